package store

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/internal/atomicfile"
)

// Options configure Open.
type Options struct {
	// Init fills a new, empty file in its first transaction (its buckets and schema). Open calls
	// it only when it creates the file.
	Init func(*bolt.Tx) error
	// SyncFreelist makes every commit write bbolt's freelist, as ledgers were written before
	// cfguard stopped syncing it (see boltOpen); benchmarks and the compatibility tests set it.
	SyncFreelist bool
	// AfterCommit, when set, runs after each bbolt commit that succeeded; an error it returns is
	// handled as a commit that failed after its pages were written (as a failed final fsync is):
	// the meta page is put back and the file reopened. Tests inject failures with it. It must not
	// read the file: a View then waits for the commit's outcome, which waits for AfterCommit.
	AfterCommit func() error
	// Logger. Default: slog.Default().
	Logger *slog.Logger
	// Now is the clock that times failed commits. Default: time.Now.
	Now func() time.Time
}

// FailureQuiet is how long commits must go without failing before an episode of failed commits
// is over: the ledger logs a WARN at an episode's first failure (one FailureQuiet or more after
// the last) and an INFO at its first success FailureQuiet or more after its last failure (none
// when a failure comes first). On a disk that refuses some commits and not
// others (a full disk where a small commit reuses pages the file holds) successes and failures
// alternate; they are one episode, not a pair of lines per retry.
const FailureQuiet = time.Minute

// File is the open ledger file. Every read and write goes through View and Update, which:
//
//   - turn a panic inside bbolt (a damaged page that slipped past the checks, or the file
//     changed under us) and a memory fault on the mapped file into a *CorruptError naming the
//     file, and reopen the file (with the full check) before the next operation;
//   - turn any error wrapping ErrCorrupt (a damaged record, see Corruptf) into a *CorruptError
//     naming the file;
//   - after a commit that failed (ENOSPC, EFBIG, a failed fsync), close bbolt, which may hold
//     the failed transaction's freelist and meta in memory, put back the meta page the commit
//     overwrote if the file shows it (a failed fsync leaves the written page in the page cache,
//     where every later read, ours and bbolt's, would take it as committed), reopen, and return
//     ErrWrite. The file then reads exactly what it held before the call;
//   - never show a View a commit before Update returned it as committed: a read transaction
//     that starts once bbolt wrote a commit's meta page, before its final fsync returned, would
//     read that commit, which the fsync may still take back. Such a View waits for the commit's
//     outcome and reads again, so what a View reads is what the file holds for good.
//
// A File is safe for concurrent use: Views run in parallel with each other and with one Update,
// but for a View that starts between a commit's meta page and its outcome, which waits for that
// outcome (milliseconds: an fsync); the caller serialises its Updates.
type File struct {
	path    string
	opts    Options
	log     *slog.Logger
	lock    *os.File // PIDFileName, flocked for the File's lifetime
	created bool

	// mu guards the bbolt handle, which is replaced after a failed commit or a panic.
	mu      sync.RWMutex
	db      *bolt.DB     // nil between a failure and the reopen that follows it
	raw     *os.File     // a second handle on the file, to save and restore a meta page
	geom    geometry     // as read by the last open
	pending *metaRestore // a meta page to put back before the next open
	closed  bool
	// committed is the id of the last transaction Update returned as committed, or the file's
	// at its last open (Open, and the reopen after a failure). commit is held by Update from
	// fn's success until the commit's outcome is known: a View whose transaction is past
	// committed waits on it; waiting counts those Views.
	committed atomic.Uint64
	commit    sync.Mutex
	waiting   atomic.Int64
	// failures counts the failed commits and keeps the latest one's time and error; failing is
	// set by a failed commit and cleared by the first success FailureQuiet after the latest
	// failure: one log line per episode of failed writes, not one per retry.
	failMu   sync.Mutex
	failures Failures
	failing  bool
}

// Failures are the commits of a File that failed, whichever transaction they were: how many,
// and when the latest failed and why (a zero At: none).
type Failures struct {
	Count uint64
	At    time.Time
	Err   error
}

// WriteFailures returns the commits that failed since Open. A success does not reset them: a
// small commit can succeed on a disk that refuses a larger one (bbolt reuses the pages it
// holds), so only the time of the latest failure says whether writes are refused now.
func (s *File) WriteFailures() Failures {
	s.failMu.Lock()
	defer s.failMu.Unlock()
	return s.failures
}

