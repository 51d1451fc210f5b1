package store

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"
)

func FuzzSeal(f *testing.F) {
	f.Add([]byte("ce-1"), []byte("payload"))
	f.Fuzz(func(t *testing.T, k, p []byte) {
		v := Seal(k, p)
		got, ok := Unseal(k, v)
		if !ok || !bytes.Equal(got, p) {
			t.Fatal("Unseal(Seal(p)) != p")
		}
		for i := range v {
			w := append([]byte(nil), v...)
			w[i] ^= 1
			if _, ok := Unseal(k, w); ok {
				t.Fatalf("a flipped bit at %d of %d passed the checksum", i, len(v))
			}
		}
	})
}

// A sealed value read under another key fails its checksum: the key is sealed with the payload.
func TestSealCoversTheKey(t *testing.T) {
	v := Seal([]byte("a"), []byte("payload"))
	if _, ok := Unseal([]byte("b"), v); ok {
		t.Fatal("a value sealed under key a unsealed under key b")
	}
}

// Reseal rewrites every value of a bucket sealed, across several chunks, and stops at the first
// error of fix, which the transaction then rolls back.
func TestReseal(t *testing.T) {
	db, err := bolt.Open(filepath.Join(t.TempDir(), "reseal.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	const n = 25000 // more than two chunks
	key := func(i int) []byte { return binary.BigEndian.AppendUint32(nil, uint32(i)) }
	err = db.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucket([]byte("b"))
		if err != nil {
			return err
		}
		for i := range n {
			if err := b.Put(key(i), []byte{byte(i)}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	fixed := 0
	err = db.Update(func(tx *bolt.Tx) error {
		return Reseal(tx.Bucket([]byte("b")), func(k, v []byte) ([]byte, error) {
			fixed++
			return append(v, 'x'), nil
		})
	})
	if err != nil || fixed != n {
		t.Fatalf("Reseal: %v after %d values, want nil after %d", err, fixed, n)
	}
	err = db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("b"))
		for i := range n {
			p, err := Get(b, key(i), "value")
			if err != nil || !bytes.Equal(p, []byte{byte(i), 'x'}) {
				t.Fatalf("value %d after Reseal: %q, %v", i, p, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	stop := errors.New("stop")
	err = db.Update(func(tx *bolt.Tx) error {
		return Reseal(tx.Bucket([]byte("b")), func(k, v []byte) ([]byte, error) {
			if binary.BigEndian.Uint32(k) == n-1 {
				return nil, stop
			}
			return v, nil
		})
	})
	if !errors.Is(err, stop) {
		t.Fatalf("Reseal with a failing fix: %v, want its error", err)
	}
}

// TestUnsealShortValues: a value shorter than its checksum (a damaged length, or a value written
// unsealed) is refused, not sliced: Get reports it as damaged, naming the record.
// inNewBucket runs fn in a write transaction on bucket "b" of a new bolt file, and returns the
// transaction's error.
func inNewBucket(t *testing.T, fn func(b *bolt.Bucket) error) error {
	t.Helper()
	db, err := bolt.Open(filepath.Join(t.TempDir(), "test.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	return db.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucket([]byte("b"))
		if err != nil {
			return err
		}
		return fn(b)
	})
}

func TestUnsealShortValues(t *testing.T) {
	for n := range CRCSize {
		if p, ok := Unseal([]byte("k"), make([]byte, n)); ok || p != nil {
			t.Errorf("a %d-byte value unsealed: %q, %v", n, p, ok)
		}
	}
	err := inNewBucket(t, func(b *bolt.Bucket) error {
		if err := b.Put([]byte("short"), []byte{1, 2}); err != nil {
			return err
		}
		_, err := Get(b, []byte("short"), `record "short"`)
		return err
	})
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), `record "short": checksum mismatch (2 bytes)`) {
		t.Fatalf("Get of a 2-byte value: %v, want ErrCorrupt naming the record", err)
	}
}

// TestGetU64WantsEightBytes: a sealed counter of another length than 8 (a record of another
// type under its key) is refused naming its length, whether shorter or longer.
func TestGetU64WantsEightBytes(t *testing.T) {
	err := inNewBucket(t, func(b *bolt.Bucket) error {
		if err := PutU64(b, []byte("good"), 0x0102030405060708); err != nil {
			return err
		}
		if v, err := GetU64(b, []byte("good"), "good"); err != nil || v != 0x0102030405060708 {
			t.Errorf("GetU64 of PutU64: %#x, %v", v, err)
		}
		for _, n := range []int{7, 9} {
			k := fmt.Appendf(nil, "len%d", n)
			if err := Put(b, k, make([]byte, n)); err != nil {
				return err
			}
			_, err := GetU64(b, k, string(k))
			if want := fmt.Sprintf("%s: %d bytes, want 8", k, n); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), want) {
				t.Errorf("GetU64 of a %d-byte value: %v, want ErrCorrupt saying %q", n, err, want)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestResealRefusesANestedBucket: Reseal rewrites values; a nested bucket where values should be
// is a damaged layout, reported, not sealed over.
func TestResealRefusesANestedBucket(t *testing.T) {
	err := inNewBucket(t, func(b *bolt.Bucket) error {
		if err := b.Put([]byte("a"), []byte("v")); err != nil {
			return err
		}
		if _, err := b.CreateBucket([]byte("inner")); err != nil {
			return err
		}
		return Reseal(b, func(k, v []byte) ([]byte, error) { return v, nil })
	})
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), `unexpected nested bucket "inner"`) {
		t.Fatalf("Reseal of a bucket holding a bucket: %v, want ErrCorrupt naming it", err)
	}
}

// TestSealEmptyPayload: a value of exactly CRCSize bytes is an empty payload and its checksum,
// and unseals; only a value shorter than the checksum is refused.
func TestSealEmptyPayload(t *testing.T) {
	for _, p := range [][]byte{nil, {}, {0}} {
		v := Seal([]byte("k"), p)
		if got, ok := Unseal([]byte("k"), v); !ok || !bytes.Equal(got, p) || len(v) != len(p)+CRCSize {
			t.Errorf("Seal of a %d-byte payload: %d bytes that unseal to %q, %v", len(p), len(v), got, ok)
		}
	}
}

// TestGetU64Absent: a counter never stored reads as 0, not as a damaged record.
func TestGetU64Absent(t *testing.T) {
	err := inNewBucket(t, func(b *bolt.Bucket) error {
		if v, err := GetU64(b, []byte("missing"), "missing"); err != nil || v != 0 {
			t.Errorf("GetU64 of an absent key: %d, %v; want 0, nil", v, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestResealReportsAFailedPut: a value Reseal cannot write back (here, in a read-only
// transaction) is its error; it does not return as if the bucket were sealed.
func TestResealReportsAFailedPut(t *testing.T) {
	db, err := bolt.Open(filepath.Join(t.TempDir(), "reseal.db"), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	err = db.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucket([]byte("b"))
		if err != nil {
			return err
		}
		return b.Put([]byte("k"), []byte("v"))
	})
	if err != nil {
		t.Fatal(err)
	}
	err = db.View(func(tx *bolt.Tx) error {
		return Reseal(tx.Bucket([]byte("b")), func(k, v []byte) ([]byte, error) { return v, nil })
	})
	if !errors.Is(err, berrors.ErrTxNotWritable) {
		t.Fatalf("Reseal in a read-only transaction: %v, want its Put's error", err)
	}
}
