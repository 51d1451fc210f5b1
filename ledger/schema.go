package ledger

import (
	"encoding/binary"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/ledger/store"
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
	bIdxP1        = []byte("idx_p1")   // anchor | class | key(p1') | id, every CE holding a certificate
	bIdxVar       = []byte("idx_var")  // anchor | class | key(variance headroom) | id, likewise
	bIdxFail      = []byte("idx_fail") // at_risk and invalidated CEs, by their last verdict (failKey)

	// bIdxCert held the certified CEs by anchor and p1' in files whose indexes have layout v1
	// (policyFingerprint): idx_p1's certified class holds them now. It is kept, empty, so that a
	// cfguard that reads layout v1 opens the file and rebuilds its indexes instead of refusing it.
	bIdxCert = []byte("idx_cert")

	// bOffsetMarks is optional (see marks.go): not among allBuckets, which every ledger has.
	bOffsetMarks = []byte("offset_marks")

	allBuckets = [][]byte{bMeta, bCounters, bOffsets, bHeaders, bBodies, bAnchors, bAnchorModels, bKLHistory,
		bOutbox, bIdxP1, bIdxVar, bIdxFail, bIdxCert}
	indexBuckets = [][]byte{bIdxP1, bIdxVar, bIdxFail}
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
	kKLBreach    = []byte("kl_breach")    // the newest update UpdateRecord.Breached marked: its sequence number, then its KL history entry
	kKLFailed    = []byte("kl_failed")    // the newest update whose outcome was failed: its sequence number, then its KL history entry
	kOutboxSeq   = []byte("outbox_seq")   // last sequence number assigned
	kOutboxAcked = []byte("outbox_acked") // every entry <= this was acknowledged (deleted)
	kOrigin      = []byte("origin")       // where the first posterior came from
	kLogHead     = []byte("log_head")     // replicas: the posterior log's head the current posterior is at
	kPolicy      = []byte("policy")       // fingerprint of the policy the indexes were built for
)

// The ledger's short names for package store's sealed values (every value ends in a CRC-32C of
// its key and payload) and record errors, which every record of the ledger is made of.

func seal(key, payload []byte) []byte     { return store.Seal(key, payload) }
func unseal(key, v []byte) ([]byte, bool) { return store.Unseal(key, v) }

func putSealed(b *bolt.Bucket, key, payload []byte) error { return store.Put(b, key, payload) }

func getSealed(b *bolt.Bucket, key []byte, what string) ([]byte, error) {
	return store.Get(b, key, what)
}

func getU64(b *bolt.Bucket, key []byte, what string) (uint64, error) {
	return store.GetU64(b, key, what)
}

func putU64(b *bolt.Bucket, key []byte, v uint64) error { return store.PutU64(b, key, v) }

func corruptf(format string, args ...any) error { return store.Corruptf(format, args...) }

func inRecord(err error, format string, args ...any) error {
	return store.InRecord(err, format, args...)
}

// u64bytes is the ledger's key for a version or sequence number: big endian, so that keys sort
// in numeric order.
func u64bytes(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

// metaU64 reads a u64 of the meta bucket, naming it in errors.
func metaU64(tx *bolt.Tx, key []byte) (uint64, error) {
	return getU64(tx.Bucket(bMeta), key, "meta "+string(key))
}

// keptEvents are the meta keys of the events kept after the KL history drops them (the newest
// breach and the newest failure): they only date alerts, so damage there is dropped, not refused.
func keptEvents() [][]byte { return [][]byte{kKLBreach, kKLFailed} }
