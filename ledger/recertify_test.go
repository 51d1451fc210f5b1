package ledger

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// checkMC verifies every Monte-Carlo change against an independent Predict of that CE alone
// with the same samples and seed (bnn shares weight draws across inputs, so p2 of one input
// does not depend on the batch it was in).
//
// A change without P2 (the bound decided) whose CE has since been confirmed under m is checked
// the same way against the CE's status.
func checkMC(t *testing.T, l *Ledger, m *bnn.Model, changes []StatusChange, samples int, seed uint64) {
	t.Helper()
	for _, ch := range changes {
		ce, err := l.Get(ch.ID)
		if err != nil {
			t.Fatal(err)
		}
		to := ch.To
		if ch.P2 == nil {
			if ce.ConfirmedVersion == nil || *ce.ConfirmedVersion != m.Version {
				continue
			}
			to = ce.Status
		}
		pred, err := m.Predict([][]float64{ce.XCF}, samples, seed)
		if err != nil {
			t.Fatal(err)
		}
		if p := pred.P(0, ce.Target); ch.P2 != nil && math.Abs(p-*ch.P2) > 1e-12 {
			t.Errorf("%s: p2 %v, independent Predict %v", ch.ID, *ch.P2, p)
		}
		e := certify.Evidence{P: pred.P(0, ce.Target), Var: pred.V(0, ce.Target), Samples: samples}
		want := certify.Verdict(ch.From, e, certify.DefaultVerdictAlpha)
		if certify.Renewable(e, ce.Delta, ce.Epsilon, certify.DefaultVerdictAlpha) {
			want = certify.Certified
		}
		if to != want {
			t.Errorf("%s: status %v, independent Monte-Carlo (%+v) says %v", ch.ID, to, e, want)
		}
	}
}

// Many small steps, each within budget on its own, drift far from the anchor. The KL used is
// KL(q_now || q_anchor) computed directly: for repeated mean shifts it is 50 (n d)^2, which
// outgrows the sum of step KLs n * 50 d^2, so summing would keep certifying CEs it must not.
func TestCumulativeDriftFlagsCEs(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), MCBatch: 7})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(10, 10))
	var ces []*CE
	for i := 0; i < 40; i++ {
		ces = append(ces, newCE(t, m0, rng))
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	pol := l.Policy()
	const d = -0.0008 // step KL = 50 * 6.4e-7 = 3.2e-5
	cur, sumKL := m0, 0.0
	flaggedAt := 0
	for n := 1; n <= 5; n++ {
		next := drift(cur, d)
		stepKL, _, err := certify.KL(next, cur)
		if err != nil {
			t.Fatal(err)
		}
		sumKL += stepKL
		for _, ce := range ces {
			if !pol.Bounds(ce.Certificate(), stepKL).Certified {
				t.Fatalf("step %d: step KL %v alone fails CE %s; the test wants each step within budget", n, stepKL, ce.ID)
			}
		}
		rep, changes := commit(t, l, next, uint64(n))
		direct, _, _ := certify.KL(next, m0)
		if rep.AnchorKL[m0.Version] != direct || rep.MaxAnchorKL != direct {
			t.Fatalf("step %d: anchor KL %v, want KL(q_now||q_0) = %v", n, rep.AnchorKL[m0.Version], direct)
		}
		if want := 50 * float64(n*n) * d * d; math.Abs(direct-want) > 1e-12 {
			t.Fatalf("step %d: KL from anchor %v, closed form 50 (n d)^2 = %v", n, direct, want)
		}
		checkMC(t, l, next, changes, 300, uint64(n))
		certified := 0
		for _, ce := range ces {
			got, err := l.Get(ce.ID)
			if err != nil {
				t.Fatal(err)
			}
			b := pol.Bounds(ce.Certificate(), direct)
			if b.Certified != (got.Status == certify.Certified) || got.Bound != b.ProbLower || got.KLFromAnchor != direct {
				t.Fatalf("step %d: CE %s status %v bound %v, policy at direct KL says %+v", n, ce.ID, got.Status, got.Bound, b)
			}
			if b.Certified {
				certified++
			}
			// Summing step KLs would have kept every CE certified this far.
			if n <= 3 && !pol.Bounds(ce.Certificate(), sumKL).Certified {
				t.Fatalf("step %d: the sum of step KLs %v already fails; pick a smaller step", n, sumKL)
			}
		}
		if certified < len(ces) && flaggedAt == 0 {
			flaggedAt = n
		}
		if cnt := countByScan(t, l); cnt[certify.Certified] != certified || sum(cnt) != len(ces) || cnt[certify.Certified] != rep.Counts[certify.Certified] {
			t.Fatalf("step %d: counts by scan %v, report %v, certified %d", n, cnt, rep.Counts, certified)
		}
		cur = next
	}
	if flaggedAt == 0 || flaggedAt > 3 {
		t.Fatalf("drift flagged CEs at step %d, want by step 3 (while the summed KL still certifies)", flaggedAt)
	}
	// The drift moved p by ~0.004: every flagged CE is at_risk, none invalidated.
	if cnt, _ := l.Counts(); cnt[certify.Invalidated] != 0 || cnt[certify.AtRisk] == 0 {
		t.Errorf("counts after drift %v, want at_risk > 0 and no invalidated", cnt)
	}
}

