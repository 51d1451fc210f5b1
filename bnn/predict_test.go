package bnn

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

func smallModel(seed uint64) *Model {
	m := New(3, []int{5, 4}, []string{"no", "yes", "maybe"}, 0.1, rand.New(rand.NewPCG(seed, 1)))
	m.Scaler = Scaler{Mean: []float64{1, -1, 0.5}, Std: []float64{2, 0.5, 1}}
	return m
}

// naiveAct applies the model's activation, written out independently of Activation.Apply.
func naiveAct(m *Model, s float64) float64 {
	switch m.Activation {
	case Tanh:
		return math.Tanh(s)
	case Sigmoid:
		return 1 / (1 + math.Exp(-s))
	}
	if s < 0 {
		return 0
	}
	return s
}

// naiveProbs is an independent reference forward pass: plain loops, no BLAS.
func naiveProbs(m *Model, net *Net, x []float64) []float64 {
	h := make([]float64, len(x))
	for j := range x {
		h[j] = (x[j] - m.Scaler.Mean[j]) / m.Scaler.Std[j]
	}
	for k, l := range m.Layers {
		o := make([]float64, l.Out)
		for r := 0; r < l.Out; r++ {
			s := net.B[k][r]
			for c := 0; c < l.In; c++ {
				s += net.W[k][r*l.In+c] * h[c]
			}
			if k < len(m.Layers)-1 {
				s = naiveAct(m, s)
			}
			o[r] = s
		}
		h = o
	}
	mx := math.Inf(-1)
	for _, v := range h {
		mx = math.Max(mx, v)
	}
	z := 0.0
	for i := range h {
		h[i] = math.Exp(h[i] - mx)
		z += h[i]
	}
	for i := range h {
		h[i] /= z
	}
	return h
}

func TestPredictMatchesNaiveReference(t *testing.T) {
	m := smallModel(1)
	X := [][]float64{{0, 0, 0}, {1, 2, 3}, {-4, 0.5, 9}, {10, -10, 0}}
	const S = 50
	p, err := m.Predict(X, S, 42)
	if err != nil {
		t.Fatal(err)
	}
	net := m.NewNet()
	for i, x := range X {
		mean := make([]float64, 3)
		sq := make([]float64, 3)
		for s := 0; s < S; s++ {
			m.Sample(SampleSeed(42, s), net)
			for c, f := range naiveProbs(m, net, x) {
				mean[c] += f / S
				sq[c] += f * f
			}
		}
		sum := 0.0
		for c := 0; c < 3; c++ {
			v := (sq[c] - S*mean[c]*mean[c]) / (S - 1)
			if math.Abs(p.P(i, c)-mean[c]) > 1e-12 || math.Abs(p.V(i, c)-v) > 1e-12 {
				t.Fatalf("input %d class %d: got (%v, %v), reference (%v, %v)", i, c, p.P(i, c), p.V(i, c), mean[c], v)
			}
			sum += p.P(i, c)
		}
		if math.Abs(sum-1) > 1e-12 {
			t.Fatalf("input %d: probabilities sum to %v", i, sum)
		}
	}
}

func TestPredictDeterministicAndSeeded(t *testing.T) {
	m := smallModel(2)
	X := [][]float64{{1, 2, 3}, {0, 0, 1}}
	a, _ := m.Predict(X, 20, 7)
	b, _ := m.Predict(X, 20, 7)
	c, _ := m.Predict(X, 20, 6) // 6 and 7 differ in their lowest bit only
	for i := range a.Mean {
		if a.Mean[i] != b.Mean[i] || a.Var[i] != b.Var[i] {
			t.Fatal("same seed gave different results")
		}
	}
	same := true
	for i := range a.Mean {
		same = same && a.Mean[i] == c.Mean[i]
	}
	if same {
		t.Fatal("different seeds gave identical results")
	}
}

// With sigma -> 0 the posterior is a point mass: zero variance, and the mean is the
// deterministic forward pass of the means.
func TestPredictPointMass(t *testing.T) {
	m := smallModel(3)
	for k := range m.Layers {
		for i := range m.Layers[k].WeightLogSigma {
			m.Layers[k].WeightLogSigma[i] = -40
		}
		for i := range m.Layers[k].BiasLogSigma {
			m.Layers[k].BiasLogSigma[i] = -40
		}
	}
	x := []float64{0.3, -2, 4}
	p, err := m.Predict([][]float64{x}, 10, 1)
	if err != nil {
		t.Fatal(err)
	}
	net := m.NewNet()
	m.Mean(net)
	want := naiveProbs(m, net, x)
	for c := range want {
		if math.Abs(p.P(0, c)-want[c]) > 1e-12 || p.V(0, c) > 1e-20 {
			t.Fatalf("class %d: mean %v var %v, want %v and 0", c, p.P(0, c), p.V(0, c), want[c])
		}
	}
}

