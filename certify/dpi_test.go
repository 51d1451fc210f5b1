package certify

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

// tinyPair returns a small model (3 inputs, hidden 5 and 4, 3 classes) with a non-trivial scaler
// and, as qNew, a copy whose last layer is perturbed: means by scale*N(0, 1), log-sigmas by
// 2*scale*N(0, 1). The bodies are shared bit for bit.
func tinyPair(seed uint64, scale float64) (qNew, qOld *bnn.Model) {
	rng := rand.New(rand.NewPCG(seed, 11))
	qOld = bnn.New(3, []int{5, 4}, []string{"a", "b", "c"}, 0.3, rng)
	qOld.Scaler = bnn.Scaler{Mean: []float64{1, -2, 0.5}, Std: []float64{2, 0.5, 1}}
	qNew = qOld.Clone()
	l := qNew.Last()
	for i := range l.WeightMu {
		l.WeightMu[i] += scale * rng.NormFloat64()
		l.WeightLogSigma[i] += 2 * scale * rng.NormFloat64()
	}
	for i := range l.BiasMu {
		l.BiasMu[i] += scale * rng.NormFloat64()
		l.BiasLogSigma[i] += 2 * scale * rng.NormFloat64()
	}
	return qNew, qOld
}

// TestConditionalKLHandComputed: with no hidden layer h is the standardised x itself, so the
// estimate is exact. One weight and one bias: x = 5 standardises to (5 - 1)/2 = 2; the weight's
// mean moves from 0.5 to 0.7 with sigma 0.1 and the bias is N(0, 0.1^2) in both, so
// z ~ N(1.4, 0.05) against N(1.0, 0.05) and KL = 0.4^2 / (2 * 0.05) = 1.6. The parameter KL is
// 0.2^2 / (2 * 0.01) = 2. When the weight's sigma also doubles (0.1 to 0.2), z ~ N(1.4, 0.17)
// against N(1.0, 0.05): with r = 0.17 / 0.05 = 3.4 the KL is (r - 1 - ln r) / 2 + 1.6 =
// 2.188112284188942 and the parameter KL (4 - 1 - ln 4) / 2 + 0.2^2 / (2 * 0.01) = 3.5 - ln 2.
func TestConditionalKLHandComputed(t *testing.T) {
	ls := math.Log(0.1)
	old := &bnn.Model{Layers: []bnn.Layer{{Name: "fc1", In: 1, Out: 1, WeightMu: []float64{0.5}, WeightLogSigma: []float64{ls},
		BiasMu: []float64{0}, BiasLogSigma: []float64{ls}}}, Scaler: bnn.Scaler{Mean: []float64{1}, Std: []float64{2}},
		Classes: []string{"only"}, PriorSigma: 0.1}
	nu := old.Clone()
	nu.Layers[0].WeightMu[0] = 0.7
	e, err := EstimateConditionalKL(nu, old, []float64{5}, 3, 1)
	if err != nil {
		t.Fatal(err)
	}
	if math.Abs(e.Mean-1.6) > 1e-12 || e.Var > 1e-24 || math.Abs(e.ParamKL-2) > 1e-12 {
		t.Fatalf("got mean %.15g var %g param KL %.15g, want 1.6, 0, 2", e.Mean, e.Var, e.ParamKL)
	}
	nu.Layers[0].WeightLogSigma[0] = math.Log(0.2)
	e, err = EstimateConditionalKL(nu, old, []float64{5}, 3, 1)
	if err != nil {
		t.Fatal(err)
	}
	if want, wantParam := 2.188112284188942, 3.5-math.Ln2; !(math.Abs(e.Mean-want) <= 1e-12 && e.Var <= 1e-24 && math.Abs(e.ParamKL-wantParam) <= 1e-12) {
		t.Fatalf("sigma doubled: got mean %.15g var %g param KL %.15g, want %.15g, 0, %.15g", e.Mean, e.Var, e.ParamKL, want, wantParam)
	}
}

