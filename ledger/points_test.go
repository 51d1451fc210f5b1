package ledger

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// pointSet is a Points that knows every point: the versions it holds.
type pointSet []uint64

func (ps pointSet) PointsIn(after, through uint64) ([]uint64, bool) {
	var out []uint64
	for _, p := range ps {
		if p > after && p <= through {
			out = append(out, p)
		}
	}
	return out, true
}

func (ps pointSet) KnownAfter() uint64 { return 0 }

func (ps pointSet) LatestPoint(through uint64) (uint64, bool) {
	var latest uint64
	ok := false
	for _, p := range ps {
		if p <= through {
			latest, ok = p, true
		}
	}
	return latest, ok
}

// measureAtPoints does what a replica's confirmer does (DueAtPoints, then ConfirmAtPoint under
// each point's posterior with draws seeded by the version, after CertifyAgainAtPoints) until no CE
// is due at a point the ledger has reached. It returns the measurements written and those at an
// inexact point.
func measureAtPoints(t *testing.T, l *Ledger, past map[uint64]*bnn.Model, points Points) (measured, inexact int) {
	t.Helper()
	for range 100 {
		due, err := l.DueAtPoints(1000, 0, 1, pastOf(past), points)
		if err != nil {
			t.Fatal(err)
		}
		if due.More {
			t.Fatal("more than 1,000 CEs due: the test holds fewer")
		}
		inexact += due.Inexact
		changes, err := l.CertifyAgainAtPoints(bg, due.Again, pastOf(past), points)
		if err != nil {
			t.Fatal(err)
		}
		wrote := len(changes)
		measured -= len(changes)
		for _, p := range slices.Sorted(maps.Keys(due.Measure)) {
			rep, _, err := l.ConfirmAtPoint(bg, posteriorPredictor{NewModelPredictor(past[p], 300, p)}, due.Measure[p], pastOf(past), points)
			if err != nil {
				t.Fatal(err)
			}
			wrote += rep.Confirmed
			inexact += rep.Inexact
		}
		measured += wrote
		if wrote == 0 {
			return measured, inexact
		}
	}
	t.Fatal("CEs still due after 100 reads")
	return
}

// confirmEveryWaiting measures with Confirm, under q_p with p's draws, every CE that waits under the current
// posterior p: what a ledger that is at version p when p becomes a point does.
func confirmEveryWaiting(t *testing.T, l *Ledger, qp *bnn.Model) int {
	t.Helper()
	n := 0
	for range 100 {
		rep, _, err := l.Confirm(bg, posteriorPredictor{NewModelPredictor(qp, 300, qp.Version)}, 1000)
		if err != nil {
			t.Fatal(err)
		}
		n += rep.Confirmed
		if rep.Confirmed == 0 || !rep.More {
			return n
		}
	}
	t.Fatal("CEs still waiting after 100 rounds")
	return n
}

// timeline is a CE's statuses as its history says: each status change and renewal with the
// version it was made at.
func timeline(t *testing.T, l *Ledger, id string) string {
	t.Helper()
	ce := getCE(t, l, id)
	s := ""
	for _, h := range ce.History {
		s += fmt.Sprintf(" %s>%s@%d", h.From, h.To, h.PosteriorVersion)
	}
	s += fmt.Sprintf(" now %s anchor %d", ce.Status, ce.AnchorVersion)
	if ce.ConfirmedVersion != nil {
		s += fmt.Sprintf(" verdict %d", *ce.ConfirmedVersion)
	}
	return s
}

