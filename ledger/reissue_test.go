package ledger

import (
	"errors"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/certify"
	bolt "go.etcd.io/bbolt"
)

// TestReissueEntries: with Options.Reissue, the transaction of each status change it selects
// stores the CE as waiting for a reissue, under the change's posterior version; the entries
// survive a reopen, page in id order, are settled by a Checkpoint with an outcome at or after
// that version (not before), and go with their CE. Verify accepts them. Without the option,
// nothing is stored.
func TestReissueEntries(t *testing.T) {
	enters := func(ch StatusChange) bool { return ch.To == certify.Invalidated }
	for _, c := range []struct {
		name   string
		option func(StatusChange) bool
	}{{"off", nil}, {"invalidated", enters}} {
		t.Run(c.name, func(t *testing.T) {
			l, dir := openTest(t, Options{Reissue: c.option})
			m := testModel(4)
			install(t, l, m)
			rng := rand.New(rand.NewPCG(1, 2))
			for range 40 {
				if err := l.Put(bg, newCE(t, m, rng)); err != nil {
					t.Fatal(err)
				}
			}
			next := drift(m, -8)
			_, changes := commit(t, l, next, 3)
			var want []PendingReissue
			for _, ch := range changes {
				if c.option != nil && enters(ch) {
					want = append(want, PendingReissue{ID: ch.ID, Version: ch.PosteriorVersion})
				}
			}
			slices.SortFunc(want, func(a, b PendingReissue) int { return strings.Compare(a.ID, b.ID) })
			if c.option != nil && len(want) < 3 {
				t.Fatalf("%d CEs invalidated by the drift, want at least 3: %+v", len(want), changes)
			}
			l = reopen(t, l, dir)
			var got []PendingReissue
			for after := ""; ; {
				page, err := l.PendingReissues(after, 2)
				if err != nil {
					t.Fatal(err)
				}
				if len(page) == 0 {
					break
				}
				got = append(got, page...)
				after = page[len(page)-1].ID
			}
			if !slices.Equal(got, want) {
				t.Fatalf("waiting for a reissue after the reopen:\n%+v\nwant\n%+v", got, want)
			}
			if len(want) == 0 {
				return
			}
			first, second := want[0], want[1]
			if err := l.Checkpoint(&Checkpoint{Reissued: []PendingReissue{{ID: first.ID, Version: first.Version - 1}}}); err != nil {
				t.Fatal(err)
			}
			if _, waits, err := l.PendingReissue(first.ID); err != nil || !waits {
				t.Fatalf("%s settled by an outcome before its change (%v)", first.ID, err)
			}
			if err := l.Checkpoint(&Checkpoint{Reissued: []PendingReissue{first}}); err != nil {
				t.Fatal(err)
			}
			if _, waits, err := l.PendingReissue(first.ID); err != nil || waits {
				t.Fatalf("%s still waits after its outcome (%v)", first.ID, err)
			}
			if err := l.Delete(second.ID); err != nil {
				t.Fatal(err)
			}
			if _, waits, err := l.PendingReissue(second.ID); err != nil || waits {
				t.Fatalf("%s still waits after its deletion (%v)", second.ID, err)
			}
			if rest, err := l.PendingReissues("", 100); err != nil || !slices.Equal(rest, want[2:]) {
				t.Fatalf("waiting: %+v (%v), want %+v", rest, err, want[2:])
			}
			checkInvariants(t, l)
			l.Close()
			if _, err := Verify(l.Path()); err != nil {
				t.Fatalf("Verify: %v", err)
			}
		})
	}
}

// A damaged reissue entry fails Verify, naming the CE; Open writes it again as waiting since
// version 0, at ERROR, so that the CE still waits (any outcome settles it) and the ledger the
// daemon runs on passes Verify again, and with it every backup.
func TestOpenRepairsADamagedReissueEntry(t *testing.T) {
	l, dir, waiting := waitingLedger(t, 3, 2)
	hit := waiting[1].ID
	damageValue(t, l, bReissue, hit)
	l.Close()
	if _, err := Verify(l.Path()); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), hit) {
		t.Fatalf("Verify of a ledger with a damaged reissue entry = %v, want a *CorruptError naming %s", err, hit)
	}
	var log strings.Builder
	l, err := Open(dir, Options{Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatalf("Open with a damaged reissue entry: %v", err)
	}
	defer l.Close()
	if !strings.Contains(log.String(), "level=ERROR") || !strings.Contains(log.String(), "id="+hit) {
		t.Fatalf("the log does not name the repaired entry at ERROR:\n%s", log.String())
	}
	want := slices.Clone(waiting)
	want[1].Version = 0
	if got, err := l.PendingReissues("", 100); err != nil || !slices.Equal(got, want) {
		t.Fatalf("waiting after Open: %+v (%v), want %+v", got, err, want)
	}
	l.Close()
	if _, err := Verify(l.Path()); err != nil {
		t.Fatalf("Verify after Open wrote the entry again: %v", err)
	}
}

