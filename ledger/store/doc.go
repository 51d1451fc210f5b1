// Package store is the ledger's file: one bbolt file, <state_dir>/cfguard.db, that is checked
// before bbolt opens it, never written when it is damaged, and read and written through
// transactions that survive bbolt's faults. It knows bbolt's on-disk format and nothing of what
// the ledger keeps in it; package ledger defines the buckets and records and imports this one.
//
// What it gives the ledger:
//
//   - Open: the state directory's lock (cfguard.pid, with the holder's pid, taken without
//     waiting: a second Open fails at once with ErrLocked), the file created only when it is
//     missing (built under a temporary name, filled by Options.Init, and linked into place), and
//     before bbolt opens an existing file for writing, its meta pages, its size against the
//     high-water mark of its last transaction, and a walk of its page tree (walk.go). An empty,
//     truncated or damaged file is refused with a *CorruptError (ErrCorrupt) that names the file,
//     says what is wrong and how to recover (move it aside, then restore a backup with `cfguard
//     restore` or start over), and nothing is written to it.
//   - File.View and File.Update: panics or memory faults inside bbolt are reported as a
//     *CorruptError, and make the File reopen the file (with the checks) before its next
//     operation; any error wrapping ErrCorrupt is named after the file; a failed commit is
//     ErrWrite (below).
//   - Sealed values (Seal, Get, Put): every value ends in a CRC-32C of its key and payload, since
//     bbolt checks its page structure and meta pages but not the bytes of values. Corruptf and
//     InRecord make the errors that say which record is damaged.
//   - Inspect, Verify, Snapshot and Install: the structural checks of a file without opening it
//     for writing, a file-level Verify (structure, bbolt's tx.Check, then the ledger's own check
//     in a read transaction), a consistent snapshot streamed while writers continue, and the
//     installation of a verified file, never over an existing one.
//
// # A damaged meta page
//
// bbolt keeps two meta pages and writes transaction t's to page t mod 2. When the newer one
// fails its checksum, bbolt opens the older one without a word (DB.meta: "fallback to previous,
// if valid"), reading it as a commit that "wasn't saved properly". etcd can afford that: its
// raft WAL, a record kept outside the file, replays whatever the fallback dropped. cfguard has no
// such record for what the API acknowledged (a counterfactual answered 201 exists only in the
// ledger), and a flipped byte on disk and a commit torn by power loss look the same in the file.
// So Open (and Verify, hence Restore) refuses a file whose damaged meta page may be the newer
// one: a *CorruptError names the page, the transaction it reads as, and the transaction the
// fallback would open. The older page damaged is tolerated with a warning, since the newest
// transaction is whole and the next commit rewrites that page; "older" means it still reads as
// transaction T-1 beside the valid T, with a high-water mark not above T's. A page whose
// transaction id is itself damaged cannot be placed, and is refused. Keeping a record outside the
// file (a transaction counter fsynced beside each commit) would let Open prove nothing is lost,
// at the price of a second fsync per increment; a refusal that is rare and says how to recover
// (a backup, or starting over) was chosen instead.
//
// A commit that fails (no space, file size limit, failed fsync) returns ErrWrite and leaves the
// ledger exactly as before the call: bbolt is closed and the file reopened, and if the failed
// commit's meta page reached the page cache (where a failed fsync leaves it, and where every later
// read would find it), the page it overwrote is put back first. So it is when the failed commit
// left its meta page damaged (a write that stopped part way): read cold, such a page would be
// refused as one that may hold a newer transaction, but this File knows it holds the commit it
// reported failed. The caller can retry once space is available.
//
// # The freelist
//
// bbolt never overwrites a page the newest transaction uses: a commit writes changed pages to
// free ones, then the meta page. Which pages are free, the freelist, is opened as a hash map and
// not written to the file (bbolt's NoFreelistSync, as etcd runs it). bbolt's default writes the
// whole list, sorted, with every commit: a ledger that has lived through audits and drifts keeps
// tens of thousands of free pages (each rewrite of every record frees the previous copies), so a
// commit wrote and fsynced hundreds of kilobytes of page ids beside a few pages of data, and took
// twice as long as on a fresh ledger of the same size. Without it, the meta page records no
// freelist page (all ones), and bbolt rebuilds the list at open by walking the tree, after the
// structural check has walked it: a free page is one that no bucket reaches. Crash safety is the
// same: the newest transaction's pages are never reused, a torn or failed commit leaves it whole.
//
// Compatibility. A file whose meta page records a freelist page (written by cfguard before it
// stopped syncing the freelist, or any bbolt file) opens as before, its freelist checked against
// the tree; the first commit drops it. A ledger or backup whose last commit was made this way
// has no freelist page, and a cfguard that predates this refuses to open or restore it ("has no
// freelist page"), writing nothing: a ledger moves forward only.
//
// What the structural check gives up: with a freelist on file, the tree and the freelist must
// partition the pages, so a branch page's child pointer damaged into the id of a free page was
// refused even when that page was a stale copy of the same leaf. With none, a pointer damaged
// into exactly such a page (a valid page header naming its own id, keys within the branch's
// bounds) reads the stale copy; every value still carries its checksum, so this needs the damage
// to land on a page id whose stale content is itself intact and in range. The ledger's fault
// tests (every page flipped, random bit flips) see no such case.
package store
