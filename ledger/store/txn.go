package store

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"

	bolt "go.etcd.io/bbolt"
)

// acquire returns the open bbolt handle, reopening the file first if a failure closed it. The
// caller must call release when its transaction is over.
func (s *File) acquire() (db *bolt.DB, release func(), err error) {
	for {
		s.mu.RLock()
		if s.db != nil {
			return s.db, s.mu.RUnlock, nil
		}
		closed := s.closed
		s.mu.RUnlock()
		if closed {
			return nil, nil, ErrClosed
		}
		s.mu.Lock()
		if s.db == nil && !s.closed {
			if err := s.openLocked(); err != nil {
				s.mu.Unlock()
				return nil, nil, fmt.Errorf("ledger: reopening after a failure: %w", err)
			}
		}
		s.mu.Unlock()
	}
}

// guarded runs f, converting panics and faults into an error made by Corruptf (panicked true).
func guarded(f func() error) (err error, panicked bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err, panicked = Corruptf("reading the file failed (%v): it is damaged, or this is a cfguard bug", r), true
		}
	}()
	return f(), false
}

// View runs fn in a read transaction of what the file holds for good: a transaction that would
// read a commit Update has not returned as committed waits for its outcome and starts again (see
// File). Views must not nest: a View inside another, started during a commit that fails, would
// wait for the commit's outcome while the file's reopen waits for the outer View.
func (s *File) View(fn func(*bolt.Tx) error) error {
	for {
		err := s.view(fn)
		if !errors.Is(err, errUncommitted) {
			return err
		}
		s.waiting.Add(1)
		s.commit.Lock()
		//lint:ignore SA2001 an empty critical section is the wait for the commit's outcome
		s.commit.Unlock()
		s.waiting.Add(-1)
	}
}

// errUncommitted: a read transaction sees a commit Update has not returned as committed.
var errUncommitted = errors.New("a commit under way")

func (s *File) view(fn func(*bolt.Tx) error) error {
	db, release, err := s.acquire()
	if err != nil {
		return err
	}
	err, panicked := guarded(func() error {
		return db.View(func(tx *bolt.Tx) error {
			if uint64(tx.ID()) > s.committed.Load() {
				return errUncommitted // before fn reads anything
			}
			return fn(tx)
		})
	})
	release()
	if panicked {
		s.log.Error("ledger: panic in a read transaction", "path", s.path, "err", err, "stack", string(debug.Stack()))
		s.reopen(nil)
	}
	return InFile(s.path, err) // errUncommitted passes unchanged: it is no ErrCorrupt
}

// Update runs fn in a write transaction and commits it. The caller serialises its Updates.
//
// From fn's success until the commit's outcome is known (the final fsync, AfterCommit, and the
// file put back when it failed) it holds the lock a View waits on when it would read the commit
// (see File); AfterCommit must not read the file.
func (s *File) Update(fn func(*bolt.Tx) error) error {
	db, release, err := s.acquire()
	if err != nil {
		return err
	}
	var (
		committing bool // fn succeeded: an error from here on is the commit's
		txid       uint64
		saved      []byte
	)
	defer func() {
		if committing {
			s.commit.Unlock()
		}
	}()
	err, panicked := guarded(func() error {
		return db.Update(func(tx *bolt.Tx) error {
			txid = uint64(tx.ID())
			if err := fn(tx); err != nil {
				return err
			}
			// The page this commit's meta will overwrite: the older of the two.
			saved = make([]byte, s.geom.pageSize)
			if _, err := s.raw.ReadAt(saved, int64(txid%2)*int64(s.geom.pageSize)); err != nil {
				return fmt.Errorf("%w: %s: reading meta page %d: %w", ErrWrite, s.path, txid%2, err)
			}
			s.commit.Lock() // bbolt writes the meta page once this returns
			committing = true
			return nil
		})
	})
	if err == nil && s.opts.AfterCommit != nil {
		err = s.opts.AfterCommit() // as if the commit's final fsync had failed
	}
	release()
	switch {
	case panicked:
		s.log.Error("ledger: panic in a write transaction", "path", s.path, "err", err, "stack", string(debug.Stack()))
		s.reopen(nil)
		return InFile(s.path, err)
	case err == nil:
		s.committed.Store(txid)
		s.failMu.Lock()
		last := s.failures.At
		recovered := s.failing && s.opts.Now().Sub(last) >= FailureQuiet
		if recovered {
			s.failing = false
		}
		s.failMu.Unlock()
		if recovered {
			s.log.Info("ledger: commits succeed again", "path", s.path, "txid", txid, "last_failure", last)
		}
		return nil
	case !committing:
		return InFile(s.path, err) // fn refused: bbolt rolled back, nothing was written
	}
	// The caller reports the failure (the daemon: once per episode, with /readyz and a metric);
	// the ledger says what it does about it once per episode too.
	cause := err
	if rerr := s.reopen(&metaRestore{txid: txid, slot: int(txid % 2), page: saved}); rerr != nil {
		err = fmt.Errorf("%w: %s: commit failed: %w (and reopening failed: %w)", ErrWrite, s.path, cause, rerr)
	} else {
		err = fmt.Errorf("%w: %s: commit failed, nothing of it was kept: %w", ErrWrite, s.path, cause)
	}
	s.failMu.Lock()
	now := s.opts.Now()
	// An episode ends at the first success FailureQuiet after its last failure, or, on a file
	// written rarely, when the next failure comes FailureQuiet or more after it.
	first := !s.failing || now.Sub(s.failures.At) >= FailureQuiet
	s.failures.Count++
	s.failures.At, s.failures.Err = now, err
	s.failing = true
	s.failMu.Unlock()
	level := slog.LevelDebug
	if first {
		level = slog.LevelWarn
	}
	s.log.Log(context.Background(), level, "ledger: commit failed; the file was reopened to read what it holds (further failures are logged at debug level until commits have gone a minute without one)",
		"path", s.path, "txid", txid, "err", cause)
	return err
}

// reopen closes bbolt and opens the file again, first putting back restore's meta page if the
// file shows the failed transaction. If it fails, the next operation tries again.
func (s *File) reopen(restore *metaRestore) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	if err := s.closeDBLocked(); err != nil {
		s.log.Warn("ledger: closing bbolt after a failure", "path", s.path, "err", err)
	}
	if restore != nil {
		s.pending = restore
	}
	return s.openLocked()
}
