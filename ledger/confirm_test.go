package ledger

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// cheapCEs makes n CEs under m with random x' and a plausible certificate, without measuring
// each (registration cost is not what these tests are about).
func cheapCEs(m *bnn.Model, rng *rand.Rand, prefix string, n int) []*CE {
	ces := make([]*CE, n)
	for i := range ces {
		x := []float64{rng.Float64()*2 - 1, rng.Float64()*2 - 1, rng.Float64()*2 - 1}
		xcf := []float64{rng.Float64()*2 - 1, rng.Float64()*2 - 1, rng.Float64()*2 - 1}
		ces[i] = &CE{ID: fmt.Sprintf("%s-%07d", prefix, i), X: x, XCF: xcf, Target: 1, AnchorVersion: m.Version,
			P1: 0.96 + 0.03*rng.Float64(), Var1: 0.002 * rng.Float64(), Samples: 1000, Delta: 0.05, Epsilon: 0.01}
	}
	return ces
}

// 2 x 10^4 CEs fail at once. Commit only marks their certificates lapsed (no Monte-Carlo under
// the writer lock, no status change); Confirm batches then give each a verdict, and the verdicts
// are exactly those of one brute-force Monte-Carlo pass over every CE with the same draws and
// seed. Confirm takes five batches and List two full pages, so every boundary is crossed; what
// the lapse costs at 10^5 CEs is BenchmarkCommitAllFailing's.
func TestConfirmManyFailing(t *testing.T) {
	n := 20_000
	if testing.Short() {
		n = 10_000
	}
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(71, 71))
	for lo := 0; lo < n; lo += 5000 {
		if err := l.Put(bg, cheapCEs(m0, rng, fmt.Sprintf("many%d", lo), min(5000, n-lo))...); err != nil {
			t.Fatal(err)
		}
	}
	m1 := toBias(m0, -0.5) // p(yes) straddles 1/2, far enough on both sides for a verdict of each kind
	start := time.Now()
	rep, changes, err := l.Commit(bg, &Checkpoint{Model: m1})
	commitTook := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if len(changes) != 0 || rep.Lapsed != n || rep.Pending != n || rep.Counts[certify.Certified] != n {
		t.Fatalf("commit: %d changes, report %+v; want all %d certificates lapsed, no status change", len(changes), rep, n)
	}
	const samples, seed = 256, 9
	p := NewModelPredictor(m1, samples, seed)
	start = time.Now()
	calls, confirmed := 0, 0
	for {
		crep, _, err := l.Confirm(bg, p, 4096)
		if err != nil {
			t.Fatal(err)
		}
		calls++
		confirmed += crep.Confirmed
		if crep.Discarded || crep.Skipped != 0 {
			t.Fatalf("confirm: %+v", crep)
		}
		if !crep.More {
			break
		}
	}
	confirmTook := time.Since(start)
	if confirmed != n {
		t.Fatalf("confirmed %d of %d", confirmed, n)
	}
	all, err := l.List(0, 10000, "")
	var xs [][]float64
	var stored []*CE
	for after := ""; err == nil; all, err = l.List(0, 10000, after) {
		if len(all) == 0 {
			break
		}
		for _, ce := range all {
			xs = append(xs, ce.XCF)
			stored = append(stored, ce)
		}
		after = all[len(all)-1].ID
	}
	if err != nil {
		t.Fatal(err)
	}
	pred, err := m1.Predict(xs, samples, seed)
	if err != nil {
		t.Fatal(err)
	}
	cnt := map[certify.Status]int{}
	for i, ce := range stored {
		e := certify.Evidence{P: pred.P(i, 1), Var: pred.V(i, 1), Samples: samples}
		want := certify.Verdict(certify.Certified, e, certify.DefaultVerdictAlpha)
		if ce.Status != want || ce.ConfirmedVersion == nil || *ce.ConfirmedVersion != m1.Version {
			t.Fatalf("%s: %v confirmed at %v; brute-force Monte-Carlo says %v at version %d", ce.ID, ce.Status, ce.ConfirmedVersion, want, m1.Version)
		}
		cnt[want]++
	}
	if cnt[certify.AtRisk] == 0 || cnt[certify.Invalidated] == 0 {
		t.Fatalf("verdicts %v: want both", cnt)
	}
	// Nothing is left to confirm at this version.
	if crep, _, err := l.Confirm(bg, p, 10); err != nil || crep.Picked != 0 || crep.More {
		t.Fatalf("confirm after convergence: %+v, %v", crep, err)
	}
	checkInvariants(t, l)
	t.Logf("%d CEs failing at once: Commit took %v (%d changes, %d candidates read); %d Confirm calls took %v; verdicts %v",
		n, commitTook, len(changes), rep.Candidates, calls, confirmTook, cnt)
}

