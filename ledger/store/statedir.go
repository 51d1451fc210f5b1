package store

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// The state directory: the ledger file and, beside it, the lock that lets one process, and one
// File in it, have the ledger open.

// FileName is the database file inside the state directory; PIDFileName is the lock file beside
// it, holding the pid of the process that has the ledger open.
const (
	FileName    = "cfguard.db"
	PIDFileName = "cfguard.pid"
)

// lockStateDir takes the exclusive flock of <dir>/cfguard.pid without waiting and writes this
// process's pid into it.
func lockStateDir(dir, path string) (*os.File, error) {
	pidPath := filepath.Join(dir, PIDFileName)
	f, err := os.OpenFile(pidPath, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("ledger: lock file: %w", err)
	}
	if err := flock(f, path, pidPath); err != nil {
		f.Close()
		return nil, err
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
}

// flock takes the exclusive flock of f, the lock file pidPath of the ledger path, without
// waiting; when another holder has it, the error (ErrLocked) names the pid the file records.
func flock(f *os.File, path, pidPath string) error {
	err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, syscall.EWOULDBLOCK):
		b := make([]byte, 32)
		n, _ := f.ReadAt(b, 0)
		return lockedError(path, pidPath, strings.TrimSpace(string(b[:n])))
	}
	return fmt.Errorf("ledger: lock %s: %w", pidPath, err)
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
