package ledger

import (
	"os"
	"path/filepath"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/ledger/store"
)

// fileFreelist reads the newest meta page of the ledger in dir and walks its tree: the freelist
// page it records (store.NoFreelist for none) and the free pages the walk counts.
func fileFreelist(t *testing.T, dir string) (freelist uint64, free int) {
	t.Helper()
	f, err := os.Open(filepath.Join(dir, FileName))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	lo, err := store.Inspect(f)
	if err != nil {
		t.Fatal(err)
	}
	return lo.Freelist, lo.FreePages
}

// openFreelist opens dir with or without a synced freelist and checks that bbolt's free page
// count equals the walk's.
func openFreelist(t *testing.T, dir string, sync bool) *Ledger {
	t.Helper()
	_, walked := fileFreelist(t, dir)
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), Now: fixedClock(), syncFreelist: sync})
	if err != nil {
		t.Fatal(err)
	}
	var st bolt.Stats
	if err := l.view(func(tx *bolt.Tx) error { st = tx.DB().Stats(); return nil }); err != nil {
		t.Fatal(err)
	}
	if opened, _ := fileFreelist(t, dir); opened == store.NoFreelist && st.FreePageN != walked {
		t.Fatalf("bbolt rebuilt a freelist of %d pages; the walk counted %d pages no bucket reaches", st.FreePageN, walked)
	}
	return l
}

// A ledger's commits write no freelist page, and a file with one (written by a ledger that synced
// its freelist) and a file without read the same both ways: each opens, reads what it held,
// passes Verify, and its next commit writes it in the opener's format.
func TestFreelistFormatsBothWays(t *testing.T) {
	dir := t.TempDir()
	richLedger(t, dir)
	if fl, free := fileFreelist(t, dir); fl != store.NoFreelist || free == 0 {
		t.Fatalf("a ledger's commit left freelist page %d (want none) and %d free pages (want some: the test needs them)", fl, free)
	}
	read := func(sync bool) string {
		l := openFreelist(t, dir, sync)
		defer l.Close()
		s, err := snapshot(l)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Verify(l.Path()); err == nil {
			t.Fatal("Verify of an open ledger did not report it locked")
		}
		return s
	}
	ref := read(false)
	for _, sync := range []bool{true, false, true, false} {
		l := openFreelist(t, dir, sync)
		before, err := l.State()
		if err != nil {
			t.Fatal(err)
		}
		// A commit that changes nothing a reader sees: the offsets the ledger holds.
		if err := l.Checkpoint(&Checkpoint{Offsets: before.Offsets}); err != nil {
			t.Fatal(err)
		}
		l.Close()
		fl, _ := fileFreelist(t, dir)
		if (fl == store.NoFreelist) == sync {
			t.Fatalf("after a commit with a synced freelist %v, the meta page records freelist page %d", sync, fl)
		}
		if _, err := Verify(filepath.Join(dir, FileName)); err != nil {
			t.Fatalf("Verify with a synced freelist %v: %v", sync, err)
		}
		if got := read(!sync); got != ref {
			t.Fatalf("after a commit with a synced freelist %v the ledger reads differently:\n got %.600s\nwant %.600s", sync, got, ref)
		}
	}
}
