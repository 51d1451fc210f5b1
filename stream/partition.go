package stream

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
)

// partState is one partition's reading state, guarded by Consumer.mu.
type partState struct {
	part      int
	next      int64     // next offset to fetch; -1 until the earliest offset is known
	hwm       int64     // high watermark, as of the last fetch or refresh
	logStart  int64     // log start offset, likewise
	lastFetch time.Time // zero until a fetch succeeded
	waiting   bool      // waiting for Next to make room (backpressure)
	running   bool
	// suspect is set whenever the reader paused, so that the topic may have been deleted and
	// recreated meanwhile: a fetch failed (the broker reported the partition unknown, or did
	// not answer), a fetch returned nothing new, the reader waited for room, or the metadata
	// lost the topic. The next fetch that brings records is then checked (verifyIdentity:
	// does the partition still hold last, the record read last?) before they are delivered.
	// A reader that fetches back to back is not checked: a topic is not deleted, recreated and
	// written to within the decoding of one fetch.
	suspect bool
	// vanished is set when the broker reported the partition unknown (the topic deleted): the
	// first fetch after it is checked even when it brings nothing new, since a new log as long
	// as the old one shows no record past the reader's position, and its records below it
	// would otherwise pass for read until the next record arrives.
	vanished      bool
	last          recordMark
	resetAccepted bool // a TopicResetError was accepted (ConsumerConfig.AcceptTopicReset)
	resetPending  bool // in ConsumerConfig.ResetPartitions: reset to the log start once it is known
	// deadFailing is when the partition's dead-letter writes began to fail (zero while they
	// succeed), deadErr the last failure: the reader retries them and reads no further meanwhile,
	// though the partition may look read to its end (Health).
	deadFailing time.Time
	deadErr     error
	// readErr is the last error of a fetch, or of reading what it fetched, since the last
	// fetch that succeeded (Health names it beside a partition that has not fetched).
	readErr error
}

// chunk is what one fetch of one partition yields, decoded: the good records and the dead
// letters (written before the chunk is queued), in offset order, and the gap found before them.
type chunk struct {
	part   int
	at     time.Time // when it was fetched
	gap    *Gap
	recs   []Record
	dead   []deadMark
	next   int64 // the offset after the chunk
	ri, di int   // how far Next has taken it
	reset  bool  // an accepted topic reset: next moves back to the new log's start
	last   recordMark

	deadMsgs []kafka.Message // the dead letters to write, parallel to dead; dropped once written
}

// deadMark is a dead-lettered message's place in a chunk.
type deadMark struct {
	offset int64
	reason string
}

// refreshLoop reads the topic's metadata and offsets every RefreshInterval, starting a reader
// for every partition it has not seen yet.
func (c *Consumer) refreshLoop(ctx context.Context) {
	t := time.NewTicker(c.cfg.RefreshInterval)
	defer t.Stop()
	for {
		c.refresh(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (c *Consumer) refresh(ctx context.Context) {
	md, err := c.cl.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{c.cfg.Topic}})
	if err != nil {
		if ctx.Err() == nil {
			c.failedAttempt("metadata", err)
		}
		return
	}
	c.out.ok("metadata")
	var topic *kafka.Topic
	for i := range md.Topics {
		if md.Topics[i].Name == c.cfg.Topic {
			topic = &md.Topics[i]
		}
	}
	c.mu.Lock()
	c.metaOK = true
	switch {
	case topic == nil:
		c.topicErr = errors.New("not in the broker's metadata")
	case topic.Error != nil:
		c.topicErr = topic.Error
	default:
		c.topicErr = nil
	}
	if c.topicErr != nil {
		if topic == nil || unknownTopic(c.topicErr) {
			for _, ps := range c.parts {
				ps.suspect, ps.vanished = true, true
			}
		}
		c.mu.Unlock()
		return
	}
	c.nparts = len(topic.Partitions)
	var parts []int
	for _, p := range topic.Partitions {
		parts = append(parts, p.ID)
		if _, ok := c.parts[p.ID]; ok {
			continue
		}
		next, ok := c.cfg.Resume[p.ID]
		reset := slices.Contains(c.cfg.ResetPartitions, p.ID)
		if !ok || reset {
			next = -1
		}
		ps := &partState{part: p.ID, next: next, running: true, resetPending: reset}
		c.parts[p.ID] = ps
		c.wg.Add(1)
		go func() { defer c.wg.Done(); c.readPartition(ctx, ps) }()
	}
	c.mu.Unlock()

	// The offsets are a real round trip (metadata may come from the transport's cache): they
	// keep the lag current while the readers wait for room, and they show the broker answers.
	reqs := make([]kafka.OffsetRequest, 0, 2*len(parts))
	for _, p := range parts {
		reqs = append(reqs, kafka.FirstOffsetOf(p), kafka.LastOffsetOf(p))
	}
	res, err := c.cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{c.cfg.Topic: reqs}})
	if err != nil {
		if ctx.Err() == nil {
			c.failedAttempt("offsets", err)
		}
		return
	}
	c.out.ok("offsets")
	c.answered()
	c.mu.Lock()
	for _, po := range res.Topics[c.cfg.Topic] {
		if ps := c.parts[po.Partition]; ps != nil && po.Error == nil {
			ps.logStart, ps.hwm = po.FirstOffset, po.LastOffset
		}
	}
	c.mu.Unlock()
}

