package ceshare

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/segmentio/kafka-go"
)

// outOfRange handles a fetch refused because next is outside p's log. Below the log start,
// requests were deleted before they were read (the topic's retention is not "for ever"): at
// the first read of a partition acquired from offset 0 with its states, the CEs of those states
// are restored from them (restore); the gap is logged as an ERROR and stored with its count through Lost (unless an
// earlier owner read the partition: then it is stored uncounted), and reading goes on from
// the log start. Past the end, the ledger's offset belongs to another log (the topic was
// deleted and created again): Reset stores offset 0 (and sends the store's CEs of p again), and reading goes
// on from 0, so that no request of the new log is skipped.
func (m *Member) outOfRange(ctx context.Context, cl *kafka.Client, p int, next int64) (int64, error) {
	first, end, err := partitionOffsets(ctx, cl, m.cfg.Topic, p)
	if err != nil {
		return next, nil // the fetch is tried again, and fails again if it must
	}
	switch {
	case next < first:
		m.mu.Lock()
		ps := m.parts[p]
		before := next == 0 && ps != nil && ps.ownedBefore
		// Restored only at the partition's first read from offset 0: the store holds nothing of
		// p then, so a state brings back nothing it has deleted or replaced (past offset 0 it
		// may have applied deletions the state topic does not show yet).
		var states map[string]State
		if next == 0 && ps != nil && !ps.ready {
			states = ps.states
		}
		m.mu.Unlock()
		restored, err := m.restore(ctx, p, next, states)
		if err != nil {
			return next, err
		}
		what := "the CEs they registered or deleted are not in this share"
		if states != nil {
			what = fmt.Sprintf("%d CEs they registered are restored from the states their owners wrote on the CE state topic; "+
				"a CE whose state no owner wrote is not in this share", restored)
		}
		if before {
			// Read from its start by a new owner: an earlier owner read (or found lost) what
			// the topic no longer holds, and a count here would repeat at every move.
			m.log.Error("CE requests were deleted before this replica read them, after an earlier owner of the partition did: "+
				what+"; not counted as lost here",
				"partition", p, "from", next, "to", first, "restored", restored, "fix", "keep the CE topic's retention.ms at -1")
			return m.apply(ctx, p, nil, next, first, nil)
		}
		m.log.Error("CE requests were deleted before they were read: "+what,
			"partition", p, "from", next, "to", first, "restored", restored, "fix", "keep the CE topic's retention.ms at -1")
		if err := m.hooks.Lost(ctx, p, next, first); err != nil {
			return next, err
		}
		m.mu.Lock()
		m.gaps += first - next
		if ps := m.parts[p]; ps != nil {
			ps.next = first
		}
		m.mu.Unlock()
		return first, nil
	case next > end:
		m.log.Error("CE partition ends before what this replica read: the topic was deleted and created again; its requests "+
			"are gone, the partition is read again from offset 0 and this replica's CEs of it are sent again",
			"partition", p, "read_to", next, "end", end)
		return m.reset(ctx, p, next, end, next) // nothing of the new log read: it ends before next
	}
	return next, nil
}

// reset handles partition p being another log than the one the store read to next (the topic
// was deleted and created again; end is the new partition's end; the store may have read the
// new log from offset from on): Reset, then p is read from offset 0.
func (m *Member) reset(ctx context.Context, p int, next, end, from int64) (int64, error) {
	if err := m.hooks.Reset(ctx, p, end, from); err != nil {
		return next, fmt.Errorf("ceshare: partition %d of %q (end %d) is another log than the one this replica read to offset %d "+
			"(the topic was deleted and created again), and its reset failed: %w", p, m.cfg.Topic, end, next, err)
	}
	m.mu.Lock()
	if ps := m.parts[p]; ps != nil {
		ps.next, ps.ready, ps.blocked = 0, false, nil // the blocking record went with the old log
	}
	m.mu.Unlock()
	return 0, nil
}

// errRecords wraps a failure to read the records of a fetch that sameLog made: retried, as the
// read loop retries its own.
var errRecords = errors.New("reading fetched records")

// sameLog fetches p's record at w.Offset and reports whether the partition is another log than
// the one w is a record of (other): its record there hashes otherwise. With no record at
// w.Offset (retention deleted it, the partition ends at or before it, which the read from the
// stored offset then finds, or compaction removed it from a topic an operator compacted) it
// cannot tell, and other is false. end is p's end as the fetch saw it. It asks for one byte: the
// broker still sends the whole first batch, which holds the record.
func (m *Member) sameLog(ctx context.Context, cl *kafka.Client, p int, w Witness) (other bool, end int64, err error) {
	res, err := cl.Fetch(ctx, &kafka.FetchRequest{Topic: m.cfg.Topic, Partition: p, Offset: w.Offset,
		MinBytes: 1, MaxBytes: 1, MaxWait: m.cfg.FetchWait})
	if err == nil && res.Error != nil {
		err = res.Error
	}
	if errors.Is(err, kafka.OffsetOutOfRange) {
		return false, 0, nil
	}
	if err != nil {
		return false, 0, err
	}
	var at *Witness
	if _, err := eachRecord(res.Records, w.Offset, func(r record) {
		if r.offset == w.Offset {
			x := witnessOf(r)
			at = &x
		}
	}); err != nil {
		return false, 0, fmt.Errorf("%w: %w", errRecords, err)
	}
	return at != nil && at.Hash != w.Hash, res.HighWatermark, nil
}

// restore hands Apply a registration rebuilt from each of states (Request.Restored; a state
// whose id is not of p, or a late write, State.Late, is left out, WARN), in order of id and in chunks of MaxBatch, each
// stored with p's offset left at next, and returns how many it handed. It runs at a gap found
// at the first read of a partition acquired from offset 0, before the gap is stored, so a
// crash in between restores again (the CEs already restored are found the same and kept).
func (m *Member) restore(ctx context.Context, p int, next int64, states map[string]State) (int, error) {
	ids := slices.Sorted(maps.Keys(states))
	handed := 0
	for len(ids) > 0 && ctx.Err() == nil {
		n := min(len(ids), m.cfg.MaxBatch)
		reqs := make([]Request, 0, n)
		for _, id := range ids[:n] {
			s := states[id]
			if Partition(id, m.cfg.Partitions) != p {
				m.log.Warn("CE state on another partition than its id's: not restored", "partition", p, "id", id, "writer", s.Replica)
				continue
			}
			if s.Late {
				// Compaction may have removed the tombstone before it: a deleted CE would come back.
				m.log.Warn("CE state written by a replica that no longer owned the partition, and no owner's state left: not restored",
					"partition", p, "id", id, "writer", s.Replica)
				continue
			}
			reqs = append(reqs, Request{Kind: KindRegister, ID: id, Replica: s.Replica, Offset: next, State: &s, Restored: true})
		}
		ids = ids[n:]
		if len(reqs) == 0 {
			continue
		}
		if err := m.hooks.Apply(ctx, p, reqs, next, nil); err != nil {
			return handed, err
		}
		handed += len(reqs)
		m.mu.Lock()
		m.restored += int64(len(reqs))
		m.mu.Unlock()
	}
	return handed, ctx.Err()
}
