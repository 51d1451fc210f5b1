package certify

import (
	"math"
	"math/big"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

func TestKLDiagHandComputed(t *testing.T) {
	ln := math.Log
	tests := []struct {
		name             string
		m2, ls2, m1, ls1 []float64
		want             float64
	}{
		{"identical", []float64{0.3, -1}, []float64{-2, 0.5}, []float64{0.3, -1}, []float64{-2, 0.5}, 0},
		{"mean shift one sd", []float64{1}, []float64{0}, []float64{0}, []float64{0}, 0.5},
		// log(s1/s2) + s2^2/(2 s1^2) - 1/2 with s2 = 2, s1 = 1: -ln 2 + 2 - 1/2.
		{"wider", []float64{0}, []float64{ln(2)}, []float64{0}, []float64{0}, 1.5 - ln(2)},
		// s2 = 1/2, s1 = 1: ln 2 + 1/8 - 1/2.
		{"narrower", []float64{0}, []float64{-ln(2)}, []float64{0}, []float64{0}, ln(2) - 0.375},
		// sums over parameters: 0.5 + (ln 2 - 0.375).
		{"sum", []float64{1, 0}, []float64{0, -ln(2)}, []float64{0, 0}, []float64{0, 0}, 0.5 + ln(2) - 0.375},
		// mean shift scaled by the OLD sigma (s1 = 0.1): dm^2 / (2 s1^2) = 0.01/0.02.
		{"old sigma scales", []float64{0.1}, []float64{ln(0.1)}, []float64{0}, []float64{ln(0.1)}, 0.5},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := KLDiag(tc.m2, tc.ls2, tc.m1, tc.ls1)
			if math.Abs(got-tc.want) > 1e-12 {
				t.Fatalf("KL = %.15g, want %.15g", got, tc.want)
			}
		})
	}
}

func TestKLDiagAsymmetric(t *testing.T) {
	a := KLDiag([]float64{0}, []float64{math.Log(2)}, []float64{0}, []float64{0})
	b := KLDiag([]float64{0}, []float64{0}, []float64{0}, []float64{math.Log(2)})
	if math.Abs(a-b) < 0.1 {
		t.Fatalf("KL(q2||q1) = %v and KL(q1||q2) = %v should differ", a, b)
	}
}

// TestKLDiagMonteCarlo checks the closed form against a seeded Monte-Carlo estimate
// E_{q2}[log q2(w) - log q1(w)], with a tolerance of 5 standard errors of the estimate.
func TestKLDiagMonteCarlo(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const d, S = 6, 400000
	m1, ls1, m2, ls2 := make([]float64, d), make([]float64, d), make([]float64, d), make([]float64, d)
	for i := 0; i < d; i++ {
		m1[i], m2[i] = rng.NormFloat64(), rng.NormFloat64()
		ls1[i], ls2[i] = rng.Float64()-1, rng.Float64()-1
	}
	logN := func(w, m, ls float64) float64 {
		z := (w - m) / math.Exp(ls)
		return -0.5*z*z - ls - 0.5*math.Log(2*math.Pi)
	}
	var sum, sumsq float64
	for s := 0; s < S; s++ {
		v := 0.0
		for i := 0; i < d; i++ {
			w := m2[i] + math.Exp(ls2[i])*rng.NormFloat64()
			v += logN(w, m2[i], ls2[i]) - logN(w, m1[i], ls1[i])
		}
		sum += v
		sumsq += v * v
	}
	mean := sum / S
	se := math.Sqrt((sumsq/S - mean*mean) / S)
	want := KLDiag(m2, ls2, m1, ls1)
	if math.Abs(mean-want) > 5*se {
		t.Fatalf("closed form %.5f, Monte-Carlo %.5f +- %.5f", want, mean, se)
	}
	t.Logf("closed form %.5f, Monte-Carlo %.5f +- %.5f (S=%d)", want, mean, se, S)
}