// Deleting a quarantined CE deletes its reissue entry with its damaged record, as deleting a
// stored CE does: an entry left behind would make a CE registered later under the id wait for a
// reissue no change of its own asked for, and with explain.reissue off earn a failure event for
// a CE the caller deleted.
func TestDeletingAQuarantinedCEDropsItsReissueEntry(t *testing.T) {
	l, dir, waiting := waitingLedger(t, 5, 1)
	hit := waiting[0].ID
	damageValue(t, l, bHeaders, hit)
	l = reopen(t, l, dir)
	defer l.Close()
	if _, err := l.Get(hit); !errors.Is(err, ErrQuarantined) {
		t.Fatalf("Get(%s) after damaging its header = %v, want ErrQuarantined", hit, err)
	}
	if err := l.Delete(hit); err != nil {
		t.Fatal(err)
	}
	if p, waits, err := l.PendingReissue(hit); err != nil || waits {
		t.Fatalf("%s still waits for a reissue after its quarantined record was deleted: %+v (%v)", hit, p, err)
	}
}

// Registering a CE under the id of a quarantined one replaces it: the quarantined CE's reissue
// entry goes, as its deletion's would, and the new CE does not wait for a reissue no change of
// its own asked for.
func TestRegisteringOverAQuarantinedCEDropsItsReissueEntry(t *testing.T) {
	l, dir, waiting := waitingLedger(t, 5, 1)
	hit := waiting[0].ID
	old, err := l.Get(hit)
	if err != nil {
		t.Fatal(err)
	}
	damageValue(t, l, bHeaders, hit)
	l = reopen(t, l, dir)
	defer l.Close()
	m, err := l.Current()
	if err != nil {
		t.Fatal(err)
	}
	ce := newCE(t, m, rand.New(rand.NewPCG(9, 9)))
	ce.ID = hit
	if err := l.Put(bg, ce); err != nil {
		t.Fatalf("registering %s over its quarantined record: %v (was %+v)", hit, err, old)
	}
	if p, waits, err := l.PendingReissue(hit); err != nil || waits {
		t.Fatalf("%s registered again still waits for the quarantined CE's reissue: %+v (%v)", hit, p, err)
	}
	if got, err := l.Get(hit); err != nil || got.ReissuePendingSince != nil {
		t.Fatalf("Get(%s) = %+v (%v), want a CE waiting for no reissue", hit, got, err)
	}
	checkInvariants(t, l)
}

// An entry sealed but not 8 bytes long is damaged for Open as it is for Verify: Open writes it
// again, so that the ledger the daemon runs on, and every backup of it, verifies.
func TestOpenRepairsAReissueEntryOfTheWrongLength(t *testing.T) {
	l, dir, waiting := waitingLedger(t, 7, 1)
	hit := waiting[0].ID
	if err := l.update(func(tx *bolt.Tx) error { return putSealed(tx.Bucket(bReissue), []byte(hit), []byte{1, 2, 3}) }); err != nil {
		t.Fatal(err)
	}
	l = reopen(t, l, dir)
	if p, waits, err := l.PendingReissue(hit); err != nil || !waits || p.Version != 0 {
		t.Fatalf("%s after Open: %+v waits=%v (%v), want waiting since version 0", hit, p, waits, err)
	}
	l.Close()
	if _, err := Verify(l.Path()); err != nil {
		t.Fatalf("Verify after Open: %v", err)
	}
}

// waitingLedger is a ledger with Options.Reissue marking CEs that enter invalidated, 40 CEs
// (drawn with seed) and a drift that invalidates at least want of them, all waiting.
func waitingLedger(t *testing.T, seed uint64, want int) (*Ledger, string, []PendingReissue) {
	t.Helper()
	l, dir := openTest(t, Options{Reissue: func(ch StatusChange) bool { return ch.To == certify.Invalidated }})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(seed, seed+1))
	for range 40 {
		if err := l.Put(bg, newCE(t, m, rng)); err != nil {
			t.Fatal(err)
		}
	}
	commit(t, l, drift(m, -8), 3)
	waiting, err := l.PendingReissues("", 100)
	if err != nil || len(waiting) < want {
		t.Fatalf("waiting for a reissue after the drift: %+v (%v), want at least %d", waiting, err, want)
	}
	return l, dir, waiting
}
