package stream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"
)

// Dead-letter headers. The original key and value are kept as they were.
const (
	HeaderReason          = "cfguard-reason"           // a Reason* code
	HeaderError           = "cfguard-error"            // human detail
	HeaderSourceTopic     = "cfguard-source-topic"     // where the record was read
	HeaderSourcePartition = "cfguard-source-partition" // decimal
	HeaderSourceOffset    = "cfguard-source-offset"    // decimal
	HeaderTruncated       = "cfguard-truncated"        // original value size, when the value was cut
)

const (
	// maxDeadLetterValue bounds the value copied to the dead-letter topic, well below the
	// broker's default 1 MB batch limit; longer values are cut and HeaderTruncated set.
	maxDeadLetterValue = 256 << 10
	// deadLetterBatch is how many dead letters Next buffers before writing them.
	deadLetterBatch = 256
	// writerBatchBytes bounds a produce request (Kafka's and kfake's default limit is 1048588).
	writerBatchBytes = 1_000_000
)

// ConsumerConfig configures a Consumer.
type ConsumerConfig struct {
	Conn ConnConfig
	// Topic holds the labelled records. Required.
	Topic string
	// GroupID is the consumer group; its committed offsets say where to resume. Required.
	GroupID string
	// DeadLetterTopic receives the records that fail validation. Required, not Topic.
	DeadLetterTopic string
	// MaxRecords is the most good records in one increment.
	// Default: 256.
	MaxRecords int
	// MaxWait is the longest an increment stays open after its first message.
	// Default: 2s.
	MaxWait time.Duration
	// Resume, when set, is the checkpointed next offset per partition: messages below it
	// were applied before and are skipped (see Consumer.Resume).
	Resume map[int]int64
	// FetchWait is the longest a fetch waits at the broker for new data.
	// Default: 500ms.
	FetchWait time.Duration
	// SessionTimeout is the group session timeout (kfake and Kafka require >= 6s).
	// Default: 10s.
	SessionTimeout time.Duration
	// HeartbeatInterval is the group heartbeat period.
	// Default: 1s.
	HeartbeatInterval time.Duration
	// RetryMin and RetryMax bound the backoff between retries of failed broker operations.
	// Default: 100ms and 10s.
	RetryMin, RetryMax time.Duration
}

func (c *ConsumerConfig) applyDefaults() error {
	if err := c.Conn.applyDefaults(); err != nil {
		return err
	}
	switch {
	case c.Topic == "":
		return errors.New("stream: consumer Topic is required")
	case c.GroupID == "":
		return errors.New("stream: consumer GroupID is required")
	case c.DeadLetterTopic == "":
		return errors.New("stream: consumer DeadLetterTopic is required")
	case c.DeadLetterTopic == c.Topic:
		return fmt.Errorf("stream: DeadLetterTopic %q must differ from Topic", c.DeadLetterTopic)
	}
	setDefault(&c.MaxRecords, 256)
	setDefault(&c.MaxWait, 2*time.Second)
	setDefault(&c.FetchWait, 500*time.Millisecond)
	setDefault(&c.SessionTimeout, 10*time.Second)
	setDefault(&c.HeartbeatInterval, time.Second)
	setDefault(&c.RetryMin, 100*time.Millisecond)
	setDefault(&c.RetryMax, 10*time.Second)
	for name, v := range map[string]int64{"MaxRecords": int64(c.MaxRecords), "MaxWait": int64(c.MaxWait),
		"FetchWait": int64(c.FetchWait), "SessionTimeout": int64(c.SessionTimeout),
		"HeartbeatInterval": int64(c.HeartbeatInterval), "RetryMin": int64(c.RetryMin)} {
		if v < 0 {
			return fmt.Errorf("stream: consumer %s must be positive, got %d", name, v)
		}
	}
	if c.RetryMax < c.RetryMin {
		return fmt.Errorf("stream: consumer RetryMax %v < RetryMin %v", c.RetryMax, c.RetryMin)
	}
	for p, off := range c.Resume {
		if p < 0 || off < 0 {
			return fmt.Errorf("stream: consumer Resume[%d] = %d: partitions and offsets are >= 0", p, off)
		}
	}
	return nil
}

