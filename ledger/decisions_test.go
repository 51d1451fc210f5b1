package ledger

// The ledger's status decisions at their edges: the re-certification report's counts, the decided
// counts while certificates are lapsed, hysteresis on undecided evidence, renewal against re-entry
// between their margins, a late registration, a measurement overtaken by a newer verdict or by a
// posterior that restores the bounds, and Confirm's batch size.

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// TestReportPendingAfterARestore: Report.Pending after a re-certification that restores lapsed
// certificates (none left pending), as in the ledger's state.
func TestReportPendingAfterARestore(t *testing.T) {
	l, m0, _ := withCEs(t, 5, "p", 10)
	far := toBias(m0, -0.5)
	rep, _, err := l.Commit(bg, &Checkpoint{Model: far})
	if err != nil || rep.Lapsed != 10 || rep.Pending != 10 {
		t.Fatalf("far: %+v %v", rep, err)
	}
	back := m0.Clone()
	back.Version = far.Version + 1
	rep, _, err = l.Commit(bg, &Checkpoint{Model: back})
	if err != nil {
		t.Fatal(err)
	}
	st, _ := l.State()
	if rep.Restored != 10 || rep.Pending != 0 || st.Pending != 0 {
		t.Fatalf("back: restored %d, report pending %d, state pending %d; want 10, 0, 0", rep.Restored, rep.Pending, st.Pending)
	}
}

// TestReportChecksEveryCEAndKeepsTheLargestAnchorKL: Report.Checked counts invalidated CEs too,
// and MaxAnchorKL is the largest of two anchors' KLs.
func TestReportChecksEveryCEAndKeepsTheLargestAnchorKL(t *testing.T) {
	l, m0, rng := withCEs(t, 6, "a", 5)
	m1 := toBias(m0, -4) // p(yes) far below 1/2: verdicts invalidated
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
		t.Fatal(err)
	}
	confirmAll(t, l, m1, 300, 1)
	if c, _ := l.Counts(); c[certify.Invalidated] != 5 {
		t.Fatalf("counts %v, want 5 invalidated", c)
	}
	if err := l.Put(bg, cheapCEs(m1, rng, "b", 3)...); err != nil { // certified under anchor m1
		t.Fatal(err)
	}
	m2 := drift(m1, 0.001)
	rep, _, err := l.Recertify(bg, m2)
	if err != nil {
		t.Fatal(err)
	}
	max := 0.0
	for _, kl := range rep.AnchorKL {
		max = math.Max(max, kl)
	}
	if rep.Checked != 8 || len(rep.AnchorKL) != 2 || rep.MaxAnchorKL != max {
		t.Fatalf("checked %d (want 8), anchor KL %v, max %v (want %v)", rep.Checked, rep.AnchorKL, rep.MaxAnchorKL, max)
	}
}

// TestDecidedLeavesOutLapsedCertificates: State.Decided does not count lapsed certificates as
// decided; they stay certified in Counts, pending renewal.
func TestDecidedLeavesOutLapsedCertificates(t *testing.T) {
	l, m0, _ := withCEs(t, 5, "p", 10)
	if _, _, err := l.Commit(bg, &Checkpoint{Model: toBias(m0, -0.5)}); err != nil {
		t.Fatal(err)
	}
	st, err := l.State()
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending != 10 || st.Decided[certify.Certified] != 0 || st.Counts[certify.Certified] != 10 {
		t.Fatalf("pending %d, decided %v, counts %v; want 10 lapsed, none decided", st.Pending, st.Decided, st.Counts)
	}
}

