package ledger

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// bruteSince is the lapse version from every KL of an anchor (kls[i] at version i), with no
// history kept: the version after the last one whose KL is at or below the threshold.
func bruteSince(kls []float64, threshold float64) (since uint64, lapsed, known bool) {
	for i := len(kls) - 1; i >= 0; i-- {
		if kls[i] <= threshold {
			return uint64(i + 1), i < len(kls)-1, true
		}
	}
	return 0, true, false
}

// A history answers, for the CEs that were under its anchor when they lapsed, what a scan of
// every version's KL answers: the version after the last one at which the bound held. For CEs
// stored under the anchor later (their lapses not seen), it answers the same or nothing. KL
// sequences of up to 800 versions that rise, fall and repeat values; thresholds drawn among the
// KLs (ties) and between them.
func TestLapseVersionsAgainstEveryVersion(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	var exact, unknown int
	for trial := range 60 {
		var residents, joiners []float64
		for range 1 + rng.IntN(12) {
			residents = append(residents, rng.Float64()*0.5)
		}
		for range 6 {
			joiners = append(joiners, rng.Float64()*0.5)
		}
		m := &memKL{entries: map[uint64]klEntry{}}
		kls := []float64{0}
		n := 1 + rng.IntN(800)
		for v := 1; v < n; v++ {
			prev := kls[v-1]
			kl := prev
			switch r := rng.Float64(); {
			case r < 0.1:
				kl = kls[rng.IntN(len(kls))] // a value seen before
			case r < 0.4:
				kl = max(0, kl-rng.Float64()*0.03)
			default:
				kl += rng.Float64() * 0.02
			}
			kls = append(kls, kl)
			lapsed := slices.ContainsFunc(residents, func(th float64) bool { return prev <= th && kl > th })
			if err := advance(m, uint64(v-1), prev, uint64(v), kl, lapsed); err != nil {
				t.Fatal(err)
			}
			checkMemShape(t, m, kl)
			for i, th := range append(slices.Clone(residents), joiners...) {
				want, isLapsed, known := bruteSince(kls, th)
				chain, err := readChain(m)
				if err != nil {
					t.Fatal(err)
				}
				got, ok := lapseVersion(chain, kl, func(k float64) bool { return k <= th })
				switch {
				case !isLapsed && ok:
					t.Fatalf("trial %d version %d threshold %v: the bound holds now, the history says lapsed since %d", trial, v, th, got)
				case ok && (!known || got != want):
					t.Fatalf("trial %d version %d threshold %v: the history says lapsed since %d, every version says %d (known %v)", trial, v, th, got, want, known)
				case isLapsed && known && !ok && i < len(residents):
					t.Fatalf("trial %d version %d: a resident CE (threshold %v) lapsed since %d, the history says it does not know", trial, v, th, want)
				case isLapsed && ok:
					exact++
				case isLapsed:
					unknown++
				}
			}
		}
	}
	t.Logf("%d lapse versions answered, %d unknown (CEs stored after they lapsed)", exact, unknown)
	if exact == 0 || unknown == 0 {
		t.Fatal("the sequences must give both answered and unknown lapse versions for the test to mean anything")
	}
}

// checkMemShape holds a history to what Verify checks: each link names a stored entry, entries'
// KLs rise toward the tail and stay below it, and no entry is left unreached.
func checkMemShape(t *testing.T, m *memKL, tail float64) {
	t.Helper()
	h, upper, reached := m.h, tail, 0
	for h.hasPrev {
		e, ok := m.entries[h.prev]
		if !ok || e.kl >= upper || e.hasPrev && e.prevNext > h.prev {
			t.Fatalf("entry at version %d (%+v, stored %v) under KL %v", h.prev, e, ok, upper)
		}
		reached++
		upper, h = e.kl, e.klLink
	}
	if reached != len(m.entries) {
		t.Fatalf("%d entries, %d reached from the head", len(m.entries), reached)
	}
}