// sneakyPredictor runs during-Predict actions (another writer) before predicting.
type sneakyPredictor struct {
	*ModelPredictor
	during func()
}

func (s *sneakyPredictor) Predict(ctx context.Context, X [][]float64) (*bnn.Predictive, error) {
	if s.during != nil {
		s.during()
	}
	return s.ModelPredictor.Predict(ctx, X)
}

// Confirm samples without the writer lock: a checkpoint can run meanwhile. If it changed the
// posterior, the batch's results are written all the same, as of the posterior sampled (and
// measured again under the new one); CEs deleted meanwhile are skipped.
func TestConfirmRacesWriters(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(72, 72))
	ces := cheapCEs(m0, rng, "race", 50)
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	m1 := toBias(m0, -0.19)
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
		t.Fatal(err)
	}
	// A checkpoint promotes m2 while m1's batch is being sampled.
	m2 := drift(m1, -0.0001)
	before := writeState(t, l)
	p := &sneakyPredictor{ModelPredictor: NewModelPredictor(m1, 32, 1), during: func() {
		if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
			t.Error(err)
		}
	}}
	crep, changes, err := l.Confirm(bg, p, 100)
	if err != nil || !crep.Behind || crep.Discarded || crep.Confirmed != len(ces) {
		t.Fatalf("confirm across a posterior change: %+v, %d changes, %v; want every verdict written, behind", crep, len(changes), err)
	}
	if after := writeState(t, l); after == before {
		t.Fatal("the concurrent commit did not happen")
	}
	// Each change is recorded at the version measured, with its anchor's KL and bound there, not
	// at the posterior current when it was written.
	kl10, _, err := certify.KL(m1, m0)
	if err != nil {
		t.Fatal(err)
	}
	if len(changes) == 0 {
		t.Fatal("no status change from a confirmation behind")
	}
	for _, ch := range changes {
		if ch.PosteriorVersion != m1.Version || ch.KL != kl10 {
			t.Fatalf("change %+v: want version %d at KL(q1 || q0) = %v", ch, m1.Version, kl10)
		}
	}
	// The verdicts are as of m1: each CE waits for a measurement under m2.
	for _, c := range ces[:5] {
		ce, err := l.Get(c.ID)
		if err != nil {
			t.Fatal(err)
		}
		if ce.ConfirmedVersion == nil || *ce.ConfirmedVersion != m1.Version {
			t.Fatalf("%s after a confirmation behind: verdict at %v, want %d", c.ID, ce.ConfirmedVersion, m1.Version)
		}
	}
	// Under m2, a CE deleted while sampling is skipped, the others get verdicts.
	p = &sneakyPredictor{ModelPredictor: NewModelPredictor(m2, 32, 1), during: func() {
		if err := l.Delete(ces[0].ID); err != nil {
			t.Error(err)
		}
	}}
	crep, _, err = l.Confirm(bg, p, 100)
	if err != nil || crep.Discarded || crep.Skipped != 1 || crep.Confirmed != len(ces)-1 {
		t.Fatalf("confirm with a delete meanwhile: %+v, %v", crep, err)
	}
	// A predictor for a posterior that is not current does nothing.
	crep, _, err = l.Confirm(bg, NewModelPredictor(m1, 32, 1), 100)
	if err != nil || !crep.Discarded || crep.Picked != 0 {
		t.Fatalf("confirm with a stale predictor: %+v, %v", crep, err)
	}
	checkInvariants(t, l)
}

