package explain

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

// testModel is an untrained model with non-trivial weights and posterior spread.
func testModel(t *testing.T, d int, hidden []int, classes int, seed uint64) *bnn.Model {
	t.Helper()
	names := make([]string, classes)
	for c := range names {
		names[c] = string(rune('a' + c))
	}
	m := bnn.New(d, hidden, names, 0.1, rand.New(rand.NewPCG(seed, 1)))
	// Widen the posterior so that the variance term is far from 0 and the draws disagree.
	for k := range m.Layers {
		for i := range m.Layers[k].WeightLogSigma {
			m.Layers[k].WeightLogSigma[i] = math.Log(0.3)
		}
	}
	return m
}

// testVAE is an untrained VAE (random weights) over m's space.
func testVAE(t *testing.T, m *bnn.Model, latent int, seed uint64) *VAE {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 2))
	d, h := m.Inputs(), 12
	v := &VAE{Inputs: d, Hidden: h, Latent: latent, ObsVar: 0.7, Scaler: m.Scaler}
	v.enc, v.mu, v.logvar = newDense(d, h, rng), newDense(h, latent, rng), newDense(h, latent, rng)
	v.dec, v.out = newDense(latent, h, rng), newDense(h, d, rng)
	return v
}

func sampleNets(m *bnn.Model, n int, seed uint64) []*bnn.Net {
	nets := make([]*bnn.Net, n)
	for s := range nets {
		nets[s] = m.NewNet()
		m.Sample(bnn.SampleSeed(seed, s), nets[s])
	}
	return nets
}

// netProbs is the softmax output of one sampled network at a standardised z, in plain loops with
// the activation written out (independent of bnn's engine and of the graph).
func netProbs(act bnn.Activation, n *bnn.Net, z []float64) []float64 {
	h := z
	for k := range n.W {
		out := make([]float64, len(n.B[k]))
		for o := range out {
			s := n.B[k][o]
			for i, v := range h {
				s += n.W[k][o*len(h)+i] * v
			}
			if k < len(n.W)-1 {
				switch act {
				case bnn.Tanh:
					s = math.Tanh(s)
				case bnn.Sigmoid:
					s = 1 / (1 + math.Exp(-s))
				default:
					s = math.Max(s, 0)
				}
			}
			out[o] = s
		}
		h = out
	}
	p := make([]float64, len(h))
	bnn.Softmax(p, h)
	return p
}

// referenceTerms computes the objective's terms in plain Go (netProbs and the VAE's ELBOWith),
// independently of the gorgonia graph.
func referenceTerms(act bnn.Activation, nets []*bnn.Net, v *VAE, z, x0, mu0, zeta []float64, target int, delta, epsilon, deltaMax float64) [numTerms]float64 {
	var r [numTerms]float64
	ps := make([]float64, len(nets))
	l1 := 0.0
	for j := range z {
		l1 += math.Abs(z[j])
		r[termProxL1] += math.Abs(z[j] - x0[j])
	}
	for s, n := range nets {
		probs := netProbs(act, n, z)
		ps[s] = probs[target]
		r[termClf] -= math.Log(ps[s]) / float64(len(nets))
		others := 0.0
		for c, p := range probs {
			if c != target {
				others += p
			}
		}
		logit := math.Log(ps[s]) - math.Log(others+1e-12)
		r[termRobust] += math.Log1p(math.Exp(deltaMax*(l1+1)-logit)) / float64(len(nets))
	}
	mean := 0.0
	for _, p := range ps {
		mean += p / float64(len(ps))
	}
	vr := 0.0
	for _, p := range ps {
		vr += (p - mean) * (p - mean) / float64(len(ps)-1)
	}
	r[termPred] = -math.Log(mean)
	r[termDelta] = math.Max(1-delta-mean, 0)
	r[termVar] = math.Max(vr-epsilon, 0)
	for j := range z {
		r[termProx] += (z[j] - x0[j]) * (z[j] - x0[j])
	}
	if v != nil {
		mu, _ := v.Encode(z)
		for k := range mu {
			r[termLatent] += (mu[k] - mu0[k]) * (mu[k] - mu0[k])
		}
		r[termELBO] = v.ELBOWith(z, zeta)
	}
	return r
}

// TestObjectiveMatchesReference checks the graph's forward values against plain Go, for every
// activation of the model.
func TestObjectiveMatchesReference(t *testing.T) {
	for _, act := range []bnn.Activation{bnn.ReLU, bnn.Tanh, bnn.Sigmoid} {
		t.Run(act.String(), func(t *testing.T) { testObjectiveMatchesReference(t, act) })
	}
}

