package ledger

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"path/filepath"
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

// The history answers, for every threshold, what a scan of every version's KL answers: the
// version after the last one at which the bound held. Sequences of up to 2,500 versions (past
// the horizon of anchorKLHorizon) that rise, fall and repeat values; thresholds drawn among the
// KLs themselves (ties) and between them. Past the horizon an answer may be unknown, never wrong.
func TestAnchorKLHistoryAnswersAsEveryVersion(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	unknown := 0
	for trial := range 40 {
		n := 1 + rng.IntN(2500)
		var kls []float64
		var pts []klPoint
		kl := 0.0
		for v := range n {
			switch r := rng.Float64(); {
			case r < 0.1 && v > 0:
				kl = kls[rng.IntN(len(kls))] // a value seen before
			case r < 0.35:
				kl = max(0, kl-rng.Float64()*0.05)
			default:
				kl += rng.Float64() * 0.03
			}
			if v == 0 {
				kl = 0
			}
			kls = append(kls, kl)
			pts = appendKL(pts, uint64(v), kl)
			checkHistoryShape(t, pts, uint64(v))
			for q := range 8 {
				threshold := kls[rng.IntN(len(kls))]
				if q%2 == 1 {
					threshold += (rng.Float64() - 0.5) * 0.02
				}
				want, lapsed, known := bruteSince(kls, threshold)
				got, ok := lapsedSince(pts, func(k float64) bool { return k <= threshold })
				switch {
				case !lapsed:
					if ok {
						t.Fatalf("trial %d version %d threshold %v: the bound holds now, history says lapsed since %d", trial, v, threshold, got)
					}
				case ok && (!known || got != want):
					t.Fatalf("trial %d version %d threshold %v: history says lapsed since %d, every version says %d (known %v)",
						trial, v, threshold, got, want, known)
				case !ok && known && want > pts[0].version:
					t.Fatalf("trial %d version %d threshold %v: history knows no lapse version, every version says %d (oldest kept %d)",
						trial, v, threshold, want, pts[0].version)
				case !ok:
					unknown++
				}
			}
		}
	}
	if unknown == 0 {
		t.Fatal("no threshold fell below the history's oldest entry: the horizon is not exercised")
	}
}

// checkHistoryShape holds pts to the shape appendKL promises: KL rising, each entry's next
// version after it and at or before the next entry's, the newest at `newest` with none, the
// oldest within the horizon.
func checkHistoryShape(t *testing.T, pts []klPoint, newest uint64) {
	t.Helper()
	tail := pts[len(pts)-1]
	switch {
	case tail.version != newest || tail.next != 0:
		t.Fatalf("newest entry %+v of %d, at version %d", tail, len(pts), newest)
	case newest >= anchorKLHorizon && pts[0].version < newest-anchorKLHorizon:
		t.Fatalf("oldest entry at version %d, past the horizon of %d", pts[0].version, newest)
	}
	for i := range len(pts) - 1 {
		if p, q := pts[i], pts[i+1]; p.kl >= q.kl || p.next <= p.version || p.next > q.version {
			t.Fatalf("entries %+v and %+v out of order", p, q)
		}
	}
}

