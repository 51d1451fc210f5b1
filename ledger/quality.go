package ledger

import (
	"encoding/binary"
	"fmt"

	bolt "go.etcd.io/bbolt"
)

// The quality bucket: KL history sequence number (u64) -> the increment's prequential record,
// sealed. The record is opaque to the ledger (the daemon's JSON: the increment's scores under
// the posterior that was current before it, and the change detector's state after them); the
// ledger stores it in the checkpoint's transaction, so that every record is scored exactly once
// across crashes, and trims it with the KL history.
//
// The bucket is optional, like offset_marks: a ledger written before prequential scores existed
// has none and opens as it did (the daemon starts its scores afresh); a build without scores
// opening a newer ledger ignores the bucket.
//
// A damaged record (its checksum, a key that is not a sequence number, no bytes) is dropped by
// Open's record check and named in an ERROR log line (quarantine.go): the records only feed the
// daemon's prequential scores, which go on from the records kept. Verify reports it as damage.
var bQuality = []byte("quality")

// QualityRecord is one stored prequential record: the KL history entry it belongs to and its
// bytes.
type QualityRecord struct {
	Seq  uint64
	Data []byte
}

// writeQuality stores data under seq and deletes the records at or below trimTo, and a key met
// among them that is not a sequence number (a damaged record, which Open drops too).
func writeQuality(tx *bolt.Tx, seq uint64, data []byte, trimTo uint64) error {
	b := tx.Bucket(bQuality)
	if b == nil {
		if len(data) == 0 {
			return nil
		}
		var err error
		if b, err = tx.CreateBucket(bQuality); err != nil {
			return err
		}
	}
	if len(data) > 0 {
		if err := putSealed(b, u64bytes(seq), data); err != nil {
			return err
		}
	}
	cur := b.Cursor()
	for k, _ := cur.First(); k != nil && (len(k) != 8 || binary.BigEndian.Uint64(k) <= trimTo); k, _ = cur.First() {
		if err := cur.Delete(); err != nil {
			return err
		}
	}
	return nil
}

// Quality returns the newest n prequential records (all kept ones if n <= 0), oldest first. A
// damaged record is a *CorruptError naming it.
func (l *Ledger) Quality(n int) ([]QualityRecord, error) {
	var out []QualityRecord
	err := l.view(func(tx *bolt.Tx) error {
		b := tx.Bucket(bQuality)
		if b == nil {
			return nil
		}
		c := b.Cursor()
		for k, v := c.Last(); k != nil && (n <= 0 || len(out) < n); k, v = c.Prev() {
			p, why := qualityPayload(k, v)
			if why != "" {
				return corruptf("quality record %x: %s", k, why)
			}
			out = append(out, QualityRecord{Seq: binary.BigEndian.Uint64(k), Data: append([]byte(nil), p...)})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return out, nil
}

// qualityDamage says what is wrong with the stored record k = v, "" when nothing is.
func qualityDamage(k, v []byte) string {
	_, why := qualityPayload(k, v)
	return why
}

// qualityPayload is the stored record k = v's payload, or what is wrong with it.
func qualityPayload(k, v []byte) (p []byte, why string) {
	p, ok := unseal(k, v)
	switch {
	case !ok:
		return nil, "checksum mismatch"
	case len(k) != 8:
		return nil, fmt.Sprintf("key of %d bytes, not a sequence number", len(k))
	case len(p) == 0:
		return nil, "empty"
	}
	return p, ""
}

// checkQuality checks every prequential record (Verify): intact (qualityDamage), and stored with
// a KL history entry written, its sequence number in [1, the last one]. The ledger does not
// decode a record's bytes, which are the daemon's.
func checkQuality(tx *bolt.Tx) error {
	b := tx.Bucket(bQuality)
	if b == nil {
		return nil
	}
	last, err := metaU64(tx, kKLSeq)
	if err != nil {
		return err
	}
	return b.ForEach(func(k, v []byte) error {
		if why := qualityDamage(k, v); why != "" {
			return corruptf("quality record %x: %s", k, why)
		}
		if s := binary.BigEndian.Uint64(k); s == 0 || s > last {
			return corruptf("quality record %d: no KL history entry was written under it (the last is %d)", s, last)
		}
		return nil
	})
}