func testObjectiveMatchesReference(t *testing.T, act bnn.Activation) {
	m := testModel(t, 5, []int{7, 6}, 3, 1)
	m.Activation = act
	v := testVAE(t, m, 3, 2)
	const S = 6
	o, err := newObjective(m, v, S)
	if err != nil {
		t.Fatal(err)
	}
	defer o.close()
	nets := sampleNets(m, S, 3)
	rng := rand.New(rand.NewPCG(4, 4))
	z, x0, mu0, zeta := randVec(rng, 5), randVec(rng, 5), randVec(rng, 3), randVec(rng, 3)
	if err := o.setNets(nets); err != nil {
		t.Fatal(err)
	}
	// delta and epsilon chosen so that both hinges are active.
	const delta, epsilon = 0.01, 1e-6
	if err := o.setProblem(2, x0, mu0, Weights{Class: 1.5, Delta: 0.7, Latent: 0.3, Var: 2, ELBO: 0.2, Prox: 0.4,
		Pred: 0.6, Robust: 0.8, ProxL1: 0.9}, delta, epsilon); err != nil {
		t.Fatal(err)
	}
	const deltaMax = 0.07
	if err := o.setDeltaMax(deltaMax); err != nil {
		t.Fatal(err)
	}
	if err := o.setZeta(zeta); err != nil {
		t.Fatal(err)
	}
	var ev objectiveEval
	if err := o.eval(z, &ev); err != nil {
		t.Fatal(err)
	}
	ref := referenceTerms(act, nets, v, z, x0, mu0, zeta, 2, delta, epsilon, deltaMax)
	for term := term(0); term < numTerms; term++ {
		if d := math.Abs(ev.Terms[term] - ref[term]); d > 1e-10*math.Max(1, math.Abs(ref[term])) {
			t.Errorf("%v: graph %v, reference %v", term, ev.Terms[term], ref[term])
		}
		if ref[term] == 0 {
			t.Errorf("%v is 0 in this set-up; the test would not exercise it", term)
		}
	}
	want := 1.5*ref[termClf] + 0.7*ref[termDelta] + 0.3*ref[termLatent] + 2*ref[termVar] - 0.2*ref[termELBO] + 0.4*ref[termProx] +
		0.6*ref[termPred] + 0.8*ref[termRobust] + 0.9*ref[termProxL1]
	if math.Abs(ev.Total-want) > 1e-10*math.Abs(want) {
		t.Errorf("total %v, want %v", ev.Total, want)
	}
}

func randVec(rng *rand.Rand, n int) []float64 {
	v := make([]float64, n)
	for i := range v {
		v[i] = rng.NormFloat64()
	}
	return v
}

// TestObjectiveGradients checks d term / d x' of every term (each alone, weight 1) against
// central finite differences of the graph's own forward value, with fixed sampled networks and
// fixed ELBO noise, at several random points, for every activation of the model.
func TestObjectiveGradients(t *testing.T) {
	for _, act := range []bnn.Activation{bnn.ReLU, bnn.Tanh, bnn.Sigmoid} {
		t.Run(act.String(), func(t *testing.T) { testObjectiveGradients(t, act) })
	}
}

func testObjectiveGradients(t *testing.T, act bnn.Activation) {
	m := testModel(t, 6, []int{9, 7}, 2, 5)
	m.Activation = act
	v := testVAE(t, m, 3, 6)
	const S = 8
	o, err := newObjective(m, v, S)
	if err != nil {
		t.Fatal(err)
	}
	defer o.close()
	rng := rand.New(rand.NewPCG(7, 7))
	for trial := 0; trial < 3; trial++ {
		if err := o.setNets(sampleNets(m, S, uint64(10+trial))); err != nil {
			t.Fatal(err)
		}
		if err := o.setZeta(randVec(rng, 3)); err != nil {
			t.Fatal(err)
		}
		z, x0, mu0 := randVec(rng, 6), randVec(rng, 6), randVec(rng, 3)
		for term := term(0); term < numTerms; term++ {
			var w Weights
			ws := []*float64{&w.Class, &w.Delta, &w.Latent, &w.Var, &w.ELBO, &w.Prox, &w.Pred, &w.Robust, &w.ProxL1}
			*ws[term] = 1
			// delta = 0.001 and epsilon = 0 keep the hinges active (checked below).
			if err := o.setProblem(trial%2, x0, mu0, w, 0.001, 0); err != nil {
				t.Fatal(err)
			}
			var ev objectiveEval
			if err := o.eval(z, &ev); err != nil {
				t.Fatal(err)
			}
			if ev.Terms[term] == 0 {
				t.Fatalf("trial %d: %v is 0, hinge inactive", trial, term)
			}
			grad := append([]float64(nil), ev.Grad...)
			const h = 1e-6
			for j := range z {
				zp := append([]float64(nil), z...)
				zm := append([]float64(nil), z...)
				zp[j] += h
				zm[j] -= h
				var ep, em objectiveEval
				if err := o.eval(zp, &ep); err != nil {
					t.Fatal(err)
				}
				if err := o.eval(zm, &em); err != nil {
					t.Fatal(err)
				}
				fd := (ep.Total - em.Total) / (2 * h)
				if term == termELBO {
					fd = -fd // the objective subtracts the ELBO; compare d ELBO / d x'
					grad[j] = -ev.Grad[j]
				}
				if d := math.Abs(fd - grad[j]); d > 1e-5*math.Max(1, math.Abs(fd)) {
					t.Errorf("trial %d %v: d/dx'[%d] autodiff %.9g, finite difference %.9g", trial, term, j, grad[j], fd)
				}
			}
		}
	}
}