// ledgerHolding opens a ledger whose posterior is m0 = testModel(4) and stores the CEs mk makes
// under it.
func ledgerHolding(t *testing.T, mk func(m0 *bnn.Model) []*CE) (*Ledger, string, *bnn.Model, []*CE) {
	t.Helper()
	l, dir := openTest(t, Options{Policy: testPolicy()})
	m0 := testModel(4)
	install(t, l, m0)
	ces := mk(m0)
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	return l, dir, m0, ces
}

// driftBy commits drift(·, d) from cur for each d in turn, and returns the last posterior.
func driftBy(t testing.TB, l *Ledger, cur *bnn.Model, ds ...float64) *bnn.Model {
	t.Helper()
	for _, d := range ds {
		cur = drift(cur, d)
		if _, _, err := l.Commit(bg, &Checkpoint{Model: cur}); err != nil {
			t.Fatal(err)
		}
	}
	return cur
}

// plainCEs are n CEs under m as newCE makes them.
func plainCEs(t *testing.T, m *bnn.Model, rng *rand.Rand, n int) []*CE {
	var ces []*CE
	for range n {
		ces = append(ces, newCE(t, m, rng))
	}
	return ces
}

// spreadCEs are n CEs under m whose certificates' bounds fail at KLs from 1e-3 to 0.1 (Theorem
// 1: epsilon 1/4 leaves Theorem 2 no ceiling to pass), each in its delta-safe set.
func spreadCEs(t testing.TB, m *bnn.Model, rng *rand.Rand, n int) []*CE {
	var ces []*CE
	for i := range n {
		ce := newCE(t, m, rng)
		ce.P1 = 0.62 + 0.37*float64(i)/float64(n-1)
		ce.Delta, ce.Epsilon = 1-ce.P1+0.001, 0.25
		ces = append(ces, ce)
	}
	return ces
}

// The lapse version a CE's read gives (renewal_pending_since) is the version after the last
// posterior at which its own bound held, by KL(q_v || q_anchor) computed directly at every
// version of a drift that goes and comes back; it is the same after a reopen, and Verify accepts
// the file.
func TestRenewalPendingSinceIsTheVersionTheBoundFailed(t *testing.T) {
	l, dir, m0, ces := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return spreadCEs(t, m0, rand.New(rand.NewPCG(12, 12)), 40) })
	pol := l.Policy()
	steps := []float64{-0.005, -0.004, 0.003, -0.007, -0.003, 0.006, -0.012, -0.006, 0.002, -0.008, -0.006, -0.01}
	kls := []float64{0} // by version - m0.Version
	cur := m0
	seen := map[uint64]int{}
	check := func(l *Ledger) {
		t.Helper()
		listed, err := l.List(0, 1000, "")
		if err != nil {
			t.Fatal(err)
		}
		byID := map[string]*CE{}
		for _, ce := range listed {
			byID[ce.ID] = ce
		}
		for _, ce := range ces {
			got, err := l.Get(ce.ID)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got.RenewalPendingSince, byID[ce.ID].RenewalPendingSince) {
				t.Fatalf("%s: renewal_pending_since %v by Get, %v by List", ce.ID, got.RenewalPendingSince, byID[ce.ID].RenewalPendingSince)
			}
			threshold := -1.0 // the largest KL at which this CE's bound holds, among those seen
			for _, k := range kls {
				if pol.Bounds(ce.Certificate(), k).Certified {
					threshold = max(threshold, k)
				}
			}
			want, lapsed, known := bruteSince(kls, threshold)
			switch {
			case got.Status != certify.Certified:
				t.Fatalf("%s is %v; Commit without Confirm keeps certificates", ce.ID, got.Status)
			case got.RenewalPending != lapsed:
				t.Fatalf("version %d: %s renewal_pending %v, its bound at every version says lapsed %v", cur.Version, ce.ID, got.RenewalPending, lapsed)
			case !lapsed && got.RenewalPendingSince != nil:
				t.Fatalf("version %d: %s holds, yet renewal_pending_since %d", cur.Version, ce.ID, *got.RenewalPendingSince)
			case lapsed && (!known || got.RenewalPendingSince == nil || *got.RenewalPendingSince != m0.Version+want):
				t.Fatalf("version %d: %s renewal_pending_since %v, its bound at every version says %d", cur.Version, ce.ID, got.RenewalPendingSince, m0.Version+want)
			case lapsed:
				seen[*got.RenewalPendingSince]++
			}
		}
	}
	for _, d := range steps {
		cur = drift(cur, d)
		if _, _, err := l.Commit(bg, &Checkpoint{Model: cur}); err != nil {
			t.Fatal(err)
		}
		kl, _, err := certify.KL(cur, m0)
		if err != nil {
			t.Fatal(err)
		}
		kls = append(kls, kl)
		check(l)
	}
	t.Logf("lapse versions seen: %v", seen)
	if len(seen) < 3 {
		t.Fatalf("lapse versions seen %v: the drift must lapse CEs at three versions or more for the test to mean anything", seen)
	}
	l = reopen(t, l, dir)
	check(l)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := Verify(filepath.Join(dir, FileName)); err != nil {
		t.Fatalf("Verify: %v", err)
	}
}

