package store

import (
	"bytes"
	"encoding/binary"
	"hash/crc32"

	bolt "go.etcd.io/bbolt"
)

// Sealed values. Every value the ledger stores ends in a CRC-32C of its key and payload, so that a
// damaged byte anywhere in a record (or in its key) is reported instead of read: bbolt checks its
// page structure and meta pages (see walk.go), not the values.
//
//	value = payload, crc32c(key, payload) u32 little endian

// CRCSize is the length of the checksum that ends every sealed value.
const CRCSize = 4

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func recordCRC(key, payload []byte) uint32 {
	return crc32.Update(crc32.Update(0, castagnoli, key), castagnoli, payload)
}

// Seal returns payload followed by its checksum (a new slice).
func Seal(key, payload []byte) []byte {
	v := make([]byte, len(payload), len(payload)+CRCSize)
	copy(v, payload)
	return binary.LittleEndian.AppendUint32(v, recordCRC(key, payload))
}

// Unseal checks a sealed value and returns its payload (aliasing v).
func Unseal(key, v []byte) ([]byte, bool) {
	if len(v) < CRCSize {
		return nil, false
	}
	p := v[:len(v)-CRCSize]
	return p, binary.LittleEndian.Uint32(v[len(p):]) == recordCRC(key, p)
}

// Put stores payload under key with its checksum.
func Put(b *bolt.Bucket, key, payload []byte) error { return b.Put(key, Seal(key, payload)) }

// Get reads a sealed value: (nil, nil) when absent, an error made by Corruptf naming what when
// damaged.
func Get(b *bolt.Bucket, key []byte, what string) ([]byte, error) {
	v := b.Get(key)
	if v == nil {
		return nil, nil
	}
	p, ok := Unseal(key, v)
	if !ok {
		return nil, Corruptf("%s: checksum mismatch (%d bytes)", what, len(v))
	}
	return p, nil
}

// GetU64 reads a sealed big-endian u64 (0 when absent).
func GetU64(b *bolt.Bucket, key []byte, what string) (uint64, error) {
	p, err := Get(b, key, what)
	if err != nil || p == nil {
		return 0, err
	}
	if len(p) != 8 {
		return 0, Corruptf("%s: %d bytes, want 8", what, len(p))
	}
	return binary.BigEndian.Uint64(p), nil
}

// PutU64 stores v as a sealed big-endian u64.
func PutU64(b *bolt.Bucket, key []byte, v uint64) error {
	return Put(b, key, binary.BigEndian.AppendUint64(nil, v))
}

// Reseal replaces every value v of b with Seal(k, fix(k, v)), in chunks (a cursor must not see
// its bucket change under it): the values of a file written before they were sealed get their
// checksums. An error from fix stops it; a nested bucket is an error made by Corruptf.
func Reseal(b *bolt.Bucket, fix func(k, v []byte) ([]byte, error)) error {
	var after []byte
	for {
		type kv struct{ k, v []byte }
		var chunk []kv
		c := b.Cursor()
		k, v := c.First()
		if after != nil {
			if k, v = c.Seek(after); bytes.Equal(k, after) {
				k, v = c.Next()
			}
		}
		for ; k != nil && len(chunk) < 10000; k, v = c.Next() {
			if v == nil {
				return Corruptf("unexpected nested bucket %q", k)
			}
			chunk = append(chunk, kv{append([]byte(nil), k...), append([]byte(nil), v...)})
		}
		if len(chunk) == 0 {
			return nil
		}
		for _, e := range chunk {
			p, err := fix(e.k, e.v)
			if err != nil {
				return err
			}
			if err := Put(b, e.k, p); err != nil {
				return err
			}
		}
		after = chunk[len(chunk)-1].k
	}
}
