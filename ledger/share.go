package ledger

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"strconv"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/certify"
)

// A replica keeps the CEs of the partitions of the CE topic it owns (package ceshare): for each,
// the offset after the last request it applied, under meta key "share/<partition>" (and a record
// it read before that offset, ShareWitness, under "sharewitness/<partition>"). ApplyShare
// stores it in the transaction that applies the requests before it (and 0 for a partition read
// again from its start), SkipShare past requests the topic lost, ReleaseShare back to 0 and then
// not at all.
func shareKey(p int) []byte { return []byte("share/" + strconv.Itoa(p)) }

// ShareOffset is the offset after the last request of CE-topic partition p the ledger applied,
// and false when it holds none (the partition was never owned, or was released).
func (l *Ledger) ShareOffset(p int) (int64, bool, error) {
	var (
		off int64
		ok  bool
	)
	err := l.view(func(tx *bolt.Tx) (err error) {
		off, ok, err = readShareOffset(tx, p)
		return err
	})
	if err != nil {
		return 0, false, fmt.Errorf("ledger: share offset: %w", err)
	}
	return off, ok, nil
}

// ShareWitness is a record of CE-topic partition Partition that the ledger's share read before its
// offset: the record's Offset and Hash (package ceshare's Witness). It is kept under meta key
// "sharewitness/<partition>" while it is before the partition's offset, so that a replica that
// acquires the partition again can tell the log it read from a topic deleted and created again
// that has grown past that offset.
type ShareWitness struct {
	Offset int64
	Hash   [32]byte
}

func shareWitnessKey(p int) []byte { return []byte("sharewitness/" + strconv.Itoa(p)) }

// ShareStart is where the ledger's share of CE-topic partition p starts reading again: the
// offset after the last request applied and whether the ledger holds one (ShareOffset), and the
// witness stored before it (nil when none).
func (l *Ledger) ShareStart(p int) (int64, bool, *ShareWitness, error) {
	var (
		off  int64
		held bool
		w    *ShareWitness
	)
	err := l.view(func(tx *bolt.Tx) (err error) {
		if off, held, err = readShareOffset(tx, p); err != nil {
			return err
		}
		w, err = readShareWitness(tx, p)
		return err
	})
	if err != nil {
		return 0, false, nil, fmt.Errorf("ledger: share start: %w", err)
	}
	if w != nil && w.Offset >= off {
		w = nil
	}
	return off, held, w, nil
}

// readShareWitness is partition p's ShareWitness in tx, nil when none.
func readShareWitness(tx *bolt.Tx, p int) (*ShareWitness, error) {
	v, err := getSealed(tx.Bucket(bMeta), shareWitnessKey(p), "meta share witness")
	if err != nil || v == nil {
		return nil, err
	}
	if len(v) != 8+32 {
		return nil, corruptf("meta share witness of partition %d: %d bytes", p, len(v))
	}
	w := &ShareWitness{Offset: int64(binary.BigEndian.Uint64(v))}
	copy(w.Hash[:], v[8:])
	return w, nil
}

// putShareOffset stores next as partition p's offset in tx, with w when it is not nil; a witness
// stored before stays while it is before next, and is deleted otherwise (an offset that went
// back, to 0 at a reset or a release).
func putShareOffset(tx *bolt.Tx, p int, next int64, w *ShareWitness) error {
	meta := tx.Bucket(bMeta)
	if err := putSealed(meta, shareKey(p), binary.BigEndian.AppendUint64(nil, uint64(next))); err != nil {
		return err
	}
	if w != nil && w.Offset >= 0 && w.Offset < next {
		return putSealed(meta, shareWitnessKey(p), append(binary.BigEndian.AppendUint64(nil, uint64(w.Offset)), w.Hash[:]...))
	}
	old, err := readShareWitness(tx, p)
	if err != nil || old == nil || old.Offset < next {
		return err
	}
	return meta.Delete(shareWitnessKey(p))
}

// readShareOffset is ShareOffset in tx.
func readShareOffset(tx *bolt.Tx, p int) (int64, bool, error) {
	v, err := getSealed(tx.Bucket(bMeta), shareKey(p), "meta share offset")
	if err != nil || v == nil {
		return 0, false, err
	}
	if len(v) != 8 {
		return 0, false, corruptf("meta share offset of partition %d: %d bytes", p, len(v))
	}
	return int64(binary.BigEndian.Uint64(v)), true, nil
}

