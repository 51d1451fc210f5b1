package ledger

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	bolt "go.etcd.io/bbolt"
)

// OffsetMark identifies a record the consumer read from a partition: its offset, its Kafka
// timestamp and a hash of its key and value (stream.RecordMark says how it is computed). A
// checkpoint stores one per partition with the partition's offset, in the same transaction, so
// that a consumer starting from the ledger can check that the topic still holds the log those
// offsets count in: a topic deleted, recreated and written past the ledger's offset while the
// daemon was stopped holds another record at Offset.
type OffsetMark struct {
	// Offset is the record's offset, below the partition's next offset.
	Offset int64 `json:"offset"`
	// Timestamp is the record's Kafka timestamp, in Unix milliseconds.
	Timestamp int64 `json:"timestamp"`
	// Sum is the hash of the record's key and value.
	Sum uint64 `json:"sum"`
}

// The offset_marks bucket: partition (u32) -> next (u64) | offset | timestamp | sum, sealed.
//
// next is the partition's offset the mark was checkpointed with. Every checkpoint that moves a
// partition's offset rewrites its mark's next (with a new mark or the same), so a mark whose
// next differs from the stored offset was left behind by a build that did not keep marks (a
// downgrade): it may belong to a log the offset no longer counts in, and is not used.
//
// The bucket is optional, not part of schema 2's buckets: a ledger written before marks existed
// has none, opens as it did and starts without a check (the consumer logs that it has no mark);
// its first checkpoint that reads a record creates the bucket and stores one. Absent marks mean
// "not known", never "different", so no schema change is needed, and a build without marks
// opening a newer ledger ignores the bucket (it checks only the buckets it knows).
const markSize = 32

func (m OffsetMark) encode(next int64) []byte {
	b := make([]byte, 0, markSize)
	b = binary.BigEndian.AppendUint64(b, uint64(next))
	b = binary.BigEndian.AppendUint64(b, uint64(m.Offset))
	b = binary.BigEndian.AppendUint64(b, uint64(m.Timestamp))
	return binary.BigEndian.AppendUint64(b, m.Sum)
}

// readMarks decodes every stored mark: partition -> (mark, the offset it was checkpointed with).
// A damaged mark, or one not below its own next offset, is a *CorruptError.
func readMarks(tx *bolt.Tx) (map[int]OffsetMark, map[int]int64, error) {
	marks, nexts := map[int]OffsetMark{}, map[int]int64{}
	b := tx.Bucket(bOffsetMarks)
	if b == nil {
		return marks, nexts, nil
	}
	err := b.ForEach(func(k, v []byte) error {
		p, ok := unseal(k, v)
		if len(k) != 4 || !ok || len(p) != markSize {
			return corruptf("offset_marks: record %x (%d bytes) is damaged", k, len(v))
		}
		part := int(binary.BigEndian.Uint32(k))
		next := int64(binary.BigEndian.Uint64(p))
		m := OffsetMark{Offset: int64(binary.BigEndian.Uint64(p[8:])), Timestamp: int64(binary.BigEndian.Uint64(p[16:])),
			Sum: binary.BigEndian.Uint64(p[24:])}
		if m.Offset < 0 || m.Offset >= next {
			return corruptf("offset_marks: partition %d: record offset %d is not below its checkpointed offset %d", part, m.Offset, next)
		}
		marks[part], nexts[part] = m, next
		return nil
	})
	return marks, nexts, err
}

// checkMarks checks the marks against the offsets: every mark belongs to a partition with an
// offset (Verify runs it).
func checkMarks(tx *bolt.Tx, offsets map[int]int64) error {
	marks, _, err := readMarks(tx)
	if err != nil {
		return err
	}
	for p := range marks {
		if _, ok := offsets[p]; !ok {
			return corruptf("offset_marks: partition %d has a mark but no offset", p)
		}
	}
	return nil
}

// validateMarks checks a checkpoint's marks against its offsets.
func (c *Checkpoint) validateMarks() error {
	for p, m := range c.Marks {
		next, ok := c.Offsets[p]
		switch {
		case !ok:
			return invalidf("mark for partition %d without an offset", p)
		case m.Offset < 0 || m.Offset >= next:
			return invalidf("mark of partition %d at offset %d, not in [0, %d)", p, m.Offset, next)
		case slices.Contains(c.ForgetMarks, p):
			return invalidf("partition %d both marked and forgotten", p)
		}
	}
	for _, p := range c.ForgetMarks {
		if p < 0 || p > math.MaxInt32 {
			return invalidf("forgotten mark of partition %d", p)
		}
	}
	return nil
}

// writeMarks stores a checkpoint's marks: a partition given in Marks gets its new mark, one in
// ForgetMarks loses its mark, and any other partition the checkpoint gives an offset keeps its
// mark with the new offset (the consumer read on in the same log), unless the mark was stale
// (left behind by a build without marks) or is not below the new offset (only a reset moves an
// offset back, and the consumer forgets the mark then): such a mark is deleted, since absent
// means "not known". Called in the checkpoint's transaction before the offsets are written.
func writeMarks(tx *bolt.Tx, c *Checkpoint) error {
	b := tx.Bucket(bOffsetMarks)
	if b == nil {
		if len(c.Marks) == 0 {
			return nil // nothing stored, nothing to store
		}
		var err error
		if b, err = tx.CreateBucket(bOffsetMarks); err != nil {
			return err
		}
	}
	marks, nexts, err := readMarks(tx)
	if err != nil {
		return err
	}
	offs := tx.Bucket(bOffsets)
	for p, next := range c.Offsets {
		m, ok := c.Marks[p]
		if !ok {
			if m, ok = marks[p]; !ok {
				continue
			}
			was, err := getU64(offs, partKey(p), fmt.Sprintf("offset of partition %d", p))
			if err != nil {
				return err
			}
			if slices.Contains(c.ForgetMarks, p) || int64(was) != nexts[p] || m.Offset >= next {
				if err := b.Delete(partKey(p)); err != nil {
					return err
				}
				continue
			}
		}
		if err := putSealed(b, partKey(p), m.encode(next)); err != nil {
			return err
		}
	}
	for _, p := range c.ForgetMarks {
		if _, ok := c.Offsets[p]; !ok {
			if err := b.Delete(partKey(p)); err != nil {
				return err
			}
		}
	}
	return nil
}

func partKey(p int) []byte { return binary.BigEndian.AppendUint32(nil, uint32(p)) }

// ResumePoint returns, as of the last checkpoint and from one transaction, the next offset to
// consume per partition and the mark of a record consumed before it (see OffsetMark) where one
// is known: partitions checkpointed before marks were kept, or whose log was reset without a
// record read since, have none.
func (l *Ledger) ResumePoint() (offsets map[int]int64, marks map[int]OffsetMark, err error) {
	err = l.view(func(tx *bolt.Tx) error {
		if offsets, err = readOffsets(tx); err != nil {
			return err
		}
		var nexts map[int]int64
		if marks, nexts, err = readMarks(tx); err != nil {
			return err
		}
		for p, next := range nexts {
			if off, ok := offsets[p]; !ok || off != next {
				delete(marks, p) // left behind by a build without marks: see the bucket's comment
			}
		}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("ledger: resume point: %w", err)
	}
	return offsets, marks, nil
}
