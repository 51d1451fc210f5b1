package stream

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"
)

// Defaults of ConsumerConfig. The configuration layer takes its defaults from here.
const (
	// DefaultMaxRecords is the increment size while the consumer keeps up.
	DefaultMaxRecords = 64
	// DefaultMaxRecordsBacklog caps the increment size while the consumer is behind. It was
	// picked by measurement (BenchmarkIngestEndToEnd in package daemon: end-to-end ingest
	// relative to plain kafka-go grows with the cap and levels off between 256 and 1024, where
	// the update's cost, which grows with the increment's records, is nearly all of it). Under
	// update.SolverAdam it is below update.DefaultIterations x update.DefaultBatchSize = 3200, so
	// that the minibatches visit every record of an increment at least once, and an update's KL
	// does not grow with the increment's size (TestUpdateKLDoesNotGrowWithIncrementSize); under
	// the daemon's default, update.SolverConverge, every update uses all its records.
	DefaultMaxRecordsBacklog = 1024
	// DefaultMaxWait is how long an increment stays open after its first record arrived.
	DefaultMaxWait = 5 * time.Second
	// DefaultFetchWait is the longest a fetch waits at the broker for new records.
	DefaultFetchWait = 500 * time.Millisecond
	// DefaultFetchMaxBytes bounds one fetch response (and so one prefetched chunk).
	DefaultFetchMaxBytes = 1 << 20
	// DefaultRefreshInterval is the period of the metadata and offsets refresh.
	DefaultRefreshInterval = 2 * time.Second
	// DefaultCommitInterval is the shortest interval between two group offset commits.
	DefaultCommitInterval = time.Second
	// DefaultRetryMin and DefaultRetryMax bound the backoff between retries.
	DefaultRetryMin = 100 * time.Millisecond
	DefaultRetryMax = 5 * time.Second
	// DefaultStallAfter is the readiness bound (see Consumer.Health).
	DefaultStallAfter = 15 * time.Second
)