// Renewals measured under a posterior that ingestion replaced meanwhile are kept: the CEs are
// re-anchored to the posterior they were measured under, its snapshot stored, their bounds judged
// at KL(q_now || q_sampled); the anchors and counts stay consistent.
func TestConfirmBehindRenews(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(73, 73))
	var ces []*CE
	for range 20 {
		ces = append(ces, newCE(t, m0, rng))
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	m1 := drift(m0, -0.01) // every certificate lapses (variance budget), p stays ~0.98
	if rep, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil || rep.Lapsed != len(ces) {
		t.Fatalf("commit: %+v, %v; want every certificate lapsed", rep, err)
	}
	m2 := drift(m1, -0.0001)
	p := &sneakyPredictor{ModelPredictor: NewModelPredictor(m1, auditSamples, 2), during: func() {
		if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
			t.Error(err)
		}
	}}
	crep, changes, err := l.Confirm(bg, p, 100)
	if err != nil || !crep.Behind || crep.Renewed != len(ces) || len(changes) != 0 {
		t.Fatalf("confirm behind: %+v, %d changes, %v; want all %d renewed, no status change", crep, len(changes), err, len(ces))
	}
	kl, _, _ := certify.KL(m2, m1)
	for _, c := range ces {
		ce, _ := l.Get(c.ID)
		b := l.Policy().Bounds(ce.Certificate(), kl)
		if ce.AnchorVersion != m1.Version || ce.KLFromAnchor != kl || ce.RenewalPending == b.Certified || ce.Status != certify.Certified {
			t.Fatalf("renewed behind: %+v; want anchored to %d at KL %v, pending = %v", ce, m1.Version, kl, !b.Certified)
		}
		// Its history records the renewal at the version measured: the new anchor, KL 0.
		r := ce.History[len(ce.History)-1]
		if !r.Renewal || r.PosteriorVersion != m1.Version || r.KL != 0 || r.Bound != ce.P1 {
			t.Fatalf("renewal recorded as %+v; want at version %d, KL 0, bound p1 = %v", r, m1.Version, ce.P1)
		}
	}
	if an, _ := l.Anchors(); len(an) != 1 || an[0].Version != m1.Version || an[0].Refs != len(ces) {
		t.Fatalf("anchors %+v: want the sampled posterior %d, held by %d CEs", an, m1.Version, len(ces))
	}
	checkInvariants(t, l)
}

// posteriorPredictor is a ModelPredictor that says which posterior it samples.
type posteriorPredictor struct{ *ModelPredictor }

func (p posteriorPredictor) Posterior() *bnn.Model { return p.m }

// A predictor whose posterior ingestion has already replaced is still used when it says which
// posterior it samples: renewals are anchored to it, judged at KL(q_now || q_sampled) (m2 also
// changes a standard deviation, so that the reverse KL differs). Without that (a plain
// Predictor) the call is discarded, nothing read, and so is one of a posterior newer than the
// ledger's.
func TestConfirmWithAReplacedPosterior(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(74, 74))
	var ces []*CE
	for range 10 {
		ces = append(ces, newCE(t, m0, rng))
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	m1 := drift(m0, -0.01)
	m2 := scaleSigma(drift(m1, -0.0001), 1.001)
	m2.Version = m1.Version + 1
	for _, m := range []*bnn.Model{m1, m2} {
		if _, _, err := l.Commit(bg, &Checkpoint{Model: m}); err != nil {
			t.Fatal(err)
		}
	}
	if crep, _, err := l.Confirm(bg, NewModelPredictor(m1, auditSamples, 2), 100); err != nil || !crep.Discarded || crep.Picked != 0 {
		t.Fatalf("a plain predictor of a replaced posterior: %+v, %v; want discarded", crep, err)
	}
	ahead := drift(m2, -0.0001)
	if crep, _, err := l.Confirm(bg, posteriorPredictor{NewModelPredictor(ahead, auditSamples, 2)}, 100); err != nil || !crep.Discarded || crep.Picked != 0 {
		t.Fatalf("a predictor of a posterior newer than the ledger's: %+v, %v; want discarded", crep, err)
	}
	crep, _, err := l.Confirm(bg, posteriorPredictor{NewModelPredictor(m1, auditSamples, 2)}, 100)
	if err != nil || crep.Discarded || !crep.Behind || crep.Renewed != len(ces) {
		t.Fatalf("a predictor of a replaced posterior that names it: %+v, %v; want all %d renewed as of version %d", crep, err, len(ces), m1.Version)
	}
	kl, _, _ := certify.KL(m2, m1)
	if rev, _, _ := certify.KL(m1, m2); rev == kl {
		t.Fatalf("KL %v both ways: the test cannot tell the directions apart", kl)
	}
	for _, c := range ces {
		ce, _ := l.Get(c.ID)
		if ce.AnchorVersion != m1.Version || ce.KLFromAnchor != kl {
			t.Fatalf("%+v: want anchored to %d at KL %v", ce, m1.Version, kl)
		}
	}
	checkInvariants(t, l)
}

