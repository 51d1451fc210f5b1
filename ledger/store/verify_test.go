package store

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	bolt "go.etcd.io/bbolt"
)

// metaTxids reads the transaction ids of the two meta pages of the bbolt file at path (page
// size ps), and which page holds the larger.
func metaTxids(t *testing.T, path string, ps int) (txids [2]uint64, newest int) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for slot := range 2 {
		txids[slot] = ne.Uint64(data[slot*ps+16+48:])
	}
	if txids[1] > txids[0] {
		newest = 1
	}
	return txids, newest
}

// snapshots writes backups of a File at two successive transactions (Snapshot writes its
// transaction to meta page 0 whatever its parity, so one of the two is out of bbolt's order).
func snapshots(t *testing.T) (paths [2]string) {
	t.Helper()
	f := openTest(t, t.TempDir(), testOptions())
	for i := range 2 {
		if err := put(f, "k", fmt.Sprint(i)); err != nil {
			t.Fatal(err)
		}
		paths[i] = filepath.Join(t.TempDir(), "backup.db")
		out, err := os.Create(paths[i])
		if err != nil {
			t.Fatal(err)
		}
		err = f.View(func(tx *bolt.Tx) error { _, err := Snapshot(context.Background(), tx, out); return err })
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	return paths
}

// TestInstallGivesBboltsOrder: an installed backup has bbolt's meta-page order whatever the
// parity of its transaction: the newest transaction T in page T mod 2 and T-1 in the other page
// (so that the older page damaged is tolerated, see alignMetas). A snapshot already in that order
// is verified once and installed as it is; one that is not gets two empty commits and is verified
// again after them.
func TestInstallGivesBboltsOrder(t *testing.T) {
	paths := snapshots(t)
	var calls []int
	for _, src := range paths {
		lo, err := Verify(src, func(*bolt.Tx) error { return nil })
		if err != nil {
			t.Fatal(err)
		}
		wantCalls, wantTxid := 1, lo.TxID
		if lo.TxID%2 != uint64(lo.MetaPage) {
			wantCalls, wantTxid = 2, lo.TxID+2
		}
		dir := filepath.Join(t.TempDir(), "state")
		n := 0
		if err := Install(src, dir, func(path string) error { n++; _, err := Verify(path, func(*bolt.Tx) error { return nil }); return err }); err != nil {
			t.Fatal(err)
		}
		calls = append(calls, n)
		txids, newest := metaTxids(t, filepath.Join(dir, FileName), lo.PageSize)
		if txids[newest] != wantTxid || uint64(newest) != wantTxid%2 || txids[1-newest] != wantTxid-1 {
			t.Errorf("backup of transaction %d in meta page %d installed with meta pages %v; want %d in page %d beside %d",
				lo.TxID, lo.MetaPage, txids, wantTxid, wantTxid%2, wantTxid-1)
		}
		if n != wantCalls {
			t.Errorf("backup of transaction %d in meta page %d: verified %d times, want %d", lo.TxID, lo.MetaPage, n, wantCalls)
		}
	}
	if calls[0] == calls[1] {
		t.Fatalf("both backups verified %d times: the test needs one of each parity", calls[0])
	}
}

// TestInstallNeverReplacesALedger: a directory that holds a ledger is refused before anything is
// copied or verified, naming the file and how to move it aside, and the ledger is left as it was.
func TestInstallNeverReplacesALedger(t *testing.T) {
	paths := snapshots(t)
	dir := t.TempDir()
	dst := filepath.Join(dir, FileName)
	if err := os.WriteFile(dst, []byte("the ledger in place"), 0o600); err != nil {
		t.Fatal(err)
	}
	verified := 0
	err := Install(paths[0], dir, func(string) error { verified++; return nil })
	if !errors.Is(err, fs.ErrExist) || !strings.Contains(err.Error(), "mv "+dst+" "+dst+".old") {
		t.Fatalf("Install over a ledger: %v, want fs.ErrExist saying how to move it aside", err)
	}
	if verified != 0 {
		t.Errorf("Install verified a copy %d times before refusing", verified)
	}
	if b, _ := os.ReadFile(dst); string(b) != "the ledger in place" {
		t.Fatalf("the ledger in place was replaced: %q", b)
	}
}

// CopyFile makes a new file: an existing destination is an error and keeps its content.
func TestCopyFileNeverOverwrites(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	os.WriteFile(src, []byte("new"), 0o600)
	os.WriteFile(dst, []byte("old"), 0o600)
	if err := CopyFile(src, dst); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("CopyFile onto an existing file: %v, want fs.ErrExist", err)
	}
	if b, _ := os.ReadFile(dst); string(b) != "old" {
		t.Fatalf("the destination now holds %q", b)
	}
}