// certified -> at_risk / invalidated -> certified again when the posterior returns to the anchor.
func TestStatusTransitions(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), MCBatch: 5})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(11, 11))
	var ces []*CE
	for i := 0; i < 60; i++ {
		ces = append(ces, newCE(t, m0, rng))
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	// Move "yes" down to bias -0.3: p(yes | x') straddles 1/2 across x', far enough on both sides for
	// the confidence bounds of a verdict.
	m1 := toBias(m0, -0.3)
	rep, changes := commit(t, l, m1, 21)
	if rep.Lapsed != len(ces) || rep.Changed != 0 || len(changes) != len(ces) {
		t.Fatalf("report %+v with %d changes; want every certificate lapsed, then every CE judged", rep, len(changes))
	}
	for _, ch := range changes {
		ce, err := l.Get(ch.ID)
		if err != nil {
			t.Fatal(err)
		}
		if ch.From != certify.Certified || ce.ConfirmedVersion == nil || *ce.ConfirmedVersion != m1.Version {
			t.Fatalf("change %+v, CE confirmed at %v: want certified -> a Monte-Carlo verdict at version %d", ch, ce.ConfirmedVersion, m1.Version)
		}
	}
	checkMC(t, l, m1, changes, 300, 21)
	if rep.Counts[certify.AtRisk] == 0 || rep.Counts[certify.Invalidated] == 0 {
		t.Fatalf("counts %v: want both at_risk and invalidated for this drift", rep.Counts)
	}
	if cnt := countByScan(t, l); !equalCounts(cnt, rep.Counts) {
		t.Fatalf("counts by scan %v, report %v", cnt, rep.Counts)
	}
	// Same statuses under the same posterior and seed: no changes.
	if _, again, err := l.Recertify(context.Background(), m1); err != nil || len(again) != 0 {
		t.Fatalf("re-certifying unchanged: %d changes, %v", len(again), err)
	}
	if crep, again, err := l.Confirm(bg, NewModelPredictor(m1, 300, 21), 100); err != nil || len(again) != 0 || crep.Picked != 0 {
		t.Fatalf("confirming again at the same version: %+v, %d changes, %v", crep, len(again), err)
	}
	// Back to the anchor's parameters under a new version: KL = 0, all certified by bound.
	m2 := m0.Clone()
	m2.Version = m1.Version + 1
	rep, changes = commit(t, l, m2, 22)
	if rep.Counts[certify.Certified] != len(ces) || rep.Changed != len(ces) || rep.MaxAnchorKL != 0 {
		t.Fatalf("after return: %+v", rep)
	}
	for _, ch := range changes {
		if ch.P2 != nil || ch.To != certify.Certified || ch.KL != 0 {
			t.Errorf("return change %+v: want certified by bound at KL 0", ch)
		}
	}
	ce, err := l.Get(ces[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	// The bound lapses (no history entry), Confirm's verdict (at_risk or invalidated, measured),
	// then certified again by the bound at KL 0.
	h := ce.History
	if n := len(h); n != 2 || h[0].From != certify.Certified || h[0].To == certify.Certified || h[0].P2 == nil ||
		h[1].To != certify.Certified || h[1].P2 != nil || h[0].PosteriorVersion != m1.Version || h[1].PosteriorVersion != m2.Version ||
		h[0].ID != ce.ID {
		t.Errorf("history %+v", ce.History)
	}
}

// toBias moves class 1's bias mean to b (next version).
func toBias(m *bnn.Model, b float64) *bnn.Model { return drift(m, b-m.Last().BiasMu[1]) }

func equalCounts(a, b map[certify.Status]int) bool {
	for _, s := range certify.Statuses() {
		if a[s] != b[s] {
			return false
		}
	}
	return true
}

func TestAnchorGC(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(12, 12))
	versions := func() []uint64 {
		t.Helper()
		an, err := l.Anchors()
		if err != nil {
			t.Fatal(err)
		}
		var v []uint64
		for _, a := range an {
			v = append(v, a.Version)
		}
		return v
	}
	if v := versions(); len(v) != 0 {
		t.Fatalf("anchors before any CE: %v", v)
	}
	a := newCE(t, m0, rng)
	if err := l.Put(bg, a); err != nil {
		t.Fatal(err)
	}
	m1 := drift(m0, -0.001)
	commit(t, l, m1, 1)
	b := newCE(t, m1, rng)
	if err := l.Put(bg, b); err != nil {
		t.Fatal(err)
	}
	if v := versions(); len(v) != 2 || v[0] != 0 || v[1] != 1 {
		t.Fatalf("anchors %v, want [0 1]", v)
	}
	if err := l.Delete(a.ID); err != nil {
		t.Fatal(err)
	}
	if v := versions(); len(v) != 1 || v[0] != 1 {
		t.Fatalf("after deleting the only CE of anchor 0: %v, want [1]", v)
	}
	if _, err := l.Get(a.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("deleted CE: %v", err)
	}
	m2 := drift(m1, -0.001)
	commit(t, l, m2, 2)
	if v := versions(); len(v) != 1 || v[0] != 1 {
		t.Fatalf("after update: %v, want [1] (b still refers to it)", v)
	}
	if err := l.Delete(b.ID); err != nil {
		t.Fatal(err)
	}
	if v := versions(); len(v) != 0 {
		t.Fatalf("after deleting every CE: %v, want none (the current posterior is not an anchor)", v)
	}
	// The released anchor cannot be used to register any more.
	late := newCE(t, m1, rng)
	if err := l.Put(bg, late); !errors.Is(err, ErrUnknownAnchor) {
		t.Errorf("put under a released anchor: %v", err)
	}
	if err := l.Delete("nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("delete unknown: %v", err)
	}
}

func TestAudit(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), MCBatch: 8})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(13, 13))
	var ces []*CE
	for i := 0; i < 30; i++ {
		ces = append(ces, newCE(t, m0, rng))
	}
	outside := newCE(t, m0, rng)
	outside.P1 = 0.9 // registered outside the set although the model is confident there
	if err := l.Put(bg, append(ces, outside)...); err != nil {
		t.Fatal(err)
	}
	// KL 50 * 1e-4 = 5e-3: past the variance budget, p still ~0.98: all at_risk.
	m1 := drift(m0, -0.01)
	rep, _ := commit(t, l, m1, 1)
	if rep.Counts[certify.AtRisk] != len(ces) {
		t.Fatalf("after drift %v, want %d at_risk", rep.Counts, len(ces))
	}
	if _, _, err := l.Audit(bg, NewModelPredictor(m0, 300, 5), AuditOptions{}); !errors.Is(err, ErrStale) {
		t.Errorf("audit with a non-current posterior: %v", err)
	}
	arep, changes, err := l.Audit(bg, NewModelPredictor(m1, auditSamples, 5), AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if arep.Evaluated != len(ces)+1 || arep.Reanchored != len(ces)+1 || arep.Counts[certify.Certified] != len(ces)+1 || len(changes) != len(ces)+1 {
		t.Fatalf("audit %+v, %d changes; want all %d re-anchored and certified", arep, len(changes), len(ces)+1)
	}
	for _, id := range []string{ces[0].ID, outside.ID} {
		ce, err := l.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		p, v := measure(t, m1, ce.XCF, 1, auditSamples, 5)
		if ce.AnchorVersion != m1.Version || ce.P1 != p || ce.Var1 != v || ce.Samples != auditSamples || ce.Status != certify.Certified || ce.KLFromAnchor != 0 {
			t.Errorf("re-anchored CE %+v; want anchor %d p1 %v var1 %v", ce, m1.Version, p, v)
		}
	}
	if an, _ := l.Anchors(); len(an) != 1 || an[0].Version != m1.Version || an[0].Refs != len(ces)+1 {
		t.Errorf("anchors after audit %+v, want only %d with %d refs", an, m1.Version, len(ces)+1)
	}
	// The next step is judged from the new anchor.
	m2 := drift(m1, -0.0005)
	rep, _ = commit(t, l, m2, 2)
	if kl, _, _ := certify.KL(m2, m1); rep.MaxAnchorKL != kl || rep.Counts[certify.Certified] != len(ces)+1 {
		t.Errorf("after audit and a small step: %+v, want KL from anchor 1 = %v and all certified", rep, kl)
	}
	// A large drift: audit leaves anchors in place for CEs not back in their set.
	m3 := toBias(m2, -0.3)
	commit(t, l, m3, 3)
	arep, changes, err = l.Audit(bg, NewModelPredictor(m3, 300, 6), AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if arep.Reanchored != 0 || arep.Counts[certify.Invalidated] == 0 {
		t.Fatalf("audit after large drift %+v", arep)
	}
	checkMC(t, l, m3, changes, 300, 6)
	an, _ := l.Anchors()
	refs := 0
	for _, a := range an {
		refs += a.Refs
	}
	if cnt, _ := l.Counts(); refs != sum(cnt)-cnt[certify.Uncertified] {
		t.Errorf("anchor refs %d, CEs holding certificates %d", refs, sum(cnt)-cnt[certify.Uncertified])
	}
}

// Readers see consistent snapshots while checkpoints run (run with -race).
func TestConcurrentReadsDuringCheckpoints(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(14, 14))
	const n = 120
	var ces []*CE
	for i := 0; i < n; i++ {
		ces = append(ces, newCE(t, m, rng))
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	errc := make(chan error, 4)
	reader := func(read func() error) {
		defer wg.Done()
		for ctx.Err() == nil {
			if err := read(); err != nil {
				errc <- err
				return
			}
		}
	}
	wg.Add(3)
	go reader(func() error {
		c, err := l.Counts()
		if err == nil && sum(c) != n {
			err = errors.New("counts do not sum to the number of CEs")
		}
		return err
	})
	go reader(func() error {
		page, err := l.List(0, n, "")
		if err == nil && len(page) != n {
			err = errors.New("list lost CEs")
		}
		return err
	})
	var last uint64
	go reader(func() error {
		cur, err := l.Current()
		if err == nil && cur.Version < last {
			err = errors.New("current posterior went backwards")
		}
		if err == nil {
			last = cur.Version
			_, err = l.Get(ces[int(cur.Version)%n].ID)
		}
		return err
	})
	for i := 0; i < 15; i++ {
		m = drift(m, -0.003)
		if _, _, err := l.Commit(ctx, &Checkpoint{Model: m, Offsets: map[int]int64{0: int64(i)}}); err != nil {
			cancel()
			t.Fatal(err)
		}
	}
	cancel()
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Error(err)
	}
}

// Recertify stops when its context is cancelled.
func TestRecertifyCancelled(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(15, 15))
	if err := l.Put(bg, newCE(t, m, rng)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, _, err := l.Recertify(ctx, drift(m, -4)); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled recertify: %v", err)
	}
}