// TestKLDiagSmallSteps checks the Expm1 form keeps precision for changes near float64 epsilon:
// for tiny dl, KL ~ dl^2 per parameter.
func TestKLDiagSmallSteps(t *testing.T) {
	const dl = 1e-9
	got := KLDiag([]float64{0}, []float64{dl}, []float64{0}, []float64{0})
	if want := dl * dl; math.Abs(got-want)/want > 1e-6 {
		t.Fatalf("KL = %g, want %g", got, want)
	}
}

func testModel(seed uint64) *bnn.Model {
	return bnn.New(5, []int{4, 3}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(seed, 0)))
}

func TestKLModels(t *testing.T) {
	q1 := testModel(1)
	if kl, n, err := KL(q1, q1.Clone()); err != nil || kl != 0 || n != q1.NumParams() {
		t.Fatalf("KL(q, q) = %v, %d, %v; want 0, %d, nil", kl, n, err, q1.NumParams())
	}
	// A last-layer change: the model KL equals the last layer's terms alone.
	q2 := q1.Clone()
	last := q2.Last()
	for i := range last.WeightMu {
		last.WeightMu[i] += 0.01 * float64(i%3)
		last.WeightLogSigma[i] -= 0.02
	}
	last.BiasMu[0] += 0.05
	kl, _, err := KL(q2, q1)
	if err != nil {
		t.Fatal(err)
	}
	l1 := q1.Last()
	want := KLDiag(last.WeightMu, last.WeightLogSigma, l1.WeightMu, l1.WeightLogSigma) +
		KLDiag(last.BiasMu, last.BiasLogSigma, l1.BiasMu, l1.BiasLogSigma)
	if kl <= 0 || math.Abs(kl-want) > 1e-15 {
		t.Fatalf("KL = %v, want last-layer terms %v", kl, want)
	}
	// A body change counts too: KL over every layer.
	q3 := q2.Clone()
	q3.Layers[0].WeightMu[0] += 0.1
	kl3, _, _ := KL(q3, q1)
	if kl3 <= kl {
		t.Fatalf("body change did not add to KL: %v <= %v", kl3, kl)
	}
	if _, _, err := KL(q1, testModel(2).Clone()); err != nil {
		t.Fatalf("same shapes should work: %v", err)
	}
	other := bnn.New(6, []int{4, 3}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 0)))
	if _, _, err := KL(other, q1); err == nil {
		t.Fatal("KL between differently shaped models should fail")
	}
}

func TestKLToPriorZeroAtPrior(t *testing.T) {
	q := testModel(3)
	for k := range q.Layers {
		l := &q.Layers[k]
		for i := range l.WeightMu {
			l.WeightMu[i] = 0
		}
		for i := range l.BiasMu {
			l.BiasMu[i] = 0
		}
	}
	if v := KLToPrior(q, 0.1); math.Abs(v) > 1e-12 {
		t.Fatalf("KL(prior || prior) = %v", v)
	}
	q.Layers[0].WeightMu[0] = 0.1 // one sd: +1/2
	if v := KLToPrior(q, 0.1); math.Abs(v-0.5) > 1e-12 {
		t.Fatalf("KL = %v, want 0.5", v)
	}
	// Every sigma twice the prior's: each parameter adds log(1/2) + 4/2 - 1/2 = 1.5 - ln 2.
	n := 0
	for k := range q.Layers {
		l := &q.Layers[k]
		for _, ls := range [][]float64{l.WeightLogSigma, l.BiasLogSigma} {
			for i := range ls {
				ls[i] = math.Log(0.2)
				n++
			}
		}
	}
	if v, want := KLToPrior(q, 0.1), 0.5+float64(n)*(1.5-math.Ln2); math.Abs(v-want) > 1e-9*want {
		t.Fatalf("KL with sigma = 2 sigma_p: %v, want %v", v, want)
	}
}