// A damaged history (a head or an entry that does not decode, entries out of order) fails Verify,
// naming the bucket and the anchor; Open deletes that history, names it at ERROR, and the CEs
// under it lose their lapse version (unknown, never a wrong one) until it starts again. Verify
// accepts the file after.
func TestDamagedAnchorKLHistoryIsDeletedAtOpen(t *testing.T) {
	for _, tc := range []struct {
		name, level, reason string
		spoil               func(t *testing.T, l *Ledger, anchor uint64)
	}{
		{"damaged head", "ERROR", "checksum mismatch or not a head", func(t *testing.T, l *Ledger, anchor uint64) {
			damageValue(t, l, bAnchorKL, string(headKey(anchor)))
		}},
		{"damaged entry", "ERROR", "checksum mismatch or not an entry", func(t *testing.T, l *Ledger, anchor uint64) {
			var key []byte
			l.view(func(tx *bolt.Tx) error {
				h, _, _ := bucketKL{tx.Bucket(bAnchorKL), anchor}.head()
				key = entryKey(h.prev, anchor)
				return nil
			})
			damageValue(t, l, bAnchorKL, string(key))
		}},
		{"broken order", "ERROR", "not below", func(t *testing.T, l *Ledger, anchor uint64) {
			err := l.update(func(tx *bolt.Tx) error {
				a, _, _ := readAnchor(tx, anchor)
				s := bucketKL{tx.Bucket(bAnchorKL), anchor}
				h, _, _ := s.head()
				e, _, _ := s.entry(h.prev)
				e.kl = a.kl + 1
				return s.putEntry(h.prev, e)
			})
			if err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, dir, m0, ces := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return plainCEs(t, m0, rand.New(rand.NewPCG(13, 13)), 20) })
			cur := driftBy(t, l, m0, -0.005, -0.005, -0.005, -0.005)
			lapsed := 0
			for _, ce := range ces {
				if got, _ := l.Get(ce.ID); got.RenewalPendingSince != nil {
					lapsed++
				}
			}
			if lapsed == 0 {
				t.Fatal("no CE has a lapse version: the drift must lapse some for the test to mean anything")
			}
			// A head of an anchor that is not stored (a build without the bucket released it) is
			// deleted at Open, counted at WARN, and accepted by Verify.
			err := l.update(func(tx *bolt.Tx) error {
				return bucketKL{tx.Bucket(bAnchorKL), m0.Version + 1000}.putHead(klLink{gapMin: 1, hasGap: true})
			})
			if err != nil {
				t.Fatal(err)
			}
			tc.spoil(t, l, m0.Version)
			l.Close()
			path := filepath.Join(dir, FileName)
			_, err = Verify(path)
			want := fmt.Sprintf("%s history of anchor %d", bAnchorKL, m0.Version)
			var ce *CorruptError
			if !errors.As(err, &ce) || !strings.Contains(err.Error(), want) {
				t.Fatalf("Verify: %v; want a corrupt ledger naming %q", err, want)
			}
			var logs bytes.Buffer
			l, err = Open(dir, Options{Policy: testPolicy(), Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			if line := logLine(logs.String(), "anchor="+fmt.Sprint(m0.Version)); !strings.Contains(line, "level="+tc.level) ||
				!strings.Contains(line, tc.reason) || !strings.Contains(line, "bucket="+string(bAnchorKL)) {
				t.Fatalf("Open logged %q; want a %s line naming the bucket, the anchor and %q", line, tc.level, tc.reason)
			}
			if line := logLine(logs.String(), "no stored anchor's history reaches"); !strings.Contains(line, "level=WARN") || !strings.Contains(line, "records=1") {
				t.Fatalf("Open logged %q; want a WARN line counting the one stray record", line)
			}
			for _, c := range ces {
				if got, _ := l.Get(c.ID); got.RenewalPendingSince != nil {
					t.Fatalf("%s: renewal_pending_since %d from a deleted history", c.ID, *got.RenewalPendingSince)
				}
			}
			// The next update starts the history again; Verify accepts the file.
			if _, _, err := l.Commit(bg, &Checkpoint{Model: drift(cur, 0.001)}); err != nil {
				t.Fatal(err)
			}
			l.Close()
			if _, err := Verify(path); err != nil {
				t.Fatalf("Verify after the repair: %v", err)
			}
		})
	}
}

