package ledger

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/atomicfile"
	"github.com/cfguard/cfguard/ledger/store"
)

// Backup streams a consistent snapshot of the ledger to w: a complete bbolt file as of one
// transaction (bbolt's Tx.WriteTo in a read transaction), while writers keep committing. It
// stops when ctx ends. Restore installs such a file; Verify checks one. The Info describes the
// snapshot as Verify would, for the fields known without reading it back (TxID, the posterior,
// offsets, counts, anchors, outbox and size; Path, pages, schema and policy stay zero).
//
// A long backup holds its read transaction: bbolt cannot reuse the pages it reads, so the file
// may grow meanwhile, and a commit that must grow bbolt's memory map (it doubles, so this is
// rare) waits for the backup to finish.
//
// A backup never holds a commit that has not returned as committed: its read transaction waits
// for the outcome of a commit under way (store.File.View).
func (l *Ledger) Backup(ctx context.Context, w io.Writer) (Info, error) {
	var info Info
	err := l.view(func(tx *bolt.Tx) error {
		info = Info{TxID: uint64(tx.ID())}
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		info.HasPosterior, info.PosteriorVersion = c.ok, c.version
		if info.Offsets, err = readOffsets(tx); err != nil {
			return err
		}
		cnt, err := readCounts(tx)
		if err != nil {
			return err
		}
		info.Counts = cnt.asMap()
		if err := forEachAnchor(tx, func(uint64, anchorMeta) error { info.Anchors++; return nil }); err != nil {
			return err
		}
		if info.OutboxLen, err = outboxLen(tx); err != nil {
			return err
		}
		info.Size, err = store.Snapshot(ctx, tx, w)
		return err
	})
	if err != nil {
		return info, fmt.Errorf("ledger: backup: %w", err)
	}
	return info, nil
}

// Info describes a ledger file as Verify found it.
type Info struct {
	Path      string `json:"path"`
	Size      int64  `json:"size"`
	PageSize  int    `json:"page_size"`
	TxID      uint64 `json:"txid"`
	Pages     int    `json:"pages"`
	FreePages int    `json:"free_pages"`
	Schema    uint64 `json:"schema"`
	// MetaDamaged says why one of the two meta pages is invalid ("" when both are valid); the
	// file is then read at the transaction the other one records.
	MetaDamaged      string                 `json:"meta_damaged,omitempty"`
	Policy           string                 `json:"policy"`
	HasPosterior     bool                   `json:"has_posterior"`
	PosteriorVersion uint64                 `json:"posterior_version"`
	Origin           string                 `json:"origin"`
	Offsets          map[int]int64          `json:"offsets"`
	Counts           map[certify.Status]int `json:"counts"`
	CEs              int                    `json:"counterfactuals"`
	Anchors          int                    `json:"anchors"`
	KLHistory        int                    `json:"kl_history"`
	OutboxLen        int                    `json:"outbox_len"`
	// Repaired is what Restore repaired in a backup whose records did not verify, before it
	// installed it (nil otherwise): the CEs it quarantined and why, and the other damage Open
	// repairs.
	Repaired *Repairs `json:"repaired,omitempty"`
}

// Verify checks the ledger file at path without writing to it or taking more than a shared lock
// (so Verifies run side by side; a file another process has open for writing gives ErrLocked):
// the meta pages and size, the page tree (store.Verify), bbolt's own tx.Check, and, for a schema-2
// file, every record and the invariants between them (counts, anchor references, statuses
// against their bounds, the indexes, the KL history and its kept breach and failure, the prequential
// records, the outbox). A schema-1 file gets the
// structural checks; Open migrates it and checks its records then.
func Verify(path string) (Info, error) {
	info := Info{Path: path}
	lo, err := store.Verify(path, func(tx *bolt.Tx) error { return verifyTx(tx, path, &info) })
	info.Size, info.PageSize, info.TxID = lo.Size, lo.PageSize, lo.TxID
	info.Pages, info.FreePages, info.MetaDamaged = lo.Pages, lo.FreePages, lo.MetaDamaged
	return info, err
}