// TestUndecidedEvidenceKeepsAnInvalidatedCE: an invalidated CE whose new evidence decides
// nothing (p = 1/2) stays invalidated (hysteresis).
func TestUndecidedEvidenceKeepsAnInvalidatedCE(t *testing.T) {
	l, m0, _ := withCEs(t, 6, "a", 5)
	m1 := toBias(m0, -4)
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
		t.Fatal(err)
	}
	confirmAll(t, l, m1, 300, 1)
	if c, _ := l.Counts(); c[certify.Invalidated] != 5 {
		t.Fatalf("counts %v, want 5 invalidated", c)
	}
	m2 := toBias(m1, 0) // far from m1: the verdicts do not carry
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
		t.Fatal(err)
	}
	rep, changes, err := l.Confirm(bg, &fixedPredictor{version: m2.Version, p: 0.5, v: 0.001, samples: 400}, 100)
	if err != nil {
		t.Fatal(err)
	}
	if c, _ := l.Counts(); rep.Confirmed != 5 || len(changes) != 0 || c[certify.Invalidated] != 5 {
		t.Fatalf("confirm %+v, changes %v, counts %v; want 5 verdicts kept invalidated", rep, changes, c)
	}
}

// TestRenewalAndReentryBetweenTheirMargins: with evidence between Renewable and Reenters, a
// lapsed certificate is renewed and an at_risk CE is not certified again.
func TestRenewalAndReentryBetweenTheirMargins(t *testing.T) {
	l, m0, rng := withCEs(t, 6, "a", 5)
	alpha := l.opts.VerdictAlpha
	pStar := 0.0
	for p := 0.95; p < 1; p += 1e-4 {
		e := certify.Evidence{P: p, Var: 0.0005, Samples: 400}
		if certify.Renewable(e, 0.05, 0.01, alpha) && !certify.Reenters(e, 0.05, 0.01, alpha) {
			pStar = p
			break
		}
	}
	if pStar == 0 {
		t.Fatal("no evidence between Renewable and Reenters")
	}
	m1 := lapse(t, l, m0)
	if _, _, err := l.Confirm(bg, &fixedPredictor{version: m1.Version, p: 0.7, v: 0.001, samples: 400}, 100); err != nil {
		t.Fatal(err)
	}
	if c, _ := l.Counts(); c[certify.AtRisk] != 5 {
		t.Fatalf("counts %v, want 5 at_risk", c)
	}
	if err := l.Put(bg, cheapCEs(m1, rng, "b", 5)...); err != nil {
		t.Fatal(err)
	}
	m2 := toBias(m1, -1.5) // the b certificates lapse, the a verdicts do not carry
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
		t.Fatal(err)
	}
	rep, changes, err := l.Confirm(bg, &fixedPredictor{version: m2.Version, p: pStar, v: 0.0005, samples: 400}, 100)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := l.Counts()
	if rep.Confirmed != 10 || rep.Renewed != 5 || len(changes) != 0 || c[certify.AtRisk] != 5 || c[certify.Certified] != 5 {
		t.Fatalf("p %v: confirm %+v, %d changes, counts %v; want b renewed, a kept at_risk", pStar, rep, len(changes), c)
	}
}

// TestLateRegistrationWaitsForAVerdict: a CE registered under an older anchor whose bound fails
// there has no verdict yet: its p1 was not measured under the current posterior, so Confirm must
// measure it.
func TestLateRegistrationWaitsForAVerdict(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(3, 3))
	keep, late := newCE(t, m0, rng), newCE(t, m0, rng)
	if err := l.Put(bg, keep); err != nil {
		t.Fatal(err)
	}
	m1 := drift(m0, -0.05)
	commit(t, l, m1, 1)
	if err := l.Put(bg, late); err != nil {
		t.Fatal(err)
	}
	got, err := l.Get(late.ID)
	if err != nil || got.Status != certify.AtRisk || got.ConfirmedVersion != nil {
		t.Fatalf("late CE %+v, %v; want at_risk without a verdict", got, err)
	}
	rep, _, err := l.Confirm(bg, NewModelPredictor(m1, 300, 1), 10)
	if err != nil || rep.Picked != 1 {
		t.Fatalf("confirm %+v, %v; want the late CE measured", rep, err)
	}
}

