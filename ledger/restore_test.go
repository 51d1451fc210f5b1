package ledger

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/ledger/store"
)

// damagedBackup builds a rich ledger, damages it with damage and copies its file, closed, to a
// file of its own, as a stopped daemon's ledger is backed up (Backup reads the anchors, and
// refuses a damaged one). It returns the backup's path and every CE as it was before the damage.
func damagedBackup(t *testing.T, damage func(l *Ledger)) (string, []*CE) {
	t.Helper()
	dir := t.TempDir()
	richLedger(t, dir)
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), Now: fixedClock()})
	if err != nil {
		t.Fatal(err)
	}
	before, err := l.List(0, 1000, "")
	if err != nil {
		l.Close()
		t.Fatal(err)
	}
	damage(l)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	backup := filepath.Join(t.TempDir(), "backup.db")
	if err := store.CopyFile(filepath.Join(dir, FileName), backup); err != nil {
		t.Fatal(err)
	}
	return backup, before
}

// firstKey is the first key of bucket b.
func firstKey(t *testing.T, l *Ledger, b []byte) string {
	t.Helper()
	var k []byte
	l.view(func(tx *bolt.Tx) error {
		k, _ = tx.Bucket(b).Cursor().First()
		k = bytes.Clone(k)
		return nil
	})
	if k == nil {
		t.Fatalf("bucket %s is empty", b)
	}
	return string(k)
}

// A backup whose only damage is to CE records (a header, a body) is restored as Open makes it:
// the two CEs quarantined with their raw bytes and named with their reasons in the Info, every
// other CE as it was, under the backup's own policy; the backup file is not written to and
// nothing is left beside the installed ledger.
func TestRestoreQuarantinesDamagedCEs(t *testing.T) {
	backup, before := damagedBackup(t, func(l *Ledger) {
		damageValue(t, l, bHeaders, "rich-a-05")
		damageValue(t, l, bBodies, "rich-b-03")
	})
	if _, err := Verify(backup); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Verify of the damaged backup: %v, want ErrCorrupt", err)
	}
	hash := fileHash(t, backup)
	state := filepath.Join(t.TempDir(), "state")
	info, err := Restore(backup, state)
	if err != nil {
		t.Fatalf("Restore of a backup with two damaged CE records: %v", err)
	}
	if fileHash(t, backup) != hash {
		t.Fatal("Restore wrote to the backup file")
	}
	want := []QuarantinedCE{{ID: "rich-a-05", Reason: "header checksum mismatch"}, {ID: "rich-b-03", Reason: "body checksum mismatch"}}
	if info.Repaired == nil || !slices.Equal(info.Repaired.Quarantined, want) {
		t.Fatalf("Restore reported %+v repaired, want the quarantined %+v", info.Repaired, want)
	}
	if info.Path != filepath.Join(state, FileName) || info.Policy != policyFingerprint(testPolicy()) || info.CEs != len(before)-2 {
		t.Errorf("Restore returned %+v; want the installed file, the backup's policy %q and %d CEs", info, policyFingerprint(testPolicy()), len(before)-2)
	}
	entries, _ := os.ReadDir(state)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if !slices.Equal(names, []string{FileName, PIDFileName}) {
		t.Errorf("the state directory holds %v, want the ledger and its lock file alone", names)
	}
	if _, err := Verify(info.Path); err != nil {
		t.Fatalf("the restored ledger does not verify: %v", err)
	}
	// Restored again over the ledger just installed: refused as any restore over a ledger is,
	// nothing of the repair left behind.
	installed := fileHash(t, info.Path)
	if _, err := Restore(backup, state); !errors.Is(err, fs.ErrExist) {
		t.Errorf("a second restore into %s: %v, want fs.ErrExist", state, err)
	}
	if entries, _ := os.ReadDir(state); len(entries) != 2 || fileHash(t, info.Path) != installed {
		t.Errorf("a refused restore changed the state directory: %d entries", len(entries))
	}
	r, err := Open(state, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if n := r.Damaged(); n != 2 {
		t.Errorf("the restored ledger's Damaged() = %d, want 2", n)
	}
	checkInvariants(t, r)
	for _, q := range want {
		if _, err := r.Get(q.ID); !errors.Is(err, ErrQuarantined) {
			t.Errorf("Get(%q) on the restored ledger: %v, want ErrQuarantined", q.ID, err)
		}
	}
	after, err := r.List(0, 1000, "")
	if err != nil {
		t.Fatal(err)
	}
	var kept []*CE
	for _, c := range before {
		if c.ID != "rich-a-05" && c.ID != "rich-b-03" {
			kept = append(kept, c)
		}
	}
	if got, want := ceJSON(t, after), ceJSON(t, kept); got != want {
		t.Errorf("the restored ledger's CEs differ from the backup's other CEs:\n got %s\nwant %s", got, want)
	}
}