// TestConditionalKLThroughAPointMassBody: with a body whose parameters have sigma e^-60, h is the
// forward pass of its means, so every draw, the first included, gives the same exact term. One
// ReLU unit: x = 5 standardises to 2, h = relu(0.5 * 2 + 0) = 1; the last layer's weight mean
// moves from 0.5 to 0.7 (sigma 0.1, bias N(0, 0.1^2)), so z ~ N(0.7, 0.02) against N(0.5, 0.02)
// and KL = 0.2^2 / (2 * 0.02) = 1, from one draw as from three.
func TestConditionalKLThroughAPointMassBody(t *testing.T) {
	ls := math.Log(0.1)
	old := &bnn.Model{Layers: []bnn.Layer{
		{Name: "fc1", In: 1, Out: 1, WeightMu: []float64{0.5}, WeightLogSigma: []float64{-60}, BiasMu: []float64{0}, BiasLogSigma: []float64{-60}},
		{Name: "fc2", In: 1, Out: 1, WeightMu: []float64{0.5}, WeightLogSigma: []float64{ls}, BiasMu: []float64{0}, BiasLogSigma: []float64{ls}},
	}, Scaler: bnn.Scaler{Mean: []float64{1}, Std: []float64{2}}, Classes: []string{"only"}, PriorSigma: 0.1}
	nu := old.Clone()
	nu.Last().WeightMu[0] = 0.7
	for _, draws := range []int{1, 3} {
		e, err := EstimateConditionalKL(nu, old, []float64{5}, draws, 1)
		if err != nil {
			t.Fatal(err)
		}
		if !(math.Abs(e.Mean-1) <= 1e-12 && e.Var <= 1e-24) {
			t.Errorf("%d draws: mean %.15g, var %g; want 1, 0", draws, e.Mean, e.Var)
		}
	}
}

// TestConditionalKLMonteCarlo checks the estimate against an independent Monte-Carlo estimate of
// KL(q_new(h, z) || q_old(h, z)): whole networks drawn from q_new with bnn's sampler (no local
// reparameterisation), h computed by a plain forward pass, z = W h + b from the drawn last layer,
// and the log-density ratio of z given h averaged (h's own ratio is 1: its law is the same).
// Tolerance: 5 standard errors of the difference of the two independent estimates.
func TestConditionalKLMonteCarlo(t *testing.T) {
	S := 200_000
	if testing.Short() {
		S = 40_000
	}
	for _, seed := range []uint64{1, 2, 3} {
		qNew, qOld := tinyPair(seed, 0.15)
		x := []float64{2.5, -1.7, 1.2}
		e, err := EstimateConditionalKL(qNew, qOld, x, S, seed)
		if err != nil {
			t.Fatal(err)
		}
		mc, mcVar := jointKLByWeights(qNew, qOld, x, S, seed+100)
		se := math.Sqrt(e.Var/float64(S) + mcVar/float64(S))
		t.Logf("seed %d: conditional %.5f (param %.5f), joint by weight draws %.5f, se %.5f", seed, e.Mean, e.ParamKL, mc, se)
		if math.Abs(e.Mean-mc) > 5*se {
			t.Errorf("seed %d: conditional KL %.6f, Monte-Carlo joint KL %.6f: differ by %.1f standard errors", seed, e.Mean, mc, math.Abs(e.Mean-mc)/se)
		}
		if e.Mean < 0.01 {
			t.Errorf("seed %d: KL %.6f too small for the comparison to mean anything", seed, e.Mean)
		}
	}
}

// jointKLByWeights is the mean and variance of log q_new(z|h) - log q_old(z|h) over S draws of
// (h, z) from q_new made with whole weight draws.
func jointKLByWeights(qNew, qOld *bnn.Model, x []float64, S int, seed uint64) (mean, variance float64) {
	rng := rand.New(rand.NewPCG(seed, 5))
	net := qNew.NewNet()
	L := len(qNew.Layers)
	a0 := make([]float64, len(x))
	qNew.Scaler.Apply(a0, x)
	var sum, sum2 float64
	for s := 0; s < S; s++ {
		qNew.Sample(rng, net)
		h := a0
		for k := 0; k+1 < L; k++ {
			l := &qNew.Layers[k]
			out := make([]float64, l.Out)
			for o := range out {
				v := net.B[k][o]
				for i, hi := range h {
					v += net.W[k][o*l.In+i] * hi
				}
				out[o] = qNew.Activation.Apply(v)
			}
			h = out
		}
		last := qNew.Last()
		r := 0.0
		for c := 0; c < last.Out; c++ {
			z := net.B[L-1][c]
			for j, hj := range h {
				z += net.W[L-1][c*last.In+j] * hj
			}
			r += logNormalGivenH(qNew.Last(), c, h, z) - logNormalGivenH(qOld.Last(), c, h, z)
		}
		sum += r
		sum2 += r * r
	}
	mean = sum / float64(S)
	return mean, (sum2 - float64(S)*mean*mean) / float64(S-1)
}