// ConsumerConfig configures a Consumer.
type ConsumerConfig struct {
	Conn ConnConfig
	// Topic holds the labelled records. Required.
	Topic string
	// GroupID is the consumer group the consumer commits its offsets to, as a simple
	// consumer that never joins the group: the commits are informational (they let Kafka
	// tooling show the consumer's lag); where to read is decided by Resume. It must be unique
	// per daemon: a group with active members refuses the commits. Required.
	GroupID string
	// DeadLetterTopic receives the records that fail validation. Required, not Topic.
	DeadLetterTopic string
	// MaxRecords is the most good records in one increment while the consumer keeps up.
	// Default: DefaultMaxRecords.
	MaxRecords int
	// MaxRecordsBacklog is the most good records in one increment while the consumer is
	// behind (more than MaxRecords records are already fetched and decoded). It also bounds
	// the prefetch. Default: DefaultMaxRecordsBacklog, or MaxRecords if that is larger.
	MaxRecordsBacklog int
	// MaxWait is the longest an increment stays open after its first record arrived.
	// Default: DefaultMaxWait.
	MaxWait time.Duration
	// Resume is the checkpointed next offset per partition: reading starts there. Partitions
	// without an entry start at their earliest offset.
	Resume map[int]int64
	// ResumeMarks identify, per partition, a record read before its Resume offset, as
	// checkpointed with it (Increment.Mark). Before reading a partition from Resume the
	// consumer checks that the partition still holds that record, and stops with a
	// TopicResetError when it holds another: the topic was recreated and written past the
	// offset while no consumer ran. A partition without a mark is not checked at start.
	// Default: none.
	ResumeMarks map[int]RecordMark
	// FetchWait is the longest a fetch waits at the broker for new data.
	// Default: DefaultFetchWait.
	FetchWait time.Duration
	// FetchMaxBytes bounds one fetch response. Default: DefaultFetchMaxBytes.
	FetchMaxBytes int
	// RefreshInterval is the period of the metadata refresh (new partitions are picked up)
	// and of the offsets refresh (high watermarks, log start offsets; it is also the
	// broker-liveness probe while no fetch is running). Default: DefaultRefreshInterval.
	RefreshInterval time.Duration
	// CommitInterval is the shortest interval between two group offset commits; durable
	// offsets that arrive meanwhile are coalesced into the next. Default: DefaultCommitInterval.
	CommitInterval time.Duration
	// RetryMin and RetryMax bound the exponential backoff (with jitter) between retries of
	// failed broker operations. Default: DefaultRetryMin and DefaultRetryMax.
	RetryMin, RetryMax time.Duration
	// StallAfter is the readiness bound of Health. Default: DefaultStallAfter.
	StallAfter time.Duration
	// AcceptTopicReset is the operator's confirmation that the topic was reset (deleted and
	// recreated, or records lost by the broker): a TopicResetError found at this start (before
	// the partition's first fetch that succeeds) is then logged and the partition read from
	// its log start (the next increment carries the new offset, to checkpoint) instead of
	// stopping the consumer. A reset found later, while the consumer runs, stops it as
	// without the confirmation. Default: false.
	AcceptTopicReset bool
	// ResetPartitions are partitions whose reset the operator confirmed after an earlier
	// consumer stopped with a TopicResetError: they are read from their log start, whatever
	// Resume says, and the first increment carries that offset, to checkpoint. Default: none.
	ResetPartitions []int
	// TopicResetHint ends a TopicResetError's message: how the operator confirms the reset
	// (the daemon names its command). Default: a sentence naming AcceptTopicReset.
	TopicResetHint string

	// deadLogWindow is the window of deadLogBurst dead letters logged one by one (tests shorten
	// it). Default: defaultDeadLogWindow.
	deadLogWindow time.Duration
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
	for name, v := range map[string]int64{"MaxRecords": int64(c.MaxRecords), "MaxRecordsBacklog": int64(c.MaxRecordsBacklog),
		"MaxWait": int64(c.MaxWait), "FetchWait": int64(c.FetchWait), "FetchMaxBytes": int64(c.FetchMaxBytes),
		"RefreshInterval": int64(c.RefreshInterval), "CommitInterval": int64(c.CommitInterval),
		"RetryMin": int64(c.RetryMin), "RetryMax": int64(c.RetryMax), "StallAfter": int64(c.StallAfter)} {
		if v < 0 {
			return fmt.Errorf("stream: consumer %s must be positive, got %d", name, v)
		}
	}
	explicitBacklog := c.MaxRecordsBacklog != 0
	c.MaxRecords = cmp.Or(c.MaxRecords, DefaultMaxRecords)
	c.MaxRecordsBacklog = cmp.Or(c.MaxRecordsBacklog, max(DefaultMaxRecordsBacklog, c.MaxRecords))
	c.MaxWait = cmp.Or(c.MaxWait, DefaultMaxWait)
	c.FetchWait = cmp.Or(c.FetchWait, DefaultFetchWait)
	c.FetchMaxBytes = cmp.Or(c.FetchMaxBytes, DefaultFetchMaxBytes)
	c.RefreshInterval = cmp.Or(c.RefreshInterval, DefaultRefreshInterval)
	c.CommitInterval = cmp.Or(c.CommitInterval, DefaultCommitInterval)
	c.RetryMin = cmp.Or(c.RetryMin, DefaultRetryMin)
	c.RetryMax = cmp.Or(c.RetryMax, max(DefaultRetryMax, c.RetryMin))
	c.StallAfter = cmp.Or(c.StallAfter, DefaultStallAfter)
	c.deadLogWindow = cmp.Or(c.deadLogWindow, defaultDeadLogWindow)
	if explicitBacklog && c.MaxRecordsBacklog < c.MaxRecords {
		return fmt.Errorf("stream: consumer MaxRecordsBacklog %d < MaxRecords %d", c.MaxRecordsBacklog, c.MaxRecords)
	}
	if c.RetryMax < c.RetryMin {
		return fmt.Errorf("stream: consumer RetryMax %v < RetryMin %v", c.RetryMax, c.RetryMin)
	}
	for p, off := range c.Resume {
		if p < 0 || off < 0 {
			return fmt.Errorf("stream: consumer Resume[%d] = %d: partitions and offsets are >= 0", p, off)
		}
	}
	for p, m := range c.ResumeMarks {
		if off, ok := c.Resume[p]; !ok || m.Offset < 0 || m.Offset >= off {
			return fmt.Errorf("stream: consumer ResumeMarks[%d] at offset %d is not below the partition's Resume offset (%d, given: %v)", p, m.Offset, off, ok)
		}
	}
	return nil
}