// listOffsets returns a partition's log start offset and high watermark.
func (c *Consumer) listOffsets(ctx context.Context, part int) (first, last int64, err error) {
	res, err := c.cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
		c.cfg.Topic: {kafka.FirstOffsetOf(part), kafka.LastOffsetOf(part)}}})
	if err != nil {
		return 0, 0, err
	}
	for _, po := range res.Topics[c.cfg.Topic] {
		if po.Partition == part {
			return po.FirstOffset, po.LastOffset, OffsetsError(po.Error)
		}
	}
	return 0, 0, fmt.Errorf("stream: no offsets for partition %d of %s in the broker's answer", part, c.cfg.Topic)
}

// readPartition fetches one partition from its position until ctx ends, decodes what it
// fetches, writes the dead letters and queues the result for Next. Errors are retried with
// backoff (reset after every success); an error no retry fixes stops the consumer.
func (c *Consumer) readPartition(ctx context.Context, ps *partState) {
	src := "partition " + strconv.Itoa(ps.part)
	defer func() {
		c.mu.Lock()
		ps.running = false
		c.mu.Unlock()
		c.out.ok(src) // a stopped reader is not failing any more, nor writing dead letters
		c.out.ok(deadLetterSource(ps.part))
	}()
	bo := backoff.Backoff{Min: c.cfg.RetryMin, Max: c.cfg.RetryMax}
	retry := func(err error) bool {
		switch {
		case ctx.Err() != nil:
			return false
		case !retryable(err):
			c.fail(fmt.Errorf("stream: reading partition %d of %s: %w", ps.part, c.cfg.Topic, err))
			return false
		}
		c.mu.Lock()
		ps.suspect = true
		ps.vanished = ps.vanished || unknownTopic(err)
		ps.readErr = err
		c.mu.Unlock()
		c.failedAttempt(src, err)
		return bo.Wait(ctx) == nil
	}
	if !c.checkResume(ctx, ps, retry) {
		return
	}
	for ctx.Err() == nil {
		c.mu.Lock()
		next := ps.next
		c.mu.Unlock()
		if next < 0 { // no checkpoint: the earliest offset
			first, _, err := c.listOffsets(ctx, ps.part)
			if err != nil {
				if !retry(err) {
					return
				}
				continue
			}
			c.mu.Lock()
			ps.next = first
			reset := ps.resetPending
			if _, ok := c.handed[ps.part]; !ok || reset {
				c.handed[ps.part] = first
			}
			ps.resetPending, ps.resetAccepted = false, ps.resetAccepted || reset
			c.mu.Unlock()
			if reset {
				c.log.Warn("topic reset confirmed by the operator: the partition is read from its log start",
					"partition", ps.part, "was_next_offset", c.cfg.Resume[ps.part], "log_start", first)
				if !c.deliver(ctx, ps, &chunk{part: ps.part, at: time.Now(), next: first, reset: true}) {
					return
				}
			}
			continue
		}
		res, err := c.cl.Fetch(ctx, &kafka.FetchRequest{Topic: c.cfg.Topic, Partition: ps.part, Offset: next,
			MinBytes: 1, MaxBytes: int64(c.cfg.FetchMaxBytes), MaxWait: c.cfg.FetchWait})
		if err == nil && res.Error != nil {
			err = res.Error
		}
		if errors.Is(err, kafka.OffsetOutOfRange) {
			c.answered()
			if !c.outOfRange(ctx, ps, next, retry) {
				return
			}
			continue
		}
		if err != nil {
			if !retry(err) {
				return
			}
			continue
		}
		c.out.ok(src)
		bo.Reset()
		c.answered()
		ch, err := c.readChunk(ps.part, res.Records, next)
		if err != nil {
			if !retry(fmt.Errorf("reading the fetched records: %w", err)) {
				return
			}
			continue
		}
		c.mu.Lock()
		suspect, last, vanished := ps.suspect, ps.last, ps.vanished
		c.mu.Unlock()
		if suspect && last.ok && (ch.next > next || vanished) {
			// New records after a pause, or the first fetch after the topic was unknown:
			// first check that the partition holds the log read so far.
			reset, err := c.verifyIdentity(ctx, ps, last)
			if err != nil {
				if !retry(err) {
					return
				}
				continue // the chunk is fetched again
			}
			if reset != nil {
				if !c.topicReset(ctx, ps, reset) {
					return
				}
				continue
			}
			c.mu.Lock()
			ps.vanished = false
			c.mu.Unlock()
		}
		c.mu.Lock()
		ps.hwm, ps.logStart, ps.lastFetch, ps.readErr = res.HighWatermark, res.LogStartOffset, time.Now(), nil
		if ch.next > ps.next {
			ps.next = ch.next
		}
		if ch.last.ok {
			ps.last = ch.last
		}
		ps.suspect = ch.next == next // an empty fetch: the reader paused (see partState.suspect)
		c.mu.Unlock()
		if len(ch.recs) == 0 && len(ch.dead) == 0 {
			continue // nothing new, or only transaction markers
		}
		if len(ch.dead) > 0 && !c.writeDead(ctx, ch) {
			return
		}
		if !c.deliver(ctx, ps, ch) {
			return
		}
	}
}