// Open opens <dir>/cfguard.db, creating it (with opts.Init) only when it does not exist.
//
// It takes the state directory's lock first (PIDFileName, flock, holding this process's pid): a
// second Open of the same directory, in this process or another, fails at once with ErrLocked
// naming the holder. An existing file is then checked before bbolt opens it for writing: its
// meta pages, its size against the high-water mark of its last transaction, and a walk of its
// page tree (see walk.go). A file that is empty, truncated or damaged is refused with a
// *CorruptError naming it and saying how to recover, and nothing is written to it.
func Open(dir string, opts Options) (*File, error) {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	path := filepath.Join(dir, FileName)
	lock, err := lockStateDir(dir, path)
	if err != nil {
		return nil, err
	}
	s := &File{path: path, opts: opts, log: opts.Logger, lock: lock}
	ok := false
	defer func() {
		if !ok {
			s.Close()
		}
	}()
	if s.created, err = createIfMissing(path, opts.Init); err != nil {
		return nil, fmt.Errorf("ledger: create %s: %w", path, err)
	}
	s.mu.Lock()
	err = s.openLocked()
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	ok = true
	return s, nil
}

// ViewsWaiting is the number of Views waiting, now, for the outcome of a commit they would
// otherwise have read before Update returned it.
func (s *File) ViewsWaiting() int64 { return s.waiting.Load() }

// Path is the database file.
func (s *File) Path() string { return s.path }

// Created reports whether Open created the file. Only a missing file is created; an existing
// file that is empty or damaged is an error, never reinitialised.
func (s *File) Created() bool { return s.created }

// Close closes the database and releases the state directory's lock. Pending reads finish first.
func (s *File) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	err := s.closeDBLocked()
	if s.lock != nil {
		if cerr := s.lock.Close(); err == nil {
			err = cerr
		}
	}
	return err
}

// openLocked opens the file with bbolt after checking it (caller holds mu for writing).
func (s *File) openLocked() error {
	if s.closed {
		return ErrClosed
	}
	f, err := os.OpenFile(s.path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("ledger: open %s: %w", s.path, err)
	}
	ok := false
	defer func() {
		if !ok {
			f.Close()
		}
	}()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return fmt.Errorf("%w: another process holds bbolt's lock on %s", ErrLocked, s.path)
		}
		return fmt.Errorf("ledger: lock %s: %w", s.path, err)
	}
	g, err := readMetas(f)
	if s.pending != nil {
		if g, err = s.restoreMeta(f, g, err); err != nil {
			return InFile(s.path, err)
		}
	}
	if err != nil {
		return InFile(s.path, err)
	}
	start := time.Now()
	st, err := walkFile(f, g)
	if err != nil {
		return InFile(s.path, err)
	}
	if !g.other.valid {
		s.log.Warn("ledger: the older of the two bbolt meta pages is damaged; the newest transaction is intact and nothing "+
			"is lost (bbolt rewrites that page with the next commit)",
			"path", s.path, "damaged_page", 1-g.slot, "reason", g.other.why, "damaged_page_txid", g.other.txid, "txid", g.meta.txid)
	}
	s.log.Debug("ledger: file checked", "path", s.path, "bytes", g.size, "pages", st.Pages, "free_pages", st.FreePages,
		"keys", st.Keys, "took", time.Since(start))
	db, err := boltOpen(s.path, f, false, s.opts.SyncFreelist)
	if err != nil {
		return err
	}
	raw, err := os.OpenFile(s.path, os.O_RDWR, 0)
	if err != nil {
		db.Close()
		return fmt.Errorf("ledger: open %s: %w", s.path, err)
	}
	var txid uint64
	if err := db.View(func(tx *bolt.Tx) error { txid = uint64(tx.ID()); return nil }); err != nil {
		raw.Close()
		db.Close()
		return fmt.Errorf("ledger: open %s: %w", s.path, err)
	}
	ok = true
	s.db, s.raw, s.geom = db, raw, g
	// What the file holds now is what every View reads: after a failed commit the meta page was
	// put back (its id is the last committed one); after a panic, the reopened file is checked.
	s.committed.Store(txid)
	return nil
}

// metaRestore is a meta page to write back: after a commit that reported failure, the page it
// overwrote (the older of the two) is put back if the file shows the failed transaction.
type metaRestore struct {
	txid uint64 // the failed transaction
	slot int
	page []byte
}

