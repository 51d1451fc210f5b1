package ledger

import (
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/ledger/store"
)

// migrate converts a schema-1 ledger to schema 2 in one transaction: every value gets its
// checksum (after its schema-1 form is decoded and checked), CE headers become format 2
// (unconfirmed: schema 1 did not record the posterior version of a Monte-Carlo verdict, so
// Confirm samples at_risk and invalidated CEs again), the new buckets are created and the indexes
// built, which re-judges every CE at its anchor's stored KL. Either all of it is committed or
// nothing: a failure leaves the schema-1 file as it was.
func (l *Ledger) migrate() error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	start := time.Now()
	var n, changed int
	err := l.update(func(tx *bolt.Tx) error {
		if err := migrateMeta(tx); err != nil {
			return err
		}
		steps := []struct {
			bucket []byte
			fix    func(k, v []byte) ([]byte, error)
		}{
			{bCounters, fixedSize(8, "counter")},
			{bOffsets, func(k, v []byte) ([]byte, error) {
				if len(k) != 4 || len(v) != 8 {
					return nil, corruptf("offset record %x=%x", k, v)
				}
				return v, nil
			}},
			{bAnchors, func(k, v []byte) ([]byte, error) {
				_, err := decodeAnchor(v)
				return v, inRecord(err, "anchor %x", k)
			}},
			{bAnchorModels, func(k, v []byte) ([]byte, error) {
				_, err := decodeModel(v)
				return v, inRecord(err, "anchor posterior %x", k)
			}},
			{bKLHistory, func(k, v []byte) ([]byte, error) {
				_, err := decodeKLEntry(k, v)
				return v, inRecord(err, "kl history entry %x", k)
			}},
			{bHeaders, func(k, v []byte) ([]byte, error) {
				h, err := decodeHeader(v)
				if err != nil {
					return nil, inRecord(err, "counterfactual %q: header", k)
				}
				return h.encode(), nil
			}},
			{bBodies, func(k, v []byte) ([]byte, error) {
				_, err := decodeBody(v, true)
				return v, inRecord(err, "counterfactual %q", k)
			}},
		}
		for _, s := range steps {
			if err := store.Reseal(tx.Bucket(s.bucket), s.fix); err != nil {
				return inRecord(err, "migrating bucket %s", s.bucket)
			}
		}
		for _, b := range allBuckets {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		if err := putU64(tx.Bucket(bMeta), kSchema, schemaVersion); err != nil {
			return err
		}
		var err error
		n, changed, err = l.rebuildTx(tx)
		return err
	})
	if err != nil {
		return fmt.Errorf("ledger: migrating %s from schema 1: %w", l.path, err)
	}
	l.log.Warn("ledger: migrated from schema 1", "path", l.path, "counterfactuals", n, "changed_status", changed, "took", time.Since(start))
	return nil
}

func fixedSize(n int, what string) func(k, v []byte) ([]byte, error) {
	return func(k, v []byte) ([]byte, error) {
		if len(v) != n {
			return nil, corruptf("%s %q: %d bytes, want %d", what, k, len(v), n)
		}
		return v, nil
	}
}

// migrateMeta seals the schema-1 meta values after checking them.
func migrateMeta(tx *bolt.Tx) error {
	meta := tx.Bucket(bMeta)
	sizes := map[string]int{string(kCurSHA): 32, string(kCurVer): 8, string(kGen): 8, string(kCounts): 32,
		string(kApplied): 8, string(kKLSeq): 8}
	for k, n := range sizes {
		if v := meta.Get([]byte(k)); v != nil {
			if len(v) != n {
				return corruptf("meta %s: %d bytes, want %d", k, len(v), n)
			}
			if err := putSealed(meta, []byte(k), append([]byte(nil), v...)); err != nil {
				return err
			}
		}
	}
	if v := meta.Get(kCurrent); v != nil {
		if _, err := decodeModel(v); err != nil {
			return inRecord(err, "current posterior")
		}
		if err := putSealed(meta, kCurrent, append([]byte(nil), v...)); err != nil {
			return err
		}
	}
	return nil
}
