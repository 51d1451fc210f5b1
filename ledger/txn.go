package ledger

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"

	bolt "go.etcd.io/bbolt"
)

// Transactions. Every read and write of the package goes through view and update, which:
//
//   - turn a panic inside bbolt (a damaged page that slipped past the checks, or the file
//     changed under us) and a memory fault on the mapped file into a *CorruptError naming the
//     file, and reopen the file (with the full check) before the next operation;
//   - turn any error about a damaged record into a *CorruptError naming the file;
//   - after a commit that failed (ENOSPC, EFBIG, a failed fsync), close bbolt, which may hold
//     the failed transaction's freelist and meta in memory, put back the meta page the commit
//     overwrote if the file shows it (a failed fsync leaves the written page in the page cache,
//     where every later read, ours and bbolt's, would take it as committed), reopen, and return
//     ErrWrite. The ledger then reads exactly what it held before the call.

// acquire returns the open bbolt handle, reopening the file first if a failure closed it. The
// caller must call release when its transaction is over.
func (l *Ledger) acquire() (db *bolt.DB, release func(), err error) {
	for {
		l.dbmu.RLock()
		if l.db != nil {
			return l.db, l.dbmu.RUnlock, nil
		}
		closed := l.closed
		l.dbmu.RUnlock()
		if closed {
			return nil, nil, ErrClosed
		}
		l.dbmu.Lock()
		if l.db == nil && !l.closed {
			if err := l.openLocked(); err != nil {
				l.dbmu.Unlock()
				return nil, nil, fmt.Errorf("ledger: reopening after a failure: %w", err)
			}
		}
		l.dbmu.Unlock()
	}
}

// guarded runs f, converting panics and faults into a recordError.
func guarded(f func() error) (err error, panicked bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err, panicked = corruptf("reading the file failed (%v): it is damaged, or this is a cfguard bug", r), true
		}
	}()
	return f(), false
}

// view runs fn in a read transaction.
func (l *Ledger) view(fn func(*bolt.Tx) error) error {
	db, release, err := l.acquire()
	if err != nil {
		return err
	}
	err, panicked := guarded(func() error { return db.View(fn) })
	release()
	if panicked {
		l.log.Error("ledger: panic in a read transaction", "path", l.path, "err", err, "stack", string(debug.Stack()))
		l.reopen(nil)
	}
	return corrupt(l.path, err)
}

// update runs fn in a write transaction and commits it. The caller holds wmu.
func (l *Ledger) update(fn func(*bolt.Tx) error) error {
	db, release, err := l.acquire()
	if err != nil {
		return err
	}
	var (
		committing bool // fn succeeded: an error from here on is the commit's
		txid       uint64
		saved      []byte
	)
	err, panicked := guarded(func() error {
		return db.Update(func(tx *bolt.Tx) error {
			txid = uint64(tx.ID())
			if err := fn(tx); err != nil {
				return err
			}
			// The page this commit's meta will overwrite: the older of the two.
			saved = make([]byte, l.geom.pageSize)
			if _, err := l.raw.ReadAt(saved, int64(txid%2)*int64(l.geom.pageSize)); err != nil {
				return fmt.Errorf("%w: %s: reading meta page %d: %w", ErrWrite, l.path, txid%2, err)
			}
			committing = true
			return nil
		})
	})
	if err == nil && l.failed != nil {
		err = l.failed() // test seam: as if the commit's final fsync had failed
	}
	release()
	switch {
	case panicked:
		l.log.Error("ledger: panic in a write transaction", "path", l.path, "err", err, "stack", string(debug.Stack()))
		l.reopen(nil)
		return corrupt(l.path, err)
	case err == nil:
		if committing && l.writeFailing.Swap(false) {
			l.log.Info("ledger: commits succeed again", "path", l.path, "txid", txid)
		}
		return nil
	case !committing:
		return corrupt(l.path, err) // fn refused: bbolt rolled back, nothing was written
	}
	// The caller reports the failure (the daemon: once per episode, with /readyz and a metric);
	// the ledger says what it does about it once per episode too.
	level := slog.LevelDebug
	if !l.writeFailing.Swap(true) {
		level = slog.LevelWarn
	}
	l.log.Log(context.Background(), level, "ledger: commit failed; reopening the file to read what it holds (further failures are logged at debug level until a commit succeeds)",
		"path", l.path, "txid", txid, "err", err)
	if rerr := l.reopen(&metaRestore{txid: txid, slot: int(txid % 2), page: saved}); rerr != nil {
		return fmt.Errorf("%w: %s: commit failed: %w (and reopening failed: %w)", ErrWrite, l.path, err, rerr)
	}
	return fmt.Errorf("%w: %s: commit failed, nothing of it was kept: %w", ErrWrite, l.path, err)
}

// reopen closes bbolt and opens the file again, first putting back restore's meta page if the
// file shows the failed transaction. If it fails, the next operation tries again.
func (l *Ledger) reopen(restore *metaRestore) error {
	l.dbmu.Lock()
	defer l.dbmu.Unlock()
	if l.closed {
		return ErrClosed
	}
	if err := l.closeDBLocked(); err != nil {
		l.log.Warn("ledger: closing bbolt after a failure", "path", l.path, "err", err)
	}
	if restore != nil {
		l.pending = restore
	}
	return l.openLocked()
}
