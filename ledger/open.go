package ledger

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/atomicfile"
)

// Open opens <stateDir>/cfguard.db, creating it only when it does not exist.
//
// It takes the state directory's lock first (PIDFileName, flock, holding this process's pid): a
// second Open of the same directory, in this process or another, fails at once with ErrLocked
// naming the holder. An existing file is then checked before bbolt opens it for writing: its
// meta pages, its size against the high-water mark of its last transaction, and a walk of its
// page tree (see walk.go). A file that is empty, truncated or damaged is refused with a
// *CorruptError naming it and saying how to recover, and nothing is written to it. A schema-1
// file is migrated, and the indexes are rebuilt when the policy changed (see doc.go).
func Open(stateDir string, opts Options) (*Ledger, error) {
	if err := opts.defaults(); err != nil {
		return nil, err
	}
	if stateDir == "" {
		return nil, fmt.Errorf("%w: ledger: empty state dir", ErrInvalid)
	}
	if err := os.MkdirAll(stateDir, 0o755); err != nil {
		return nil, fmt.Errorf("ledger: state dir: %w", err)
	}
	path := filepath.Join(stateDir, FileName)
	lock, err := lockStateDir(stateDir, path)
	if err != nil {
		return nil, err
	}
	l := &Ledger{path: path, opts: opts, log: opts.Logger, lock: lock, models: map[uint64]*bnn.Model{}}
	ok := false
	defer func() {
		if !ok {
			l.Close()
		}
	}()
	if l.created, err = createIfMissing(path, opts.Policy); err != nil {
		return nil, fmt.Errorf("ledger: create %s: %w", path, err)
	}
	l.dbmu.Lock()
	err = l.openLocked()
	l.dbmu.Unlock()
	if err != nil {
		return nil, err
	}
	if err := l.prepare(); err != nil {
		return nil, err
	}
	if err := l.checkRecords(); err != nil {
		return nil, err
	}
	ok = true
	return l, nil
}

// Close closes the database and releases the state directory's lock. Pending reads finish first.
func (l *Ledger) Close() error {
	l.dbmu.Lock()
	defer l.dbmu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	err := l.closeDBLocked()
	if l.lock != nil {
		if cerr := l.lock.Close(); err == nil {
			err = cerr
		}
	}
	return err
}

// lockStateDir takes the exclusive flock of <dir>/cfguard.pid without waiting and writes this
// process's pid into it.
func lockStateDir(dir, path string) (*os.File, error) {
	pidPath := filepath.Join(dir, PIDFileName)
	f, err := os.OpenFile(pidPath, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("ledger: lock file: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		b := make([]byte, 32)
		n, _ := f.ReadAt(b, 0)
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, lockedError(path, pidPath, strings.TrimSpace(string(b[:n])))
		}
		return nil, fmt.Errorf("ledger: lock %s: %w", pidPath, err)
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
}

func lockedError(path, pidPath, holder string) error {
	switch _, err := strconv.Atoi(holder); {
	case holder == strconv.Itoa(os.Getpid()):
		return fmt.Errorf("%w: this process (pid %s) already has %s open (lock file %s): use that Ledger, or Close it first", ErrLocked, holder, path, pidPath)
	case err == nil:
		return fmt.Errorf("%w: another process (pid %s) holds %s (lock file %s): stop it, or give this one another state_dir", ErrLocked, holder, path, pidPath)
	}
	return fmt.Errorf("%w: another process holds %s (lock file %s, no pid recorded): stop it, or give this one another state_dir", ErrLocked, path, pidPath)
}

// createIfMissing creates an empty ledger at path when no file is there: built under a
// temporary name, fsynced, then linked into place (link never replaces a file) and the
// directory fsynced, so that a crash never leaves an empty or half-initialised cfguard.db.
func createIfMissing(path string, pol certify.Policy) (bool, error) {
	if _, err := os.Lstat(path); err == nil || !errors.Is(err, fs.ErrNotExist) {
		return false, err
	}
	// Under the directory lock, leftovers of an interrupted creation are ours to remove.
	old, _ := filepath.Glob(path + ".new-*")
	for _, f := range old {
		os.Remove(f)
	}
	tmp := fmt.Sprintf("%s.new-%d", path, os.Getpid())
	db, err := bolt.Open(tmp, 0o600, &bolt.Options{Timeout: time.Second, FreelistType: bolt.FreelistMapType})
	if err != nil {
		return false, err
	}
	err = db.Update(func(tx *bolt.Tx) error { return initSchema(tx, pol) })
	if cerr := db.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = syncFile(tmp)
	}
	if err != nil {
		os.Remove(tmp)
		return false, err
	}
	err = os.Link(tmp, path)
	os.Remove(tmp)
	if errors.Is(err, fs.ErrExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return true, atomicfile.SyncDir(filepath.Dir(path))
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

func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// metaRestore is a meta page to write back: after a commit that reported failure, the page it
// overwrote (the older of the two) is put back if the file shows the failed transaction.
type metaRestore struct {
	txid uint64 // the failed transaction
	slot int
	page []byte
}

// openLocked opens the file with bbolt after checking it (caller holds dbmu for writing).
func (l *Ledger) openLocked() error {
	if l.closed {
		return ErrClosed
	}
	f, err := os.OpenFile(l.path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("ledger: open %s: %w", l.path, err)
	}
	ok := false
	defer func() {
		if !ok {
			f.Close()
		}
	}()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return fmt.Errorf("%w: another process holds bbolt's lock on %s", ErrLocked, l.path)
		}
		return fmt.Errorf("ledger: lock %s: %w", l.path, err)
	}
	g, err := readMetas(f)
	if err == nil && l.pending != nil {
		if g, err = l.restoreMeta(f, g); err != nil {
			return err
		}
	}
	if err != nil {
		return corrupt(l.path, err)
	}
	start := time.Now()
	st, err := walkFile(f, g)
	if err != nil {
		return corrupt(l.path, err)
	}
	if !g.other.valid {
		l.log.Warn("ledger: the older of the two bbolt meta pages is damaged; the newest transaction is intact and nothing "+
			"is lost (bbolt rewrites that page with the next commit)",
			"path", l.path, "damaged_page", 1-g.slot, "reason", g.other.why, "damaged_page_txid", g.other.txid, "txid", g.meta.txid)
	}
	l.log.Debug("ledger: file checked", "path", l.path, "bytes", g.size, "pages", st.Pages, "free_pages", st.FreePages,
		"keys", st.Keys, "took", time.Since(start))
	db, err := boltOpen(l.path, f, false, l.opts.syncFreelist)
	if err != nil {
		return err
	}
	raw, err := os.OpenFile(l.path, os.O_RDWR, 0)
	if err != nil {
		db.Close()
		return fmt.Errorf("ledger: open %s: %w", l.path, err)
	}
	ok = true
	l.db, l.raw, l.geom = db, raw, g
	return nil
}

