package ledger

import (
	"errors"
	"path/filepath"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/ledger/store"
)

// resumePoint reads the ledger's resume point, failing the test on an error.
func resumePoint(t *testing.T, l *Ledger) (map[int]int64, map[int]OffsetMark) {
	t.Helper()
	offs, marks, err := l.ResumePoint()
	if err != nil {
		t.Fatal(err)
	}
	return offs, marks
}

// TestOffsetMarks: a checkpoint's marks are stored with its offsets; a checkpoint that moves an
// offset without a mark keeps the mark (same log); a forgotten mark is gone; marks survive a
// reopen and pass Verify; a mark must lie below its partition's offset.
func TestOffsetMarks(t *testing.T) {
	l, dir := openTest(t, Options{})
	m0 := OffsetMark{Offset: 9, Timestamp: 1700000000123, Sum: 0xfeedface}
	m1 := OffsetMark{Offset: 4, Timestamp: 1700000000456, Sum: 42}
	if err := l.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 10, 1: 5}, Marks: map[int]OffsetMark{0: m0, 1: m1}}); err != nil {
		t.Fatal(err)
	}
	offs, marks := resumePoint(t, l)
	if offs[0] != 10 || offs[1] != 5 || marks[0] != m0 || marks[1] != m1 {
		t.Fatalf("resume point %v %v, want offsets 10, 5 with marks %v, %v", offs, marks, m0, m1)
	}

	// Partition 0 reads on without a new mark (the increment ended inside a fetch): the mark
	// stays. Partition 1 is reset to a new log (whose start is past the old offset): its mark
	// is forgotten.
	if err := l.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 30, 1: 50}, ForgetMarks: []int{1}}); err != nil {
		t.Fatal(err)
	}
	offs, marks = resumePoint(t, l)
	if offs[0] != 30 || marks[0] != m0 {
		t.Fatalf("partition 0 at %d with mark %v, want 30 with %v", offs[0], marks[0], m0)
	}
	if _, ok := marks[1]; ok || offs[1] != 50 {
		t.Fatalf("partition 1 at %d with mark %v after its reset, want 50 without a mark", offs[1], marks[1])
	}

	for name, cp := range map[string]*Checkpoint{
		"mark at the offset":  {Offsets: map[int]int64{0: 31}, Marks: map[int]OffsetMark{0: {Offset: 31}}},
		"mark without offset": {Offsets: map[int]int64{0: 31}, Marks: map[int]OffsetMark{2: {Offset: 1}}},
		"negative mark":       {Offsets: map[int]int64{0: 31}, Marks: map[int]OffsetMark{0: {Offset: -1}}},
		"marked and forgot":   {Offsets: map[int]int64{0: 31}, Marks: map[int]OffsetMark{0: {Offset: 1}}, ForgetMarks: []int{0}},
	} {
		if err := l.Checkpoint(cp); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}

	// An offset moved back without forgetting the mark (no consumer does this): the mark cannot
	// belong to the log any more and is dropped, never kept above its offset.
	if err := l.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 5}}); err != nil {
		t.Fatal(err)
	}
	if _, marks = resumePoint(t, l); len(marks) != 0 {
		t.Fatalf("marks %v after partition 0 moved below its mark, want none", marks)
	}
	if err := l.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 40}, Marks: map[int]OffsetMark{0: m0}}); err != nil {
		t.Fatal(err)
	}

	path := filepath.Join(dir, FileName)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := Verify(path); err != nil {
		t.Fatalf("Verify: %v", err)
	}
	l2, err := Open(dir, Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if _, marks = resumePoint(t, l2); marks[0] != m0 {
		t.Fatalf("after reopening, mark %v, want %v", marks[0], m0)
	}
}