// logLine is the first line of logs that contains s ("" when none).
func logLine(logs, s string) string {
	for line := range strings.Lines(logs) {
		if strings.Contains(line, s) {
			return line
		}
	}
	return ""
}

// A snapshot anchor (CEs registered, or restored, under a past posterior) gets a history from
// the past posteriors that run without a gap to the current one: with every version, each CE's
// certificate has the lapse version a ledger that held it all along gives; with a gap, the same
// or none.
func TestSnapshotAnchorGetsThePastHistory(t *testing.T) {
	owner, _, m0, ces := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return spreadCEs(t, m0, rand.New(rand.NewPCG(14, 14)), 30) })
	past := map[uint64]*bnn.Model{m0.Version: m0}
	cur := m0
	for _, d := range []float64{-0.005, -0.004, 0.003, -0.007, -0.003, 0.006, -0.012, -0.006} {
		cur = drift(cur, d)
		past[cur.Version] = cur
		if _, _, err := owner.Commit(bg, &Checkpoint{Model: cur}); err != nil {
			t.Fatal(err)
		}
	}
	// The lapse version each ledger's history gives a CE's certificate under anchor m0 (the new
	// owner judges a registration whose bound fails at_risk: its status then says nothing).
	since := func(l *Ledger, ce *CE) *uint64 {
		var out *uint64
		l.view(func(tx *bolt.Tx) error {
			a, _, err := readAnchor(tx, m0.Version)
			if err != nil {
				t.Fatal(err)
			}
			if v, ok := failingSince(tx, l.Policy(), ce.Certificate(), m0.Version, a, nil); ok {
				out = &v
			}
			return nil
		})
		return out
	}
	for _, tc := range []struct {
		name  string
		drop  []uint64 // versions missing from past
		exact bool
	}{
		{"every version", nil, true},
		{"a gap", []uint64{m0.Version + 6}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			given := maps.Clone(past)
			delete(given, cur.Version)
			for _, v := range tc.drop {
				delete(given, v)
			}
			next, _ := openTest(t, Options{Policy: testPolicy()})
			install(t, next, cur)
			var again []*CE
			for _, ce := range ces {
				c := *ce
				again = append(again, &c)
			}
			if _, err := next.PutPast(bg, again, given); err != nil {
				t.Fatal(err)
			}
			same, absent := 0, 0
			for _, ce := range ces {
				want, got := since(owner, ce), since(next, ce)
				switch {
				case want == nil && got == nil:
				case got == nil && !tc.exact:
					absent++
				case want == nil || got == nil || *want != *got:
					t.Fatalf("%s: lapse version %v at the owner, %v at the new one", ce.ID, ptrU64(want), ptrU64(got))
				default:
					same++
				}
			}
			t.Logf("%d lapse versions the same, %d not known at the new owner", same, absent)
			if same == 0 || !tc.exact && absent == 0 {
				t.Fatal("the drift must give lapse versions both sides know (and, with a gap, some the new owner does not)")
			}
		})
	}
}