func ceJSON(t *testing.T, ces []*CE) string {
	t.Helper()
	b, err := json.Marshal(ces)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// A backup with damage Open does not repair (an anchor, a posterior), with or without damaged CE
// records beside it, is refused as a backup that does not verify, with the message Verify's
// finding gives: nothing is installed, no directory is made, the backup is not written to.
func TestRestoreRefusesDamageOpenDoesNotRepair(t *testing.T) {
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, l *Ledger)
	}{
		{"anchor", func(t *testing.T, l *Ledger) { damageValue(t, l, bAnchors, firstKey(t, l, bAnchors)) }},
		{"anchor posterior", func(t *testing.T, l *Ledger) { damageValue(t, l, bAnchorModels, firstKey(t, l, bAnchorModels)) }},
		{"current posterior", func(t *testing.T, l *Ledger) { damageValue(t, l, bMeta, string(kCurrent)) }},
		{"a CE body and an anchor", func(t *testing.T, l *Ledger) {
			damageValue(t, l, bBodies, "rich-b-03")
			damageValue(t, l, bAnchors, firstKey(t, l, bAnchors))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			backup, _ := damagedBackup(t, func(l *Ledger) { tc.damage(t, l) })
			_, verr := Verify(backup)
			var ce *store.CorruptError
			if !errors.As(verr, &ce) {
				t.Fatalf("Verify of the damaged backup: %v, want a *CorruptError", verr)
			}
			hash := fileHash(t, backup)
			state := filepath.Join(t.TempDir(), "state")
			_, err := Restore(backup, state)
			want := fmt.Sprintf("ledger: restore: the backup %s cannot be restored: %v. Nothing was installed; the state directory %s "+
				"is as it was. Restore another backup (cfguard restore %s --from BACKUP)",
				store.ShellQuote(backup), ce.Detail, store.ShellQuote(state), store.RecoveryConfigPlaceholder)
			if err == nil || err.Error() != want || !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Restore: %v\nwant %s", err, want)
			}
			if fileHash(t, backup) != hash {
				t.Fatal("Restore wrote to the backup file")
			}
			if _, err := os.Stat(state); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("a refused restore left the state directory behind: %v", err)
			}
		})
	}
}

// A backup whose only damage is an index entry is restored with its indexes rebuilt, no CE
// quarantined, and the repair reported.
func TestRestoreRebuildsDamagedIndexes(t *testing.T) {
	backup, before := damagedBackup(t, func(l *Ledger) { damageValue(t, l, bIdxP1, firstKey(t, l, bIdxP1)) })
	state := filepath.Join(t.TempDir(), "state")
	info, err := Restore(backup, state)
	if err != nil {
		t.Fatalf("Restore of a backup with a damaged index entry: %v", err)
	}
	if r := info.Repaired; r == nil || r.IndexEntries != 1 || len(r.Quarantined) != 0 || info.CEs != len(before) {
		t.Fatalf("Restore returned %+v, repaired %+v; want %d CEs, 1 index entry repaired, none quarantined", info, r, len(before))
	}
	r, err := Open(state, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	checkInvariants(t, r)
	if n := r.Damaged(); n != 0 {
		t.Errorf("Damaged() = %d, want 0", n)
	}
}

// A backup that needs a repair, aimed at a state directory Install refuses (a running ledger
// holds it, or it holds a ledger), is refused as any restore there is, before the repair: the
// Repairing callback is not called and nothing is made in the directory. Into a free one, it is
// called once, with what Verify found, before the repaired copy is installed.
func TestRestoreRefusesAnOccupiedStateDirBeforeRepairing(t *testing.T) {
	backup, _ := damagedBackup(t, func(l *Ledger) { damageValue(t, l, bBodies, "rich-b-03") })
	var said []string
	opts := RestoreOptions{Repairing: func(detail string) { said = append(said, detail) }}
	state := t.TempDir()
	l, err := Open(state, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	before := func() []string {
		entries, _ := os.ReadDir(state)
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		return names
	}
	held := before()
	if _, err := RestoreWith(backup, state, opts); !errors.Is(err, ErrLocked) || len(said) != 0 {
		t.Errorf("a repairing restore into a running ledger's directory: %v, Repairing called %d times; want ErrLocked before any repair", err, len(said))
	}
	l.Close()
	if _, err := RestoreWith(backup, state, opts); !errors.Is(err, fs.ErrExist) || !strings.Contains(err.Error(), "mv ") || len(said) != 0 {
		t.Errorf("a repairing restore over a ledger: %v, Repairing called %d times; want fs.ErrExist saying to move it aside, before any repair", err, len(said))
	}
	if got := before(); !slices.Equal(got, held) {
		t.Errorf("the refused restores left %v in the state directory, which held %v", got, held)
	}
	free := filepath.Join(t.TempDir(), "state")
	info, err := RestoreWith(backup, free, opts)
	if err != nil || info.Repaired == nil {
		t.Fatalf("the restore into a free directory: %+v, %v", info, err)
	}
	if len(said) != 1 || !strings.Contains(said[0], "checksum") {
		t.Errorf("Repairing was told %q, want once, what Verify found", said)
	}
}