// CounterRequestsLost is the counter (State.Counters) of CE requests deleted from the CE topic
// before they were read (SkipShare).
const CounterRequestsLost = "ce_requests_lost"

// SkipShare moves partition p's offset from `from`, where the ledger holds it (0 when it holds
// none), to `to`, past requests the CE topic no longer has (its retention deleted them before
// they were read), and adds to - from to the counter CounterRequestsLost, in one transaction:
// this ledger counts a loss once, and whenever it passes one. It refuses, writing nothing, when
// p's offset is not `from` (another call moved it) or when to < from.
func (l *Ledger) SkipShare(p int, from, to int64) error {
	if p < 0 || from < 0 || to < from {
		return fmt.Errorf("ledger: skip share: %w", invalidf("partition %d from offset %d to %d", p, from, to))
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	err := l.update(func(tx *bolt.Tx) error {
		held, _, err := readShareOffset(tx, p)
		if err != nil {
			return err
		}
		if held != from {
			return invalidf("partition %d is at offset %d, not %d", p, held, from)
		}
		if err := putSealed(tx.Bucket(bMeta), shareKey(p), binary.BigEndian.AppendUint64(nil, uint64(to))); err != nil {
			return err
		}
		return addCounter(tx, CounterRequestsLost, to-from, l.opts.Now())
	})
	if err != nil {
		return fmt.Errorf("ledger: skip share of partition %d: %w", p, err)
	}
	return nil
}

// ResetShare sets partition p's offset back to 0 (its witness goes with it) and forgets the
// outcomes of its requests (ApplyShare) at offsets from `from` on, in one transaction: the
// partition's topic was deleted and created again, and reading it from its start applies each
// request of the new log, in order, also those an owner that kept p read, from `from` on,
// before it found the new log. Outcomes of requests before `from` (the old log's) stay, so that
// a client's retry of one is still answered as its first attempt was. The CEs stay.
func (l *Ledger) ResetShare(p int, from int64) error {
	if p < 0 || from < 0 {
		return fmt.Errorf("ledger: reset share: %w", invalidf("partition %d from offset %d", p, from))
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	err := l.update(func(tx *bolt.Tx) error {
		if err := putShareOffset(tx, p, 0, nil); err != nil {
			return err
		}
		return forgetOutcomes(tx, p, from)
	})
	if err != nil {
		return fmt.Errorf("ledger: reset share of partition %d: %w", p, err)
	}
	return nil
}

// ReleaseShare deletes every CE for which in(id) holds, quarantined ones included, and forgets
// partition p's offset and the outcomes of its requests (ApplyShare). The CEs go in transactions of at most releaseBatch;
// before the first, a held offset is set back to 0 and the outcomes are deleted, so that a
// release cut short (ctx, a crash) leaves the partition to be read again from its start: an
// acquisition then stores the CEs deleted again and skips those left, instead of reading on
// from the old offset without them. It returns how many CEs it deleted.
func (l *Ledger) ReleaseShare(ctx context.Context, p int, in func(id string) bool) (int, error) {
	// The offset back to 0 and the outcomes of p's requests forgotten, together: a partition
	// read again from its start applies its requests again.
	l.wmu.Lock()
	err := l.update(func(tx *bolt.Tx) error {
		if v := tx.Bucket(bMeta).Get(shareKey(p)); v != nil {
			if err := putShareOffset(tx, p, 0, nil); err != nil {
				return err
			}
		}
		return forgetOutcomes(tx, p, 0)
	})
	l.wmu.Unlock()
	if err != nil {
		return 0, fmt.Errorf("ledger: release share: %w", err)
	}
	var ids [][]byte
	collect := func(k, _ []byte) error {
		if in(string(k)) {
			ids = append(ids, bytes.Clone(k))
		}
		return nil
	}
	err = l.view(func(tx *bolt.Tx) error {
		if q := tx.Bucket(bQuarantine); q != nil { // their damaged records go too
			if err := q.ForEach(collect); err != nil {
				return err
			}
		}
		return tx.Bucket(bHeaders).ForEach(collect)
	})
	if err != nil {
		return 0, fmt.Errorf("ledger: release share: %w", err)
	}
	n := 0
	for len(ids) > 0 {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		chunk := ids[:min(len(ids), releaseBatch)]
		ids = ids[len(chunk):]
		if err := l.deleteAll(chunk); err != nil {
			return n, fmt.Errorf("ledger: release share: %w", err)
		}
		n += len(chunk)
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if err := l.update(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bMeta).Delete(shareWitnessKey(p)); err != nil {
			return err
		}
		return tx.Bucket(bMeta).Delete(shareKey(p))
	}); err != nil {
		return n, fmt.Errorf("ledger: release share: %w", err)
	}
	return n, nil
}

// releaseBatch bounds the CEs one transaction of ReleaseShare deletes.
const releaseBatch = 10_000

// deleteAll deletes the CEs under keys (those still stored) in one transaction (ReleaseShare).
// A CE whose header was damaged since Open is quarantined first, with every other damaged header
// (quarantineDamaged), and a quarantined CE under keys is dropped with the rest: the partition's
// next owner stores it again from the CE topic. The log names each one dropped.
func (l *Ledger) deleteAll(keys [][]byte) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var found deletedDamaged
	err := l.update(func(tx *bolt.Tx) error {
		found = deletedDamaged{}
		for _, key := range keys {
			if _, err := l.readHeaderForDeletion(tx, key, found); err != nil {
				return err
			}
			if len(found) > 0 {
				break // every damaged header is in quarantine now
			}
		}
		for _, key := range keys {
			if why, q := quarantineReason(tx, key); q {
				found[string(key)] = damagedCE{why: why, released: true}
			}
		}
		return l.deleteStored(tx, keys, false)
	})
	if err == nil {
		l.reportDamaged(found)
	}
	return err
}

