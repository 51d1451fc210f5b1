package ledger

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/atomicfile"
	"github.com/cfguard/cfguard/ledger/store"
)

// Open opens <stateDir>/cfguard.db, creating it only when it does not exist.
//
// It takes the state directory's lock first (PIDFileName, flock, holding this process's pid): a
// second Open of the same directory, in this process or another, fails at once with ErrLocked
// naming the holder. An existing file is then checked before bbolt opens it for writing: its
// meta pages, its size against the high-water mark of its last transaction, and a walk of its
// page tree (store.Open). A file that is empty, truncated or damaged is refused with a
// *CorruptError naming it and saying how to recover, and nothing is written to it. A schema-1
// file is migrated. A ledger whose first posterior came from another origin than
// Options.Origin is then refused (*OriginError) with nothing written. Every record is then read
// once: damaged CEs are quarantined (quarantine.go), and the indexes are rebuilt from the CEs
// left when any was, when an index entry is damaged or when the policy changed (see doc.go).
func Open(stateDir string, opts Options) (*Ledger, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	if stateDir == "" {
		return nil, fmt.Errorf("%w: ledger: empty state dir", ErrInvalid)
	}
	if err := atomicfile.MkdirAll(stateDir); err != nil {
		return nil, fmt.Errorf("ledger: state dir: %w", err)
	}
	l := &Ledger{opts: opts, log: opts.Logger, models: map[uint64]*bnn.Model{}, idBits: rand.Uint32}
	f, err := store.Open(stateDir, store.Options{
		Init:         func(tx *bolt.Tx) error { return initSchema(tx, opts.Policy) },
		SyncFreelist: opts.syncFreelist,
		AfterCommit:  l.afterCommit,
		Logger:       opts.Logger,
	})
	if err != nil {
		return nil, err
	}
	l.file, l.path = f, f.Path()
	ok := false
	defer func() {
		if !ok {
			l.Close()
		}
	}()
	rebuild, policyWas, err := l.prepare()
	if err != nil {
		return nil, err
	}
	if opts.Origin != "" {
		// Before checkRecords, which rebuilds the indexes and re-judges every CE for a changed
		// Policy: a refused configuration must leave the ledger as it was.
		have, err := l.Origin()
		if err != nil {
			return nil, err
		}
		if have != "" && have != opts.Origin {
			return nil, &OriginError{Have: have, Want: opts.Origin}
		}
	}
	if rebuild {
		l.log.Warn("ledger: the certificate policy changed; rebuilding the indexes and re-judging every counterfactual",
			"path", l.path, "was", policyWas, "now", policyFingerprint(l.opts.Policy))
	}
	if err := l.checkRecords(rebuild); err != nil {
		return nil, err
	}
	if err := l.checkKept(); err != nil {
		return nil, err
	}
	if err := l.keepFailureFromHistory(); err != nil {
		return nil, err
	}
	ok = true
	return l, nil
}

// Close closes the database and releases the state directory's lock. Pending reads finish first.
func (l *Ledger) Close() error { return l.file.Close() }

// view runs fn in a read transaction (see store.File.View).
func (l *Ledger) view(fn func(*bolt.Tx) error) error { return l.file.View(fn) }

// update runs fn in a write transaction and commits it (see store.File.Update). The caller
// holds wmu.
func (l *Ledger) update(fn func(*bolt.Tx) error) error { return l.file.Update(fn) }

// afterCommit runs Options.AfterCommit, if set, after each successful commit.
func (l *Ledger) afterCommit() error {
	if l.opts.AfterCommit != nil {
		return l.opts.AfterCommit()
	}
	return nil
}

// initSchema creates every bucket of an empty schema-2 ledger.
func initSchema(tx *bolt.Tx, pol certify.Policy) error {
	for _, b := range append(allBuckets, bOffsetMarks) {
		if _, err := tx.CreateBucketIfNotExists(b); err != nil {
			return err
		}
	}
	meta := tx.Bucket(bMeta)
	if err := putU64(meta, kSchema, schemaVersion); err != nil {
		return err
	}
	return putSealed(meta, kPolicy, []byte(policyFingerprint(pol)))
}