func setDefault[T comparable](v *T, def T) {
	var zero T
	if *v == zero {
		*v = def
	}
}

// Increment is a batch of good records ready to be applied, with the bookkeeping needed to
// commit it.
type Increment struct {
	// Records are the decoded records, in fetch order (per partition, in offset order).
	Records []Record
	// DeadLettered counts messages of this increment written to the dead-letter topic.
	DeadLettered int
	// Skipped counts messages dropped because they were below the resume offset of their
	// partition (already applied) or delivered twice.
	Skipped int
	// NextOffsets maps each partition seen in this increment to its last offset + 1: the
	// offset to resume from once the increment is applied. Checkpoint the per-partition
	// maximum over increments.
	NextOffsets map[int]int64

	topic string
	msgs  []kafka.Message // one per partition, at NextOffsets-1, for CommitMessages
}

// XY returns the features and labels of the records, for update.LastLayer.
func (inc *Increment) XY() ([][]float64, []int) {
	X := make([][]float64, len(inc.Records))
	y := make([]int, len(inc.Records))
	for i, r := range inc.Records {
		X[i], y[i] = r.X, r.Label
	}
	return X, y
}

// Stats is a snapshot of a Consumer's counters (totals since it started).
type Stats struct {
	// Lag is kafka-go's ReaderStats.Lag: how far the last fetch was behind the partition's
	// high watermark.
	Lag int64
	// Fetched counts messages fetched, Decoded good records, Skipped dropped ones.
	Fetched, Decoded, Skipped int64
	// DeadLettered counts messages written to the dead-letter topic, by reason code.
	DeadLettered map[string]int64
	// Increments counts increments returned by Next; Commits successful Commit calls.
	Increments, Commits int64
	// Retries counts broker operations (fetch, commit, dead-letter write) that failed and
	// were retried.
	Retries int64
	// Pending is the number of good records in the increment being built.
	Pending int64
}

// Consumer reads labelled records from a topic as a member of a consumer group and hands
// them out in increments; see the package documentation for the offset discipline. Next and
// Commit may be called from different goroutines, but Next from one at a time.
//
// Next fetches in batches: one blocking FetchMessage, then as many more as kafka-go has
// already queued (ReaderStats.QueueLength), so they return at once. Each batch is decoded on
// up to GOMAXPROCS goroutines (decoding is most of the per-record cost) and filed in offset
// order.
type Consumer struct {
	cfg    ConsumerConfig
	schema *Schema
	log    *slog.Logger
	r      *kafka.Reader
	dlq    *kafka.Writer
	tr     *kafka.Transport

	nextMu  sync.Mutex // serialises Next, guards pending
	pending pending

	mu   sync.Mutex
	skip map[int]int64 // drop offsets below skip[partition]

	fetchedN, decoded, skipped, increments, commits, retries, pendingN atomic.Int64
	deadMu                                                             sync.Mutex
	dead                                                               map[string]int64

	cancel   context.CancelFunc // ends run
	done     chan struct{}      // closed once run has closed the reader, writer and connections
	closeErr error
}

// pending is the increment being built. It survives an error return from Next, so that
// nothing fetched is lost: the next call carries on with it.
type pending struct {
	first   time.Time // arrival of the first message; zero when empty
	records []Record
	dead    []deadLetter // waiting to be written
	nDead   int          // written to the dead-letter topic
	skipped int
	next    map[int]int64
}

type deadLetter struct {
	msg    kafka.Message
	reason string
}

func (p *pending) empty() bool { return p.first.IsZero() }

// begin starts an increment at the arrival of its first message.
func (p *pending) begin(maxRecords int) {
	p.first = time.Now()
	p.next = make(map[int]int64)
	p.records = make([]Record, 0, min(maxRecords, 4096))
}

