package ledger

import (
	"encoding/binary"
	"fmt"
	"slices"
	"strings"

	bolt "go.etcd.io/bbolt"
)

// The reissue bucket: CE id -> the posterior version (u64) of the status change that made the CE
// wait for a reissue, sealed. With Options.Reissue set, the transaction that records such a
// change (recordChange) writes the entry, so a CE waiting for its replacement is known after a
// crash as surely as its status is; Checkpoint.Reissued deletes it in the transaction that stores
// the outcome's event, and deleting the CE deletes it too.
//
// The bucket is optional, like quality: a ledger written by a build without it opens as it did,
// and a build without it opening a newer ledger ignores it. A damaged value is read as version
// 0: the key is the CE waiting, which is what matters; Open writes it again so (repairReissues).
var bReissue = []byte("reissue")

// PendingReissue is a CE waiting for a reissue: its id, and the posterior version of the status
// change that made it wait. An outcome under that version or a later one settles it.
type PendingReissue struct {
	ID      string
	Version uint64
}

// markReissues writes the reissue entries of the transaction's status changes that
// Options.Reissue selects, in key order (see writeTx on random inserts); a CE changed twice keeps
// its latest change's version.
func (w *writeTx) markReissues() error {
	sel := w.l.opts.Reissue
	if sel == nil {
		return nil
	}
	var marks []PendingReissue
	for _, ch := range w.changes {
		if sel(ch) {
			marks = append(marks, PendingReissue{ID: ch.ID, Version: ch.PosteriorVersion})
		}
	}
	if len(marks) == 0 {
		return nil
	}
	slices.SortStableFunc(marks, func(a, b PendingReissue) int { return strings.Compare(a.ID, b.ID) })
	return w.putReissues(marks)
}

// putReissues writes the entries of ps, creating the bucket with the first.
func (w *writeTx) putReissues(ps []PendingReissue) error {
	b, err := w.tx.CreateBucketIfNotExists(bReissue)
	if err != nil {
		return err
	}
	for _, p := range ps {
		if err := putSealed(b, []byte(p.ID), u64bytes(p.Version)); err != nil {
			return err
		}
	}
	return nil
}

// settleReissues deletes the entries of done whose stored change is at or before the version
// given: an entry a later status change wrote again waits on. The state of each CE settled is
// written again (Options.EncodeState), so that a later owner of the CE does not reissue it again;
// not that of a CE whose record is damaged (found after Open), which would fail the outcome's
// transaction: a later owner may then reissue it once more.
func (w *writeTx) settleReissues(done []PendingReissue) error {
	b := w.tx.Bucket(bReissue)
	if b == nil {
		return nil
	}
	hdrs := w.tx.Bucket(bHeaders)
	for _, d := range done {
		k := []byte(d.ID)
		v := b.Get(k)
		if v == nil || reissueVersion(k, v) > d.Version {
			continue
		}
		if err := b.Delete(k); err != nil {
			return err
		}
		if raw := hdrs.Get(k); raw != nil && w.l.opts.EncodeState != nil {
			if _, _, err := loadStored(w.tx, k, raw); err == nil {
				w.states.add(k)
			}
		}
	}
	return nil
}

// dropReissue deletes the entry of a deleted CE.
func dropReissue(tx *bolt.Tx, id []byte) error {
	if b := tx.Bucket(bReissue); b != nil {
		return b.Delete(id)
	}
	return nil
}

// repairReissues writes the damaged reissue entries of ids (Open's record check) again, sealed,
// as waiting since version 0, naming each in an ERROR line: the key is what matters, the CE
// waiting, and an entry at version 0 is settled by any outcome. Dropping one would lose the
// reissue; keeping it damaged would fail every Verify, and so every backup, of a ledger the
// daemon runs on.
func (l *Ledger) repairReissues(ids [][]byte) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	err := l.update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bReissue)
		for _, id := range ids {
			if err := putSealed(b, id, u64bytes(0)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return corrupt(l.path, fmt.Errorf("ledger: writing %d damaged reissue entries again: %w", len(ids), err))
	}
	for _, id := range ids {
		l.log.Error("ledger: a reissue entry (bucket reissue) is damaged; it was written again, the counterfactual still waiting "+
			"for its reissue (settled by any outcome)", "path", l.path, "id", string(id))
	}
	return nil
}

// reissueVersion decodes an entry's value; a damaged one is version 0.
func reissueVersion(k, v []byte) uint64 {
	version, _ := decodeReissue(k, v)
	return version
}

// decodeReissue decodes an entry's value: its version, and false when it is damaged (its seal
// fails, or it does not hold 8 bytes). Open (scanRecords) and Verify (checkReissues) both judge
// an entry by it.
func decodeReissue(k, v []byte) (uint64, bool) {
	p, ok := unseal(k, v)
	if !ok || len(p) != 8 {
		return 0, false
	}
	return binary.BigEndian.Uint64(p), true
}

// checkReissues checks that every reissue entry is sealed and holds a version (Verify). An entry
// may outlive its CE in the quarantine: it names a CE, not a record.
func checkReissues(tx *bolt.Tx) error {
	b := tx.Bucket(bReissue)
	if b == nil {
		return nil
	}
	return b.ForEach(func(k, v []byte) error {
		if _, ok := decodeReissue(k, v); !ok {
			return corruptf("reissue entry of counterfactual %q: checksum mismatch or not a version", k)
		}
		return nil
	})
}

// PendingReissues pages through the CEs waiting for a reissue in id order: up to limit (at least
// 1) with ids after `after` ("" = from the start).
func (l *Ledger) PendingReissues(after string, limit int) ([]PendingReissue, error) {
	var out []PendingReissue
	err := l.view(func(tx *bolt.Tx) error {
		b := tx.Bucket(bReissue)
		if b == nil {
			return nil
		}
		c := b.Cursor()
		k, v := c.First()
		if after != "" {
			k, v = c.Seek([]byte(after))
			if k != nil && string(k) == after {
				k, v = c.Next()
			}
		}
		for ; k != nil && len(out) < max(limit, 1); k, v = c.Next() {
			out = append(out, PendingReissue{ID: string(k), Version: reissueVersion(k, v)})
		}
		return nil
	})
	return out, err
}

// PendingReissue reports whether CE id waits for a reissue, and since which change.
func (l *Ledger) PendingReissue(id string) (p PendingReissue, ok bool, err error) {
	err = l.view(func(tx *bolt.Tx) error {
		if b := tx.Bucket(bReissue); b != nil {
			if v := b.Get([]byte(id)); v != nil {
				p, ok = PendingReissue{ID: id, Version: reissueVersion([]byte(id), v)}, true
			}
		}
		return nil
	})
	return p, ok, err
}