func TestPredictRejectsBadInput(t *testing.T) {
	m := smallModel(4)
	for name, X := range map[string][][]float64{
		"empty":     {},
		"dimension": {{1, 2}},
		"nan":       {{1, math.NaN(), 2}},
		"inf":       {{math.Inf(1), 0, 0}},
	} {
		if _, err := m.Predict(X, 10, 1); err == nil {
			t.Errorf("%s: want an error", name)
		}
	}
	if _, err := m.Predict([][]float64{{1, 2, 3}}, 1, 1); err == nil {
		t.Error("one sample gives no variance: want an error")
	}
}

func TestValidate(t *testing.T) {
	breakers := map[string]func(m *Model){
		"nan mu":                           func(m *Model) { m.Layers[1].WeightMu[0] = math.NaN() },
		"inf log sigma":                    func(m *Model) { m.Layers[0].BiasLogSigma[0] = math.Inf(1) },
		"huge log sigma":                   func(m *Model) { m.Layers[0].BiasLogSigma[0] = 800 },
		"log sigma whose square overflows": func(m *Model) { m.Layers[2].WeightLogSigma[0] = 500 },
		"log sigma past the bound":         func(m *Model) { m.Layers[2].WeightLogSigma[0] = MaxLogSigma + 1e-9 },
		"tiny log sigma":                   func(m *Model) { m.Layers[2].BiasLogSigma[0] = -MaxLogSigma - 1 },
		"empty class name":                 func(m *Model) { m.Classes[1] = "" },
		"duplicate class names":            func(m *Model) { m.Classes[1] = m.Classes[0] },
		"empty feature name":               func(m *Model) { m.Features = []string{"a", "", "c"} },
		"duplicate feature names":          func(m *Model) { m.Features = []string{"a", "b", "a"} },
		"short bias":                       func(m *Model) { m.Layers[2].BiasMu = m.Layers[2].BiasMu[:1] },
		"chain":                            func(m *Model) { m.Layers[1].In = 7 },
		"classes":                          func(m *Model) { m.Classes = m.Classes[:2] },
		"scaler std":                       func(m *Model) { m.Scaler.Std[1] = 0 },
		"features":                         func(m *Model) { m.Features = []string{"a"} },
		"prior":                            func(m *Model) { m.PriorSigma = 0 },
		// Each of these breaks one rule only, so that the check of that rule decides.
		"nan records":                    func(m *Model) { m.Records = math.NaN() },
		"inf records":                    func(m *Model) { m.Records = math.Inf(1) },
		"inf mu":                         func(m *Model) { m.Layers[1].WeightMu[0] = math.Inf(-1) },
		"log sigma just below the bound": func(m *Model) { m.Layers[0].BiasLogSigma[0] = -MaxLogSigma - 1e-9 },
		"nan scaler mean":                func(m *Model) { m.Scaler.Mean[0] = math.NaN() },
		"inf scaler mean":                func(m *Model) { m.Scaler.Mean[2] = math.Inf(1) },
		"inf scaler std":                 func(m *Model) { m.Scaler.Std[0] = math.Inf(1) },
		"long scaler std":                func(m *Model) { m.Scaler.Std = append(m.Scaler.Std, 1) },
		"short scaler mean":              func(m *Model) { m.Scaler.Mean = m.Scaler.Mean[:2] },
		"negative dropout":               func(m *Model) { m.Dropout = -0.1 },
		"unknown activation":             func(m *Model) { m.Activation = 9 },
		"chain, lengths agreeing": func(m *Model) {
			l := &m.Layers[1]
			l.In = 7
			l.WeightMu, l.WeightLogSigma = make([]float64, l.Out*7), make([]float64, l.Out*7)
		},
		"a layer of no units": func(m *Model) {
			l, next := &m.Layers[1], &m.Layers[2]
			l.Out, l.WeightMu, l.WeightLogSigma, l.BiasMu, l.BiasLogSigma = 0, nil, nil, nil, nil
			next.In, next.WeightMu, next.WeightLogSigma = 0, nil, nil
		},
		"dropout 1": func(m *Model) { m.Dropout = 1 },
		"nan prior": func(m *Model) { m.PriorSigma = math.NaN() },
		// An infinite prior sigma, or one whose square overflows or underflows, makes the
		// learner's prior term log sigma or 1/sigma^2 infinite: every update would fail.
		"inf prior":                   func(m *Model) { m.PriorSigma = math.Inf(1) },
		"prior sigma past the bound":  func(m *Model) { m.PriorSigma = math.Exp(MaxLogSigma + 1e-9) },
		"prior sigma below the bound": func(m *Model) { m.PriorSigma = math.Exp(-MaxLogSigma - 1e-9) },
		"negative prior":              func(m *Model) { m.PriorSigma = -0.1 },
	}
	if err := smallModel(5).Validate(); err != nil {
		t.Fatalf("fresh model invalid: %v", err)
	}
	edge := smallModel(5)
	edge.Layers[2].WeightLogSigma[0], edge.Layers[2].WeightLogSigma[1] = MaxLogSigma, -MaxLogSigma
	edge.Features = []string{"a", "b", "c"}
	if err := edge.Validate(); err != nil {
		t.Fatalf("log sigma at the bound, distinct names: %v", err)
	}
	for name, br := range breakers {
		m := smallModel(5)
		br(m)
		if err := m.Validate(); err == nil {
			t.Errorf("%s: Validate accepted a broken model", name)
		}
	}
}