// NewConsumer validates cfg, joins the group and returns a Consumer. Its connections and
// goroutines stop when ctx ends or on Close.
func NewConsumer(ctx context.Context, cfg ConsumerConfig, schema *Schema, log *slog.Logger) (*Consumer, error) {
	if schema == nil {
		return nil, errors.New("stream: NewConsumer needs a Schema")
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := cfg.applyDefaults(); err != nil {
		return nil, err
	}
	log = log.With("topic", cfg.Topic, "group", cfg.GroupID)
	rc := readerConfig(&cfg, log)
	// NewReader panics on an invalid config; validate first.
	if err := rc.Validate(); err != nil {
		return nil, fmt.Errorf("stream: consumer config: %w", err)
	}
	c := &Consumer{
		cfg: cfg, schema: schema, log: log,
		skip: make(map[int]int64), dead: make(map[string]int64),
		done: make(chan struct{}),
	}
	for _, r := range Reasons() {
		c.dead[r] = 0
	}
	c.Resume(cfg.Resume)
	var lctx context.Context
	lctx, c.cancel = context.WithCancel(ctx)
	c.tr = cfg.Conn.transport(lctx)
	c.dlq = newWriter(cfg.Conn.Brokers, cfg.DeadLetterTopic, c.tr, log)
	c.r = kafka.NewReader(rc)
	go c.run(lctx)
	return c, nil
}

// readerConfig is the kafka-go reader configuration of a consumer (the benchmark's plain
// baseline uses it too, so that both read the same way).
func readerConfig(cfg *ConsumerConfig, log *slog.Logger) kafka.ReaderConfig {
	return kafka.ReaderConfig{
		Brokers:           cfg.Conn.Brokers,
		GroupID:           cfg.GroupID,
		Topic:             cfg.Topic,
		Dialer:            cfg.Conn.dialer(),
		QueueCapacity:     1024,
		MinBytes:          1,
		MaxBytes:          4 << 20,
		MaxWait:           cfg.FetchWait,
		HeartbeatInterval: cfg.HeartbeatInterval,
		SessionTimeout:    cfg.SessionTimeout,
		RebalanceTimeout:  cfg.SessionTimeout,
		JoinGroupBackoff:  cfg.RetryMin,
		StartOffset:       kafka.FirstOffset,
		CommitInterval:    0, // synchronous: CommitMessages returns once the broker has the offsets
		ReadBackoffMin:    cfg.RetryMin,
		ReadBackoffMax:    cfg.RetryMax,
		ErrorLogger:       kafka.LoggerFunc(func(f string, a ...any) { log.Warn("kafka-go reader: " + fmt.Sprintf(f, a...)) }),
	}
}

// newWriter is a synchronous writer that waits for all in-sync replicas. Batching comes from
// the caller passing many messages to one WriteMessages call, so the batch timeout is short.
func newWriter(brokers []string, topic string, tr *kafka.Transport, log *slog.Logger) *kafka.Writer {
	return &kafka.Writer{
		Addr:         kafka.TCP(brokers...),
		Topic:        topic,
		Balancer:     &kafka.Hash{},
		RequiredAcks: kafka.RequireAll,
		BatchSize:    1000,
		BatchBytes:   writerBatchBytes,
		BatchTimeout: time.Millisecond,
		MaxAttempts:  3,
		Transport:    tr,
		ErrorLogger:  kafka.LoggerFunc(func(f string, a ...any) { log.Warn("kafka-go writer: " + fmt.Sprintf(f, a...)) }),
	}
}

// run closes the reader, the writer and the connections once ctx ends (or Close is called).
func (c *Consumer) run(ctx context.Context) {
	defer close(c.done)
	<-ctx.Done()
	c.closeErr = errors.Join(c.r.Close(), c.dlq.Close())
	c.tr.CloseIdleConnections()
}

// fetch returns the next message, retrying broker errors with backoff. The decision to retry
// is made here, where the error is understood; the context is checked first.
func (c *Consumer) fetch(ctx context.Context) (kafka.Message, error) {
	bo := backoff{min: c.cfg.RetryMin, max: c.cfg.RetryMax}
	for {
		m, err := c.r.FetchMessage(ctx)
		if err == nil {
			c.fetchedN.Add(1)
			return m, nil
		}
		if ctx.Err() != nil {
			return kafka.Message{}, ctx.Err()
		}
		if errors.Is(err, io.EOF) || c.closed() {
			return kafka.Message{}, ErrClosed
		}
		if !retryable(err) {
			return kafka.Message{}, fmt.Errorf("stream: fetching from %s: %w", c.cfg.Topic, err)
		}
		c.retries.Add(1)
		c.log.Warn("fetch failed; retrying", "err", err)
		if err := bo.wait(ctx); err != nil {
			return kafka.Message{}, err
		}
	}
}

func (c *Consumer) closed() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// Close leaves the group and closes the connections, then waits for every goroutine to stop.
// Messages fetched but not committed are delivered again to the next member. Dead letters of
// the increment being built that were not written yet are not written; their records are
// delivered again too.
func (c *Consumer) Close() error {
	c.cancel()
	<-c.done
	return c.closeErr
}

// Resume makes the consumer drop, count as Skipped and commit the messages whose offset is
// below next[partition]: the checkpoint's per-partition next offsets. It only ever raises the
// thresholds. Call it before the first Next.
func (c *Consumer) Resume(next map[int]int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for p, off := range next {
		if off > c.skip[p] {
			c.skip[p] = off
		}
	}
}

// Next returns the next increment: it is complete when it holds MaxRecords good records, or
// when MaxWait has passed since its first message arrived, whichever is first. Before the
// first message Next waits as long as ctx allows. An increment without good records is
// returned only when it has dead-lettered or skipped messages whose offsets need committing.
// Bad records are written to the dead-letter topic before Next returns.
//
// Within one Consumer no offset is returned twice: a message delivered again (after a
// rebalance) below what earlier increments covered is skipped. Broker errors are retried with
// backoff; Next returns an error only when ctx ends, the consumer is closed (ErrClosed), or a
// broker error cannot be retried. On an error return, what was fetched stays pending for the
// next call.
func (c *Consumer) Next(ctx context.Context) (*Increment, error) {
	c.nextMu.Lock()
	defer c.nextMu.Unlock()
	p := &c.pending
	// fctx carries the increment's deadline once it has a first message; it is made once
	// per call, not per fetch.
	fctx, withDeadline := ctx, false
	var batch []kafka.Message
	for len(p.records) < c.cfg.MaxRecords {
		if len(p.dead) >= deadLetterBatch {
			if err := c.flushDead(ctx); err != nil {
				return nil, err
			}
		}
		if !p.empty() {
			deadline := p.first.Add(c.cfg.MaxWait)
			if !time.Now().Before(deadline) {
				break
			}
			if !withDeadline {
				var cancel context.CancelFunc
				fctx, cancel = context.WithDeadline(ctx, deadline)
				defer cancel() // once: guarded by withDeadline
				withDeadline = true
			}
		}
		m, err := c.fetch(fctx)
		if err != nil {
			if ctx.Err() == nil && !p.empty() && fctx.Err() != nil {
				break // MaxWait elapsed
			}
			return nil, err
		}
		if p.empty() {
			p.begin(c.cfg.MaxRecords)
			var cancel context.CancelFunc
			fctx, cancel = context.WithDeadline(ctx, p.first.Add(c.cfg.MaxWait))
			defer cancel() // once: the increment is no longer empty
			withDeadline = true
		}
		// What kafka-go has queued already comes without waiting. Its queue length may count
		// a stale message FetchMessage drops after a rebalance; then the fetch waits, bounded
		// by the increment's deadline (set above), and an error leaves the batch so far to be
		// filed.
		batch = append(batch[:0], m)
		more := min(int(c.r.Stats().QueueLength), c.cfg.MaxRecords-len(p.records)-1)
		for range more {
			m, err := c.fetch(fctx)
			if err != nil {
				break
			}
			batch = append(batch, m)
		}
		c.handle(batch)
	}
	if err := c.flushDead(ctx); err != nil {
		return nil, err
	}
	return c.take(), nil
}

// handle files a batch of fetched messages, in order, into the pending increment: skipped,
// dead-lettered or decoded. Decoding runs in parallel.
func (c *Consumer) handle(batch []kafka.Message) {
	p := &c.pending
	keep := make([]bool, len(batch))
	c.mu.Lock()
	for i, m := range batch {
		floor := c.skip[m.Partition]
		if n, ok := p.next[m.Partition]; ok && n > floor {
			floor = n // a redelivery of something already in this increment
		}
		keep[i] = m.Offset >= floor
		if m.Offset+1 > p.next[m.Partition] {
			p.next[m.Partition] = m.Offset + 1
		}
	}
	c.mu.Unlock()
	// Decode straight into the increment's record slice, then close the gaps left by
	// skipped and bad messages.
	base := len(p.records)
	p.records = slices.Grow(p.records, len(batch))[:base+len(batch)]
	errs := c.schema.decodeAll(batch, keep, p.records[base:])
	w := base
	for i, m := range batch {
		switch {
		case !keep[i]:
			p.skipped++
			c.skipped.Add(1)
		case errs[i] != nil:
			err := errs[i]
			p.dead = append(p.dead, deadLetter{msg: deadLetterMessage(m, err), reason: err.Reason})
			c.log.Debug("record dead-lettered", "partition", m.Partition, "offset", m.Offset, "reason", err.Reason, "detail", err.Detail)
		default:
			rec := &p.records[w]
			if w != base+i {
				*rec = p.records[base+i]
			}
			rec.Partition, rec.Offset = m.Partition, m.Offset
			if rec.Time.IsZero() {
				rec.Time = m.Time
			}
			w++
		}
	}
	clear(p.records[w : base+len(batch)]) // drop what the gaps still reference
	p.records = p.records[:w]
	c.decoded.Add(int64(w - base))
	c.pendingN.Store(int64(len(p.records)))
}

// decodeAll decodes the values of batch[i] where keep[i] into out[i], on up to GOMAXPROCS
// goroutines (joined before it returns) when the batch is large enough to pay for them. The
// features of the whole batch share one array (each record's X has its own capacity, so an
// append to it cannot spill into the next). It returns the decode errors, nil where fine.
func (s *Schema) decodeAll(batch []kafka.Message, keep []bool, out []Record) []*DecodeError {
	errs := make([]*DecodeError, len(batch))
	d := len(s.features)
	slab := make([]float64, len(batch)*d)
	one := func(lo, hi int) {
		for i := lo; i < hi; i++ {
			if keep[i] {
				out[i], errs[i] = s.decodeInto(batch[i].Value, slab[i*d:(i+1)*d:(i+1)*d])
			}
		}
	}
	const minPerWorker = 32
	workers := min(runtime.GOMAXPROCS(0), len(batch)/minPerWorker, 8)
	if workers <= 1 {
		one(0, len(batch))
		return errs
	}
	var wg sync.WaitGroup
	chunk := (len(batch) + workers - 1) / workers
	for lo := chunk; lo < len(batch); lo += chunk {
		wg.Go(func() { one(lo, min(lo+chunk, len(batch))) })
	}
	one(0, chunk)
	wg.Wait()
	return errs
}

func deadLetterMessage(m kafka.Message, de *DecodeError) kafka.Message {
	h := make([]kafka.Header, 0, 6+len(m.Headers))
	h = append(h,
		kafka.Header{Key: HeaderReason, Value: []byte(de.Reason)},
		kafka.Header{Key: HeaderError, Value: []byte(de.Detail)},
		kafka.Header{Key: HeaderSourceTopic, Value: []byte(m.Topic)},
		kafka.Header{Key: HeaderSourcePartition, Value: strconv.AppendInt(nil, int64(m.Partition), 10)},
		kafka.Header{Key: HeaderSourceOffset, Value: strconv.AppendInt(nil, m.Offset, 10)},
	)
	value := m.Value
	if len(value) > maxDeadLetterValue {
		h = append(h, kafka.Header{Key: HeaderTruncated, Value: strconv.AppendInt(nil, int64(len(value)), 10)})
		value = value[:maxDeadLetterValue]
	}
	h = append(h, m.Headers...)
	return kafka.Message{Key: m.Key, Value: value, Headers: h, Time: m.Time}
}

// flushDead writes the pending dead letters, retrying what failed until ctx ends.
func (c *Consumer) flushDead(ctx context.Context) error {
	p := &c.pending
	bo := backoff{min: c.cfg.RetryMin, max: c.cfg.RetryMax}
	for len(p.dead) > 0 {
		msgs := make([]kafka.Message, len(p.dead))
		for i, d := range p.dead {
			msgs[i] = d.msg
		}
		err := c.dlq.WriteMessages(ctx, msgs...)
		var failed []deadLetter
		var werrs kafka.WriteErrors
		switch {
		case err == nil:
		case errors.As(err, &werrs) && len(werrs) == len(msgs):
			for i, e := range werrs {
				if e != nil {
					failed = append(failed, p.dead[i])
				}
			}
		default:
			failed = p.dead
		}
		c.countDead(p.dead, failed)
		p.nDead += len(p.dead) - len(failed)
		p.dead = failed
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, io.ErrClosedPipe) {
			return ErrClosed
		}
		if !retryable(err) {
			return fmt.Errorf("stream: writing %d dead letters to %s: %w", len(failed), c.cfg.DeadLetterTopic, err)
		}
		c.retries.Add(1)
		c.log.Warn("dead-letter write failed; retrying", "dead_letters", len(failed), "err", err)
		if err := bo.wait(ctx); err != nil {
			return err
		}
	}
	return nil
}

