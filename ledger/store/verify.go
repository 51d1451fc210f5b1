package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/internal/atomicfile"
)

// Verify checks the ledger file at path without writing to it or taking more than a shared lock
// (so Verifies run side by side; a file another process has open for writing gives ErrLocked):
// the meta pages and size, the page tree (walk.go), bbolt's own tx.Check, and then check, in a
// read transaction, for what the records must hold. It returns what the structural checks found
// (the layout is filled in as far as they got when they fail).
func Verify(path string, check func(*bolt.Tx) error) (Layout, error) {
	f, err := os.Open(path)
	if err != nil {
		return Layout{}, fmt.Errorf("ledger: verify: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			f.Close()
		}
	}()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_SH|syscall.LOCK_NB); err != nil {
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return Layout{}, fmt.Errorf("%w: a process has %s open for writing; verify a Backup of it instead", ErrLocked, path)
		}
		return Layout{}, fmt.Errorf("ledger: verify: lock %s: %w", path, err)
	}
	g, err := readMetas(f)
	if err != nil {
		return Layout{}, InFile(path, err)
	}
	lo := g.layout(walkStats{})
	st, err := walkFile(f, g)
	if err != nil {
		return lo, InFile(path, err)
	}
	lo = g.layout(st)
	db, err := boltOpen(path, f, true, false)
	if err != nil {
		return lo, err
	}
	ok = true
	defer db.Close()
	err, _ = guarded(func() error {
		return db.View(func(tx *bolt.Tx) error {
			if err := bboltCheck(tx); err != nil {
				return err
			}
			return check(tx)
		})
	})
	if err != nil {
		return lo, InFile(path, fmt.Errorf("ledger: verify: %w", err))
	}
	return lo, nil
}

// bboltCheck runs bbolt's own consistency check and reports its first finding.
func bboltCheck(tx *bolt.Tx) error {
	var first error
	for err := range tx.Check() {
		if first == nil {
			first = Corruptf("bbolt check: %v", err)
		}
	}
	return first
}

// Snapshot writes a complete bbolt file as of tx to w (bbolt's Tx.WriteTo), failing once ctx has
// ended. Run in a read transaction, it lets writers keep committing meanwhile.
func Snapshot(ctx context.Context, tx *bolt.Tx, w io.Writer) (int64, error) {
	return tx.WriteTo(&ctxWriter{ctx: ctx, w: w})
}

// ctxWriter fails writes once ctx has ended.
type ctxWriter struct {
	ctx context.Context
	w   io.Writer
}

func (c *ctxWriter) Write(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.w.Write(p)
}

// alignMetas gives a copied backup the meta pages bbolt's own commits leave. A snapshot
// (Snapshot: bbolt's Tx.WriteTo) writes its transaction T to meta page 0 and T-1 to page 1,
// whatever T; bbolt commits transaction t to page t mod 2. With T odd, the first commit after a
// restore (T+1) overwrites page 0 and leaves T-1 beside it, two transactions older, and a damage
// to that page would then be refused (olderDamaged) where it costs nothing. Two empty commits
// (T+1 to page 0, T+2 to page 1) put the file in bbolt's order. It runs on a file that verified
// (bbolt faults on a damaged one, see walk.go) and reports whether it committed.
func alignMetas(path string) (bool, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return false, err
	}
	g, err := readMetas(f)
	if err != nil || g.meta.txid%2 == uint64(g.slot) {
		return false, errors.Join(err, f.Close())
	}
	db, err := boltOpen(path, f, false, false) // f is bbolt's from here
	if err != nil {
		f.Close()
		return false, err
	}
	for range 2 {
		if err := db.Update(func(*bolt.Tx) error { return nil }); err != nil {
			db.Close()
			return true, err
		}
	}
	return true, db.Close()
}

// Install installs the file src as <dir>/cfguard.db, never over an existing one. It refuses when
// dir already holds a ledger (move that aside first) or is locked by a running process, copies
// src to a temporary file beside the target, fsyncs it and runs verify on the copy (again after
// alignMetas, when that committed to it), links it into place (a link, unlike a rename, fails if
// the target appeared meanwhile), and fsyncs the directory. Errors are prefixed "ledger: restore".
func Install(src, dir string, verify func(path string) error) error {
	if err := atomicfile.MkdirAll(dir); err != nil {
		return fmt.Errorf("ledger: restore: %w", err)
	}
	dst := filepath.Join(dir, FileName)
	lock, err := lockStateDir(dir, dst)
	if err != nil {
		return fmt.Errorf("ledger: restore: %w", err)
	}
	defer lock.Close()
	if err := occupied(dst); err != nil {
		return err
	}
	tmp := fmt.Sprintf("%s.restore-%d", dst, os.Getpid())
	defer os.Remove(tmp)
	if err := CopyFile(src, tmp); err != nil {
		return fmt.Errorf("ledger: restore: copy %s to %s: %w", src, tmp, err)
	}
	checkCopy := func() error {
		err := verify(tmp)
		var ce *CorruptError
		if errors.As(err, &ce) { // not the advice for a damaged ledger: the copy is removed
			return fmt.Errorf("ledger: restore: %w: the copy of %s in %s did not verify, though the backup did: %s. The copy was removed "+
				"and nothing was installed; run the restore again, and if it fails again, check the disk of %s",
				ErrCorrupt, ShellQuote(src), ShellQuote(dir), Reason(ce.Detail), ShellQuote(dir))
		}
		if err != nil {
			return fmt.Errorf("ledger: restore: the copy of %s failed verification: %w", src, err)
		}
		return nil
	}
	if err := checkCopy(); err != nil {
		return err
	}
	aligned, err := alignMetas(tmp)
	if err != nil {
		return fmt.Errorf("ledger: restore: giving the copy %s bbolt's meta-page order: %w. Nothing was installed; run the restore again", tmp, err)
	}
	if aligned {
		if err := checkCopy(); err != nil {
			return err
		}
	}
	if err := occupied(dst); err != nil {
		return err
	}
	if err := os.Link(tmp, dst); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return occupied(dst)
		}
		return fmt.Errorf("ledger: restore: %w", err)
	}
	if err := atomicfile.SyncDir(dir); err != nil {
		return fmt.Errorf("ledger: restore: sync %s: %w", dir, err)
	}
	return nil
}

// occupied is Install's refusal of dst when it exists.
func occupied(dst string) error {
	if _, err := os.Lstat(dst); err == nil {
		return fmt.Errorf("ledger: restore: %w: %s already holds a ledger; Restore never replaces one. Move it aside first (mv %s %s)",
			fs.ErrExist, dst, ShellQuote(dst), ShellQuote(AsideName(dst, ".old")))
	}
	return nil
}

// Installable is Install's refusal of dir as things stand (dir holds a ledger, or a running
// process holds its lock), nil when Install would go on; it creates nothing. Install checks again:
// a caller that does long work before Install (a repair) asks first, so that a restore that
// cannot be installed is refused before that work rather than after it.
func Installable(dir string) error {
	dst := filepath.Join(dir, FileName)
	pidPath := filepath.Join(dir, PIDFileName)
	f, err := os.OpenFile(pidPath, os.O_RDWR, 0)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return occupied(dst)
	case err != nil:
		return fmt.Errorf("ledger: restore: lock file: %w", err)
	}
	defer f.Close() // releases the lock flock takes
	if err := flock(f, dst, pidPath); err != nil {
		return fmt.Errorf("ledger: restore: %w", err)
	}
	return occupied(dst)
}

// CopyFile copies src to a new file dst (it must not exist) and fsyncs it.
func CopyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, in)
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return err
}