// logNormalGivenH is the log-density of logit c at z given h under layer l.
func logNormalGivenH(l *bnn.Layer, c int, h []float64, z float64) float64 {
	m, v := l.BiasMu[c], math.Exp(2*l.BiasLogSigma[c])
	for j, hj := range h {
		m += l.WeightMu[c*l.In+j] * hj
		v += math.Exp(2*l.WeightLogSigma[c*l.In+j]) * hj * hj
	}
	return -0.5*(z-m)*(z-m)/v - 0.5*math.Log(2*math.Pi*v)
}

// TestConditionalKLBelowParameterKL: the data-processing inequality, for random perturbations
// small and large: the estimate and both confidence bounds never exceed the last layer's
// parameter KL, which is certify.KL of the two models (the body contributes 0).
func TestConditionalKLBelowParameterKL(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 9))
	for seed := uint64(1); seed <= 20; seed++ {
		scale := []float64{1e-4, 1e-2, 0.1, 1}[seed%4]
		qNew, qOld := tinyPair(seed, scale)
		full, _, err := KL(qNew, qOld)
		if err != nil {
			t.Fatal(err)
		}
		x := []float64{3 * rng.NormFloat64(), 3 * rng.NormFloat64(), 3 * rng.NormFloat64()}
		e, err := EstimateConditionalKL(qNew, qOld, x, 500, seed)
		if err != nil {
			t.Fatal(err)
		}
		if !(math.Abs(e.ParamKL-full) <= 1e-12*full) { // NaN fails
			t.Fatalf("seed %d: ParamKL %v, certify.KL %v", seed, e.ParamKL, full)
		}
		if !(e.Mean > 0) || e.Mean > full*(1+1e-12) {
			t.Errorf("seed %d (scale %g): conditional KL %v not in (0, parameter KL %v]", seed, scale, e.Mean, full)
		}
		if h, b := e.Hoeffding(0.01), e.Bernstein(0.01); !(h >= e.Mean && h <= full && b >= e.Mean && b <= full) {
			t.Errorf("seed %d: bounds %v (Hoeffding) %v (Bernstein) not in [mean %v, parameter KL %v]", seed, h, b, e.Mean, full)
		}
		t.Logf("scale %g: conditional/parameter %.3f", scale, e.Mean/full)
	}
}

// TestConditionalKLZeroWhenLastLayersEqual: equal posteriors give exactly 0, and so do the bounds.
func TestConditionalKLZeroWhenLastLayersEqual(t *testing.T) {
	_, qOld := tinyPair(4, 0.1)
	mean, upper, err := ConditionalKL(qOld.Clone(), qOld, []float64{1, 2, 3}, 100, 7)
	if err != nil {
		t.Fatal(err)
	}
	if mean != 0 || upper != 0 {
		t.Fatalf("equal models: mean %v, upper %v, want 0, 0", mean, upper)
	}
	e, err := EstimateConditionalKL(qOld.Clone(), qOld, []float64{1, 2, 3}, 100, 7)
	if err != nil {
		t.Fatal(err)
	}
	if b := e.Bernstein(0.01); b != 0 {
		t.Fatalf("equal models: Bernstein bound %v, want 0 (a range of 0 leaves nothing to bound)", b)
	}
}