// countDead adds the written dead letters (all minus failed, which is a subsequence) to the
// per-reason totals.
func (c *Consumer) countDead(all, failed []deadLetter) {
	c.deadMu.Lock()
	defer c.deadMu.Unlock()
	for _, d := range all {
		c.dead[d.reason]++
	}
	for _, d := range failed {
		c.dead[d.reason]--
	}
}

// take turns the pending increment into an Increment and raises the skip thresholds to it.
func (c *Consumer) take() *Increment {
	p := &c.pending
	inc := &Increment{Records: p.records, DeadLettered: p.nDead, Skipped: p.skipped,
		NextOffsets: maps.Clone(p.next), topic: c.cfg.Topic}
	for part, next := range p.next {
		inc.msgs = append(inc.msgs, kafka.Message{Topic: c.cfg.Topic, Partition: part, Offset: next - 1})
	}
	c.Resume(p.next)
	c.pending = pending{}
	c.pendingN.Store(0)
	c.increments.Add(1)
	return inc
}

// Commit commits the increment's offsets to the group: each partition's NextOffsets. Call it
// only after the increment's effect is durable. Broker errors are retried with backoff until
// ctx ends. A failed commit loses nothing: the messages come again and Resume skips them.
func (c *Consumer) Commit(ctx context.Context, inc *Increment) error {
	if inc == nil || len(inc.msgs) == 0 {
		return nil
	}
	if inc.topic != c.cfg.Topic {
		return fmt.Errorf("stream: increment is from topic %q, consumer reads %q", inc.topic, c.cfg.Topic)
	}
	bo := backoff{min: c.cfg.RetryMin, max: c.cfg.RetryMax}
	for {
		err := c.r.CommitMessages(ctx, inc.msgs...)
		if err == nil {
			c.commits.Add(1)
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("stream: committing %v: %w", inc.NextOffsets, ctx.Err())
		}
		if errors.Is(err, io.ErrClosedPipe) {
			return ErrClosed
		}
		if !retryable(err) {
			return fmt.Errorf("stream: committing %v: %w", inc.NextOffsets, err)
		}
		c.retries.Add(1)
		c.log.Warn("commit failed; retrying", "offsets", inc.NextOffsets, "err", err)
		if err := bo.wait(ctx); err != nil {
			return fmt.Errorf("stream: committing %v: %w", inc.NextOffsets, err)
		}
	}
}

// Stats returns a snapshot of the counters.
func (c *Consumer) Stats() Stats {
	s := Stats{
		Lag:     c.r.Stats().Lag,
		Fetched: c.fetchedN.Load(), Decoded: c.decoded.Load(), Skipped: c.skipped.Load(),
		Increments: c.increments.Load(), Commits: c.commits.Load(), Retries: c.retries.Load(),
		Pending: c.pendingN.Load(),
	}
	c.deadMu.Lock()
	s.DeadLettered = maps.Clone(c.dead)
	c.deadMu.Unlock()
	return s
}
