package ledger

import (
	"encoding/binary"
	"fmt"

	bolt "go.etcd.io/bbolt"
)

// The outbox. Events that describe a change (status changes, and whatever the daemon puts in
// Checkpoint.Events) are written in the transaction that makes the change, so that a crash can
// never keep one without the other. A publisher reads them in order with Outbox, publishes them,
// and acknowledges with AckOutbox, which deletes them; after a crash it publishes again from the
// first unacknowledged entry (at-least-once delivery, in order, with Seq to deduplicate).
//
// Sequence numbers are assigned in commit order and never reused within the ledger (a ledger
// restored from a backup numbers again from the backup's: consumers tell such events apart by
// their time as well): meta outbox_seq is the last
// one assigned and outbox_acked the last one acknowledged, and the entries in between are all
// present, so the length is their difference.

// readOutboxEntry checks and decodes the outbox record k, v.
func readOutboxEntry(k, v []byte) (OutboxEntry, error) {
	p, ok := unseal(k, v)
	if !ok {
		return OutboxEntry{}, corruptf("outbox entry %x: checksum mismatch", k)
	}
	e, err := decodeOutboxEntry(k, p)
	if err != nil {
		return OutboxEntry{}, inRecord(err, "outbox entry %x", k)
	}
	return e, nil
}

// Outbox returns up to max entries (default 1000) with Seq > after, in order, of commits that
// succeeded: none of a commit whose final fsync is failing (store.File.View waits for its
// outcome).
func (l *Ledger) Outbox(after uint64, max int) ([]OutboxEntry, error) {
	if max <= 0 {
		max = 1000
	}
	var out []OutboxEntry
	err := l.view(func(tx *bolt.Tx) error {
		c := tx.Bucket(bOutbox).Cursor()
		for k, v := c.Seek(u64bytes(after + 1)); k != nil && len(out) < max; k, v = c.Next() {
			e, err := readOutboxEntry(k, v)
			if err != nil {
				return err
			}
			out = append(out, e)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: outbox: %w", err)
	}
	return out, nil
}

// AckOutbox deletes every entry with Seq <= upTo (which must not exceed the last assigned).
func (l *Ledger) AckOutbox(upTo uint64) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	err := l.update(func(tx *bolt.Tx) error {
		last, err := metaU64(tx, kOutboxSeq)
		if err != nil {
			return err
		}
		acked, err := metaU64(tx, kOutboxAcked)
		if err != nil {
			return err
		}
		if upTo > last {
			return invalidf("acknowledging up to %d, but the last outbox entry is %d", upTo, last)
		}
		if upTo <= acked {
			return nil
		}
		c := tx.Bucket(bOutbox).Cursor()
		for k, _ := c.First(); k != nil && binary.BigEndian.Uint64(k) <= upTo; k, _ = c.First() {
			if err := c.Delete(); err != nil {
				return err
			}
		}
		return putU64(tx.Bucket(bMeta), kOutboxAcked, upTo)
	})
	if err != nil {
		return fmt.Errorf("ledger: ack outbox: %w", err)
	}
	return nil
}

// OutboxLen is the number of unacknowledged entries of commits that succeeded.
func (l *Ledger) OutboxLen() (int, error) {
	var n int
	err := l.view(func(tx *bolt.Tx) (err error) { n, err = outboxLen(tx); return err })
	if err != nil {
		return 0, fmt.Errorf("ledger: outbox: %w", err)
	}
	return n, nil
}

func outboxLen(tx *bolt.Tx) (int, error) {
	last, err := metaU64(tx, kOutboxSeq)
	if err != nil {
		return 0, err
	}
	acked, err := metaU64(tx, kOutboxAcked)
	if err != nil {
		return 0, err
	}
	if acked > last {
		return 0, corruptf("outbox acknowledged up to %d but assigned only up to %d", acked, last)
	}
	return int(last - acked), nil
}