// restoreMeta puts back the meta page a failed commit overwrote, if the file shows that commit:
// as its newest meta page, or as a damaged page in the slot the commit wrote, beside the
// transaction before it (a meta page write that failed part way, which readMetas, with readErr,
// refuses: from the file alone such a page may hold an acknowledged transaction, but this one was
// reported failed, and what it overwrote is the saved page).
func (s *File) restoreMeta(f *os.File, g geometry, readErr error) (geometry, error) {
	p := s.pending
	torn := g.meta.valid && g.meta.txid+1 == p.txid && g.slot != p.slot && g.other.read && !g.other.valid &&
		len(p.page) == g.pageSize
	switch {
	case readErr != nil && !torn:
		return g, readErr
	case torn:
		if _, err := f.WriteAt(p.page, int64(p.slot*g.pageSize)); err != nil {
			return g, fmt.Errorf("%w: %s: putting back meta page %d after a failed commit: %w", ErrWrite, s.path, p.slot, err)
		}
		if err := f.Sync(); err != nil {
			return g, fmt.Errorf("%w: %s: syncing meta page %d after a failed commit: %w", ErrWrite, s.path, p.slot, err)
		}
		s.log.Warn("ledger: a failed commit left its meta page damaged; the page it overwrote was put back", "path", s.path,
			"txid", p.txid, "page", p.slot, "reason", g.other.why)
		s.pending = nil
		return readMetas(f)
	case g.meta.txid < p.txid:
		s.pending = nil // the failed transaction never reached the file
		return g, nil
	}
	if g.meta.txid != p.txid || g.slot != p.slot || len(p.page) != g.pageSize {
		return g, Corruptf("after a failed commit of transaction %d the file shows transaction %d in meta page %d, which this process did not write (another program wrote to the file?)", p.txid, g.meta.txid, g.slot)
	}
	if _, err := f.WriteAt(p.page, int64(p.slot*g.pageSize)); err != nil {
		return g, fmt.Errorf("%w: %s: putting back meta page %d after a failed commit: %w", ErrWrite, s.path, p.slot, err)
	}
	if err := f.Sync(); err != nil {
		return g, fmt.Errorf("%w: %s: syncing meta page %d after a failed commit: %w", ErrWrite, s.path, p.slot, err)
	}
	s.log.Warn("ledger: a failed commit had reached the file's page cache; its meta page was put back", "path", s.path, "txid", p.txid)
	s.pending = nil
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
			db, err = nil, &CorruptError{Path: path, Detail: Corruptf("bbolt could not open it: %v", r)}
		}
	}()
	db, err = bolt.Open(path, 0o600, &bolt.Options{Timeout: 10 * time.Millisecond, ReadOnly: readOnly,
		FreelistType: bolt.FreelistMapType, NoFreelistSync: !syncFreelist, OpenFile: open})
	if err != nil {
		return nil, fmt.Errorf("ledger: open %s: %w", path, err)
	}
	return db, nil
}

func (s *File) closeDBLocked() error {
	var err error
	if s.db != nil {
		err = s.db.Close()
		s.db = nil
	}
	if s.raw != nil {
		s.raw.Close()
		s.raw = nil
	}
	return err
}

// temporaries lists the files createIfMissing builds a ledger at path under (path.new-<pid>)
// that are left in the directory.
func temporaries(path string) []string {
	m, _ := filepath.Glob(path + ".new-*")
	return m
}

// createIfMissing creates an empty ledger at path when no file is there: built under a
// temporary name, fsynced, then linked into place (link never replaces a file) and the
// directory fsynced, so that a crash never leaves an empty or half-initialised cfguard.db.
func createIfMissing(path string, init func(*bolt.Tx) error) (bool, error) {
	if _, err := os.Lstat(path); err == nil || !errors.Is(err, fs.ErrNotExist) {
		return false, err
	}
	// Under the directory lock, leftovers of an interrupted creation are ours to remove.
	for _, f := range temporaries(path) {
		os.Remove(f)
	}
	tmp := fmt.Sprintf("%s.new-%d", path, os.Getpid())
	db, err := bolt.Open(tmp, 0o600, &bolt.Options{Timeout: time.Second, FreelistType: bolt.FreelistMapType})
	if err != nil {
		return false, err
	}
	if init != nil {
		err = db.Update(init)
	}
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

func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}
