package ledger

import (
	"encoding/json"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/certify"
)

// A drift lapses every certificate (KL past the variance budget) while every CE stays well inside
// its set. Commit only flags the lapses (no status change, no event); Confirm then renews each:
// re-anchored to the current posterior with the measured (p1, V1, S), still certified, a renewal
// in its history, nothing in the outbox, the old anchor released. A full check passes throughout.
func TestConfirmRenewsLapsedCertificates(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(21, 21))
	var ces []*CE
	for range 25 {
		ces = append(ces, newCE(t, m0, rng))
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	outboxBefore, _ := l.Outbox(0, 1<<20)
	m1 := drift(m0, -0.01) // KL 5e-3: past the variance budget of epsilon_max 0.05, p still ~0.98
	rep, changes, err := l.Commit(bg, &Checkpoint{Model: m1})
	if err != nil {
		t.Fatal(err)
	}
	if len(changes) != 0 || rep.Lapsed != len(ces) || rep.Pending != len(ces) || rep.Counts[certify.Certified] != len(ces) {
		t.Fatalf("commit: %d changes, report %+v; want %d lapsed certificates and no status change", len(changes), rep, len(ces))
	}
	// Theorem 2 alone lapsed: the smallest Theorem 1 bound still holds, and is reported.
	minBound := 1.0
	for _, c := range ces {
		ce, _ := l.Get(c.ID)
		minBound = min(minBound, ce.Bound)
	}
	if st, _ := l.State(); st.Pending != len(ces) || !st.HasBound || st.MinBound != minBound || minBound < 0.5 {
		t.Fatalf("state after the lapse: pending %d, min bound %v (has %v); want %d pending and the smallest Theorem 1 bound, %v >= 1/2", st.Pending, st.MinBound, st.HasBound, len(ces), minBound)
	}
	ce, _ := l.Get(ces[0].ID)
	if ce.Status != certify.Certified || !ce.RenewalPending || ce.Bound >= 0.5 && ce.VarBound <= 0.05 {
		t.Fatalf("lapsed CE %+v: want certified, renewal pending, a bound that fails", ce)
	}
	checkInvariants(t, l)
	crep, changes, err := l.Confirm(bg, NewModelPredictor(m1, auditSamples, 3), 100)
	if err != nil {
		t.Fatal(err)
	}
	if crep.Renewed != len(ces) || len(changes) != 0 || crep.More {
		t.Fatalf("confirm %+v, %d status changes; want all %d renewed without a status change", crep, len(changes), len(ces))
	}
	for _, c := range ces {
		ce, err := l.Get(c.ID)
		if err != nil {
			t.Fatal(err)
		}
		p, v := measure(t, m1, ce.XCF, 1, auditSamples, 3)
		last := ce.History[len(ce.History)-1]
		if ce.Status != certify.Certified || ce.RenewalPending || ce.AnchorVersion != m1.Version || ce.P1 != p || ce.Var1 != v ||
			ce.Samples != auditSamples || ce.KLFromAnchor != 0 || !last.Renewal || last.P2 == nil || *last.P2 != p {
			t.Fatalf("renewed CE %+v; want certified under %d with p1 %v var1 %v and a renewal in its history", ce, m1.Version, p, v)
		}
	}
	outboxAfter, _ := l.Outbox(0, 1<<20)
	if len(outboxAfter) != len(outboxBefore) {
		t.Fatalf("renewals wrote %d outbox entries, want none", len(outboxAfter)-len(outboxBefore))
	}
	if an, _ := l.Anchors(); len(an) != 1 || an[0].Version != m1.Version || an[0].Refs != len(ces) {
		t.Fatalf("anchors after renewal %+v: want only %d, with %d references", an, m1.Version, len(ces))
	}
	if st, _ := l.State(); st.Pending != 0 || !st.HasBound || st.MaxAnchorKL != 0 {
		t.Fatalf("state after renewal %+v", st)
	}
	checkInvariants(t, l)
}

// A CE held at p ~ 1/2 across 100 posterior versions (40 under -short), each measured afresh
// (new draws per version), changes status at most a handful of times: verdicts move only on
// evidence at the configured confidence. The point estimate would decide afresh at every version.
func TestVerdictNearHalfAcrossVersions(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(22, 22))
	ce := newCE(t, m0, rng)
	if err := l.Put(bg, ce); err != nil {
		t.Fatal(err)
	}
	// The bias at which p(yes | x') = 1/2 for this x', by bisection on a precise estimate.
	lo, hi := -20.0, 4.0
	for range 24 { // to 1.4e-6 of the bias, well inside the estimate's own error
		mid := (lo + hi) / 2
		if p, _ := measure(t, toBias(m0, mid), ce.XCF, 1, 20000, 1); p < 0.5 {
			lo = mid
		} else {
			hi = mid
		}
	}
	m := toBias(m0, (lo+hi)/2)
	versions, samples := 100, 1000
	if testing.Short() {
		versions = 40 // the race step: single-goroutine statistics the detector only slows
	}
	naive, undecided := 0, 0
	var prevNaive certify.Status
	for v := range versions {
		next := m.Clone()
		next.Version = m0.Version + 1 + uint64(v)
		if _, _, err := l.Commit(bg, &Checkpoint{Model: next}); err != nil {
			t.Fatal(err)
		}
		confirmAll(t, l, next, samples, uint64(1000+v))
		// The counts of decided statuses agree with the CE's own decided: kept by hysteresis
		// under the current posterior (undecided) at most versions here.
		st, err := l.State()
		if err != nil {
			t.Fatal(err)
		}
		cur, err := l.Get(ce.ID)
		if err != nil {
			t.Fatal(err)
		}
		if want := map[bool]int{true: 1, false: 0}[cur.Decided]; st.Decided[cur.Status] != want {
			t.Fatalf("version %d: the CE is %v with decided %v, State counts %d decided %v", next.Version, cur.Status, cur.Decided, st.Decided[cur.Status], cur.Status)
		}
		if !cur.Decided {
			undecided++
		}
		p, _ := measure(t, next, ce.XCF, 1, samples, uint64(1000+v))
		if s := certify.Observed(p, map[bool]int{true: 1, false: 0}[p >= 0.5], 1); v > 0 && s != prevNaive {
			naive++
			prevNaive = s
		} else if v == 0 {
			prevNaive = s
		}
	}
	got, err := l.Get(ce.ID)
	if err != nil {
		t.Fatal(err)
	}
	changes := 0
	for _, h := range got.History {
		if h.From != h.To && h.PosteriorVersion > m0.Version {
			changes++
		}
	}
	out, _ := l.Outbox(0, 1<<20)
	events := 0
	for _, e := range out {
		var ch StatusChange
		if json.Unmarshal(e.Value, &ch) == nil && ch.ID == ce.ID {
			events++
		}
	}
	t.Logf("p ~ 1/2 over %d versions: %d status changes (%d events), undecided at %d; the point estimate would have changed %d times", versions, changes, events, undecided, naive)
	if undecided == 0 {
		t.Fatal("the CE at p ~ 1/2 was decided at every version: the count of undecided verdicts kept by hysteresis is not tested")
	}
	if changes > 3 || events != changes {
		t.Fatalf("%d status changes and %d events over %d versions, want at most 3, one event each; history %+v", changes, events, versions, got.History)
	}
	if naive < 10 {
		t.Fatalf("the point estimate changed only %d times: p is not near 1/2 and the test shows nothing", naive)
	}
}
