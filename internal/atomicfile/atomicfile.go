// Package atomicfile writes files so that a reader sees either the old content or the new, never
// a torn mix: write a temporary file in the same directory, fsync it, rename it over the target,
// and fsync the directory so the rename itself survives a crash.
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"
)

// WriteFile atomically replaces path with data (mode 0o644). On any error before the rename the
// old file is untouched and the temporary file is removed; every error names path.
func WriteFile(path string, data []byte) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("atomic write %s: %w", path, err)
	}
	tmp := f.Name()
	ok := false
	defer func() {
		if !ok {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("atomic write %s: %w", path, err)
	}
	if err := f.Chmod(0o644); err != nil {
		return fmt.Errorf("atomic write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("atomic write %s: fsync: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("atomic write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("atomic write %s: %w", path, err)
	}
	ok = true
	return SyncDir(dir)
}

// SyncDir fsyncs a directory so that renames and creations in it are durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("fsync dir: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync dir %s: %w", dir, err)
	}
	return nil
}

// MkdirAll creates dir and any missing parents (mode 0o755), as os.MkdirAll does, and fsyncs
// the parent of each directory it created and of dir itself, so that the directories survive a
// crash with the files fsynced in them afterwards (a file's fsync makes its data and its entry
// durable, not the entry of a directory created for it). dir's parent is fsynced even when dir
// exists: a call that created it and then failed to fsync is made good by the next.
func MkdirAll(dir string) error {
	dir = filepath.Clean(dir)
	sync := []string{filepath.Dir(dir)} // parents to fsync, deepest first
	for d := filepath.Dir(dir); filepath.Dir(d) != d; d = filepath.Dir(d) {
		if _, err := os.Stat(d); err == nil || !os.IsNotExist(err) {
			break
		}
		sync = append(sync, filepath.Dir(d))
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, d := range sync {
		if err := SyncDir(d); err != nil {
			return fmt.Errorf("creating %s: %w", dir, err)
		}
	}
	return nil
}

// File is one file of a set written by WriteFiles.
type File struct {
	Name string
	Data []byte
}

// WriteFiles creates dir if needed and writes each file atomically, in order. The set as a
// whole is not atomic: write last the file that vouches for the others (e.g. a sidecar holding
// their checksums), so that a crash in between leaves a set its reader rejects.
func WriteFiles(dir string, files ...File) error {
	if err := MkdirAll(dir); err != nil {
		return err
	}
	for _, f := range files {
		if err := WriteFile(filepath.Join(dir, f.Name), f.Data); err != nil {
			return err
		}
	}
	return nil
}
