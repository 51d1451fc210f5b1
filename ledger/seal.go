package ledger

import (
	"encoding/binary"
	"hash/crc32"

	bolt "go.etcd.io/bbolt"
)

// Bucket names (schema 2). The first eight are those of schema 1.
var (
	bMeta         = []byte("meta")
	bCounters     = []byte("counters")
	bOffsets      = []byte("offsets")
	bHeaders      = []byte("ce_hdr")
	bBodies       = []byte("ce_body")
	bAnchors      = []byte("anchors")
	bAnchorModels = []byte("anchor_models")
	bKLHistory    = []byte("kl_history")
	bOutbox       = []byte("outbox")
	bIdxP1        = []byte("idx_p1")   // anchor | key(p1') | id, every CE holding a certificate
	bIdxVar       = []byte("idx_var")  // anchor | key(variance headroom) | id, likewise
	bIdxCert      = []byte("idx_cert") // anchor | key(p1') | id, certified CEs only
	bIdxFail      = []byte("idx_fail") // confirmed version + 1 (0 = none) | id, CEs whose bound fails

	// bOffsetMarks is optional (see marks.go): not among allBuckets, which every ledger has.
	bOffsetMarks = []byte("offset_marks")

	allBuckets = [][]byte{bMeta, bCounters, bOffsets, bHeaders, bBodies, bAnchors, bAnchorModels, bKLHistory,
		bOutbox, bIdxP1, bIdxVar, bIdxCert, bIdxFail}
	indexBuckets = [][]byte{bIdxP1, bIdxVar, bIdxCert, bIdxFail}
)

// Meta keys.
var (
	kSchema      = []byte("schema")
	kCurrent     = []byte("current")     // posterior blob
	kCurSHA      = []byte("current_sha") // SHA-256 of the blob
	kCurVer      = []byte("current_version")
	kGen         = []byte("generation")
	kCounts      = []byte("counts") // 4 x u64 by status - 1, then the lapsed count (absent before lapses existed)
	kApplied     = []byte("applied")
	kAppliedAt   = []byte("applied_at") // unix ns of the last checkpoint that applied records
	kKLSeq       = []byte("kl_seq")
	kOutboxSeq   = []byte("outbox_seq")   // last sequence number assigned
	kOutboxAcked = []byte("outbox_acked") // every entry <= this was acknowledged (deleted)
	kOrigin      = []byte("origin")       // where the first posterior came from
	kLogHead     = []byte("log_head")     // replicas: the posterior log's head the current posterior is at
	kPolicy      = []byte("policy")       // fingerprint of the policy the indexes were built for
)

// Record checksums. From schema 2 every value the ledger stores ends in a CRC-32C of its key
// and payload, so that a damaged byte anywhere in a record (or in its key) is reported instead
// of read: bbolt checks its page structure and meta pages, not the values.
const crcSize = 4

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func recordCRC(key, payload []byte) uint32 {
	return crc32.Update(crc32.Update(0, castagnoli, key), castagnoli, payload)
}

// seal returns payload followed by its checksum (a new slice).
func seal(key, payload []byte) []byte {
	v := make([]byte, len(payload), len(payload)+crcSize)
	copy(v, payload)
	return binary.LittleEndian.AppendUint32(v, recordCRC(key, payload))
}

// unseal checks a sealed value and returns its payload (aliasing v).
func unseal(key, v []byte) ([]byte, bool) {
	if len(v) < crcSize {
		return nil, false
	}
	p := v[:len(v)-crcSize]
	return p, binary.LittleEndian.Uint32(v[len(p):]) == recordCRC(key, p)
}

// putSealed stores payload under key with its checksum.
func putSealed(b *bolt.Bucket, key, payload []byte) error { return b.Put(key, seal(key, payload)) }

// getSealed reads a sealed value: (nil, nil) when absent, a recordError naming what when damaged.
func getSealed(b *bolt.Bucket, key []byte, what string) ([]byte, error) {
	v := b.Get(key)
	if v == nil {
		return nil, nil
	}
	p, ok := unseal(key, v)
	if !ok {
		return nil, corruptf("%s: checksum mismatch (%d bytes)", what, len(v))
	}
	return p, nil
}

func u64bytes(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

// getU64 reads a sealed big-endian u64 (0 when absent).
func getU64(b *bolt.Bucket, key []byte, what string) (uint64, error) {
	p, err := getSealed(b, key, what)
	if err != nil || p == nil {
		return 0, err
	}
	if len(p) != 8 {
		return 0, corruptf("%s: %d bytes, want 8", what, len(p))
	}
	return binary.BigEndian.Uint64(p), nil
}

func putU64(b *bolt.Bucket, key []byte, v uint64) error { return putSealed(b, key, u64bytes(v)) }

// metaU64 reads a u64 of the meta bucket, naming it in errors.
func metaU64(tx *bolt.Tx, key []byte) (uint64, error) {
	return getU64(tx.Bucket(bMeta), key, "meta "+string(key))
}