// policyFingerprint names what the indexes depend on: the slack-to-KL map (mode) and how p1'
// and the variance ceiling are computed (Hoeffding alpha, epsilon_max).
func policyFingerprint(p certify.Policy) string {
	alpha := "off"
	if p.Hoeffding {
		alpha = strconv.FormatFloat(p.Alpha, 'g', -1, 64)
	}
	return fmt.Sprintf("index %s; mode %s; epsilon_max %s; hoeffding alpha %s", indexLayout, p.Mode,
		strconv.FormatFloat(p.EpsilonMax, 'g', -1, 64), alpha)
}

// indexLayout names the layout of the index keys and values (index.go). A ledger whose indexes
// have another layout has another fingerprint, so Open rebuilds them.
const indexLayout = "v2"

// prepare checks the schema and the small records and migrates schema 1. It reports whether the
// policy changed since the indexes were built (rebuild), and the fingerprint they were built
// for (was): checkRecords then rebuilds them, after it has quarantined the damaged CEs, which a
// rebuild could not judge. It writes nothing unless it migrates.
func (l *Ledger) prepare() (rebuild bool, was string, err error) {
	var (
		schema uint64
		fp     string
	)
	err = l.view(func(tx *bolt.Tx) error {
		for _, b := range allBuckets[:8] {
			if tx.Bucket(b) == nil {
				return corruptf("bucket %q is missing (not a cfguard ledger?)", b)
			}
		}
		raw := tx.Bucket(bMeta).Get(kSchema)
		switch {
		case len(raw) == 8 && bytes.Equal(raw, u64bytes(1)):
			schema = 1
			return nil
		case raw == nil:
			return corruptf("meta schema is missing (not a cfguard ledger?)")
		}
		var err error
		if schema, err = metaU64(tx, kSchema); err != nil || schema != schemaVersion {
			return err
		}
		for _, b := range allBuckets {
			if tx.Bucket(b) == nil {
				return corruptf("bucket %q is missing", b)
			}
		}
		p, err := getSealed(tx.Bucket(bMeta), kPolicy, "meta policy")
		fp = string(p)
		if err != nil {
			return err
		}
		return l.checkSmall(tx)
	})
	if err != nil {
		return false, "", err
	}
	switch {
	case schema == 1:
		return false, "", l.migrate()
	case schema > schemaVersion:
		return false, "", fmt.Errorf("ledger: %w: %s has schema %d; this build reads schemas 1 and %d: run the cfguard that wrote it",
			ErrNewerSchema, store.ShellQuote(l.path), schema, schemaVersion)
	case schema != schemaVersion:
		return false, "", corrupt(l.path, corruptf("schema %d; this build reads schemas 1 and %d", schema, schemaVersion))
	case fp != policyFingerprint(l.opts.Policy):
		return true, fp, nil
	}
	return false, "", nil
}

// checkKept deletes a kept event (kKLBreach, kKLFailed: see LastKLEvents) that is damaged or
// names an update the KL history never had: it only dates an alert, LastKLEvents falls back to the
// KL history without it, and nothing can rebuild it. An ERROR line names it.
func (l *Ledger) checkKept() error {
	for _, key := range keptEvents() {
		var bad error
		if err := l.view(func(tx *bolt.Tx) error {
			bad = verifyKept(tx, key)
			return nil
		}); err != nil {
			return err
		}
		if bad == nil {
			continue
		}
		l.wmu.Lock()
		err := l.update(func(tx *bolt.Tx) error { return tx.Bucket(bMeta).Delete(key) })
		l.wmu.Unlock()
		if err != nil {
			return corrupt(l.path, fmt.Errorf("ledger: deleting the damaged meta %s: %w", key, err))
		}
		l.repairs.KeptEvents = append(l.repairs.KeptEvents, string(key))
		l.log.Error(fmt.Sprintf("ledger: the record of the last KL event (meta %s) is damaged; it was deleted, and the time "+
			"of that event comes from the KL history alone", key), "path", l.path, "reason", bad)
	}
	return nil
}

