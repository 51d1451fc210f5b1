package ledger

import (
	"time"

	bolt "go.etcd.io/bbolt"
)

// WriteFailure returns when the running episode of failed commits began and the last commit's
// error (ErrWrite: no space, file size limit, failed fsync), or a nil error when the last commit,
// of any writer, succeeded. A daemon whose own writes are rare (registrations while no record
// arrives) learns from it that the file cannot be written, and Probe ends the episode.
func (l *Ledger) WriteFailure() (since time.Time, err error) { return l.file.WriteFailure() }

// Probe commits one transaction that rewrites the schema version with its own value: bbolt
// copies the page on write, so the commit needs a page and an fsync like any other write, and
// changes nothing. While commits fail it fails too (ErrWrite); its success ends the episode
// WriteFailure reports.
func (l *Ledger) Probe() error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	return l.update(func(tx *bolt.Tx) error {
		return putU64(tx.Bucket(bMeta), kSchema, schemaVersion)
	})
}