func ptrU64(p *uint64) string {
	if p == nil {
		return "none"
	}
	return fmt.Sprint(*p)
}

// recordAnchorKL keeps in the bucket the history advance keeps in memory, over random KL
// sequences with lapses, and the bucket's history passes the checks Verify makes at every
// version; failingSince reads from it what lapseVersion reads from memory.
func TestRecordAnchorKLKeepsWhatMemoryKeeps(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	rng := rand.New(rand.NewPCG(5, 6))
	pol := l.Policy()
	for trial := range 4 {
		anchor := uint64(trial * 3)
		m := &memKL{entries: map[uint64]klEntry{}}
		err := l.update(func(tx *bolt.Tx) error {
			b, err := tx.CreateBucketIfNotExists(bAnchorKL)
			if err != nil {
				return err
			}
			kl := 0.0
			for v := anchor + 1; v < anchor+300; v++ {
				prev := kl
				kl = max(0, kl+(rng.Float64()-0.35)*0.004)
				lapsed := rng.IntN(4) == 0 && kl > prev
				if err := advance(m, v-1, prev, v, kl, lapsed); err != nil {
					return err
				}
				if err := recordAnchorKL(b, anchor, v-1, prev, v, kl, lapsed); err != nil {
					return err
				}
				s := bucketKL{b, anchor}
				h, _, err := s.head()
				if err != nil || h != m.h {
					return fmt.Errorf("version %d: head %+v in the bucket (%v), %+v in memory", v, h, err, m.h)
				}
				for u, e := range m.entries {
					if got, ok, err := s.entry(u); err != nil || !ok || got != e {
						return fmt.Errorf("version %d: entry %d is %+v in the bucket (%v %v), %+v in memory", v, u, got, ok, err, e)
					}
				}
				a := anchorMeta{kl: kl, klVersion: v}
				if why := historyDamage(s, a, map[string]bool{}); why != "" {
					return fmt.Errorf("version %d: %s", v, why)
				}
				cert := certify.Certificate{P1: 0.55 + 0.45*rng.Float64(), Samples: 4000, Delta: 0.5, Epsilon: 0.25}
				holds := func(k float64) bool { return pol.Bounds(cert, k).Certified }
				s1, ok1 := failingSince(tx, pol, cert, anchor, a, nil)
				if s3, ok3 := failingSince(tx, pol, cert, anchor, a, &klReads{}); s3 != s1 || ok3 != ok1 {
					return fmt.Errorf("version %d: failingSince %d %v, through a list's reads %d %v", v, s1, ok1, s3, ok3)
				}
				chain, err := readChain(m)
				if err != nil {
					return err
				}
				if s2, ok2 := lapseVersion(chain, kl, holds); s1 != s2 || ok1 != ok2 {
					return fmt.Errorf("version %d: failingSince %d %v, in memory %d %v", v, s1, ok1, s2, ok2)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("anchor %d: %v", anchor, err)
		}
	}
}

// A history damaged while the ledger runs does not stop the commits: the next commit starts it
// again at its tail (its CEs' lapse versions become unknown), and Verify accepts the file after.
func TestDamagedHistoryDoesNotStopCommits(t *testing.T) {
	l, dir, m0, ces := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return plainCEs(t, m0, rand.New(rand.NewPCG(15, 15)), 10) })
	cur := driftBy(t, l, m0, -0.005) // every certificate lapses: an entry at m0's version
	if got, _ := l.Get(ces[0].ID); got.RenewalPendingSince == nil {
		t.Fatal("no lapse version before the damage: the test shows nothing")
	}
	damageValue(t, l, bAnchorKL, string(entryKey(m0.Version, m0.Version)))
	if got, _ := l.Get(ces[0].ID); got.RenewalPendingSince != nil {
		t.Fatalf("a lapse version %d read through a damaged entry", *got.RenewalPendingSince)
	}
	cur = drift(cur, 0.002) // KL falls: advancing walks the damaged entry
	if _, _, err := l.Commit(bg, &Checkpoint{Model: cur}); err != nil {
		t.Fatalf("a commit over a damaged history: %v", err)
	}
	if got, _ := l.Get(ces[0].ID); got.RenewalPendingSince != nil {
		t.Fatalf("a lapse version %d after the history started again", *got.RenewalPendingSince)
	}
	l.Close()
	if _, err := Verify(filepath.Join(dir, FileName)); err != nil {
		t.Fatalf("Verify: %v", err)
	}
}

// A verdict that ends a lapsed certificate names the version since which its bound had failed
// (StatusChange.LapsedSince, for the status_changed event): the CE's renewal_pending_since before
// the verdict, for CEs that lapsed at different versions before a drift gave them verdicts.
func TestVerdictOnALapsedCertificateNamesItsLapseVersion(t *testing.T) {
	l, _, m0, ces := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return spreadCEs(t, m0, rand.New(rand.NewPCG(16, 16)), 30) })
	cur := driftBy(t, l, m0, -0.005, -0.004, -0.007, -4) // lapses at several versions, then a drift
	before := map[string]*uint64{}
	for _, ce := range ces {
		got, err := l.Get(ce.ID)
		if err != nil {
			t.Fatal(err)
		}
		before[ce.ID] = got.RenewalPendingSince
	}
	verdicts, versions := 0, map[uint64]bool{}
	for _, ch := range confirmAll(t, l, cur, 300, 1) {
		if ch.From != certify.Certified || ch.To == certify.Certified {
			if ch.LapsedSince != nil {
				t.Fatalf("%s %v -> %v names a lapse version %d", ch.ID, ch.From, ch.To, *ch.LapsedSince)
			}
			continue
		}
		verdicts++
		if want := before[ch.ID]; !reflect.DeepEqual(ch.LapsedSince, want) {
			t.Fatalf("%s: the verdict names lapse version %s, the CE said %s before it", ch.ID, ptrU64(ch.LapsedSince), ptrU64(want))
		}
		if ch.LapsedSince != nil {
			versions[*ch.LapsedSince] = true
		}
	}
	t.Logf("%d verdicts on lapsed certificates, lapse versions %v", verdicts, versions)
	if len(versions) < 2 {
		t.Fatal("the verdicts must end certificates that lapsed at two versions or more for the test to mean anything")
	}
}