// deleteStored deletes in tx the CEs under keys that are stored or quarantined, with their reissue
// entries, releases the anchor references of the stored ones and collects the anchors no CE
// refers to any more. With tombstones (a CE deleted, not released to another owner), each
// deleted CE's state is a tombstone (Options.EncodeState), a quarantined one's too: its last
// state may be on the CE state topic, and a later owner must not restore it from there.
func (l *Ledger) deleteStored(tx *bolt.Tx, keys [][]byte, tombstones bool) error {
	c, err := readCur(tx)
	if err != nil {
		return err
	}
	w, err := l.newWriteTx(tx, l.opts.Now().UTC())
	if err != nil {
		return err
	}
	for _, key := range keys {
		h, ok, err := readHeader(tx, key)
		if err != nil {
			return err
		}
		if !ok {
			if q := tx.Bucket(bQuarantine); q != nil && q.Get(key) != nil {
				if err := q.Delete(key); err != nil { // the damaged record is dropped
					return err
				}
				if err := dropReissue(tx, key); err != nil {
					return err
				}
				if tombstones {
					w.states.add(key)
				}
			}
			continue
		}
		if err := w.deleteCE(key, &h); err != nil {
			return err
		}
		if tombstones {
			w.states.add(key)
		}
		if h.status != certify.Uncertified {
			if err := l.ref(tx, c, h.anchor, -1, 0, time.Time{}); err != nil {
				return err
			}
		}
	}
	if err := l.gcAnchors(tx, c.version); err != nil {
		return err
	}
	return w.finish()
}

// ShareOffsets returns every partition the ledger holds requests of, with its offset.
func (l *Ledger) ShareOffsets() (map[int]int64, error) {
	out := map[int]int64{}
	err := l.view(func(tx *bolt.Tx) error {
		c := tx.Bucket(bMeta).Cursor()
		prefix := []byte("share/")
		for k, _ := c.Seek(prefix); k != nil && bytes.HasPrefix(k, prefix); k, _ = c.Next() {
			p, err := strconv.Atoi(string(k[len(prefix):]))
			if err != nil {
				return corruptf("meta key %q", k)
			}
			v, err := getSealed(tx.Bucket(bMeta), k, "meta share offset")
			if err != nil {
				return err
			}
			if len(v) != 8 {
				return corruptf("meta share offset of partition %d: %d bytes", p, len(v))
			}
			out[p] = int64(binary.BigEndian.Uint64(v))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: share offsets: %w", err)
	}
	return out, nil
}