// outOfRange handles a fetch refused because next is outside the partition's log. Below the
// log start the records were deleted before they were read: the gap is reported (an ERROR line
// and a Gap in the next increment) and reading goes on from the log start. Past the end, the
// position belongs to another log (the topic was recreated, or the broker lost records): the
// reader neither moves backwards on its own (that could apply an offset twice) nor waits for
// the log to reach its position (that would skip the new log's records below it in silence);
// it stops the consumer with a TopicResetError, unless the operator accepted the reset
// (topicReset). It returns false when the reader must stop.
func (c *Consumer) outOfRange(ctx context.Context, ps *partState, next int64, retry func(error) bool) bool {
	first, last, err := c.listOffsets(ctx, ps.part)
	if err != nil {
		return retry(err)
	}
	c.mu.Lock()
	ps.logStart, ps.hwm = first, last
	c.mu.Unlock()
	switch {
	case next < first:
		gap := Gap{Partition: ps.part, From: next, To: first}
		c.log.Error("records were deleted by the broker (retention) before they were read; they will not be applied",
			"partition", ps.part, "from", gap.From, "to", gap.To, "lost", gap.Records())
		c.lost.Add(gap.Records()) // after the line: whoever sees the count finds the line
		c.mu.Lock()
		ps.next = first
		c.mu.Unlock()
		return c.deliver(ctx, ps, &chunk{part: ps.part, at: time.Now(), gap: &gap, next: first})
	case next > last:
		return c.topicReset(ctx, ps, c.resetError(ps, first, last, "the next offset is past the partition's end"))
	}
	return true // in range again (the log moved meanwhile): fetch again
}

