package postlog

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/stream"
)

// Log is the posterior topic in Kafka: partition 0 of Topic.
type Log struct {
	conn  stream.ConnConfig
	topic string
	tr    *kafka.Transport
	cl    *kafka.Client
	w     *kafka.Writer
	keys  *clusterkey.Keyring
	log   *slog.Logger
	// maxMessageBytes is the topic's max.message.bytes as checkSettings read it (0: unknown).
	maxMessageBytes int
}

// MaxRecordBytes is the largest record of the log: cfguard creates the topic with this
// max.message.bytes, Append refuses a larger record, and readers fetch this much and more.
// A genesis carries the whole model, base64 in JSON: each parameter's mean and log sigma in
// float64, about 22.6 bytes per parameter (the bundled mnist network's 52,650 parameters make a
// genesis of 1,192,277 bytes). Brokers accept records of 1 MiB by default (message.max.bytes),
// about 46,000 parameters; 16 MiB holds about 740,000.
const MaxRecordBytes = 16 << 20

// readerMaxBytes is what a reader of the log fetches at most: a batch holds one record, at most
// MaxRecordBytes and its batch's framing. A reader asking for less than a batch would get it cut.
const readerMaxBytes = MaxRecordBytes + 64<<10

// Open connects to the posterior topic, creating it when it is missing: one partition,
// cleanup.policy delete, retention.ms and retention.bytes -1 (kept for ever), replication factor
// min(3, brokers). It refuses a topic with more than one partition: Kafka orders records only
// within a partition, and the acceptance rule needs one order. Close releases it.
// Append signs each record with keys' signing key.
func Open(ctx context.Context, conn stream.ConnConfig, topic string, keys *clusterkey.Keyring, log *slog.Logger) (*Log, error) {
	return open(ctx, conn, topic, keys, log, true)
}

// OpenExisting is Open for a reader of a log that must exist (a tool): a missing topic is an
// error, not created. It cannot Append.
func OpenExisting(ctx context.Context, conn stream.ConnConfig, topic string, log *slog.Logger) (*Log, error) {
	return open(ctx, conn, topic, nil, log, false)
}

// OpenExistingWriter is OpenExisting for a tool that appends (cfguard new-epoch): records it
// appends are signed with keys.
func OpenExistingWriter(ctx context.Context, conn stream.ConnConfig, topic string, keys *clusterkey.Keyring, log *slog.Logger) (*Log, error) {
	return open(ctx, conn, topic, keys, log, false)
}

func open(ctx context.Context, conn stream.ConnConfig, topic string, keys *clusterkey.Keyring, log *slog.Logger, create bool) (*Log, error) {
	tr, err := conn.Transport(context.WithoutCancel(ctx))
	if err != nil {
		return nil, err
	}
	l := &Log{conn: conn, topic: topic, tr: tr, log: log, keys: keys,
		cl: &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: tr, Timeout: 10 * time.Second}}
	l.w = &kafka.Writer{Addr: kafka.TCP(conn.Brokers...), Topic: topic, Transport: tr, RequiredAcks: kafka.RequireAll,
		BatchSize: 1, BatchBytes: readerMaxBytes, BatchTimeout: time.Millisecond, MaxAttempts: 3, Balancer: &kafka.LeastBytes{},
		ErrorLogger: kafka.LoggerFunc(func(msg string, args ...any) {
			log.Warn("posterior log writer: " + fmt.Sprintf(msg, args...))
		})}
	if err := l.ensure(ctx, create); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// unreachable is what to do about an error of asking the brokers that did not reach them (a
// refused or failed connection, a timeout), in brackets after a space, or "".
func unreachable(err error) string {
	var op *net.OpError
	if errors.As(err, &op) || errors.Is(err, context.DeadlineExceeded) {
		return " (check that the brokers kafka.brokers names are up and reachable from here)"
	}
	return ""
}

// Close releases the connections.
func (l *Log) Close() error {
	err := l.w.Close()
	l.tr.CloseIdleConnections()
	return err
}

// Topic is the log's topic.
func (l *Log) Topic() string { return l.topic }