// TestStatusesAtPointsAreAFunctionOfTheLog: with confirmation points, a CE's statuses do not
// depend on when its owner measures it. Four ledgers hold the same CEs and commit the same drift,
// which goes out and comes back (bounds fail, then hold again):
//
//	reference  at each point, Confirm under it every CE that waits (it is the current posterior)
//	timely     after each commit, what a replica's confirmer does (DueAtPoints, ConfirmAtPoint)
//	late       the same once, after the last commit
//	handover   timely for the first half, then nothing until the end (a new owner that takes
//	           over with a backlog)
//
// Every CE's history, each change and renewal with the version it was made at, is the same in
// all four. When the drift ends back at the CEs' anchor, the late ledgers measure CEs whose bound
// holds again at the current posterior: each is certified again at the first version at which
// its bound held, as the reference's commit of that version did, and counted inexact when the
// reference measured it again at a point before that (here those measurements decided nothing).
func TestStatusesAtPointsAreAFunctionOfTheLog(t *testing.T) {
	out := []float64{-0.01, -0.02, -0.03, -0.04, -0.05, -0.05, -0.06, -0.04, 0.02, 0.05, 0.06, 0.08, 0.07, 0.05, -0.03, -0.06, -0.08, -0.05, 0.04, 0.09}
	for _, tc := range []struct {
		name    string
		ds      []float64
		points  pointSet
		inexact bool
	}{
		{"out and back", out, pointSet{2, 3, 6, 9, 10, 12, 15, 18, 19, 20}, false},
		{"back to the anchor at the end", append(slices.Clone(out), 0.06), pointSet{2, 3, 6, 9, 10, 12, 15, 18, 19, 20, 21}, true},
	} {
		t.Run(tc.name, func(t *testing.T) { statusesAtPoints(t, tc.ds, tc.points, tc.inexact) })
	}
}

func statusesAtPoints(t *testing.T, ds []float64, points pointSet, wantInexact bool) {
	ref, refDir, m0, ces := ledgerHolding(t, sameCEs(t))
	timely, _, _, _ := ledgerHolding(t, sameCEs(t))
	late, lateDir, _, _ := ledgerHolding(t, sameCEs(t))
	handover, _, _, _ := ledgerHolding(t, sameCEs(t))
	past := map[uint64]*bnn.Model{m0.Version: m0}
	cur := m0
	var counts struct{ ref, timely, late, handover, inexact int }
	for i, d := range ds {
		prev := cur
		for _, l := range []*Ledger{ref, timely, late, handover} {
			cur = driftBy(t, l, prev, d)
		}
		past[cur.Version] = cur
		if slices.Contains(points, cur.Version) {
			counts.ref += confirmEveryWaiting(t, ref, cur)
		}
		n, inex := measureAtPoints(t, timely, past, points)
		counts.timely, counts.inexact = counts.timely+n, counts.inexact+inex
		if i < len(ds)/2 {
			n, inex = measureAtPoints(t, handover, past, points)
			counts.handover, counts.inexact = counts.handover+n, counts.inexact+inex
		}
	}
	n, inex := measureAtPoints(t, late, past, points)
	counts.late, counts.inexact = n, counts.inexact+inex
	n, inex = measureAtPoints(t, handover, past, points)
	counts.handover, counts.inexact = counts.handover+n, counts.inexact+inex
	if got := counts.inexact > 0; got != wantInexact {
		t.Errorf("%d measurements counted inexact; want some: %t", counts.inexact, wantInexact)
	}
	changes, restored := 0, 0
	for _, ce := range ces {
		want := timeline(t, ref, ce.ID)
		for name, l := range map[string]*Ledger{"timely": timely, "late": late, "handover": handover} {
			if got := timeline(t, l, ce.ID); got != want {
				t.Errorf("%s: %s:%s\nreference:%s", ce.ID, name, got, want)
			}
		}
		for _, h := range getCE(t, ref, ce.ID).History {
			if h.From != h.To {
				changes++
			}
			if h.To == certify.Certified && h.From != certify.Certified && h.P2 == nil {
				restored++
			}
		}
	}
	t.Logf("measurements: reference %d, timely %d, late %d, handover %d (%d inexact); %d status changes, %d certified again at a commit",
		counts.ref, counts.timely, counts.late, counts.handover, counts.inexact, changes, restored)
	if changes == 0 || restored == 0 || counts.late == 0 {
		t.Fatalf("%d status changes, %d certified again at a commit, %d late measurements: the drift tells nothing", changes, restored, counts.late)
	}
	for _, f := range []struct {
		l   *Ledger
		dir string
	}{{ref, refDir}, {late, lateDir}} {
		if err := f.l.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := Verify(filepath.Join(f.dir, FileName)); err != nil {
			t.Errorf("Verify: %v", err)
		}
	}
}

