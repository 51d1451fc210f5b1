package ledger

import "github.com/cfguard/cfguard/ledger/store"

// WriteFailures are the commits to the ledger that failed since Open, of every writer
// (ErrWrite: no space, file size limit, failed fsync): their count and the latest one's time
// and error. A daemon whose own writes are rare (registrations while no record arrives) learns
// from it that the disk refuses them.
func (l *Ledger) WriteFailures() store.Failures { return l.file.WriteFailures() }