// TestConfirmDoesNotOverrideANewerVerdict: a measurement of a CE that got a newer verdict while
// it was sampled is not written.
func TestConfirmDoesNotOverrideANewerVerdict(t *testing.T) {
	l, m0, _ := withCEs(t, 5, "p", 5)
	m1 := lapse(t, l, m0)
	// While the outer measurement samples (p = 0.7), another Confirm invalidates the CEs (p = 0.3).
	racing := &fixedPredictor{version: m1.Version, p: 0.7, v: 0.001, samples: 400, during: func() {
		if _, _, err := l.Confirm(bg, &fixedPredictor{version: m1.Version, p: 0.3, v: 0.001, samples: 400}, 100); err != nil {
			t.Error(err)
		}
	}}
	rep, _, err := l.Confirm(bg, racing, 100)
	if err != nil {
		t.Fatal(err)
	}
	if c, _ := l.Counts(); rep.Skipped != 5 || c[certify.Invalidated] != 5 {
		t.Fatalf("outer confirm %+v, counts %v; want the 5 newer invalidated verdicts kept", rep, c)
	}
}

// TestConfirmSkipsCertificatesRestoredMeanwhile: a CE whose bound holds again when the
// measurement is written gets no verdict.
func TestConfirmSkipsCertificatesRestoredMeanwhile(t *testing.T) {
	l, m0, _ := withCEs(t, 5, "p", 5)
	m1 := lapse(t, l, m0)
	back := m0.Clone()
	back.Version = m1.Version + 1
	// While the measurement samples (p = 0.3), a posterior under which the bounds hold is committed.
	restoring := &fixedPredictor{version: m1.Version, p: 0.3, v: 0.001, samples: 400, during: func() {
		if _, _, err := l.Commit(bg, &Checkpoint{Model: back}); err != nil {
			t.Error(err)
		}
	}}
	rep, changes, err := l.Confirm(bg, restoring, 100)
	if err != nil {
		t.Fatal(err)
	}
	if c, _ := l.Counts(); rep.Skipped != 5 || len(changes) != 0 || c[certify.Certified] != 5 {
		t.Fatalf("confirm %+v, %d changes, counts %v; want all 5 skipped, still certified", rep, len(changes), c)
	}
}

// TestConfirmMeasuresAtMostMax: Confirm measures at most max CEs.
func TestConfirmMeasuresAtMostMax(t *testing.T) {
	l, m0, _ := withCEs(t, 5, "p", 5)
	m1 := lapse(t, l, m0)
	rep, _, err := l.Confirm(bg, &fixedPredictor{version: m1.Version, p: 0.3, v: 0.001, samples: 400}, 2)
	if err != nil || rep.Picked != 2 || !rep.More {
		t.Fatalf("confirm %+v, %v; want 2 picked, more to come", rep, err)
	}
}

// TestAnchorWithoutCEsIsNotReported: an anchor no CE refers to any more (kept because it is the
// current posterior) is not re-certified: it is not in AnchorKL.
func TestAnchorWithoutCEsIsNotReported(t *testing.T) {
	l, m0, rng := withCEs(t, 5, "a", 2)
	m1 := drift(m0, 0.001)
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
		t.Fatal(err)
	}
	b := cheapCEs(m1, rng, "b", 1)
	if err := l.Put(bg, b...); err != nil {
		t.Fatal(err)
	}
	if err := l.Delete(b[0].ID); err != nil {
		t.Fatal(err)
	}
	rep, _, err := l.Recertify(bg, drift(m1, 0.001))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := rep.AnchorKL[m0.Version]; !ok || len(rep.AnchorKL) != 1 {
		t.Fatalf("anchor KL %v, want only anchor %d", rep.AnchorKL, m0.Version)
	}
}

// withCEs opens a ledger with the test policy, installs testModel(4) as its posterior m0 and
// stores n certified CEs under it (ids prefix0, prefix1, ...), drawn with rng seeded by seed,
// which it returns for more.
func withCEs(t *testing.T, seed uint64, prefix string, n int) (*Ledger, *bnn.Model, *rand.Rand) {
	t.Helper()
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(seed, seed))
	if err := l.Put(bg, cheapCEs(m0, rng, prefix, n)...); err != nil {
		t.Fatal(err)
	}
	return l, m0, rng
}

// lapse commits m0 with its last bias moved by -0.5, a posterior under which the CEs certified
// under m0 lapse, and returns it.
func lapse(t *testing.T, l *Ledger, m0 *bnn.Model) *bnn.Model {
	t.Helper()
	m1 := toBias(m0, -0.5)
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
		t.Fatal(err)
	}
	return m1
}