func (l *Log) ensure(ctx context.Context, create bool) error {
	for attempt := 0; ; attempt++ {
		md, err := l.cl.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{l.topic}})
		if err != nil {
			return fmt.Errorf("replication.posterior_topic %s: metadata from kafka.brokers %v: %w%s", l.topic, l.conn.Brokers, err, unreachable(err))
		}
		var t *kafka.Topic
		for i := range md.Topics {
			if md.Topics[i].Name == l.topic {
				t = &md.Topics[i]
			}
		}
		switch {
		case t != nil && t.Error == nil && len(t.Partitions) == 1:
			return l.checkSettings(ctx)
		case t != nil && t.Error == nil:
			return fmt.Errorf("replication.posterior_topic %s has %d partitions: the posterior log must be one partition "+
				"(Kafka orders records only within one); name a new topic in replication.posterior_topic", l.topic, len(t.Partitions))
		case t != nil && !errors.Is(t.Error, kafka.UnknownTopicOrPartition):
			return fmt.Errorf("replication.posterior_topic %s: %w", l.topic, t.Error)
		case attempt > 0:
			return fmt.Errorf("replication.posterior_topic %s: created, but the cluster does not show it", l.topic)
		case !create:
			return fmt.Errorf("replication.posterior_topic %s does not exist on %v", l.topic, l.conn.Brokers)
		}
		rf := min(3, len(md.Brokers))
		res, err := l.cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: l.topic, NumPartitions: 1,
			ReplicationFactor: rf, ConfigEntries: []kafka.ConfigEntry{{ConfigName: "cleanup.policy", ConfigValue: "delete"},
				{ConfigName: "retention.ms", ConfigValue: "-1"}, {ConfigName: "retention.bytes", ConfigValue: "-1"},
				{ConfigName: "max.message.bytes", ConfigValue: strconv.Itoa(MaxRecordBytes)}}}}})
		if err != nil {
			return fmt.Errorf("replication.posterior_topic %s: create: %w", l.topic, err)
		}
		if err := res.Errors[l.topic]; err != nil && !errors.Is(err, kafka.TopicAlreadyExists) {
			return fmt.Errorf("replication.posterior_topic %s: create: %w", l.topic, err)
		}
		l.log.Info("posterior log created", "topic", l.topic, "replication_factor", rf)
		// Metadata may lag the creation for a moment.
		if err := waitTopic(ctx, l.cl, l.topic); err != nil {
			return err
		}
	}
}

// checkSettings checks the topic's settings that lose entries of the log. Compaction
// (cleanup.policy naming compact) keeps only the last record of each key: a losing append at a
// sequence (key e/<seq>) would replace the accepted entry, and a new epoch's genesis the first
// one. A writer (a replica, cfguard new-epoch) refuses such a topic; a reader (cfguard
// verify-log) says so at WARN and reads on. A finite retention (retention.ms or retention.bytes
// other than -1) deletes the log's first entries, which every replica bootstraps from: it is
// logged at ERROR. Settings that cannot be read (no DescribeConfigs permission) are logged at
// WARN.
func (l *Log) checkSettings(ctx context.Context) error {
	res, err := l.cl.DescribeConfigs(ctx, &kafka.DescribeConfigsRequest{Resources: []kafka.DescribeConfigRequestResource{{
		ResourceType: kafka.ResourceTypeTopic, ResourceName: l.topic, ConfigNames: []string{"cleanup.policy", "retention.ms", "retention.bytes", "max.message.bytes"}}}})
	if err == nil && len(res.Resources) != 1 {
		err = fmt.Errorf("%d resources in the answer, want 1", len(res.Resources))
	}
	if err == nil {
		err = res.Resources[0].Error
	}
	if err != nil {
		l.log.Warn("the posterior topic's settings cannot be read: check by hand that it is not compacted and keeps its records for ever",
			"topic", l.topic, "err", err, "want", "cleanup.policy=delete retention.ms=-1 retention.bytes=-1")
		return nil
	}
	var finite []any
	for _, c := range res.Resources[0].ConfigEntries {
		switch c.ConfigName {
		case "cleanup.policy":
			if !strings.Contains(c.ConfigValue, "compact") {
				continue
			}
			err := fmt.Errorf("replication.posterior_topic %s has cleanup.policy=%s: compaction keeps only the last record of each key "+
				"and would drop accepted entries of the posterior log; set cleanup.policy=delete (kafka-configs.sh --alter --entity-type "+
				"topics --entity-name %s --add-config cleanup.policy=delete) and check the log with cfguard verify-log, or name a new "+
				"topic in replication.posterior_topic", l.topic, c.ConfigValue, l.topic)
			if l.keys != nil {
				return err
			}
			l.log.Warn("the posterior log is compacted", "err", err)
		case "retention.ms", "retention.bytes":
			if c.ConfigValue != "-1" {
				finite = append(finite, c.ConfigName, c.ConfigValue)
			}
		case "max.message.bytes":
			l.maxMessageBytes, _ = strconv.Atoi(c.ConfigValue)
		}
	}
	if len(finite) > 0 {
		l.log.Error("the posterior topic does not keep its records for ever: its first entries will be deleted, and a replica that "+
			"starts with an empty state_dir cannot bootstrap from the log; set retention.ms=-1 and retention.bytes=-1 on it "+
			"(kafka-configs.sh --alter --entity-type topics --entity-name "+l.topic+" --add-config retention.ms=-1,retention.bytes=-1)",
			append([]any{"topic", l.topic}, finite...)...)
	}
	return nil
}