// measureDue gives every CE of l that is due for a measurement at a version past holds its
// measurement under that version (DueLane, ConfirmDue), with S = 300 draws seeded by the
// version, until none is due; it returns how many it measured, and how many of those were of an
// at_risk or invalidated CE (a verdict measured again).
func measureDue(t testing.TB, l *Ledger, past map[uint64]*bnn.Model) (n, again int) {
	t.Helper()
	for range 100 {
		byVersion, more, err := l.DueLane(1000, 0, 1, pastOf(past), func(u uint64) bool { return past[u] != nil })
		if err != nil {
			t.Fatal(err)
		}
		if more {
			t.Fatal("more than 1,000 CEs due: the test holds fewer")
		}
		if len(byVersion) == 0 {
			return n, again
		}
		for _, u := range slices.Sorted(maps.Keys(byVersion)) {
			ids := byVersion[u]
			for _, id := range ids {
				if ce, err := l.Get(string(id)); err != nil {
					t.Fatal(err)
				} else if ce.Status != certify.Certified {
					again++
				}
			}
			rep, _, err := l.ConfirmDue(bg, posteriorPredictor{NewModelPredictor(past[u], 300, u)}, ids, pastOf(past))
			if err != nil {
				t.Fatal(err)
			}
			if rep.Picked != len(ids) || rep.Confirmed != len(ids) {
				t.Fatalf("due version %d: %d CEs, %+v", u, len(ids), rep)
			}
			n += rep.Confirmed
		}
	}
	t.Fatal("CEs still due after 100 rounds")
	return n, again
}