// verifyTx checks, for schema 2, every record (checkAll).
func verifyTx(tx *bolt.Tx, path string, info *Info) error {
	meta := tx.Bucket(bMeta)
	if meta == nil {
		return corruptf("bucket %q is missing (not a cfguard ledger?)", bMeta)
	}
	if raw := meta.Get(kSchema); len(raw) == 8 && bytes.Equal(raw, u64bytes(1)) {
		info.Schema = 1
		return nil
	}
	var err error
	if info.Schema, err = metaU64(tx, kSchema); err != nil {
		return err
	}
	switch {
	case info.Schema > schemaVersion:
		return fmt.Errorf("%w: %s has schema %d, this build reads 1 and %d: open or restore it with the cfguard that wrote it",
			ErrNewerSchema, store.ShellQuote(path), info.Schema, schemaVersion)
	case info.Schema != schemaVersion:
		return corruptf("schema %d; this build reads 1 and %d", info.Schema, schemaVersion)
	}
	for _, b := range allBuckets {
		if tx.Bucket(b) == nil {
			return corruptf("bucket %q is missing", b)
		}
	}
	fp, err := getSealed(meta, kPolicy, "meta policy")
	if err != nil {
		return err
	}
	pol, old, err := parsePolicyFingerprint(string(fp))
	if err != nil {
		return err
	}
	info.Policy = string(fp)
	l := &Ledger{path: path, opts: Options{Policy: pol}, log: slog.New(slog.DiscardHandler), models: map[uint64]*bnn.Model{},
		oldIndexes: old}
	return l.checkAll(tx, info)
}

// Restore installs the ledger file src as <stateDir>/cfguard.db. It verifies src, refuses when
// the state directory already holds a ledger (it never replaces one: move that aside first) or
// is locked by a running process, copies src to a temporary file beside the target, fsyncs and
// verifies the copy, links it into place (a link, unlike a rename, fails if the target appeared
// meanwhile), and fsyncs the directory. It returns what Verify found in the installed file.
//
// A src whose only damage is damage Open repairs (a CE's record, an index entry, a prequential
// record, a reissue entry, an anchor KL history, a kept KL event: see quarantine.go) is installed
// as Open makes it (restoreRepaired): the damaged CEs quarantined with their raw bytes, and
// Info.Repaired says what was repaired. src itself is never written to.
//
// A src that does not verify otherwise (damaged meta, anchors, posteriors, outbox or structure,
// or not a ledger) is refused with an error wrapping ErrCorrupt that says what to do about such
// a backup, not what a damaged ledger needs; a backup of a newer cfguard with one wrapping
// ErrNewerSchema.
func Restore(src, stateDir string) (Info, error) { return RestoreWith(src, stateDir, RestoreOptions{}) }

// RestoreOptions are Restore's callbacks (RestoreWith).
type RestoreOptions struct {
	// Repairing, when set, is called once the state directory is found free (no ledger in it,
	// no process holding it) and before a src whose records did not verify is repaired: about a
	// second per million CEs, so that a command can say what it is doing meanwhile. detail is
	// what Verify found.
	Repairing func(detail string)
}

// RestoreWith is Restore, telling opts what it does.
func RestoreWith(src, stateDir string, opts RestoreOptions) (Info, error) {
	if found, err := Verify(src); err != nil {
		var ce *store.CorruptError
		if !errors.As(err, &ce) {
			return Info{}, fmt.Errorf("ledger: restore: %w", err)
		}
		refused := fmt.Errorf("ledger: restore: the backup %s cannot be restored: %w. Nothing was installed; the state directory %s "+
			"is as it was. Restore another backup (cfguard restore %s --from BACKUP)",
			store.ShellQuote(src), ce.Detail, store.ShellQuote(stateDir), store.RecoveryConfigPlaceholder)
		if found.Policy == "" { // the damage is not in the records Open repairs
			return Info{}, refused
		}
		return restoreRepaired(src, stateDir, found.Policy, refused, func() { // once the state directory is found free
			if opts.Repairing != nil {
				opts.Repairing(store.Reason(ce.Detail))
			}
		})
	}
	return installVerified(src, stateDir)
}