func TestCloneIsDeep(t *testing.T) {
	m := smallModel(6)
	c := m.Clone()
	c.Layers[0].WeightMu[0] += 1
	c.Scaler.Mean[0] += 1
	c.Classes[0] = "changed"
	if m.Layers[0].WeightMu[0] == c.Layers[0].WeightMu[0] || m.Scaler.Mean[0] == c.Scaler.Mean[0] || m.Classes[0] == "changed" {
		t.Fatal("Clone shares memory with the original")
	}
	if !SameBody(m, m.Clone()) {
		t.Fatal("a clone should have the same body")
	}
}

func TestFitScaler(t *testing.T) {
	s := FitScaler([][]float64{{1, 5}, {3, 5}})
	if s.Mean[0] != 2 || s.Std[0] != 1 || s.Mean[1] != 5 || s.Std[1] != 1 {
		t.Fatalf("scaler %+v", s)
	}
	// A constant feature whose mean rounds away from its value (0.1 three times sums to
	// 0.30000000000000004): its std is rounding, about 1e-17, taken as constant (std 1), not
	// as a scale that would multiply it by 1e17.
	if s := FitScaler([][]float64{{0.1}, {0.1}, {0.1}}); s.Std[0] != 1 {
		t.Errorf("a constant feature of 0.1: std %v, want 1", s.Std[0])
	}
}

// BitsEqual compares bit patterns: NaN equals NaN, -0 is not 0, and lengths must agree.
func TestBitsEqual(t *testing.T) {
	nan, negZero := math.NaN(), math.Copysign(0, -1)
	for _, tc := range []struct {
		a, b []float64
		want bool
	}{
		{[]float64{1, nan}, []float64{1, nan}, true},
		{[]float64{0}, []float64{negZero}, false},
		{[]float64{1}, []float64{1, 1}, false},
		{[]float64{1, 2}, []float64{1, 2.0000000000000004}, false},
	} {
		if got := BitsEqual(tc.a, tc.b); got != tc.want {
			t.Errorf("BitsEqual(%v, %v) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
	}
}

// TestSampleDrawsTheTorchbnnGaussian: every parameter is drawn from N(mu, sigma^2) with
// sigma = exp(log_sigma) (torchbnn's convention, not exp(2 log_sigma) or softplus): over 20,000
// draws each parameter's sample mean and standard deviation match mu and exp(log_sigma) to 4
// standard errors, for log sigmas of -1, 0.5 and 0.
func TestSampleDrawsTheTorchbnnGaussian(t *testing.T) {
	m := smallModel(8)
	logSigmas := []float64{-1, 0.5, 0}
	for k := range m.Layers {
		l := &m.Layers[k]
		for i := range l.WeightLogSigma {
			l.WeightLogSigma[i] = logSigmas[i%len(logSigmas)]
		}
		for i := range l.BiasLogSigma {
			l.BiasLogSigma[i] = logSigmas[(i+1)%len(logSigmas)]
		}
	}
	const n = 20000
	rng := rand.New(rand.NewPCG(5, 6))
	net := m.NewNet()
	type acc struct{ sum, sq float64 }
	w, b := make([][]acc, len(m.Layers)), make([][]acc, len(m.Layers))
	for k, l := range m.Layers {
		w[k], b[k] = make([]acc, len(l.WeightMu)), make([]acc, len(l.BiasMu))
	}
	for range n {
		m.Sample(rng, net)
		for k := range m.Layers {
			for i, v := range net.W[k] {
				w[k][i].sum += v
				w[k][i].sq += v * v
			}
			for i, v := range net.B[k] {
				b[k][i].sum += v
				b[k][i].sq += v * v
			}
		}
	}
	check := func(what string, a acc, mu, logSigma float64) {
		t.Helper()
		sigma := math.Exp(logSigma)
		mean := a.sum / n
		sd := math.Sqrt(a.sq/n - mean*mean)
		if math.Abs(mean-mu) > 4*sigma/math.Sqrt(n) || math.Abs(sd-sigma) > 4*sigma/math.Sqrt(2*n) {
			t.Errorf("%s: mean %.4f sd %.4f, want %.4f and exp(%v) = %.4f", what, mean, sd, mu, logSigma, sigma)
		}
	}
	for k, l := range m.Layers {
		for i := range l.WeightMu {
			check(fmt.Sprintf("%s.weight[%d]", l.Name, i), w[k][i], l.WeightMu[i], l.WeightLogSigma[i])
		}
		for i := range l.BiasMu {
			check(fmt.Sprintf("%s.bias[%d]", l.Name, i), b[k][i], l.BiasMu[i], l.BiasLogSigma[i])
		}
	}
}