// Gap is a range of offsets of one partition whose records were deleted by the broker
// (retention) before the consumer read them: records [From, To) are lost.
type Gap struct {
	Partition int
	From, To  int64
}

// Records is the number of records lost.
func (g Gap) Records() int64 { return g.To - g.From }

// Increment is a batch of good records ready to be applied, with the bookkeeping needed to
// checkpoint it.
type Increment struct {
	// Records are the decoded records, in offset order per partition.
	Records []Record
	// DeadLettered counts messages of this increment written to the dead-letter topic.
	DeadLettered int
	// Gaps are the records lost before this increment's records (see Gap); NextOffsets is
	// past them.
	Gaps []Gap
	// NextOffsets maps each partition seen in this increment to the offset to resume from once
	// the increment is applied (its last offset + 1). Checkpoint them.
	NextOffsets map[int]int64

	topic  string
	resets map[int]bool       // partitions whose offset moved back to a new log's start (AcceptTopicReset)
	marks  map[int]recordMark // see Mark
}

// Mark returns the mark of a record of partition p read before NextOffsets[p], to checkpoint
// with it (ConsumerConfig.ResumeMarks of the next start): the last message of the last fetch
// the increment took whole. That is the message at NextOffsets[p]-1 unless transaction markers
// follow it or the increment ends inside a fetch; an earlier record identifies the log as
// well. ok is false when the increment took no whole fetch of p after its last reset: the
// mark checkpointed before still holds then, unless Reset(p) says p moved to a new log.
func (inc *Increment) Mark(p int) (m RecordMark, ok bool) {
	rm := inc.marks[p]
	return rm.RecordMark, rm.ok
}

// Reset reports whether the increment moves partition p back to a new log's start (a reset
// the operator confirmed: see ConsumerConfig.AcceptTopicReset and ResetPartitions).
func (inc *Increment) Reset(p int) bool { return inc.resets[p] }

// Lost is the number of records of the increment's gaps.
func (inc *Increment) Lost() int64 {
	var n int64
	for _, g := range inc.Gaps {
		n += g.Records()
	}
	return n
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
	// Lag is, summed over partitions, the high watermark (as of the last fetch or refresh)
	// minus the next offset Next will hand out: records produced and not yet handed out.
	Lag int64
	// Fetched counts messages fetched, Decoded good records.
	Fetched, Decoded int64
	// DeadLettered counts messages written to the dead-letter topic, by reason code.
	DeadLettered map[string]int64
	// Lost counts records deleted by the broker before they were read (see Gap).
	Lost int64
	// Increments counts increments returned by Next; Commits successful group offset commits.
	Increments, Commits int64
	// Committed is the last offset per partition committed to the group.
	Committed map[int]int64
	// Retries counts broker operations (fetch, refresh, commit, dead-letter write) that failed
	// and were retried.
	Retries int64
	// Pending is the number of good records fetched and decoded but not handed out yet.
	Pending int64
	// CaughtUp: the consumer holds no record it has not handed out, and in every partition its
	// fetch position is at the high watermark of its last fetch or refresh: no record past what
	// it handed out is known to it. Transaction markers count as read (a fetch moves past them),
	// where Lag counts them.
	CaughtUp bool
	// Partitions is the topic's partition count, as of the last metadata refresh.
	Partitions int
}