// TestConditionalKLRefusesDifferentBodies: only a shared body gives h the same law under both.
func TestConditionalKLRefusesDifferentBodies(t *testing.T) {
	qNew, qOld := tinyPair(5, 0.1)
	x := []float64{1, 2, 3}
	cases := []struct {
		name   string
		change func(m *bnn.Model)
		want   string
	}{
		{"body weight", func(m *bnn.Model) { m.Layers[0].WeightMu[3] += 1e-9 }, "bodies differ"},
		{"body sigma", func(m *bnn.Model) { m.Layers[1].BiasLogSigma[0] -= 0.1 }, "bodies differ"},
		{"scaler", func(m *bnn.Model) { m.Scaler.Std[1] *= 1.01 }, "scalers differ"},
		{"scaler mean", func(m *bnn.Model) { m.Scaler.Mean[2] += 1e-9 }, "scalers differ"},
		// Another number of classes: the same body, a last layer with its first two rows only.
		{"classes", func(m *bnn.Model) {
			l := m.Last()
			l.Out = 2
			l.WeightMu, l.WeightLogSigma = l.WeightMu[:2*l.In], l.WeightLogSigma[:2*l.In]
			l.BiasMu, l.BiasLogSigma = l.BiasMu[:2], l.BiasLogSigma[:2]
			m.Classes = m.Classes[:2]
		}, "last layers have shapes"},
		{"activation", func(m *bnn.Model) { m.Activation = bnn.Tanh }, "activations differ"},
		{"invalid", func(m *bnn.Model) { m.Last().BiasMu[0] = math.NaN() }, "invalid model"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := qNew.Clone()
			tc.change(m)
			if _, _, err := ConditionalKL(m, qOld, x, 10, 1); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one that says %q", err, tc.want)
			}
		})
	}
	for _, bad := range []struct {
		x     []float64
		draws int
	}{{[]float64{1, 2}, 10}, {[]float64{1, math.Inf(1), 3}, 10}, {x, 0}} {
		if _, _, err := ConditionalKL(qNew, qOld, bad.x, bad.draws, 1); err == nil {
			t.Errorf("x %v, draws %d: no error", bad.x, bad.draws)
		}
	}
}

// TestConditionalKLUpperBoundCovers: over 400 independent small estimates, the upper bounds at
// alpha = 0.1 miss the true value (a 400,000-draw estimate) at most as often as alpha allows
// (Hoeffding and empirical Bernstein are conservative: the expected miss rate is well below 0.1;
// the threshold 0.1 + 3 binomial standard deviations fails only for a wrong bound).
func TestConditionalKLUpperBoundCovers(t *testing.T) {
	qNew, qOld := tinyPair(6, 0.2)
	x := []float64{0.5, -3, 2}
	truth, err := EstimateConditionalKL(qNew, qOld, x, 400_000, 99)
	if err != nil {
		t.Fatal(err)
	}
	const runs, alpha = 400, 0.1
	var missH, missB int
	for r := 0; r < runs; r++ {
		e, err := EstimateConditionalKL(qNew, qOld, x, 30, uint64(1000+r))
		if err != nil {
			t.Fatal(err)
		}
		if !(e.Hoeffding(alpha) >= truth.Mean) { // a bound that is not a number misses
			missH++
		}
		if !(e.Bernstein(alpha) >= truth.Mean) {
			missB++
		}
	}
	limit := int(runs * (alpha + 3*math.Sqrt(alpha*(1-alpha)/runs)))
	t.Logf("truth %.5f (param %.5f): misses Hoeffding %d, Bernstein %d of %d (limit %d)", truth.Mean, truth.ParamKL, missH, missB, runs, limit)
	if missH > limit || missB > limit {
		t.Fatalf("misses Hoeffding %d, Bernstein %d of %d, limit %d", missH, missB, runs, limit)
	}
}