// restoreMeta puts back the meta page a failed commit overwrote, if the file shows that commit.
func (l *Ledger) restoreMeta(f *os.File, g geometry) (geometry, error) {
	p := l.pending
	if g.meta.txid < p.txid {
		l.pending = nil // the failed transaction never reached the file
		return g, nil
	}
	if g.meta.txid != p.txid || g.slot != p.slot || len(p.page) != g.pageSize {
		return g, corruptf("after a failed commit of transaction %d the file shows transaction %d in meta page %d", p.txid, g.meta.txid, g.slot)
	}
	if _, err := f.WriteAt(p.page, int64(p.slot*g.pageSize)); err != nil {
		return g, fmt.Errorf("%w: %s: putting back meta page %d after a failed commit: %w", ErrWrite, l.path, p.slot, err)
	}
	if err := f.Sync(); err != nil {
		return g, fmt.Errorf("%w: %s: syncing meta page %d after a failed commit: %w", ErrWrite, l.path, p.slot, err)
	}
	l.log.Warn("ledger: a failed commit had reached the file's page cache; its meta page was put back", "path", l.path, "txid", p.txid)
	l.pending = nil
	return readMetas(f)
}

// boltOpen opens path with bbolt on the already locked and checked handle f.
//
// Writers open it with bbolt's hashmap freelist and without syncing the freelist (as etcd
// does): a commit writes only the pages it changed and the meta page, never the list of every
// free page, so its cost does not grow with the free space a ledger accumulates (rewrites by
// audits and drifts leave tens of thousands of free pages in a ledger of 10^6 CEs, and writing
// and sorting them was most of a commit). The meta page then records no freelist page, and bbolt
// rebuilds the freelist at open by walking the tree: a free page is one no bucket reaches. A file
// whose meta records a freelist (written with syncFreelist, or by an older cfguard) opens the
// same way; its freelist is read once and dropped by the next commit.
func boltOpen(path string, f *os.File, readOnly, syncFreelist bool) (db *bolt.DB, err error) {
	handed := false
	open := func(name string, flag int, perm os.FileMode) (*os.File, error) {
		if !handed && name == path {
			handed = true
			return f, nil
		}
		return os.OpenFile(name, flag, perm)
	}
	defer func() {
		if r := recover(); r != nil {
			db, err = nil, &CorruptError{Path: path, Detail: corruptf("bbolt could not open it: %v", r)}
		}
	}()
	db, err = bolt.Open(path, 0o600, &bolt.Options{Timeout: 10 * time.Millisecond, ReadOnly: readOnly,
		FreelistType: bolt.FreelistMapType, NoFreelistSync: !syncFreelist, OpenFile: open})
	if err != nil {
		return nil, fmt.Errorf("ledger: open %s: %w", path, err)
	}
	return db, nil
}

func (l *Ledger) closeDBLocked() error {
	var err error
	if l.db != nil {
		err = l.db.Close()
		l.db = nil
	}
	if l.raw != nil {
		l.raw.Close()
		l.raw = nil
	}
	return err
}

// policyFingerprint names what the indexes depend on: the slack-to-KL map (mode) and how p1'
// and the variance ceiling are computed (Hoeffding alpha, epsilon_max).
func policyFingerprint(p certify.Policy) string {
	alpha := "off"
	if p.Hoeffding {
		alpha = strconv.FormatFloat(p.Alpha, 'g', -1, 64)
	}
	return fmt.Sprintf("index v1; mode %s; epsilon_max %s; hoeffding alpha %s", p.Mode,
		strconv.FormatFloat(p.EpsilonMax, 'g', -1, 64), alpha)
}

// prepare checks the schema and the small records, then migrates schema 1 or rebuilds the
// indexes for a changed policy. It writes nothing when neither is needed.
func (l *Ledger) prepare() error {
	var (
		schema uint64
		fp     string
	)
	err := l.view(func(tx *bolt.Tx) error {
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
		return err
	}
	switch {
	case schema == 1:
		return l.migrate()
	case schema != schemaVersion:
		return fmt.Errorf("ledger: %s has schema %d; this build reads schemas 1 and %d (was it written by a newer cfguard?)", l.path, schema, schemaVersion)
	case fp != policyFingerprint(l.opts.Policy):
		l.log.Warn("ledger: the certificate policy changed; rebuilding the indexes and re-judging every counterfactual",
			"path", l.path, "was", fp, "now", policyFingerprint(l.opts.Policy))
		return l.rebuild()
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
		if _, ok := unseal(k, v); !ok {
			return corruptf("meta %q: checksum mismatch (its key or value is damaged)", k)
		}
		return nil
	})
}