// TestExpm1MinusX checks expm1MinusX against 256-bit arithmetic at points across its range and
// on a sweep of 1e-3 < |x| < 2e-3, where math.Exp's cancellation costs the most, to the relative
// error its comment states.
func TestExpm1MinusX(t *testing.T) {
	xs := []float64{-0.5, -1e-3, -9.99e-4, -1e-7, 0, 1e-9, 5e-4, 1e-3, 0.01, 2}
	for k := range 2000 {
		x := 1e-3 + float64(k)*1e-3/2000
		xs = append(xs, x, -x)
	}
	// From 2e-3 to 1 on a log scale: where a series with a larger cut-off than 1e-3 would be out
	// (its truncation error ~|x|^3/60 relative passes 2.2e-10 from |x| ~ 2.4e-3 on).
	for k := range 200 {
		x := 2e-3 * math.Pow(500, float64(k)/199)
		xs = append(xs, x, -x)
	}
	for _, x := range xs {
		want := bigExpm1MinusX(x)
		if got := expm1MinusX(x); math.Abs(got-want) > 2.2e-10*math.Abs(want)+1e-300 {
			t.Errorf("expm1MinusX(%g) = %.17g, want %.17g", x, got, want)
		}
	}
}

// bigExpm1MinusX is an independent reference: sum_{k>=2} x^k / k! at 256-bit precision.
func bigExpm1MinusX(x float64) float64 {
	bx := new(big.Float).SetPrec(256).SetFloat64(x)
	term := new(big.Float).SetPrec(256).Mul(bx, bx)
	term.Quo(term, big.NewFloat(2))
	sum := new(big.Float).SetPrec(256).Set(term)
	for k := 3; k < 80; k++ {
		term.Mul(term, bx)
		term.Quo(term, new(big.Float).SetInt64(int64(k)))
		sum.Add(sum, term)
	}
	f, _ := sum.Float64()
	return f
}

// TestKLOverflowIsAnError: a posterior whose KL overflows float64 (a log sigma of 400: exp(800))
// has no KL, and KL says so rather than returning +Inf as a value.
func TestKLOverflowIsAnError(t *testing.T) {
	q1 := testModel(1)
	q2 := q1.Clone()
	q2.Last().WeightLogSigma[0] = 400
	if kl, _, err := KL(q2, q1); err == nil {
		t.Fatalf("KL with a log sigma of 400 = %v, nil; want an error", kl)
	}
}

// TestKLRefusesDifferentDepths: models with different numbers of layers have no KL, even when
// every layer the shallower one has matches the deeper one's in shape (5->4, 4->3 against
// 5->4, 4->3, 3->3), in either order.
func TestKLRefusesDifferentDepths(t *testing.T) {
	classes := []string{"a", "b", "c"}
	shallow := bnn.New(5, []int{4}, classes, 0.1, rand.New(rand.NewPCG(1, 0)))
	deep := bnn.New(5, []int{4, 3}, classes, 0.1, rand.New(rand.NewPCG(1, 0)))
	for k := range shallow.Layers {
		if a, b := shallow.Layers[k], deep.Layers[k]; a.In != b.In || a.Out != b.Out {
			t.Fatalf("layer %d: shapes %dx%d and %dx%d: the test needs matching shapes", k, a.Out, a.In, b.Out, b.In)
		}
	}
	if kl, _, err := KL(shallow, deep); err == nil {
		t.Errorf("KL(1 hidden layer || 2 hidden layers) = %v, nil; want an error", kl)
	}
	if kl, _, err := KL(deep, shallow); err == nil {
		t.Errorf("KL(2 hidden layers || 1 hidden layer) = %v, nil; want an error", kl)
	}
}

// TestKLNaNIsAnError: a model with a NaN parameter (a corrupt model; KL does not validate its
// inputs) has no KL, and KL says so rather than returning NaN as a value.
func TestKLNaNIsAnError(t *testing.T) {
	q1 := testModel(1)
	q2 := q1.Clone()
	q2.Last().WeightMu[0] = math.NaN()
	if kl, _, err := KL(q2, q1); err == nil {
		t.Fatalf("KL with a NaN weight mean = %v, nil; want an error", kl)
	}
}