// The confidence bounds' values against their formulas, computed here from an estimate's
// fields (not through BernsteinMargin): with r = ParamKL and L = ln(2 / alpha),
//
//	Hoeffding = Mean + r sqrt(ln(1 / alpha) / (2 S))
//	Bernstein = Mean + sqrt(2 Var L / S) + 7 r L / (3 (S - 1))
//
// each clipped at r, for ranges r below and above 1 (a variance scaled by r instead of r^2
// shows there), and r itself where the clip binds.
func TestConditionalKLBoundsAreTheirFormulas(t *testing.T) {
	for _, e := range []ConditionalKLEstimate{
		{Mean: 0.1, Var: 0.002, Draws: 400, ParamKL: 1},
		{Mean: 0.05, Var: 0.0008, Draws: 200, ParamKL: 0.25},
		{Mean: 0.9, Var: 0.4, Draws: 50, ParamKL: 3},
		{Mean: 0.2, Var: 0.01, Draws: 10, ParamKL: 0.3}, // both clipped
	} {
		for _, alpha := range []float64{0.01, 0.1} {
			s, r := float64(e.Draws), e.ParamKL
			wantH := min(e.Mean+r*math.Sqrt(math.Log(1/alpha)/(2*s)), r)
			l := math.Log(2 / alpha)
			wantB := min(e.Mean+math.Sqrt(2*e.Var*l/s)+7*r*l/(3*(s-1)), r)
			if got := e.Hoeffding(alpha); !(math.Abs(got-wantH) <= 1e-12*wantH) { // NaN fails
				t.Errorf("%+v alpha %g: Hoeffding %.15g, want %.15g", e, alpha, got, wantH)
			}
			if got := e.Bernstein(alpha); !(math.Abs(got-wantB) <= 1e-12*wantB) {
				t.Errorf("%+v alpha %g: Bernstein %.15g, want %.15g", e, alpha, got, wantB)
			}
		}
	}
}

// The estimate's Var is the unbiased sample variance of its terms: over many estimates of two
// draws, and of five, its mean matches the variance of single-draw estimates (each one term),
// to 20%, where the biased m2 / S would give half (four fifths) of it and m2 * (S - 1), equal to
// m2 / (S - 1) at two draws only, four times it at five. A mean Var that is not a number fails.
func TestConditionalKLVarIsUnbiased(t *testing.T) {
	qNew, qOld := tinyPair(6, 0.2)
	x := []float64{0.5, -3, 2}
	const runs = 3000
	var terms []float64
	for r := 0; r < runs; r++ {
		one, err := EstimateConditionalKL(qNew, qOld, x, 1, uint64(20000+r))
		if err != nil {
			t.Fatal(err)
		}
		terms = append(terms, one.Mean)
	}
	var m, v float64
	for _, t := range terms {
		m += t / runs
	}
	for _, t := range terms {
		v += (t - m) * (t - m) / (runs - 1)
	}
	for _, draws := range []int{2, 5} {
		var meanVar float64
		for r := 0; r < runs; r++ {
			e, err := EstimateConditionalKL(qNew, qOld, x, draws, uint64(7000+r+100_000*draws))
			if err != nil {
				t.Fatal(err)
			}
			meanVar += e.Var / runs
		}
		if ratio := meanVar / v; !(math.Abs(ratio-1) <= 0.2) {
			t.Errorf("mean Var of %d-draw estimates %.4g, variance of the terms %.4g: ratio %.3f, want 1 (%.3f: a biased variance)",
				draws, meanVar, v, ratio, float64(draws-1)/float64(draws))
		}
	}
}

// TestConditionalKLBoundsOutsideTheirDomains: where a confidence bound has no confidence (alpha
// outside (0, 1)), no draws, or too few, it is the data-processing clip ParamKL itself; and a
// ParamKL of 0 (equal last layers) bounds everything at 0, with or without draws. (Hoeffding at
// alpha = 1 would otherwise be the bare Mean; with no draws and ParamKL = 0, 0 * Inf is NaN.)
func TestConditionalKLBoundsOutsideTheirDomains(t *testing.T) {
	e := ConditionalKLEstimate{Mean: 0.1, Var: 0.01, Draws: 100, ParamKL: 0.5}
	for _, alpha := range []float64{0, 1, -0.5, 2, math.NaN()} {
		if h, b := e.Hoeffding(alpha), e.Bernstein(alpha); h != 0.5 || b != 0.5 {
			t.Errorf("alpha %v: Hoeffding %v, Bernstein %v; want ParamKL 0.5", alpha, h, b)
		}
	}
	for _, tc := range []struct {
		e    ConditionalKLEstimate
		want float64
	}{
		{ConditionalKLEstimate{ParamKL: 0.3}, 0.3}, // no draws
		{ConditionalKLEstimate{}, 0},
		{ConditionalKLEstimate{Mean: 0.1, Draws: 1, ParamKL: 0.3}, 0.3}, // Bernstein needs 2 draws
		{ConditionalKLEstimate{Draws: 100}, 0},
	} {
		if tc.e.Draws < 1 || tc.e.ParamKL == 0 {
			if h := tc.e.Hoeffding(0.01); h != tc.want {
				t.Errorf("%+v: Hoeffding %v, want %v", tc.e, h, tc.want)
			}
		}
		if b := tc.e.Bernstein(0.01); b != tc.want {
			t.Errorf("%+v: Bernstein %v, want %v", tc.e, b, tc.want)
		}
	}
}

