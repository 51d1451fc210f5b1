package stream

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/segmentio/kafka-go"
)

// TopicResetError says that a partition no longer holds the log the consumer's position
// belongs to: the topic was deleted and recreated, or the broker lost records. Reading on
// would skip the new log's records below the position in silence (or apply records of another
// log as if they followed), so the consumer stops instead (see ConsumerConfig.AcceptTopicReset
// for the way on).
type TopicResetError struct {
	Topic     string `json:"topic"`
	Partition int    `json:"partition"`
	// Offset is the consumer's next offset for the partition (the checkpoint's, at start).
	Offset int64 `json:"offset"`
	// LogStart and End are the partition's log start offset and high watermark as found.
	LogStart int64 `json:"log_start"`
	End      int64 `json:"end"`
	// Why says what showed it: the position is past the end, or the record read last is not
	// the one the partition now holds at its offset.
	Why string `json:"why"`
	// Hint tells the operator how to go on (ConsumerConfig.TopicResetHint).
	Hint string `json:"-"`
}

func (e *TopicResetError) Error() string {
	return fmt.Sprintf("topic %s partition %d was reset: %s (next offset %d, the partition's log now spans offsets %d to %d); "+
		"the topic was deleted and recreated, or the broker lost records, and nothing more is read from it. %s",
		e.Topic, e.Partition, e.Why, e.Offset, e.LogStart, e.End, e.Hint)
}

// defaultTopicResetHint is TopicResetError.Hint when ConsumerConfig.TopicResetHint is empty.
const defaultTopicResetHint = "To read the partition from its log start, start the consumer again with AcceptTopicReset."

// recordMark identifies the last record a reader fetched, to check after the topic went
// missing that the partition still holds the same log (see verifyIdentity).
type recordMark struct {
	ok     bool
	offset int64
	sum    uint64 // FNV-1a of the key, the value and the timestamp
}

func markOf(offset int64, key, value []byte, at time.Time) recordMark {
	h := fnv.New64a()
	h.Write(binary.BigEndian.AppendUint32(nil, uint32(len(key))))
	h.Write(key)
	h.Write(value)
	h.Write(binary.BigEndian.AppendUint64(nil, uint64(at.UnixMilli())))
	return recordMark{ok: true, offset: offset, sum: h.Sum64()}
}

// unknownTopic reports whether err says the broker does not know the topic or partition (it
// was deleted, or is being created).
func unknownTopic(err error) bool {
	return errors.Is(err, kafka.UnknownTopicOrPartition) || errors.Is(err, kafka.UnknownTopicID)
}

// verifyIdentity runs after a fetch that followed a pause brought records (see
// partState.suspect): it fetches the offset of the last record read before and compares that
// record with the one read then. Logs only grow, so if the partition holds it now, the records
// just fetched extend the same log. It returns the reset found (nil when the log is the same,
// or when it cannot tell: retention deleted the record, or compaction) or the fetch's error.
// It costs one fetch of one batch per pause.
func (c *Consumer) verifyIdentity(ctx context.Context, ps *partState, last recordMark) (*TopicResetError, error) {
	res, err := c.cl.Fetch(ctx, &kafka.FetchRequest{Topic: c.cfg.Topic, Partition: ps.part, Offset: last.offset,
		MinBytes: 1, MaxBytes: 1, MaxWait: c.cfg.FetchWait}) // the broker still returns the first whole batch
	if err == nil && res.Error != nil {
		err = res.Error
	}
	if errors.Is(err, kafka.OffsetOutOfRange) {
		first, end, err := c.listOffsets(ctx, ps.part)
		if err != nil {
			return nil, err
		}
		if last.offset >= end {
			return c.resetError(ps, first, end, fmt.Sprintf("the partition ends at %d, before the record read last (offset %d)", end, last.offset)), nil
		}
		return nil, nil // deleted by retention (first > last.offset): nothing to compare
	}
	if err != nil {
		return nil, err
	}
	var found *recordMark
	err = eachRecord(res.Records, func(r *kafka.Record, control bool) error {
		if r.Offset != last.offset || control || found != nil {
			return nil
		}
		key, err := readBytes(r.Key)
		if err != nil {
			return err
		}
		value, err := readBytes(r.Value)
		if err != nil {
			return err
		}
		m := markOf(r.Offset, key, value, r.Time)
		found = &m
		return nil
	})
	if err != nil {
		return nil, err
	}
	if found != nil && found.sum != last.sum {
		return c.resetError(ps, res.LogStartOffset, res.HighWatermark,
			fmt.Sprintf("the record at offset %d is not the one read there before", last.offset)), nil
	}
	return nil, nil
}

func (c *Consumer) resetError(ps *partState, logStart, end int64, why string) *TopicResetError {
	c.mu.Lock()
	next := ps.next
	c.mu.Unlock()
	hint := c.cfg.TopicResetHint
	if hint == "" {
		hint = defaultTopicResetHint
	}
	return &TopicResetError{Topic: c.cfg.Topic, Partition: ps.part, Offset: next, LogStart: logStart, End: end, Why: why, Hint: hint}
}

// topicReset handles a reset found on ps: with AcceptTopicReset, the first reset of each
// partition is accepted (logged; the partition is read from its log start, and the next
// increment checkpoints that offset); otherwise the consumer stops with the error. It returns
// false when the reader must stop.
func (c *Consumer) topicReset(ctx context.Context, ps *partState, e *TopicResetError) bool {
	c.mu.Lock()
	accept := c.cfg.AcceptTopicReset && !ps.resetAccepted
	if accept {
		ps.resetAccepted, ps.suspect, ps.last = true, false, recordMark{}
		ps.next, ps.logStart, ps.hwm = e.LogStart, e.LogStart, e.End
		c.handed[ps.part] = e.LogStart
	}
	c.mu.Unlock()
	if !accept {
		c.fail(e)
		return false
	}
	c.log.Warn("topic reset accepted by the operator: the partition is read again from its log start",
		"partition", ps.part, "was_next_offset", e.Offset, "log_start", e.LogStart, "end", e.End, "why", e.Why)
	return c.deliver(ctx, ps, &chunk{part: ps.part, at: time.Now(), next: e.LogStart, reset: true})
}