// installVerified installs the verified ledger file src (store.Install), returning what Verify
// found in the installed file.
func installVerified(src, stateDir string) (Info, error) {
	var info Info
	err := store.Install(src, stateDir, func(tmp string) (err error) {
		info, err = Verify(tmp)
		return err
	})
	if err != nil {
		return Info{}, err
	}
	info.Path = filepath.Join(stateDir, FileName)
	return info, nil
}

// restoreRepaired installs what Open makes of the backup src, whose records did not verify: in a
// temporary directory inside stateDir, Open repairs a copy of src under the backup's own policy
// (the fingerprint policy, from its meta: under another one Open would re-judge every CE), and
// the repaired copy, once it verifies, is installed as any backup is. The directory is removed
// whatever happens, and stateDir too when this created it and nothing was installed. When Open
// refuses the copy, or the repaired copy does not verify, the damage is not damage Open repairs:
// the backup is refused with refused, the refusal of a backup that does not verify. A state
// directory Install would refuse (a ledger in it, a process holding it) is refused before the
// repair, not after it; repairing is called just before the repair.
func restoreRepaired(src, stateDir, policy string, refused error, repairing func()) (info Info, err error) {
	pol, _, err := parsePolicyFingerprint(policy)
	if err != nil {
		return Info{}, refused
	}
	if err := store.Installable(stateDir); err != nil {
		return Info{}, err
	}
	repairing()
	created, err := missingDirs(stateDir)
	if err != nil {
		return Info{}, fmt.Errorf("ledger: restore: %w", err)
	}
	if err := atomicfile.MkdirAll(stateDir); err != nil {
		return Info{}, fmt.Errorf("ledger: restore: %w", err)
	}
	defer func() {
		if err != nil {
			for _, d := range created { // deepest first; one that holds a file stays
				if os.Remove(d) != nil {
					break
				}
			}
		}
	}()
	work, err := os.MkdirTemp(stateDir, FileName+".repair-*")
	if err != nil {
		return Info{}, fmt.Errorf("ledger: restore: %w", err)
	}
	defer os.RemoveAll(work)
	repaired := filepath.Join(work, FileName)
	if err := store.CopyFile(src, repaired); err != nil {
		return Info{}, fmt.Errorf("ledger: restore: copy %s to %s: %w", src, repaired, err)
	}
	l, err := Open(work, Options{Policy: pol, Logger: slog.New(slog.DiscardHandler)})
	if errors.Is(err, ErrCorrupt) {
		return Info{}, refused
	}
	if err != nil {
		return Info{}, fmt.Errorf("ledger: restore: repairing a copy of %s in %s: %w. Nothing was installed", src, work, err)
	}
	rep := l.repairs
	if err := l.Close(); err != nil {
		return Info{}, fmt.Errorf("ledger: restore: repairing a copy of %s in %s: %w. Nothing was installed", src, work, err)
	}
	if _, err := Verify(repaired); errors.Is(err, ErrCorrupt) {
		return Info{}, refused
	} else if err != nil {
		return Info{}, fmt.Errorf("ledger: restore: verifying the repaired copy of %s: %w. Nothing was installed", src, err)
	}
	if info, err = installVerified(repaired, stateDir); err != nil {
		return Info{}, err
	}
	info.Repaired = &rep
	return info, nil
}

// missingDirs lists dir and those of its parents that do not exist, deepest first.
func missingDirs(dir string) ([]string, error) {
	var missing []string
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		_, err := os.Lstat(d)
		if err == nil {
			return missing, nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		missing = append(missing, d)
		if filepath.Dir(d) == d {
			return missing, nil
		}
	}
}