// A CE due for a measurement (a certificate whose bound lapsed, a verdict that stopped carrying)
// is measured under the version it became due at, whenever that is done: a ledger measured after
// every commit and one measured once, after the last, make the same measurements and give every
// CE the same outcome (status, verdict version, anchor, p1), along whole chains of them: a
// certificate that lapses gets a verdict or a renewal at its lapse version, a verdict that stops
// carrying is measured again at that version, a renewed certificate that lapses again is
// measured at its new lapse version. Measured under the newest posterior instead, as the
// confirmer does with a CE whose due version it does not know, the late ledger's outcomes
// differ.
func TestDueMeasurementsAreAFunctionOfTheLog(t *testing.T) {
	d := driveTwo(t, -0.005, -0.004, -0.007, -0.01, -0.03, -0.05, -0.1, -0.2, -0.01, -0.005)
	timely, late, m0, cur, ces, past := d.timely, d.late, d.m0, d.cur, d.ces, d.past
	if n, a := measureDue(t, late, past); n != d.measured || a != d.again {
		t.Fatalf("the late ledger made %d measurements, %d of verdicts; the timely one %d, %d", n, a, d.measured, d.again)
	}
	measured, again := d.measured, d.again
	newest, _, _, _ := ledgerHolding(t, sameCEs(t))
	for v := m0.Version + 1; v <= cur.Version; v++ {
		if _, _, err := newest.Commit(bg, &Checkpoint{Model: past[v]}); err != nil {
			t.Fatal(err)
		}
	}
	confirmBatches(t, newest, cur, 300, cur.Version, 1000)
	type outcome struct {
		status    certify.Status
		confirmed string
		anchor    uint64
		p1        float64
	}
	of := func(l *Ledger, id string) outcome {
		ce, err := l.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		return outcome{ce.Status, ptrU64(ce.ConfirmedVersion), ce.AnchorVersion, ce.P1}
	}
	differ := 0
	for _, ce := range ces {
		a, b := of(timely, ce.ID), of(late, ce.ID)
		if a != b {
			t.Fatalf("%s: measured after every commit %+v, once at the end %+v", ce.ID, a, b)
		}
		// Every decided verdict that stopped carrying was measured again at that version.
		got, err := late.Get(ce.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.VerdictBound != nil && got.VerdictPending {
			t.Errorf("%s: its verdict under version %s decided, does not carry to %d, and was not measured again", ce.ID, a.confirmed, cur.Version)
		}
		if of(newest, ce.ID) != a {
			differ++
		}
	}
	t.Logf("%d measurements of %d CEs, %d of them of a verdict measured again; measured under the newest posterior, %d of %d outcomes differ",
		measured, len(ces), again, differ, len(ces))
	if measured < len(ces)+10 || again < 10 {
		t.Fatal("the drift must take ten CEs or more through a second measurement, and ten verdicts, for the test to mean anything")
	}
	if differ == 0 {
		t.Fatal("measuring under the newest posterior gives the same outcomes: the test cannot tell the two apart")
	}
}

// ConfirmDue measures only the certificates that lapsed at its predictor's version, and
// ConfirmLaneLeaving leaves the lapsed certificates whose lapse version leave names to it and
// picks the others.
func TestConfirmLaneLeavesLapsedCertificatesToTheirVersion(t *testing.T) {
	l, _, m0, _ := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return spreadCEs(t, m0, rand.New(rand.NewPCG(16, 16)), 40) })
	cur := driftBy(t, l, m0, -0.005, -0.004, -0.007, -0.01, -0.03)
	byVersion, _, err := l.DueLane(1000, 0, 1, nil, func(uint64) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	if len(byVersion) < 2 {
		t.Fatalf("lapse versions %v: the drift must lapse certificates at two versions or more", slices.Sorted(maps.Keys(byVersion)))
	}
	lapsed := 0
	for _, ids := range byVersion {
		lapsed += len(ids)
	}
	// ConfirmDue measures only the certificates that lapsed at its predictor's version.
	past := map[uint64]*bnn.Model{m0.Version: m0}
	for m := m0; m.Version < cur.Version; {
		m = drift(m, []float64{-0.005, -0.004, -0.007, -0.01, -0.03}[m.Version])
		past[m.Version] = m
	}
	us := slices.Sorted(maps.Keys(byVersion))
	for _, tc := range []struct {
		ids  [][]byte
		want int
	}{
		{byVersion[us[0]], 0},
		{slices.Concat(byVersion[us[0]], byVersion[us[1]]), len(byVersion[us[1]])},
	} {
		rep, _, err := l.ConfirmDue(bg, posteriorPredictor{NewModelPredictor(past[us[1]], 300, 1)}, tc.ids, nil)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Picked != tc.want {
			t.Fatalf("ConfirmDue at version %d of %d certificates picked %d, want the %d that lapsed at it", us[1], len(tc.ids), rep.Picked, tc.want)
		}
	}
	p := NewModelPredictor(cur, 300, 1)
	last := cur.Version
	for _, tc := range []struct {
		name  string
		leave func(uint64) bool
		want  int
	}{
		{"every version left", func(uint64) bool { return true }, 0},
		{"the last version left", func(u uint64) bool { return u == last }, lapsed - len(byVersion[last])},
		{"none left", nil, lapsed},
	} {
		l, _, m0, _ := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return spreadCEs(t, m0, rand.New(rand.NewPCG(16, 16)), 40) })
		driftBy(t, l, m0, -0.005, -0.004, -0.007, -0.01, -0.03)
		rep, _, err := l.ConfirmLaneLeaving(bg, p, 1000, 0, 1, nil, tc.leave)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Picked != tc.want {
			t.Errorf("%s: picked %d of %d lapsed certificates, want %d", tc.name, rep.Picked, lapsed, tc.want)
		}
	}
}