// TestLedgerWithoutMarks: a ledger written before marks existed (no offset_marks bucket) opens,
// verifies and resumes without marks; its next checkpoint with a mark creates the bucket.
func TestLedgerWithoutMarks(t *testing.T) {
	l, dir := openTest(t, Options{})
	if err := l.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 10}}); err != nil {
		t.Fatal(err)
	}
	l.Close()
	path := filepath.Join(dir, FileName)
	withDB(t, path, func(tx *bolt.Tx) error { return tx.DeleteBucket(bOffsetMarks) })
	if _, err := Verify(path); err != nil {
		t.Fatalf("Verify of a ledger without marks: %v", err)
	}
	l2, err := Open(dir, Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	offs, marks := resumePoint(t, l2)
	if offs[0] != 10 || len(marks) != 0 {
		t.Fatalf("resume point %v %v, want offset 10 without marks", offs, marks)
	}
	if err := l2.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 20}}); err != nil {
		t.Fatal(err)
	}
	m := OffsetMark{Offset: 24, Timestamp: 7, Sum: 8}
	if err := l2.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 25}, Marks: map[int]OffsetMark{0: m}}); err != nil {
		t.Fatal(err)
	}
	if _, marks = resumePoint(t, l2); marks[0] != m {
		t.Fatalf("mark %v, want %v", marks[0], m)
	}
}

// TestStaleMarkIgnored: a mark whose checkpointed offset is not the partition's offset (a build
// without marks moved the offset) is not returned: it may belong to another log. A mark that
// fails its checksum, or lies at or above its own offset, is damage (Verify and Open refuse), and
// so, for Verify, is a mark of a partition without an offset.
func TestStaleMarkIgnored(t *testing.T) {
	l, dir := openTest(t, Options{})
	if err := l.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 10}, Marks: map[int]OffsetMark{0: {Offset: 9, Sum: 1}}}); err != nil {
		t.Fatal(err)
	}
	l.Close()
	path := filepath.Join(dir, FileName)
	// What an older build's checkpoint does: the offset moves, the mark stays as it was.
	withDB(t, path, func(tx *bolt.Tx) error { return putSealed(tx.Bucket(bOffsets), partKey(0), u64bytes(3)) })
	if _, err := Verify(path); err != nil {
		t.Fatalf("Verify: %v", err)
	}
	l2, err := Open(dir, Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	if offs, marks := resumePoint(t, l2); offs[0] != 3 || len(marks) != 0 {
		t.Fatalf("resume point %v %v, want offset 3 without the stale mark", offs, marks)
	}
	// Carried forward by a later checkpoint, the stale mark stays gone.
	if err := l2.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 12}}); err != nil {
		t.Fatal(err)
	}
	if _, marks := resumePoint(t, l2); len(marks) != 0 {
		t.Fatalf("marks %v after a checkpoint, want the stale one gone", marks)
	}
	l2.Close()

	// A mark of a partition without an offset: Verify names it (Open has no use for it).
	orphan := partKey(7)
	withDB(t, path, func(tx *bolt.Tx) error {
		return putSealed(tx.Bucket(bOffsetMarks), orphan, OffsetMark{Offset: 1}.encode(2))
	})
	if _, err := Verify(path); !errors.Is(err, ErrCorrupt) {
		t.Errorf("a mark without an offset: Verify %v, want ErrCorrupt", err)
	}
	withDB(t, path, func(tx *bolt.Tx) error { return tx.Bucket(bOffsetMarks).Delete(orphan) })

	for name, put := range map[string]func(b *bolt.Bucket) error{
		"checksum":         func(b *bolt.Bucket) error { return b.Put(partKey(0), make([]byte, markSize+store.CRCSize)) },
		"above its offset": func(b *bolt.Bucket) error { return putSealed(b, partKey(0), OffsetMark{Offset: 12}.encode(12)) },
	} {
		withDB(t, path, func(tx *bolt.Tx) error {
			b, err := tx.CreateBucketIfNotExists(bOffsetMarks)
			if err != nil {
				return err
			}
			return put(b)
		})
		if _, err := Verify(path); !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: Verify %v, want ErrCorrupt", name, err)
		}
		if l, err := Open(dir, Options{Logger: quietLogger()}); !errors.Is(err, ErrCorrupt) {
			if err == nil {
				l.Close()
			}
			t.Errorf("%s: Open %v, want ErrCorrupt", name, err)
		}
	}
}

// withDB runs fn in a write transaction on the closed ledger file at path.
func withDB(t *testing.T, path string, fn func(tx *bolt.Tx) error) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(fn); err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
}