// TestCertifiedAgainAt: a failing CE measured under version 1, whose bound fails at versions 2 and
// 3 and holds from 4 on, is certified again at 4; exactly so when no point before 4 has it wait
// (its verdict decided nothing: it waits at every point), inexactly when point 3 does.
func TestCertifiedAgainAt(t *testing.T) {
	pol := testPolicy()
	m0 := testModel(4)
	past := map[uint64]*bnn.Model{0: m0}
	cur := m0
	for _, d := range []float64{-0.2, -0.2, 0, 0.4, 0} {
		cur = drift(cur, d)
		past[cur.Version] = cur
	}
	h := header{status: certify.AtRisk, confirmed: true, cv: 1, anchor: 0, p1: 0.9, var1: 0.01, samples: 1000, delta: 0.101, epsilon: 0.25, target: 1}
	for v := uint64(2); v <= 5; v++ {
		kl, _, err := certify.KL(past[v], m0)
		if err != nil {
			t.Fatal(err)
		}
		if holds := pol.Bounds(h.certificate(), kl).Certified; holds != (v >= 4) {
			t.Fatalf("the bound holds at version %d (KL %v): %t; the test wants it from 4 on", v, kl, holds)
		}
	}
	for _, tc := range []struct {
		points pointSet
		exact  bool
	}{{pointSet{5}, true}, {pointSet{4}, true}, {pointSet{3, 5}, false}, {pointSet{2}, false}} {
		d := &pointReads{l: &Ledger{opts: Options{Policy: pol}}, now: 5, past: pastOf(past), points: tc.points, kls: map[[2]uint64]float64{}}
		if x, exact := d.certifiedAgainAt(&h, 1); x != 4 || exact != tc.exact {
			t.Errorf("points %v: certified again at %d, exact %t; want 4, %t", tc.points, x, exact, tc.exact)
		}
	}
}

// steadyPredictor predicts p(yes) = 0.8 with variance 0.01 from 1,000 draws for every input, under
// the posterior m: a decided at_risk verdict whose carry margin no small KL takes away.
type steadyPredictor struct{ m *bnn.Model }

func (p steadyPredictor) Version() uint64       { return p.m.Version }
func (p steadyPredictor) Posterior() *bnn.Model { return p.m }
func (p steadyPredictor) Predict(_ context.Context, X [][]float64) (*bnn.Predictive, error) {
	out := &bnn.Predictive{N: len(X), C: 2, S: 1000}
	for range X {
		out.Mean = append(out.Mean, 0.2, 0.8)
		out.Var = append(out.Var, 0.01, 0.01)
	}
	return out, nil
}

// TestACarriedVerdictWhoseBoundHeldAgainIsCertifiedAgain: a certificate lapses at version 1,
// holds again at 3 and lapses again at 4; points are 2 and 5. A ledger measuring at each point
// as it comes makes it at_risk at 2 (a decided verdict that carries through 5), certifies it again
// at the commit of 3, and makes it at_risk again at 5. A ledger that measures only after the last
// commit finds the same: its verdict at 2 still carries at 5, so only the bound that held again at
// 3 (the candidates of CEs certified again) brings it back to be measured at 5.
func TestACarriedVerdictWhoseBoundHeldAgainIsCertifiedAgain(t *testing.T) {
	pol := testPolicy()
	m0 := testModel(4)
	mk := func() *Ledger {
		l, _ := openTest(t, Options{Policy: pol})
		install(t, l, m0)
		ce := &CE{ID: "ce", X: []float64{0.1, 0.2, 0.3}, XCF: []float64{0.3, 0.2, 0.1}, Target: 1, AnchorVersion: 0, P1: 0.9, Var1: 0.01,
			Samples: 1000, Delta: 0.101, Epsilon: 0.25}
		if err := l.Put(bg, ce); err != nil {
			t.Fatal(err)
		}
		return l
	}
	ref, late := mk(), mk()
	points := pointSet{2, 5}
	past := map[uint64]*bnn.Model{0: m0}
	cur := m0
	for _, d := range []float64{-0.05, 0, 0.05, -0.05, 0} {
		cur = driftBy(t, ref, cur, d)
		driftBy(t, late, past[cur.Version-1], d)
		past[cur.Version] = cur
		if slices.Contains(points, cur.Version) {
			if _, _, err := ref.Confirm(bg, steadyPredictor{cur}, 10); err != nil {
				t.Fatal(err)
			}
		}
	}
	cert := getCE(t, ref, "ce").Certificate()
	for v := uint64(1); v <= 5; v++ {
		kl, _, err := certify.KL(past[v], m0)
		if err != nil {
			t.Fatal(err)
		}
		if holds := pol.Bounds(cert, kl).Certified; holds != (v == 3) {
			t.Fatalf("the bound holds at version %d: %t; the test wants it to hold at 3 alone", v, holds)
		}
	}
	for range 10 {
		due, err := late.DueAtPoints(10, 0, 1, pastOf(past), points)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := late.CertifyAgainAtPoints(bg, due.Again, pastOf(past), points); err != nil {
			t.Fatal(err)
		}
		for p, ids := range due.Measure {
			if _, _, err := late.ConfirmAtPoint(bg, steadyPredictor{past[p]}, ids, pastOf(past), points); err != nil {
				t.Fatal(err)
			}
		}
		if len(due.Again)+len(due.Measure) == 0 {
			break
		}
	}
	want := " certified>at_risk@2 at_risk>certified@3 certified>at_risk@5 now at_risk anchor 0 verdict 5"
	for name, l := range map[string]*Ledger{"reference": ref, "late": late} {
		if got := timeline(t, l, "ce"); got != want {
			t.Errorf("%s:%s\nwant:%s", name, got, want)
		}
	}
}