func waitTopic(ctx context.Context, cl *kafka.Client, topic string) error {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for i := 0; i < 200; i++ {
		md, err := cl.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
		if err == nil && len(md.Topics) == 1 && md.Topics[0].Error == nil && len(md.Topics[0].Partitions) > 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return fmt.Errorf("replication.posterior_topic %s: not visible 10s after its creation", topic)
}

// End is the offset after the log's last record: reading to End means having seen every
// record appended before the call.
func (l *Log) End(ctx context.Context) (int64, error) {
	res, err := l.cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{l.topic: {kafka.LastOffsetOf(0)}}})
	if err != nil {
		return 0, fmt.Errorf("posterior log %s: end offset: %w", l.topic, err)
	}
	ps := res.Topics[l.topic]
	if len(ps) != 1 {
		return 0, fmt.Errorf("posterior log %s: end offset: %d partitions in the answer", l.topic, len(ps))
	}
	if ps[0].Error != nil {
		return 0, fmt.Errorf("posterior log %s: end offset: %w", l.topic, stream.OffsetsError(ps[0].Error))
	}
	return ps[0].LastOffset, nil
}

// InputEnds returns the end offset (the high watermark) of every partition of topic, the
// input topic whose records the log's increments cover.
func (l *Log) InputEnds(ctx context.Context, topic string) (map[int]int64, error) {
	w, err := stream.ReadWatermarks(ctx, l.cl, topic)
	if err != nil {
		return nil, fmt.Errorf("input topic: %w", err)
	}
	ends := make(map[int]int64, len(w))
	for p, pw := range w {
		ends[p] = pw.End
	}
	return ends, nil
}

// Append writes value as the log's next record (acks=all) and returns once the cluster
// acknowledged it. It does not say whether the entry was accepted: read the log back. A failed
// Append may still have been stored (a retry of kafka-go's); the chain ignores a duplicate.
// The record carries value's authenticator (Sign) in its clusterkey.Header header.
func (l *Log) Append(ctx context.Context, key string, value []byte) error {
	if l.keys == nil {
		return fmt.Errorf("posterior log %s: append: opened without a key (a reader)", l.topic)
	}
	msg := kafka.Message{Key: []byte(key), Value: value, Headers: []kafka.Header{{Key: clusterkey.Header, Value: Sign(l.keys, value)}}}
	// What the broker measures against max.message.bytes: the record and its batch's framing
	// (about 70 bytes for one record; recordOverhead counts more, so a record within some 60
	// bytes of the limit is refused although the broker would take it).
	size := len(msg.Key) + len(msg.Value) + len(clusterkey.Header) + len(msg.Headers[0].Value) + recordOverhead
	switch {
	case size > MaxRecordBytes:
		return fmt.Errorf("posterior log %s: append: a record of %d bytes (key %s), over the %d bytes a record of the log may hold "+
			"(postlog.MaxRecordBytes): a genesis carries the whole model, and this model is too large to replicate", l.topic, size, key, MaxRecordBytes)
	case l.maxMessageBytes > 0 && size > l.maxMessageBytes:
		return l.tooLarge(key, size, fmt.Sprintf("over the topic's max.message.bytes (%d)", l.maxMessageBytes))
	}
	if err := l.w.WriteMessages(ctx, msg); err != nil {
		if sizeRefused(err) {
			return l.tooLarge(key, size, fmt.Sprintf("refused by the broker (%v)", err))
		}
		return fmt.Errorf("posterior log %s: append: %w", l.topic, err)
	}
	return nil
}