// TestObjectiveWithoutVAE builds the baselines' graph (no VAE terms).
func TestObjectiveWithoutVAE(t *testing.T) {
	m := testModel(t, 4, []int{5}, 2, 9)
	o, err := newObjective(m, nil, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer o.close()
	if err := o.setNets(sampleNets(m, 4, 1)); err != nil {
		t.Fatal(err)
	}
	if err := o.setProblem(1, make([]float64, 4), nil, Weights{Class: 1, Prox: 0.1}, 0.05, 0.01); err != nil {
		t.Fatal(err)
	}
	var ev objectiveEval
	if err := o.eval([]float64{1, -1, 0.5, 2}, &ev); err != nil {
		t.Fatal(err)
	}
	if ev.Terms[termELBO] != 0 || ev.Terms[termLatent] != 0 {
		t.Errorf("VAE terms %v %v without a VAE", ev.Terms[termELBO], ev.Terms[termLatent])
	}
	if want := 0.1 * (1 + 1 + 0.25 + 4); math.Abs(ev.Total-ev.Terms[termClf]-want) > 1e-12 {
		t.Errorf("total - L_clf = %v, want prox %v", ev.Total-ev.Terms[termClf], want)
	}
	_ = context.Background()
}

// Far from the data (x' at -1000 standard deviations in every feature) E_w[p(y' | x', w)]
// underflows to 0, and L_pred = -log E[p] would be +Inf: with the weight 0 Wachter gives it, the
// total would be 0 x Inf = NaN, and the search would give up on an objective whose own terms
// are finite. L_pred is kept finite (-log(E[p] + 1e-300), about 690.8 there), so the total and its
// gradient are Wachter's terms alone.
func TestZeroWeightTermLeavesTheObjectiveFinite(t *testing.T) {
	m, _, _ := blobFixture(t)
	const S = 4
	o, err := newObjective(m, nil, S)
	if err != nil {
		t.Fatal(err)
	}
	defer o.close()
	if err := o.setNets(sampleNets(m, S, 3)); err != nil {
		t.Fatal(err)
	}
	z0 := make([]float64, m.Inputs())
	w := WachterWeights
	if err := o.setProblem(1, z0, nil, w, 0.05, 0.01); err != nil {
		t.Fatal(err)
	}
	z := make([]float64, m.Inputs())
	for j := range z {
		z[j] = -1000
	}
	var ev objectiveEval
	if err := o.eval(z, &ev); err != nil {
		t.Fatal(err)
	}
	want := w.Class*ev.Terms[termClf] + w.Prox*ev.Terms[termProx]
	if w.Pred != 0 || math.IsNaN(ev.Total) || math.Abs(ev.Total-want) > 1e-9*math.Abs(want) {
		t.Errorf("total %v, want Wachter's own %v (L_clf %v, L_prox %v; L_pred %v at weight %v)", ev.Total, want, ev.Terms[termClf], ev.Terms[termProx], ev.Terms[termPred], w.Pred)
	}
	if math.Abs(ev.Terms[termPred]+math.Log(1e-300)) > 1e-9 {
		t.Errorf("L_pred %v where E[p] underflows, want -log(1e-300) = %v", ev.Terms[termPred], -math.Log(1e-300))
	}
	for j, g := range ev.Grad {
		if math.IsNaN(g) || math.IsInf(g, 0) {
			t.Fatalf("gradient[%d] = %v", j, g)
		}
	}
}