// deliver queues ch for Next once the prefetch has room: while fewer than 2 x
// MaxRecordsBacklog messages, records and dead letters, are fetched and not handed out. So the
// prefetch holds at most that plus one fetch, and the dead-letter topic is written at most that
// far ahead of the checkpoint. Next, which waits for more only while it holds fewer than
// MaxRecords <= MaxRecordsBacklog records and, holding dead letters, no longer than MaxWait,
// never waits for long for room it is itself holding.
func (c *Consumer) deliver(ctx context.Context, ps *partState, ch *chunk) bool {
	limit := 2 * c.cfg.MaxRecordsBacklog
	for {
		c.mu.Lock()
		if c.buffered+c.deadAhead < limit {
			c.buffered, c.deadAhead = c.buffered+len(ch.recs), c.deadAhead+len(ch.dead)
			ps.waiting = false
			c.mu.Unlock()
			break
		}
		ps.waiting, ps.suspect = true, true
		room := c.spaceCh
		c.mu.Unlock()
		select {
		case <-room:
		case <-ctx.Done():
			return false
		}
	}
	select {
	case c.chunks <- ch:
		return true
	case <-ctx.Done():
		return false
	}
}

// readChunk reads the records of a fetch response at or after from (a response may start
// with records before the offset asked for), decodes them and files them: good records, or
// dead letters to write. Records without an id are named by DefaultID. A response whose
// batches hold no record at or after from still moves the chunk's next offset on (see
// pastEmptyBatches).
func (c *Consumer) readChunk(part int, rr kafka.RecordReader, from int64) (*chunk, error) {
	ch := &chunk{part: part, at: time.Now(), next: from}
	type msg struct {
		offset     int64
		time       time.Time
		key, value []byte
		headers    []kafka.Header
	}
	var msgs []msg
	err := EachRecord(rr, func(r *kafka.Record, control bool) error {
		if r.Offset < from {
			return nil
		}
		ch.next = max(ch.next, r.Offset+1)
		if control {
			return nil // a transaction marker: not a message
		}
		m := msg{offset: r.Offset, time: r.Time}
		for _, h := range r.Headers { // the reader reuses them
			m.headers = append(m.headers, kafka.Header{Key: h.Key, Value: slices.Clone(h.Value)})
		}
		var err error
		if m.key, err = ReadBytes(r.Key); err == nil {
			m.value, err = ReadBytes(r.Value)
		}
		msgs = append(msgs, m)
		return err
	})
	if err != nil {
		return nil, err
	}
	if ch.next == from {
		ch.next = pastEmptyBatches(rr, from)
	}
	if len(msgs) > 0 {
		m := msgs[len(msgs)-1]
		ch.last = markOf(m.offset, m.key, m.value, m.time)
	}
	c.fetched.Add(int64(len(msgs)))
	values := make([][]byte, len(msgs))
	for i, m := range msgs {
		values[i] = m.value
	}
	recs := make([]Record, len(msgs))
	errs := c.schema.decodeAll(values, recs)
	w := 0
	for i, m := range msgs {
		if errs[i] != nil {
			ch.dead = append(ch.dead, deadMark{offset: m.offset, reason: errs[i].Reason})
			ch.deadMsgs = append(ch.deadMsgs, deadLetterMessage(c.cfg.Topic, part, m.offset, m.key, m.value, m.headers, m.time, errs[i]))
			c.log.Debug("record dead-lettered", "partition", part, "offset", m.offset, "reason", errs[i].Reason, "detail", errs[i].Detail)
			continue
		}
		rec := recs[i]
		rec.Partition, rec.Offset = part, m.offset
		if rec.Time.IsZero() {
			rec.Time = m.time
		}
		rec.ID = cmp.Or(rec.ID, DefaultID(c.cfg.Topic, part, m.offset))
		recs[w] = rec
		w++
	}
	clear(recs[w:])
	ch.recs = recs[:w]
	c.decoded.Add(int64(w))
	return ch, nil
}