// pastOf is a Past over the posteriors of m.
func pastOf(m map[uint64]*bnn.Model) Past { return func(v uint64) *bnn.Model { return m[v] } }

// sameCEs makes the 40 CEs of spreadCEs with ids of their own, ce-00 to ce-39, so that ledgers
// that hold them hold the same CEs.
func sameCEs(t *testing.T) func(m0 *bnn.Model) []*CE {
	return func(m0 *bnn.Model) []*CE {
		ces := spreadCEs(t, m0, rand.New(rand.NewPCG(16, 16)), 40)
		for i, ce := range ces {
			ce.ID = fmt.Sprintf("ce-%02d", i)
		}
		return ces
	}
}

// twoLedgers are two ledgers that hold the same CEs (sameCEs) and committed the same drift:
// timely had every CE due at a version past holds measured after each commit (measureDue, which
// made measured measurements, again of them of verdicts), late none yet.
type twoLedgers struct {
	timely, late    *Ledger
	m0, cur         *bnn.Model
	ces             []*CE
	past            map[uint64]*bnn.Model
	measured, again int
}

// driveTwo commits drift(·, d) from testModel(4) for each d in turn to two ledgers holding the
// same CEs, measuring the timely one's due CEs after each commit.
func driveTwo(t *testing.T, ds ...float64) twoLedgers {
	t.Helper()
	var d twoLedgers
	d.timely, _, d.m0, d.ces = ledgerHolding(t, sameCEs(t))
	d.late, _, _, _ = ledgerHolding(t, sameCEs(t))
	d.past, d.cur = map[uint64]*bnn.Model{d.m0.Version: d.m0}, d.m0
	for _, step := range ds {
		prev := d.cur
		d.cur = driftBy(t, d.timely, prev, step)
		driftBy(t, d.late, prev, step)
		d.past[d.cur.Version] = d.cur
		n, a := measureDue(t, d.timely, d.past)
		d.measured, d.again = d.measured+n, d.again+a
	}
	return d
}

// getCE is l.Get(id), failing the test on an error.
func getCE(t *testing.T, l *Ledger, id string) *CE {
	t.Helper()
	ce, err := l.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	return ce
}