// Consumer reads labelled records from every partition of a topic and hands them out in
// increments; see the package documentation for the offset discipline. Next may be called
// from one goroutine at a time; the other methods from any.
//
// It is not a member of a consumer group: it reads each partition from the checkpointed
// offset it was given, so a restart after a crash reads again at once, without waiting for a
// group's session timeout or rebalance. One reader goroutine per partition fetches, decodes
// and dead-letters in the background, up to 2 x MaxRecordsBacklog messages (records and dead
// letters) ahead (nothing is committed early: group commits follow MarkDurable); Next
// assembles increments from what they have ready.
type Consumer struct {
	cfg    ConsumerConfig
	schema *Schema
	log    *slog.Logger
	tr     *kafka.Transport
	cl     *kafka.Client
	dlq    *kafka.Writer
	dlqOne *kafka.Writer // one dead letter per record batch (writeDead's single mode)
	out    *outage       // broker outages: one WARN when they start, one INFO when they end
	group  *outage       // group commits refused while the broker answers

	chunks chan *chunk // from the readers to Next, in offset order per partition

	stopped  chan struct{} // closed when the consumer's context ends (Close, or the caller's)
	done     chan struct{} // closed once every goroutine has stopped and the connections are closed
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	failOnce sync.Once
	failed   chan struct{} // closed on an error no retry can fix
	failErr  error

	mu          sync.Mutex
	parts       map[int]*partState
	nparts      int       // partitions in the last metadata
	metaOK      bool      // metadata seen at least once
	topicErr    error     // from the last metadata: the topic is missing or unreadable
	brokerReply time.Time // last time the broker answered
	lastErr     error     // last broker error
	handed      map[int]int64
	buffered    int           // records fetched and decoded, not handed out yet (the prefetch)
	deadAhead   int           // dead letters written, not handed out yet (in the prefetch's bound too)
	spaceCh     chan struct{} // closed (and replaced) when Next hands records out

	nextMu sync.Mutex // serialises Next; guards pend and carry
	pend   pending
	carry  *chunk

	commitMu  sync.Mutex
	durable   map[int]int64
	committed map[int]int64
	wake      chan struct{}

	fetched, decoded, lost, increments, commits, retries atomic.Int64
	deadMu                                               sync.Mutex
	dead                                                 map[string]int64
	deadLogAt                                            time.Time // start of the dead letters' log window (guarded by deadMu)
	deadLogged, deadSuppressed                           int
	deadTimer                                            *time.Timer // ends the window of a spent burst (logDead)
	deadClosed                                           bool        // Close has logged the last summary
}

// NewConsumer validates cfg and starts reading. Its connections and goroutines stop when ctx
// ends or on Close.
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
	c := &Consumer{
		cfg: cfg, schema: schema, log: log,
		out:    newOutage(log, "kafka broker operations"),
		group:  newOutage(log, "group offset commits"),
		chunks: make(chan *chunk, 4096), spaceCh: make(chan struct{}),
		stopped: make(chan struct{}), done: make(chan struct{}), failed: make(chan struct{}),
		parts: make(map[int]*partState), handed: make(map[int]int64),
		durable: make(map[int]int64), committed: make(map[int]int64), wake: make(chan struct{}, 1),
		dead: make(map[string]int64),
	}
	for _, r := range Reasons() {
		c.dead[r] = 0
	}
	for p, off := range cfg.Resume {
		c.handed[p] = off
	}
	// The transport outlives the consumer's context by the final commit (see run).
	trCtx, stopTransport := context.WithCancel(context.WithoutCancel(ctx))
	c.tr = cfg.Conn.transport(trCtx)
	c.cl = &kafka.Client{Addr: kafka.TCP(cfg.Conn.Brokers...), Transport: c.tr, Timeout: cfg.Conn.DialTimeout + 2*cfg.FetchWait}
	c.dlq = newWriter(cfg.Conn.Brokers, cfg.DeadLetterTopic, c.tr, c.out.kafkaLogger("kafka-go dead-letter writer"))
	// The shared writer batches the messages of concurrent calls (every partition's reader)
	// into one record batch; a dead letter written alone must be alone in its batch.
	c.dlqOne = newWriter(cfg.Conn.Brokers, cfg.DeadLetterTopic, c.tr, c.out.kafkaLogger("kafka-go dead-letter writer"))
	c.dlqOne.BatchSize = 1
	lctx, cancel := context.WithCancel(ctx)
	c.cancel = cancel
	c.wg.Add(2)
	go func() { defer c.wg.Done(); c.refreshLoop(lctx) }()
	go func() { defer c.wg.Done(); c.commitLoop(lctx) }()
	go c.run(lctx, stopTransport)
	return c, nil
}

// run waits for the end, then stops everything in order: the goroutines, a last commit of
// what is durable (bounded), the writer and the connections.
func (c *Consumer) run(ctx context.Context, stopTransport context.CancelFunc) {
	defer close(c.done)
	<-ctx.Done()
	close(c.stopped)
	c.wg.Wait()
	c.closeDeadLog() // the readers, which count dead letters, have stopped
	fctx, cancel := context.WithTimeout(context.Background(), finalCommitTimeout)
	if err := c.commitDurable(fctx); err != nil {
		c.log.Warn("last group offset commit failed; the group's offsets stay behind the checkpoint (they are informational)", "err", err)
	}
	cancel()
	c.dlq.Close()
	c.dlqOne.Close()
	stopTransport()
	c.tr.CloseIdleConnections()
}