// sizeRefused reports whether a write failed because the broker found the record too large.
// kafka-go's writer reports a batch's failure as WriteErrors, which errors.Is does not look into.
func sizeRefused(err error) bool {
	var we kafka.WriteErrors
	if errors.As(err, &we) {
		return slices.ContainsFunc(we, func(e error) bool { return errors.Is(e, kafka.MessageSizeTooLarge) })
	}
	return errors.Is(err, kafka.MessageSizeTooLarge)
}

// recordOverhead bounds what a batch of one record adds to its key, value and header: the
// batch header (61 bytes) and the record's varints and attributes.
const recordOverhead = 128

// tooLarge is Append's error for a record of size bytes that the topic does not take (why),
// with how to raise the topic's limit.
func (l *Log) tooLarge(key string, size int, why string) error {
	return fmt.Errorf("posterior log %s: append: a record of %d bytes (key %s) is %s: raise the topic's limit to what cfguard creates "+
		"it with (kafka-configs.sh --alter --entity-type topics --entity-name %s --add-config max.message.bytes=%d) and start again",
		l.topic, size, key, why, l.topic, MaxRecordBytes)
}

// Record is one record of the log.
type Record struct {
	Offset int64
	Value  []byte
	// Time is the record's Kafka timestamp: when its writer appended it.
	Time time.Time
	// Auth is the record's clusterkey.Header header (nil when it has none).
	Auth []byte
}

// ReaderMaxWait is the MaxWait of kafka-go readers of cfguard's topics. kafka-go's Reader sets a
// fetch's read deadline to MaxWait and asks the broker to hold an empty fetch until 1 s before it
// (defaultRTT), or, for a MaxWait under 1 s, for three quarters of it: 250 ms would leave the
// broker's answer 62 ms to arrive, which a starved CPU misses on every fetch (an i/o timeout, a
// new connection, a backoff), so that a follower on a core shared with 20 busy processes reads
// nothing for 10 s. At 1.25 s the broker holds an empty fetch 250 ms and its answer has 1 s.
// Close waits for the fetch in flight (a cancelled context does not end it): usually at most
// the broker's 250 ms, and up to 1.25 s when the broker does not answer.
const ReaderMaxWait = 1250 * time.Millisecond

// Reader reads the log in order from an offset.
type Reader struct {
	r *kafka.Reader
}

// Read returns a reader from offset from (0: the log's start).
func (l *Log) Read(from int64) (*Reader, error) {
	d, err := l.conn.Dialer()
	if err != nil {
		return nil, err
	}
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: l.conn.Brokers, Topic: l.topic, Partition: 0, Dialer: d,
		MinBytes: 1, MaxBytes: readerMaxBytes, MaxWait: ReaderMaxWait, ReadBackoffMin: 50 * time.Millisecond, ReadBackoffMax: time.Second,
		// Outages show as the end offset that cannot be read (the daemon's watch of the log's end).
		ErrorLogger: kafka.LoggerFunc(func(msg string, args ...any) {
			l.log.Debug("posterior log reader: " + fmt.Sprintf(msg, args...))
		})})
	if err := r.SetOffset(from); err != nil {
		r.Close()
		return nil, err
	}
	return &Reader{r: r}, nil
}

// Next blocks until the next record or ctx's end.
func (r *Reader) Next(ctx context.Context) (Record, error) {
	m, err := r.r.FetchMessage(ctx)
	if err != nil {
		return Record{}, err
	}
	rec := Record{Offset: m.Offset, Value: m.Value, Time: m.Time}
	for _, h := range m.Headers {
		if h.Key == clusterkey.Header {
			rec.Auth = h.Value
		}
	}
	return rec, nil
}

// Close releases the reader.
func (r *Reader) Close() error { return r.r.Close() }