// TestConditionalKLOneDraw: the variance of one term is 0 (not m2 / 0, which is NaN).
func TestConditionalKLOneDraw(t *testing.T) {
	qNew, qOld := tinyPair(7, 0.2)
	e, err := EstimateConditionalKL(qNew, qOld, []float64{0.5, -1, 2}, 1, 3)
	if err != nil {
		t.Fatal(err)
	}
	if e.Var != 0 || !(e.Mean > 0) {
		t.Fatalf("one draw: mean %v, var %v; want a positive mean and var 0", e.Mean, e.Var)
	}
}

// TestConditionalKLNotFiniteIsAnError: valid models (finite parameters, |log sigma| <= 100) and a
// finite x can still overflow the estimate; it is then an error, not a value. With no hidden
// layer h is x itself: x = 1e200 squares to +Inf in the logits' variances (Inf - Inf: NaN); a
// weight mean of 1e200 squares to +Inf in the mean term (one draw: Mean = +Inf).
func TestConditionalKLNotFiniteIsAnError(t *testing.T) {
	ls := math.Log(0.1)
	old := &bnn.Model{Layers: []bnn.Layer{{Name: "fc1", In: 1, Out: 1, WeightMu: []float64{0.5}, WeightLogSigma: []float64{ls},
		BiasMu: []float64{0}, BiasLogSigma: []float64{ls}}}, Scaler: bnn.Scaler{Mean: []float64{0}, Std: []float64{1}},
		Classes: []string{"only"}, PriorSigma: 0.1}
	nu := old.Clone()
	nu.Layers[0].WeightMu[0] = 0.7
	if e, err := EstimateConditionalKL(nu, old, []float64{1e200}, 1, 1); err == nil {
		t.Errorf("x = 1e200: estimate %+v, no error", e)
	}
	nu.Layers[0].WeightMu[0] = 1e200
	if e, err := EstimateConditionalKL(nu, old, []float64{1}, 1, 1); err == nil {
		t.Errorf("weight mean 1e200: estimate %+v, no error", e)
	}
}

// TestConditionalKLRefusesInfiniteFeatures: an infinite feature is refused by name, even where
// the network would carry it to a finite h: with one tanh hidden unit of positive weight mean,
// x = +Inf gives the pre-activation +Inf + Inf * N(0, 1), which is +Inf (tanh 1, a finite h and a
// finite KL) whenever the normal draw is positive, NaN otherwise. Over 32 seeds of one draw each,
// every one must be refused as a bad feature.
func TestConditionalKLRefusesInfiniteFeatures(t *testing.T) {
	ls := math.Log(0.1)
	layer := func(name string) bnn.Layer {
		return bnn.Layer{Name: name, In: 1, Out: 1, WeightMu: []float64{1}, WeightLogSigma: []float64{ls},
			BiasMu: []float64{0}, BiasLogSigma: []float64{ls}}
	}
	old := &bnn.Model{Layers: []bnn.Layer{layer("fc1"), layer("fc2")}, Activation: bnn.Tanh,
		Scaler: bnn.Scaler{Mean: []float64{0}, Std: []float64{1}}, Classes: []string{"only"}, PriorSigma: 0.1}
	nu := old.Clone()
	nu.Last().WeightMu[0] = 1.5
	if _, err := EstimateConditionalKL(nu, old, []float64{1}, 1, 1); err != nil {
		t.Fatalf("a finite feature: %v", err)
	}
	for _, x := range []float64{math.Inf(1), math.Inf(-1)} {
		for seed := uint64(1); seed <= 32; seed++ {
			if e, err := EstimateConditionalKL(nu, old, []float64{x}, 1, seed); err == nil || !strings.Contains(err.Error(), "feature 0") {
				t.Fatalf("x = %v, seed %d: estimate %+v, error %v; want an error naming feature 0", x, seed, e, err)
			}
		}
	}
}