// finalCommitTimeout bounds the last group commit at Close.
const finalCommitTimeout = 3 * time.Second

// Close stops the readers, commits the durable offsets to the group one last time (for at
// most a few seconds), closes the connections and waits for every goroutine to stop. Records
// fetched but not handed out, or handed out but not marked durable, are read again by the
// next consumer started from the checkpoint.
func (c *Consumer) Close() error {
	c.cancel()
	<-c.done
	return nil
}

// fail stops the consumer for good: err is configuration-class (retrying cannot fix it) or
// a TopicResetError. Next returns it wrapped in ErrStopped, and Health reports it. It is
// logged once.
func (c *Consumer) fail(err error) {
	c.failOnce.Do(func() {
		c.failErr = fmt.Errorf("%w: %w", ErrStopped, err)
		// Logged before Next is woken: whoever sees the stop (a caller of Next, Health) finds
		// its ERROR line written.
		c.log.Error("consumer stopped by an error that retrying cannot fix; no more records are read until the cause is fixed and the daemon restarted", "err", err)
		close(c.failed)
	})
}

// pending is the increment being built. It survives an error return from Next, so that
// nothing taken from the readers is lost: the next call carries on with it.
type pending struct {
	first time.Time // arrival of its first item; zero when empty
	recs  []Record
	dead  int
	gaps  []Gap
	next  map[int]int64
	reset map[int]bool
	marks map[int]recordMark
}

func (p *pending) empty() bool { return p.first.IsZero() }

// take moves ch's items, in offset order, into p until p holds limit records (the dead
// letters right after the limit-th record stay in ch). It reports whether ch is used up.
func (p *pending) take(ch *chunk, limit int) bool {
	if p.empty() {
		p.first, p.next = ch.at, make(map[int]int64)
	}
	if ch.reset { // the partition's offset moves back: the records before it in p are of the old log
		if p.reset == nil {
			p.reset = make(map[int]bool)
		}
		p.next[ch.part], p.reset[ch.part] = ch.next, true
		delete(p.marks, ch.part) // a mark of the old log
		return true
	}
	if ch.gap != nil {
		p.gaps = append(p.gaps, *ch.gap)
		p.next[ch.part] = max(p.next[ch.part], ch.gap.To)
		ch.gap = nil
	}
	for ch.ri < len(ch.recs) || ch.di < len(ch.dead) {
		if len(p.recs) >= limit {
			return false
		}
		if ch.di == len(ch.dead) { // only records left: take them in one go
			k := min(len(ch.recs), ch.ri+limit-len(p.recs))
			p.recs = append(p.recs, ch.recs[ch.ri:k]...)
			ch.ri = k
			p.next[ch.part] = ch.recs[k-1].Offset + 1
			continue
		}
		if ch.ri < len(ch.recs) && ch.recs[ch.ri].Offset < ch.dead[ch.di].offset {
			p.recs = append(p.recs, ch.recs[ch.ri])
			p.next[ch.part] = ch.recs[ch.ri].Offset + 1
			ch.ri++
			continue
		}
		p.dead++
		p.next[ch.part] = ch.dead[ch.di].offset + 1
		ch.di++
	}
	p.next[ch.part] = max(p.next[ch.part], ch.next)
	if ch.last.ok {
		if p.marks == nil {
			p.marks = make(map[int]recordMark)
		}
		p.marks[ch.part] = ch.last
	}
	return true
}