// partlyKnown is a Points that knows the points after `after` only, as a head that kept the
// latest few.
type partlyKnown struct {
	pointSet
	after uint64
}

func (p partlyKnown) KnownAfter() uint64 { return p.after }

func (p partlyKnown) PointsIn(after, through uint64) ([]uint64, bool) {
	if after < p.after {
		return nil, false
	}
	return p.pointSet.PointsIn(after, through)
}

// TestDueAtTheLatestPointWhenThePointsAreNotKnown: a CE last judged before the points known
// (Points.KnownAfter) is judged from them on, exactly; one whose posteriors at the points past
// does not hold is due at the latest point whose posterior past holds, and counted inexact; with
// none held, it is not due.
func TestDueAtTheLatestPointWhenThePointsAreNotKnown(t *testing.T) {
	l, _, m0, _ := ledgerHolding(t, sameCEs(t))
	past := map[uint64]*bnn.Model{m0.Version: m0}
	cur := m0
	for _, d := range []float64{-0.05, -0.05, -0.05, -0.05} {
		cur = driftBy(t, l, cur, d)
		past[cur.Version] = cur
	}
	all := pointSet{2, 4}
	exact, err := l.DueAtPoints(1000, 0, 1, pastOf(past), all)
	if err != nil {
		t.Fatal(err)
	}
	if exact.Inexact != 0 || len(exact.Measure[2]) == 0 {
		t.Fatalf("every point and posterior known: %d inexact, %d due at 2; want none inexact, some due at 2", exact.Inexact, len(exact.Measure[2]))
	}
	n := 0
	for _, ids := range exact.Measure {
		n += len(ids)
	}
	without := maps.Clone(past)
	delete(without, 2)
	only4 := map[uint64]*bnn.Model{4: past[4]}
	for _, tc := range []struct {
		name         string
		points       Points
		past         map[uint64]*bnn.Model
		due, inexact int
	}{
		{"points known after 3 only", partlyKnown{all, 3}, past, n, 0},
		{"point 2's posterior not held", all, without, n, n},
		{"points known after 3, only the latest point's posterior held", partlyKnown{all, 3}, only4, n, 0},
		{"no point's posterior held", all, map[uint64]*bnn.Model{3: past[3]}, 0, 0},
	} {
		due, err := l.DueAtPoints(1000, 0, 1, pastOf(tc.past), tc.points)
		if err != nil {
			t.Fatal(err)
		}
		if got := len(due.Measure[4]); got != tc.due || due.Inexact != tc.inexact || len(due.Measure) > min(1, tc.due) {
			t.Errorf("%s: %d due at 4 of %d due at %d points, %d inexact; want %d at 4, %d inexact", tc.name, got, n, len(due.Measure), due.Inexact, tc.due, tc.inexact)
		}
	}
}

