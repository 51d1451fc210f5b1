package stream

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// nextErr calls Next until it returns an error (failing if records arrive meanwhile).
func nextErr(t *testing.T, c *Consumer, within time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	for {
		inc, err := c.Next(ctx)
		if err != nil {
			return err
		}
		if len(inc.Records) > 0 {
			t.Fatalf("records handed out from a reset partition: %v", ids([]*Increment{inc}))
		}
	}
}

// wantReset checks that err is the consumer's stop by a TopicResetError of partition 0.
func wantReset(t *testing.T, err error, offset, end int64) *TopicResetError {
	t.Helper()
	var re *TopicResetError
	if !errors.Is(err, ErrStopped) || !errors.As(err, &re) {
		t.Fatalf("Next: %v, want ErrStopped with a TopicResetError", err)
	}
	if re.Topic != recordsTopic || re.Partition != 0 || re.Offset != offset || re.End != end || re.LogStart != 0 {
		t.Fatalf("reset %+v, want topic %s partition 0 offset %d log [0, %d)", re, recordsTopic, offset, end)
	}
	for _, s := range []string{recordsTopic, "partition 0", "AcceptTopicReset"} {
		if !strings.Contains(err.Error(), s) {
			t.Fatalf("error %q does not name %q", err, s)
		}
	}
	return re
}

// TestCheckpointPastTheEnd: a checkpoint beyond the partition's end (the topic was recreated,
// or the broker lost records) stops the consumer with a TopicResetError naming the topic,
// partition and offsets, one ERROR line and Health not ready; it neither reads backwards nor
// waits for the log to reach its position (which would skip the records below it in
// silence). With AcceptTopicReset the partition is read from its log start.
func TestCheckpointPastTheEnd(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("new", 10)...)
	log, lines := newLogLines(t)
	cfg := consumerConfig(conn, "ahead")
	cfg.Resume = map[int]int64{0: 30}
	c, err := NewConsumer(context.Background(), cfg, testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	wantReset(t, nextErr(t, c, 20*time.Second), 30, 10)
	if h := c.Health(); h.Ready || !slices.ContainsFunc(h.Reasons, func(s string) bool { return strings.Contains(s, "was reset") }) {
		t.Fatalf("health %+v, want not ready naming the reset", h)
	}
	if n := lines.count(slog.LevelError, "retrying cannot fix"); n != 1 {
		t.Fatalf("%d ERROR lines, want 1", n)
	}

	// The operator confirms: the partition is read from its log start, and the increments
	// carry the new offsets to checkpoint.
	cfg.AcceptTopicReset = true
	c2 := newConsumer(t, cfg)
	incs := collect(t, c2, 10, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, goodIDs("new", 10)) {
		t.Fatalf("after the confirmation read %v, want new0..new9", got)
	}
	if off := checkpoint(incs)[0]; off != 10 {
		t.Fatalf("checkpoint offset %d after the accepted reset, want 10", off)
	}
	// Records past the old position: the confirmed consumer reads them, the stopped one not.
	produce(t, conn, recordsTopic, 0, goodRecords("more", 25)...) // offsets 10..34
	incs = collect(t, c2, 25, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, goodIDs("more", 25)) || checkpoint(incs)[0] != 35 {
		t.Fatalf("read %v up to offset %d, want more0..more24 up to 35", got, checkpoint(incs)[0])
	}
	if err := nextErr(t, c, time.Second); !errors.Is(err, ErrStopped) {
		t.Fatalf("the stopped consumer's Next after more records: %v, want ErrStopped", err)
	}
	if n := lines.count(slog.LevelError, "retrying cannot fix"); n != 1 {
		t.Fatalf("%d ERROR lines, want 1", n)
	}
}

func goodIDs(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = prefix + strconv.Itoa(i)
	}
	return out
}

// TestRecreatedTopicStopsTheConsumer: N records read, the topic deleted and recreated, M > N
// records produced to the new topic (so that the old position is inside the new log): the
// consumer stops with a TopicResetError and hands out nothing of the new topic.
func TestRecreatedTopicStopsTheConsumer(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	const n, m = 30, 80
	produce(t, conn, recordsTopic, 0, goodRecords("old", n)...)
	cfg := consumerConfig(conn, "recreated")
	c := newConsumer(t, cfg)
	if got := ids(collect(t, c, n, 20*time.Second)); len(got) != n {
		t.Fatalf("read %d records, want %d", len(got), n)
	}
	waitfor.Cond(t, 10*time.Second, "the consumer to be caught up", func() bool { return c.Health().CaughtUp })

	recreateTopic(t, conn, recordsTopic)
	produce(t, conn, recordsTopic, 0, goodRecords("new", m)...)
	err := nextErr(t, c, 30*time.Second)
	re := wantReset(t, err, n, m)
	t.Logf("%v", re)
	if h := c.Health(); h.Ready {
		t.Fatalf("health ready after a reset: %+v", h)
	}

	// A consumer started from the checkpoint (offset n, inside the new log: offsets alone
	// cannot tell) with the reset confirmed reads the whole new log.
	cfg.Resume, cfg.ResetPartitions = map[int]int64{0: n}, []int{0}
	c2 := newConsumer(t, cfg)
	incs := collect(t, c2, m, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, goodIDs("new", m)) || checkpoint(incs)[0] != m || !incs[0].Reset(0) {
		t.Fatalf("after the confirmation read %d records up to offset %d (first increment a reset: %v), want new0..new%d up to %d",
			len(got), checkpoint(incs)[0], incs[0].Reset(0), m-1, m)
	}
}

// recreateTopic deletes topic and creates it again with one partition, as an operator would.
func recreateTopic(t *testing.T, conn ConnConfig, topic string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...)}
	if res, err := cl.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{topic}}); err != nil || res.Errors[topic] != nil {
		t.Fatalf("deleting %s: %v %v", topic, err, res)
	}
	res, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 1, ReplicationFactor: 1}}})
	if err != nil || res.Errors[topic] != nil {
		t.Fatalf("creating %s: %v %v", topic, err, res)
	}
}