// Next returns the next increment. While the consumer keeps up, an increment is complete when
// it holds MaxRecords good records, or when MaxWait has passed since its first record arrived
// (records prefetched while the previous increment was applied have been waiting already). When
// more records than that are already fetched and decoded, the consumer is behind and the
// increment takes them, up to MaxRecordsBacklog. Before the first record Next waits as long as
// ctx allows. An increment without good records is returned only when it has dead letters or
// gaps to checkpoint. The dead letters of an increment are written before Next returns it.
//
// Within one Consumer no offset is handed out twice. Broker errors are retried with backoff
// in the background; Next returns an error only when ctx ends (what was taken stays pending
// for the next call), the consumer is closed (ErrClosed), or it has stopped for good (an error
// that wraps ErrStopped: a configuration-class broker error, or a TopicResetError).
func (c *Consumer) Next(ctx context.Context) (*Increment, error) {
	c.nextMu.Lock()
	defer c.nextMu.Unlock()
	p := &c.pend
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		for len(p.recs) < c.cfg.MaxRecordsBacklog {
			ch := c.carry
			if ch == nil {
				select {
				case ch = <-c.chunks:
				default:
				}
			}
			if ch == nil {
				break
			}
			if p.take(ch, c.cfg.MaxRecordsBacklog) {
				c.carry = nil
			} else {
				c.carry = ch
			}
		}
		if len(p.recs) >= c.cfg.MaxRecords {
			return c.finish(), nil
		}
		var deadline <-chan time.Time
		if !p.empty() {
			d := time.Until(p.first.Add(c.cfg.MaxWait))
			if d <= 0 {
				return c.finish(), nil
			}
			if timer == nil {
				timer = time.NewTimer(d)
			} else {
				timer.Reset(d)
			}
			deadline = timer.C
		}
		select {
		case ch := <-c.chunks:
			c.carry = ch
		case <-deadline:
			return c.finish(), nil
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-c.stopped:
			return nil, ErrClosed
		case <-c.failed:
			return nil, c.failErr
		}
	}
}

// finish turns the pending increment into an Increment.
func (c *Consumer) finish() *Increment {
	p := &c.pend
	inc := &Increment{Records: p.recs, DeadLettered: p.dead, Gaps: p.gaps, NextOffsets: p.next, topic: c.cfg.Topic, resets: p.reset, marks: p.marks}
	c.mu.Lock()
	maps.Copy(c.handed, p.next)
	c.buffered -= len(p.recs)
	c.deadAhead -= p.dead
	close(c.spaceCh) // wakes the readers waiting for room
	c.spaceCh = make(chan struct{})
	c.mu.Unlock()
	c.pend = pending{}
	c.increments.Add(1)
	return inc
}

