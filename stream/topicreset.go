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

// RecordMark identifies one record of a partition's log: its offset, its Kafka timestamp and a
// hash of its key and value. The consumer keeps the mark of the record it read last, to check
// after a pause that the partition still holds the same log (verifyIdentity), and hands out
// with each increment the mark of a record read before its NextOffsets (Increment.Mark), which
// the daemon checkpoints with them, so that a consumer started from the checkpoint checks the
// same before reading on (ConsumerConfig.ResumeMarks).
//
// Sum is FNV-1a 64 of len(key) (4 bytes, big-endian), the key and the value. The threat is an
// accident, a topic recreated and written again, not an adversary forging a collision: whoever
// can write the topic can feed the daemon any record, a colliding one included, so a
// cryptographic hash (SHA-256) would buy nothing but 24 more bytes per partition. A different
// record at the same offset has the same sum with probability 2^-64. The timestamp is compared
// beside it because a topic recreated and filled by replaying the same data (same keys and
// values, as a deterministic producer or a re-run job writes them) is told apart by when its
// records were written (CreateTime is set by the producer, LogAppendTime by the broker). A copy
// identical in key, value and timestamp at the offset (a mirror that preserves timestamps) is
// taken as the same log: reading it on from the offset is then right, unless the copy differs
// below it, which one record cannot show.
type RecordMark struct {
	Offset    int64
	Timestamp int64 // Unix milliseconds
	Sum       uint64
}

// recordMark is a RecordMark that may be absent.
type recordMark struct {
	RecordMark
	ok bool
}

func markOf(offset int64, key, value []byte, at time.Time) recordMark {
	h := fnv.New64a()
	h.Write(binary.BigEndian.AppendUint32(nil, uint32(len(key))))
	h.Write(key)
	h.Write(value)
	return recordMark{RecordMark: RecordMark{Offset: offset, Timestamp: at.UnixMilli(), Sum: h.Sum64()}, ok: true}
}

// differs says how the record found differs from the one marked, or "" when they are the same.
func (m RecordMark) differs(found RecordMark) string {
	switch {
	case found.Sum != m.Sum:
		return "its key or value differs from the one read there"
	case found.Timestamp != m.Timestamp:
		return fmt.Sprintf("it has the same key and value, written at %s where the one read there was written at %s",
			time.UnixMilli(found.Timestamp).UTC().Format(time.RFC3339Nano), time.UnixMilli(m.Timestamp).UTC().Format(time.RFC3339Nano))
	}
	return ""
}

// unknownTopic reports whether err says the broker does not know the topic or partition (it
// was deleted, or is being created).
func unknownTopic(err error) bool {
	return errors.Is(err, kafka.UnknownTopicOrPartition) || errors.Is(err, kafka.UnknownTopicID)
}

// verifyIdentity runs after a fetch that followed a pause brought records (see
// partState.suspect), and at start before a partition is read from a checkpoint with a mark
// (checkResume): it fetches the offset of the record marked and compares the record found with
// it. Logs only grow, so if the partition holds it now, the records after it extend the same
// log. It returns the reset found or the fetch's error; nil, nil when the log is the same, or
// when it cannot tell (logged at INFO): retention deleted the record (its offset is below the
// log start while the log reaches past it: that is not a reset), or compaction removed it. It
// costs one fetch of one batch.
func (c *Consumer) verifyIdentity(ctx context.Context, ps *partState, last recordMark) (*TopicResetError, error) {
	res, err := c.cl.Fetch(ctx, &kafka.FetchRequest{Topic: c.cfg.Topic, Partition: ps.part, Offset: last.Offset,
		MinBytes: 1, MaxBytes: 1, MaxWait: c.cfg.FetchWait}) // the broker still returns the first whole batch
	if err == nil && res.Error != nil {
		err = res.Error
	}
	if errors.Is(err, kafka.OffsetOutOfRange) {
		first, end, err := c.listOffsets(ctx, ps.part)
		if err != nil {
			return nil, err
		}
		if last.Offset >= end {
			return c.resetError(ps, first, end, fmt.Sprintf("the partition ends at %d, before the record read at offset %d", end, last.Offset)), nil
		}
		c.log.Info("the topic's identity could not be checked: the record read at the offset is no longer in the partition (deleted by retention, not a reset)",
			"partition", ps.part, "offset", last.Offset, "log_start", first, "end", end)
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var found *recordMark
	err = EachRecord(res.Records, func(r *kafka.Record, control bool) error {
		if r.Offset != last.Offset || control || found != nil {
			return nil
		}
		key, err := ReadBytes(r.Key)
		if err != nil {
			return err
		}
		value, err := ReadBytes(r.Value)
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
	if found == nil {
		c.log.Info("the topic's identity could not be checked: the partition holds no record at the offset of the one read there (compacted)",
			"partition", ps.part, "offset", last.Offset, "log_start", res.LogStartOffset, "end", res.HighWatermark)
		return nil, nil
	}
	if why := last.differs(found.RecordMark); why != "" {
		return c.resetError(ps, res.LogStartOffset, res.HighWatermark,
			fmt.Sprintf("the record at offset %d is not the one read there before: %s", last.Offset, why)), nil
	}
	return nil, nil
}

// checkResume runs before a partition's first fetch from a checkpointed offset: with the
// checkpoint's mark (ConsumerConfig.ResumeMarks), it checks that the partition still holds the
// record marked (verifyIdentity), which offsets alone cannot show for a topic recreated and
// written past the offset while no consumer ran. A reset found is handled as one found while
// running (topicReset). Without a mark (a checkpoint written before marks were kept) the check
// is skipped, logged at INFO. It returns false when the reader must stop.
func (c *Consumer) checkResume(ctx context.Context, ps *partState, retry func(error) bool) bool {
	c.mu.Lock()
	next, pending := ps.next, ps.resetPending
	c.mu.Unlock()
	if next <= 0 || pending {
		return true // nothing read from this log yet, or read from its start anyway
	}
	m, ok := c.cfg.ResumeMarks[ps.part]
	if !ok {
		c.log.Info("the topic's identity is not checked at start: the checkpoint holds no mark of a record read from the partition (the next checkpoint that reads one stores it)",
			"partition", ps.part, "offset", next)
		return true
	}
	last := recordMark{RecordMark: m, ok: true}
	for {
		reset, err := c.verifyIdentity(ctx, ps, last)
		if err != nil {
			if !retry(err) {
				return false
			}
			continue
		}
		if reset != nil {
			return c.topicReset(ctx, ps, reset)
		}
		c.mu.Lock()
		ps.last, ps.suspect = last, false
		c.mu.Unlock()
		return true
	}
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

// topicReset handles a reset found on ps: with AcceptTopicReset, a reset found at this start
// (before the partition's first fetch that succeeded) is accepted, once (logged; the
// partition is read from its log start, and the next increment checkpoints that offset);
// otherwise the consumer stops with the error. It returns false when the reader must stop.
func (c *Consumer) topicReset(ctx context.Context, ps *partState, e *TopicResetError) bool {
	c.mu.Lock()
	// A reset found after a fetch of this consumer's start succeeded is a new one.
	accept := c.cfg.AcceptTopicReset && !ps.resetAccepted && ps.lastFetch.IsZero()
	if accept {
		ps.resetAccepted, ps.suspect, ps.vanished, ps.last = true, false, false, recordMark{}
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