// The lapse version a CE's read gives (renewal_pending_since) is the version after the last
// posterior at which its own bound held, by KL(q_v || q_anchor) computed directly at every
// version of a drift that goes and comes back; it is the same after a reopen, and Verify accepts
// the file.
func TestRenewalPendingSinceIsTheVersionTheBoundFailed(t *testing.T) {
	l, dir := openTest(t, Options{Policy: testPolicy()})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(12, 12))
	var ces []*CE
	for i := range 40 {
		ce := newCE(t, m0, rng)
		// Certificates whose bounds fail at KLs from 1e-3 to 0.1 (Theorem 1: epsilon 1/4 leaves
		// Theorem 2 no ceiling to pass), each in its delta-safe set.
		ce.P1 = 0.62 + 0.37*float64(i)/39
		ce.Delta, ce.Epsilon = 1-ce.P1+0.001, 0.25
		ces = append(ces, ce)
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	pol := l.Policy()
	steps := []float64{-0.005, -0.004, 0.003, -0.007, -0.003, 0.006, -0.012, -0.006, 0.002, -0.008, -0.006, -0.01}
	kls := []float64{0} // by version - m0.Version
	cur := m0
	seen := map[uint64]int{}
	check := func(l *Ledger) {
		t.Helper()
		for _, ce := range ces {
			got, err := l.Get(ce.ID)
			if err != nil {
				t.Fatal(err)
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

// A damaged history (an entry that does not decode, or entries out of order) fails Verify,
// naming the bucket and the anchor; Open deletes that history, names it at ERROR, and the CEs
// under it lose their lapse version (unknown, never a wrong one) until it starts again. Verify
// accepts the file after.
func TestDamagedAnchorKLHistoryIsDeletedAtOpen(t *testing.T) {
	for _, tc := range []struct {
		name, level, reason string
		spoil               func(t *testing.T, l *Ledger, anchor uint64)
	}{
		{"damaged entry", "ERROR", damagedEntry, func(t *testing.T, l *Ledger, anchor uint64) {
			var key []byte
			l.view(func(tx *bolt.Tx) error {
				a, _, _ := readAnchor(tx, anchor)
				key = anchorKLKey(a.klVersion, anchor)
				return nil
			})
			damageValue(t, l, bAnchorKL, string(key))
		}},
		{"broken order", "ERROR", "out of order", func(t *testing.T, l *Ledger, anchor uint64) {
			err := l.update(func(tx *bolt.Tx) error {
				a, _, _ := readAnchor(tx, anchor)
				b := tx.Bucket(bAnchorKL)
				e, _ := getAnchorKL(b, a.klVersion, anchor)
				p, _ := getAnchorKL(b, e.prev, anchor)
				p.kl = e.kl + 1
				return putSealed(b, anchorKLKey(e.prev, anchor), p.encode())
			})
			if err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, dir := openTest(t, Options{Policy: testPolicy()})
			m0 := testModel(4)
			install(t, l, m0)
			rng := rand.New(rand.NewPCG(13, 13))
			var ces []*CE
			for range 20 {
				ces = append(ces, newCE(t, m0, rng))
			}
			if err := l.Put(bg, ces...); err != nil {
				t.Fatal(err)
			}
			cur := m0
			for range 4 {
				cur = drift(cur, -0.005)
				if _, _, err := l.Commit(bg, &Checkpoint{Model: cur}); err != nil {
					t.Fatal(err)
				}
			}
			lapsed := 0
			for _, ce := range ces {
				if got, _ := l.Get(ce.ID); got.RenewalPendingSince != nil {
					lapsed++
				}
			}
			if lapsed == 0 {
				t.Fatal("no CE has a lapse version: the drift must lapse some for the test to mean anything")
			}
			// A history that starts again (a build without the bucket moved its anchor on)
			// leaves entries no history reaches: deleted at Open, counted at WARN, accepted by
			// Verify.
			err := l.update(func(tx *bolt.Tx) error {
				b := tx.Bucket(bAnchorKL)
				return putSealed(b, anchorKLKey(cur.Version+7, m0.Version+1000), klEntry{kl: 1}.encode())
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
			if line := logLine(logs.String(), "no history reaches"); !strings.Contains(line, "level=WARN") || !strings.Contains(line, "entries=1") {
				t.Fatalf("Open logged %q; want a WARN line counting the one stray entry", line)
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

// A snapshot anchor (a CE registered, or restored, under a past posterior) gets the history an
// owner that held it all along has, from the past posteriors that run without a gap to the
// current one: equal entry for entry to the history of a ledger that committed every version.
func TestSnapshotAnchorGetsThePastHistory(t *testing.T) {
	owner, _ := openTest(t, Options{Policy: testPolicy()})
	m0 := testModel(4)
	install(t, owner, m0)
	rng := rand.New(rand.NewPCG(14, 14))
	if err := owner.Put(bg, newCE(t, m0, rng)); err != nil {
		t.Fatal(err)
	}
	past := map[uint64]*bnn.Model{m0.Version: m0}
	cur := m0
	for _, d := range []float64{-0.002, 0.001, -0.003, -0.001, 0.004} {
		cur = drift(cur, d)
		past[cur.Version] = cur
		if _, _, err := owner.Commit(bg, &Checkpoint{Model: cur}); err != nil {
			t.Fatal(err)
		}
	}
	var want []klPoint
	owner.view(func(tx *bolt.Tx) error { want, _ = anchorKL(tx, m0.Version, cur.Version); return nil })

	for _, tc := range []struct {
		name  string
		drop  []uint64 // versions missing from past
		first uint64   // the oldest version the history can hold
	}{
		{"every version", nil, m0.Version},
		{"a gap", []uint64{m0.Version + 2}, m0.Version + 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			given := map[uint64]*bnn.Model{}
			for v, m := range past {
				if v != cur.Version {
					given[v] = m
				}
			}
			for _, v := range tc.drop {
				delete(given, v)
			}
			next, _ := openTest(t, Options{Policy: testPolicy()})
			install(t, next, cur)
			if _, err := next.PutPast(bg, []*CE{newCE(t, m0, rng)}, given); err != nil {
				t.Fatal(err)
			}
			var got []klPoint
			next.view(func(tx *bolt.Tx) error { got, _ = anchorKL(tx, m0.Version, cur.Version); return nil })
			var expect []klPoint
			for _, p := range want {
				if p.version >= tc.first {
					expect = append(expect, p)
				}
			}
			if fmt.Sprint(got) != fmt.Sprint(expect) {
				t.Fatalf("history of the snapshot anchor\n got %v\nwant %v (the owner's: %v)", got, expect, want)
			}
		})
	}
}

// recordAnchorKL, which reads and writes only the entries a version changes, and
// pruneAnchorKL, which drops what passes the horizon, leave in the bucket exactly the history
// appendKL computes from the whole of it, over sequences that pass the horizon; failingSince
// reads from the bucket what lapsedSince reads from that history.
func TestRecordAnchorKLWritesWhatAppendKLComputes(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	rng := rand.New(rand.NewPCG(5, 6))
	pol := l.Policy()
	cut := 0
	for trial := range 4 {
		anchor := uint64(trial * 3)
		var pts []klPoint
		kl, prev := 0.0, uint64(0)
		err := l.update(func(tx *bolt.Tx) error {
			for v := anchor; v < anchor+anchorKLHorizon+100; v++ {
				if v > anchor {
					rise := 0.1 + 0.3*float64(trial%2) // mostly rising (reaches the horizon), or wandering
					kl = max(0, kl+(rng.Float64()-rise)*0.004)
				}
				pts = appendKL(pts, v, kl)
				if err := recordAnchorKL(tx, anchor, prev, v, kl, v == anchor); err != nil {
					return err
				}
				if err := pruneAnchorKL(tx, v); err != nil {
					return err
				}
				prev = v
				if v%5 == 0 || v+10 > anchor+anchorKLHorizon {
					got, ok := anchorKL(tx, anchor, v)
					if !ok || fmt.Sprint(got) != fmt.Sprint(pts) {
						return fmt.Errorf("version %d: the bucket holds %v, appendKL %v", v, got, pts)
					}
				}
				if pts[0].version > anchor && pts[0].version == v-anchorKLHorizon {
					cut++
				}
				cert := certify.Certificate{P1: 0.55 + 0.45*rng.Float64(), Samples: 4000, Delta: 0.5, Epsilon: 0.25}
				a := anchorMeta{kl: kl, klVersion: v}
				s1, ok1 := failingSince(tx, pol, cert, anchor, a)
				s2, ok2 := lapsedSince(pts, func(k float64) bool { return pol.Bounds(cert, k).Certified })
				if s1 != s2 || ok1 != ok2 {
					return fmt.Errorf("version %d: failingSince %d %v, lapsedSince %d %v", v, s1, ok1, s2, ok2)
				}
			}
			// The next trial's anchor starts at 0 again: this one's history goes.
			return tx.DeleteBucket(bAnchorKL)
		})
		if err != nil {
			t.Fatalf("anchor %d: %v", anchor, err)
		}
	}
	if cut == 0 {
		t.Fatal("no history reached the horizon: pruning is not exercised")
	}
}