// TestPointsJudgeAtAnAnchorNoLongerInThePast: a CE whose anchor's posterior is no longer among
// the recent ones the caller holds (past: a replica's last 256) is judged at the points with the
// anchor's posterior the ledger stores, as when it held it: a replica whose CEs were registered
// long ago measures them at the points they become due at, not at the latest one, and counts
// nothing inexact.
func TestPointsJudgeAtAnAnchorNoLongerInThePast(t *testing.T) {
	ds := []float64{-0.01, -0.02, -0.03, -0.04, -0.05, -0.05, -0.06, -0.04, 0.02, 0.05, 0.06, 0.08, 0.07, 0.05, -0.03, -0.06, -0.08, -0.05, 0.04, 0.09}
	points := pointSet{2, 3, 6, 9, 10, 12, 15, 18, 19, 20}
	ref, _, m0, ces := ledgerHolding(t, sameCEs(t))
	timely, _, _, _ := ledgerHolding(t, sameCEs(t))
	past := map[uint64]*bnn.Model{} // without the anchor m0: evicted
	cur, inexact := m0, 0
	for _, d := range ds {
		prev := cur
		for _, l := range []*Ledger{ref, timely} {
			cur = driftBy(t, l, prev, d)
		}
		past[cur.Version] = cur
		if slices.Contains(points, cur.Version) {
			confirmEveryWaiting(t, ref, cur)
		}
		_, inex := measureAtPoints(t, timely, past, points)
		inexact += inex
	}
	if inexact != 0 {
		t.Errorf("%d measurements counted inexact; want none: the ledger stores the anchor's posterior", inexact)
	}
	for _, ce := range ces {
		if got, want := timeline(t, timely, ce.ID), timeline(t, ref, ce.ID); got != want {
			t.Errorf("%s:%s\nreference:%s", ce.ID, got, want)
		}
	}
}

// TestPointsAreDueOnlyWherePastHoldsThePosterior: a CE is due for a measurement only at a point
// whose posterior past holds (the caller measures under it), though the ledger stores others
// (its anchors: here CEs registered at points): with past holding the last 3 versions, every CE
// DueAtPoints finds is due at one of them.
func TestPointsAreDueOnlyWherePastHoldsThePosterior(t *testing.T) {
	ds := []float64{-0.01, -0.02, -0.03, -0.04, -0.05, -0.05, -0.06, -0.04, 0.02, 0.05, 0.06, 0.08, 0.07, 0.05, -0.03, -0.06, -0.08, -0.05, 0.04, 0.09}
	points := pointSet{2, 3, 6, 9, 10, 12, 15, 18, 19, 20}
	l, _, m0, _ := ledgerHolding(t, sameCEs(t))
	cur := m0
	past := map[uint64]*bnn.Model{}
	for i, d := range ds {
		cur = driftBy(t, l, cur, d)
		past[cur.Version] = cur
		delete(past, cur.Version-3)
		if slices.Contains(points, cur.Version) && i%4 != 3 {
			// A CE registered at a point the owner has not measured at: an anchor there.
			ces := spreadCEs(t, cur, rand.New(rand.NewPCG(uint64(i), 7)), 3)
			for j, ce := range ces {
				ce.ID = fmt.Sprintf("registered-%d-%d", cur.Version, j)
			}
			if err := l.Put(bg, ces...); err != nil {
				t.Fatal(err)
			}
		}
		if i%4 != 3 {
			continue // a lagging owner: CEs come due at points it no longer holds
		}
		for range 100 {
			due, err := l.DueAtPoints(1000, 0, 1, pastOf(past), points)
			if err != nil {
				t.Fatal(err)
			}
			for p := range due.Measure {
				if past[p] == nil {
					t.Fatalf("at version %d: %d CEs due at point %d, whose posterior past does not hold", cur.Version, len(due.Measure[p]), p)
				}
			}
			changes, err := l.CertifyAgainAtPoints(bg, due.Again, pastOf(past), points)
			if err != nil {
				t.Fatal(err)
			}
			wrote := len(changes)
			for p, ids := range due.Measure {
				rep, _, err := l.ConfirmAtPoint(bg, posteriorPredictor{NewModelPredictor(past[p], 300, p)}, ids, pastOf(past), points)
				if err != nil {
					t.Fatal(err)
				}
				wrote += rep.Confirmed
			}
			if wrote == 0 {
				break
			}
		}
	}
}