// Verify takes a shared lock: Verifies of one file run side by side (here, beside a shared lock
// another Verify would hold), and check runs in its read transaction, its ErrCorrupt naming the
// file.
func TestVerifySharesItsLockAndRunsCheck(t *testing.T) {
	paths := snapshots(t)
	held, err := os.Open(paths[0])
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	if err := syscall.Flock(int(held.Fd()), syscall.LOCK_SH|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	if _, err := Verify(paths[0], func(*bolt.Tx) error { return nil }); err != nil {
		t.Fatalf("Verify beside a shared lock: %v", err)
	}
	_, err = Verify(paths[0], func(tx *bolt.Tx) error {
		if tx.Bucket(bucket) == nil {
			return errors.New("check ran without the file's bucket")
		}
		return Corruptf("counterfactual %q: checksum mismatch", "ce-1")
	})
	var ce *CorruptError
	if !errors.As(err, &ce) || ce.Path != paths[0] || !strings.Contains(err.Error(), `counterfactual "ce-1": checksum mismatch`) {
		t.Fatalf("Verify with a failing check: %v, want a *CorruptError naming %s and the record", err, paths[0])
	}
}

// Snapshot stops once its context has ended.
func TestSnapshotStopsWithItsContext(t *testing.T) {
	f := openTest(t, t.TempDir(), testOptions())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var n int64
	err := f.View(func(tx *bolt.Tx) (err error) { n, err = Snapshot(ctx, tx, new(strings.Builder)); return err })
	// bbolt's WriteTo formats the writer's error with %s: the cause is in the text only.
	if err == nil || !strings.Contains(err.Error(), context.Canceled.Error()) || n != 0 {
		t.Fatalf("Snapshot with an ended context: %d bytes, %v; want 0 and the context's error", n, err)
	}
}

// TestVerifyRefusesADamagedFile: Verify runs the structural checks before bbolt sees the file: an
// empty file and a page that is not the one its parent points to are a *CorruptError naming the
// file and saying what the check found, with the layout filled in as far as the checks got.
func TestVerifyRefusesADamagedFile(t *testing.T) {
	data, lo := walkFixture(t)
	root := int(ne.Uint64(data[lo.MetaPage*lo.PageSize+16+16:]))
	badID := append([]byte(nil), data...)
	ne.PutUint64(badID[root*lo.PageSize:], uint64(root+1))
	for _, c := range []struct {
		name     string
		data     []byte
		want     string
		wantTxID uint64
	}{
		{"empty", nil, "empty (0 bytes)", 0},
		{"page id", badID, fmt.Sprintf("bbolt page %d says it is page %d", root, root+1), lo.TxID},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), FileName)
			if err := os.WriteFile(path, c.data, 0o600); err != nil {
				t.Fatal(err)
			}
			got, err := Verify(path, func(*bolt.Tx) error { return nil })
			var ce *CorruptError
			if !errors.As(err, &ce) || ce.Path != path || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Verify: %v, want a *CorruptError naming %s and saying %q", err, path, c.want)
			}
			if got.TxID != c.wantTxID {
				t.Errorf("Verify's layout names transaction %d, want %d", got.TxID, c.wantTxID)
			}
		})
	}
}

// The mv that a refusal prints moves the ledger to a name that does not exist: a file set aside
// by an earlier restore (or found damaged earlier) is not replaced by following the advice again.
func TestRecoveryAdviceNeverMovesOverAFile(t *testing.T) {
	paths := snapshots(t)
	dir := t.TempDir()
	dst := filepath.Join(dir, FileName)
	for _, name := range []string{dst, dst + ".old", dst + ".damaged", dst + ".damaged-2"} {
		if err := os.WriteFile(name, []byte(name), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	err := Install(paths[0], dir, func(string) error { return nil })
	if !errors.Is(err, fs.ErrExist) || !strings.Contains(err.Error(), "mv "+dst+" "+dst+".old-2)") {
		t.Errorf("Install over a ledger beside %s.old: %v, want the advice to move it to %s.old-2", dst, err, dst)
	}
	ce := &CorruptError{Path: dst, Detail: errors.New("bad")}
	if !strings.Contains(ce.Error(), "mv "+dst+" "+dst+".damaged-3)") {
		t.Errorf("a damaged ledger beside %s.damaged and .damaged-2: %v, want the advice to move it to %s.damaged-3", dst, ce, dst)
	}
}
