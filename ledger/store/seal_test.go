package store

import (
	"bytes"
	"encoding/binary"
	"errors"
	"path/filepath"
	"testing"

	bolt "go.etcd.io/bbolt"
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