// MarkDurable tells the consumer that inc's effect is durable (checkpointed): its offsets may
// be committed to the group. The commit happens in the background, coalesced with later ones
// (at most one per CommitInterval), and retried with backoff until it succeeds or a later one
// supersedes it; it is informational, so nothing waits for it. inc must come from this
// consumer's Next.
func (c *Consumer) MarkDurable(inc *Increment) {
	if inc == nil || len(inc.NextOffsets) == 0 {
		return
	}
	if inc.topic != c.cfg.Topic {
		c.log.Error("MarkDurable: increment from another consumer ignored", "increment_topic", inc.topic)
		return
	}
	c.commitMu.Lock()
	for p, off := range inc.NextOffsets {
		if inc.resets[p] {
			c.durable[p] = off // a new log: its offsets start over
		} else {
			c.durable[p] = max(c.durable[p], off)
		}
	}
	c.commitMu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// Stats returns a snapshot of the counters.
func (c *Consumer) Stats() Stats {
	s := Stats{
		Fetched: c.fetched.Load(), Decoded: c.decoded.Load(), Lost: c.lost.Load(),
		Increments: c.increments.Load(), Retries: c.retries.Load(),
	}
	c.mu.Lock()
	for p, ps := range c.parts {
		if from, ok := c.handed[p]; ok || ps.hwm > 0 {
			s.Lag += max(0, ps.hwm-max(from, ps.logStart))
		}
	}
	s.Pending = int64(c.buffered)
	s.CaughtUp = c.buffered == 0 && c.deadAhead == 0
	for _, ps := range c.parts {
		s.CaughtUp = s.CaughtUp && ps.next >= ps.hwm
	}
	s.Partitions = c.nparts
	c.mu.Unlock()
	c.commitMu.Lock()
	s.Commits, s.Committed = c.commits.Load(), maps.Clone(c.committed)
	c.commitMu.Unlock()
	c.deadMu.Lock()
	s.DeadLettered = maps.Clone(c.dead)
	c.deadMu.Unlock()
	return s
}

// Health is a snapshot of the consumer's readiness; see Consumer.Health.
type Health struct {
	// Ready is true when every condition holds; Reasons says which do not.
	Ready   bool
	Reasons []string
	// LastBrokerReply is the last time the broker answered a request (fetch, offsets, metadata).
	LastBrokerReply time.Time
	// Partitions is the topic's partition count; Readers the partition readers running.
	Partitions, Readers int
	// CaughtUp is true when every partition has been read up to its high watermark.
	CaughtUp bool
}

// Health reports whether the consumer works, from state its own traffic keeps current: it
// makes no request. It is ready when
//
//  1. the broker answered within StallAfter: fetches answer at least every FetchWait while
//     they run, and the offsets refresh asks every RefreshInterval, so a live broker is never
//     older than about RefreshInterval;
//  2. the topic's metadata has been read, names the topic, and every partition is held by a
//     running reader (a reader stops only on an error no retry fixes);
//  3. every partition has fetched within StallAfter, or has nothing to fetch (its position is
//     at its high watermark), or is waiting for Next to make room (the daemon is busy: that is
//     backpressure, not a stall);
//  4. no partition's dead-letter writes have been failing for longer than StallAfter (its
//     reader retries them and reads no further, also when nothing more was produced).
//
// So a consumer whose broker goes away turns unready within StallAfter, and ready again
// within about max(RefreshInterval, RetryMax) + FetchWait after the broker answers again
// (the readers' backoff is capped at RetryMax).
func (c *Consumer) Health() Health {
	now := time.Now()
	bound := c.cfg.StallAfter
	c.mu.Lock()
	defer c.mu.Unlock()
	h := Health{LastBrokerReply: c.brokerReply, Partitions: c.nparts, CaughtUp: true}
	var why []string
	select {
	case <-c.failed:
		why = append(why, "stopped: "+c.failErr.Error())
	default:
	}
	if since := now.Sub(c.brokerReply); since > bound {
		msg := "the broker has not answered yet"
		if !c.brokerReply.IsZero() {
			// An error the broker answers (an unknown topic) is not an answer here: say so, so
			// that the reason does not read as a broker gone.
			msg = fmt.Sprintf("the broker has not answered a request successfully for %v (bound %v)", since.Round(time.Millisecond), bound)
		}
		if c.lastErr != nil {
			msg += ": " + c.lastErr.Error()
		}
		why = append(why, msg)
	}
	switch {
	case !c.metaOK:
		why = append(why, "no metadata for topic "+c.cfg.Topic+" yet")
	case c.topicErr != nil:
		why = append(why, fmt.Sprintf("topic %s: %v", c.cfg.Topic, c.topicErr))
	}
	for _, p := range slices.Sorted(maps.Keys(c.parts)) {
		ps := c.parts[p]
		if ps.running {
			h.Readers++
		} else if p < c.nparts {
			why = append(why, fmt.Sprintf("partition %d: no running reader", p))
		}
		caughtUp := ps.next >= 0 && ps.next >= ps.hwm
		if !caughtUp {
			h.CaughtUp = false
		}
		if !ps.deadFailing.IsZero() && now.Sub(ps.deadFailing) > bound {
			why = append(why, fmt.Sprintf("partition %d: its dead letters cannot be written to %s for %v, and it is read no further until they are: %v",
				p, c.cfg.DeadLetterTopic, now.Sub(ps.deadFailing).Round(time.Millisecond), ps.deadErr))
		}
		switch {
		case caughtUp || ps.waiting:
		case now.Sub(ps.lastFetch) > bound:
			msg := fmt.Sprintf("partition %d: no fetch for %v with %d records to read", p, now.Sub(ps.lastFetch).Round(time.Millisecond), ps.hwm-ps.next)
			if ps.readErr != nil {
				msg += ": " + ps.readErr.Error()
			}
			why = append(why, msg)
		}
	}
	if c.metaOK && c.topicErr == nil && h.Readers < c.nparts {
		why = append(why, fmt.Sprintf("%d of %d partitions have a running reader", h.Readers, c.nparts))
	}
	h.Ready, h.Reasons = len(why) == 0, why
	return h
}

// answered notes that the broker answered (any request).
func (c *Consumer) answered() {
	c.mu.Lock()
	c.brokerReply = time.Now()
	c.mu.Unlock()
}

// failedAttempt counts a failed broker operation and tells the outage log.
func (c *Consumer) failedAttempt(source string, err error) {
	c.retries.Add(1)
	c.out.fail(source, err)
	c.mu.Lock()
	c.lastErr = err
	c.mu.Unlock()
}