// With Hoeffding's bound (certify.hoeffding_alpha) a certificate starts from p1 - sqrt(ln(1/alpha)
// / (2 S)), 0.048 at S = 1000 and alpha = 0.01, a wider margin than the empirical Bernstein one the
// renewal rules use (0.012 at Var = 0). At delta = 0.49 a measurement of p = 0.54 re-enters its set
// (0.54 - 2 x 0.012 >= 0.51) while a certificate of it fails at KL 0 (0.54 - 0.048 < 1/2): Confirm
// gives it a verdict (at_risk, decided at the new version), never a certificate that fails at its
// own anchor. A CE measured at p = 0.60 is renewed as before.
func TestConfirmWithHoeffdingRenewsOnlyWhatHoldsAtItsAnchor(t *testing.T) {
	m := testModel(0)
	for k := range m.Layers { // sigmas of e^-12: every draw gives the same p
		l := &m.Layers[k]
		for i := range l.WeightLogSigma {
			l.WeightLogSigma[i] = -12
		}
		for i := range l.BiasLogSigma {
			l.BiasLogSigma[i] = -12
		}
	}
	xcf := []float64{0.1, -0.2, 0.3}
	// Class 1's bias moves p(yes | xcf) to pTarget (the two logits differ by the bias alone).
	at := func(m *bnn.Model, pTarget float64) *bnn.Model {
		c := m.Clone()
		p, _ := measure(t, c, xcf, 1, 10, 1)
		c.Last().BiasMu[1] += math.Log(pTarget/(1-pTarget)) - math.Log(p/(1-p))
		return c
	}
	pol := certify.Policy{Mode: certify.Paper, EpsilonMax: 0.25, Hoeffding: true, Alpha: 0.01}
	for _, tc := range []struct {
		p       float64
		renewed bool
	}{{0.54, false}, {0.60, true}} {
		l, _ := openTest(t, Options{Policy: pol, VerdictAlpha: 0.01})
		// Registered at p = 0.54: in its set, its certificate failing at KL 0 (at_risk at once,
		// decided); then the posterior moves p to tc.p, and by a KL the verdict does not carry over.
		m1 := at(m, 0.54)
		install(t, l, m1)
		p1, v1 := measure(t, m1, xcf, 1, 1000, 3)
		ce := &CE{ID: "ce", X: []float64{0, 0, 0}, XCF: xcf, Target: 1, AnchorVersion: m1.Version, P1: p1, Var1: v1, Samples: 1000, Delta: 0.49, Epsilon: 0.01}
		if err := l.Put(bg, ce); err != nil {
			t.Fatal(err)
		}
		m2 := drift(at(m1, tc.p), 1e-6)
		if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
			t.Fatal(err)
		}
		p2, v2 := measure(t, m2, xcf, 1, 1000, 3)
		e := certify.Evidence{P: p2, Var: v2, Samples: 1000}
		if !certify.Reenters(e, 0.49, 0.01, 0.01) {
			t.Fatalf("p = %v: the measurement (%v, %v) does not re-enter its set; the case is not the one tested", tc.p, p2, v2)
		}
		got, err := l.Get("ce")
		if err != nil {
			t.Fatal(err)
		}
		if got.Status != certify.AtRisk {
			t.Fatalf("p = %v: before Confirm the CE is %v; want at_risk, its certificate failing at KL 0", tc.p, got.Status)
		}
		rep, _, err := l.Confirm(bg, NewModelPredictor(m2, 1000, 3), 16)
		if err != nil {
			t.Fatalf("p = %v: Confirm: %v", tc.p, err)
		}
		if got, err = l.Get("ce"); err != nil {
			t.Fatal(err)
		}
		holds := pol.Bounds(got.Certificate(), 0).Certified
		switch {
		case tc.renewed && (rep.Renewed != 1 || got.Status != certify.Certified || got.AnchorVersion != m2.Version || !holds):
			t.Errorf("p = %v: %+v, CE %v anchored at %d (holds at KL 0: %v); want renewed, certified at %d", tc.p, rep, got.Status, got.AnchorVersion, holds, m2.Version)
		case !tc.renewed && (rep.Renewed != 0 || rep.Confirmed != 1 || got.Status != certify.AtRisk || got.ConfirmedVersion == nil || *got.ConfirmedVersion != m2.Version):
			t.Errorf("p = %v: %+v, CE %v with verdict at %v; want no renewal, at_risk decided at %d", tc.p, rep, got.Status, got.ConfirmedVersion, m2.Version)
		}
	}
}