// pastEmptyBatches returns the offset to fetch next after a response to a fetch at from that
// holds no record at or after from: past the offsets its batches prove empty, or from when it
// holds no batch (nothing new). The broker answers a fetch from the first batch whose last
// offset is at or after from, so when that batch's records all lie below from (compaction
// removed the batch's tail, and kept the batch's last offset, as Kafka does), every offset
// from from to that batch's end holds no record, and likewise up to the base offset of any
// later batch, which can then only be empty. Fetching at from again would bring the same
// batch for ever. A Java consumer moves to the batch's last offset + 1; kafka-go does not
// decode that offset, so the position moves past what is proven: max(from, the last batch's
// base offset) + 1, at least one offset per fetch, until a fetch reaches a record or the
// batch's end.
func pastEmptyBatches(rr kafka.RecordReader, from int64) int64 {
	batches := []kafka.RecordReader{rr}
	if s, ok := rr.(*protocol.RecordStream); ok {
		batches = s.Records
	}
	next := from
	for _, b := range batches {
		switch b := b.(type) {
		case *protocol.RecordBatch:
			next = max(from, b.BaseOffset) + 1
		case *protocol.ControlBatch:
			next = max(from, b.BaseOffset) + 1
		}
	}
	return next
}

// EachRecord calls fn for every record of rr (a kafka-go fetch response's records) in order,
// telling transaction markers (control records) apart: they take offsets but are not messages.
// A record's key and value are released once fn returns: copy them (ReadBytes) to keep them.
func EachRecord(rr kafka.RecordReader, fn func(r *kafka.Record, control bool) error) error {
	batches := []kafka.RecordReader{rr}
	if s, ok := rr.(*protocol.RecordStream); ok {
		batches = s.Records
	}
	for _, b := range batches {
		_, control := b.(*protocol.ControlBatch)
		if cb, ok := b.(*protocol.ControlBatch); ok {
			b = cb.Records
		}
		for {
			r, err := b.ReadRecord()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return err
			}
			err = fn(r, control)
			closeBytes(r.Key)
			closeBytes(r.Value)
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// ReadBytes copies a record's key or value (nil stays nil).
func ReadBytes(b kafka.Bytes) ([]byte, error) {
	if b == nil {
		return nil, nil
	}
	return protocol.ReadAll(b)
}

func closeBytes(b kafka.Bytes) {
	if b != nil {
		b.Close()
	}
}

// decodeAll decodes values[i] into out[i], on up to GOMAXPROCS goroutines (joined before it
// returns) when there are enough to pay for them. The features of all records share one array
// (each record's X has its own capacity, so an append to it cannot spill into the next). It
// returns the decode errors, nil where fine.
func (s *Schema) decodeAll(values [][]byte, out []Record) []*DecodeError {
	const minPerWorker = 64
	return s.decodeOn(values, out, min(runtime.GOMAXPROCS(0), len(values)/minPerWorker, 8))
}

// decodeOn is decodeAll on workers goroutines (the caller's alone when workers <= 1).
func (s *Schema) decodeOn(values [][]byte, out []Record, workers int) []*DecodeError {
	errs := make([]*DecodeError, len(values))
	d := len(s.features)
	slab := make([]float64, len(values)*d)
	one := func(lo, hi int) {
		for i := lo; i < hi; i++ {
			out[i], errs[i] = s.decodeInto(values[i], slab[i*d:(i+1)*d:(i+1)*d])
		}
	}
	if workers <= 1 {
		one(0, len(values))
		return errs
	}
	var wg sync.WaitGroup
	chunk := (len(values) + workers - 1) / workers
	for lo := chunk; lo < len(values); lo += chunk {
		wg.Go(func() { one(lo, min(lo+chunk, len(values))) })
	}
	one(0, chunk)
	wg.Wait()
	return errs
}