// keepFailureFromHistory writes meta kl_failed from the KL history when the key is missing and
// the history holds a failed update: a ledger written before the key existed, or whose damaged
// one checkKept deleted, would otherwise forget its newest failure once the history drops it.
// The copy is exact: the kept failure is the newest ever, so a history that holds any failure
// holds the newest. A history that does not decode is left to Verify and LastKLEvents; a write
// that fails is logged and does not stop Open.
func (l *Ledger) keepFailureFromHistory() error {
	missing := false
	if err := l.view(func(tx *bolt.Tx) error { missing = tx.Bucket(bMeta).Get(kKLFailed) == nil; return nil }); err != nil || !missing {
		return err
	}
	ev, err := l.LastKLEvents(0) // without the kept one, the history's newest failure
	if err != nil || ev.Failed == nil {
		return nil
	}
	failed := ev.Failed
	l.wmu.Lock()
	err = l.update(func(tx *bolt.Tx) error {
		return putSealed(tx.Bucket(bMeta), kKLFailed, append(u64bytes(failed.Seq), failed.encode()...))
	})
	l.wmu.Unlock()
	if err != nil { // it only dates an alert: the ledger opens, and the next Open tries again
		l.log.Warn("ledger: could not keep the KL history's last failed update apart; CfguardUpdatesFailing may end early once the history drops it",
			"path", l.path, "key", string(kKLFailed), "err", err)
		return nil
	}
	l.log.Info("ledger: kept the KL history's last failed update apart, so that it dates CfguardUpdatesFailing after the history drops it",
		"path", l.path, "key", string(kKLFailed), "update", failed.Seq, "at", failed.At)
	return nil
}

// verifyKept checks the event kept under key: that it decodes, and that its sequence number is
// one the KL history gave.
func verifyKept(tx *bolt.Tx, key []byte) error {
	e, found, err := readKept(tx, key)
	if err != nil || !found {
		return err
	}
	last, err := metaU64(tx, kKLSeq)
	if err != nil {
		return err
	}
	if e.Seq == 0 || e.Seq > last {
		return corruptf("meta %s: update %d, the KL history's last is %d", key, e.Seq, last)
	}
	return nil
}

// checkSmall decodes every small record Open can afford to read: the meta scalars, the current
// posterior, the anchor records and the checksums of the anchor posteriors.
func (l *Ledger) checkSmall(tx *bolt.Tx) error {
	c, err := readCur(tx)
	if err != nil {
		return err
	}
	for _, k := range [][]byte{kGen, kApplied, kAppliedAt, kKLSeq, kOutboxSeq, kOutboxAcked} {
		if _, err := metaU64(tx, k); err != nil {
			return err
		}
	}
	if _, err := readCounts(tx); err != nil {
		return err
	}
	if _, err := getSealed(tx.Bucket(bMeta), kOrigin, "meta origin"); err != nil {
		return err
	}
	if _, err := getSealed(tx.Bucket(bMeta), kLogHead, "meta log_head"); err != nil {
		return err
	}
	if c.ok {
		if _, err := l.model(tx, c.version); err != nil {
			return err
		}
	}
	models := tx.Bucket(bAnchorModels)
	if err := forEachAnchor(tx, func(v uint64, _ anchorMeta) error {
		blob, err := getSealed(models, u64bytes(v), fmt.Sprintf("posterior version %d (anchor)", v))
		if err == nil && blob == nil {
			err = corruptf("anchor %d has no posterior blob", v)
		}
		return err
	}); err != nil {
		return err
	}
	// Every meta value is sealed with its key: a damaged key, which the reads above would take
	// for a missing value (0), fails its checksum here.
	return tx.Bucket(bMeta).ForEach(func(k, v []byte) error {
		if slices.ContainsFunc(keptEvents(), func(e []byte) bool { return bytes.Equal(k, e) }) {
			return nil // checkKept: damage there is dropped, not refused
		}
		if _, ok := unseal(k, v); !ok {
			return corruptf("meta %q: checksum mismatch (its key or value is damaged)", k)
		}
		return nil
	})
}
