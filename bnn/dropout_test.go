package bnn

import (
	"context"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/internal/gradcheck"
)

// TestDropoutGradient checks one row's backward pass against central finite differences of its
// NLL, the dropout mask held fixed (the same rng seed for every pass).
func TestDropoutGradient(t *testing.T) {
	m := New(5, []int{7, 6}, []string{"a", "b", "c"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	m.Dropout = 0.3
	x := []float64{0.3, -1.2, 0.8, 2, -0.4}
	var params []Param
	for k := range m.Layers {
		l := &m.Layers[k]
		params = append(params, Param{Value: l.WeightMu, Grad: make([]float64, len(l.WeightMu))},
			Param{Value: l.BiasMu, Grad: make([]float64, len(l.BiasMu))})
	}
	tr := newDropoutPass(m)
	nllAt := func() float64 {
		scratch := make([]Param, len(params))
		for i, p := range params {
			scratch[i] = Param{Value: p.Value, Grad: make([]float64, len(p.Grad))}
		}
		nll, _ := tr.step(x, 2, rand.New(rand.NewPCG(9, 9)), scratch, 1)
		return nll
	}
	tr.step(x, 2, rand.New(rand.NewPCG(9, 9)), params, 1)
	dropped, checked := 0, 0
	for _, keep := range tr.keep[1:] {
		for _, v := range keep {
			if v == 0 {
				dropped++
			}
		}
	}
	if dropped == 0 {
		t.Fatal("no unit dropped; the mask is not exercised")
	}
	values := make([][]float64, len(params))
	for i, p := range params {
		values[i] = p.Value
	}
	gradcheck.Central(values, 1e-6, nllAt, func(pi, j int, fd float64) {
		if g := params[pi].Grad[j]; math.Abs(fd-g) > 1e-6*math.Max(1, math.Abs(fd)) {
			t.Errorf("param %d[%d]: backprop %.9g, finite difference %.9g", pi, j, g, fd)
		}
		checked++
	})
	if checked == 0 {
		t.Fatal("nothing checked")
	}
}

// TestFitDropoutBreastCancer: the MC Dropout network reaches the paper's accuracy on a held-out
// 20%, its predictive is stochastic (dropout masks, not Gaussian weights), a Pool reproduces
// PredictWith bit for bit, and model files refuse it.
func TestFitDropoutBreastCancer(t *testing.T) {
	set, d, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	train, test := set.Split(0.8, 1)
	m, st, err := FitDropout(context.Background(), train, d.Classes, DefaultDropout, TrainConfig{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	p, err := m.Predict(test.X, 200, 3)
	if err != nil {
		t.Fatal(err)
	}
	correct, spread := 0, 0.0
	for i, y := range test.Y {
		if p.Argmax(i) == y {
			correct++
		}
		spread = math.Max(spread, p.V(i, y))
	}
	acc := float64(correct) / float64(len(test.Y))
	t.Logf("test accuracy %.4f, max predictive variance %.4g, train %+v", acc, spread, st)
	if acc < 0.93 {
		t.Errorf("test accuracy %.4f < 0.93", acc)
	}
	if !(spread > 1e-4) {
		t.Errorf("max predictive variance %v: the passes are not stochastic", spread)
	}
	pool, err := NewPool(m, 50, 7, Float64)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := pool.Predict(context.Background(), test.X[:5])
	b, _ := m.PredictWith(context.Background(), test.X[:5], 50, 7, Float64)
	for i := range a.Mean {
		if a.Mean[i] != b.Mean[i] || a.Var[i] != b.Var[i] {
			t.Fatalf("pool and PredictWith differ at %d: %v %v", i, a.Mean[i], b.Mean[i])
		}
	}
	// Sample gives the engine's networks: the mean of 50 sampled nets' softmax matches.
	net := m.NewNet()
	z := make([]float64, m.Inputs())
	m.Scaler.Apply(z, test.X[0])
	mean := 0.0
	for s := 0; s < 50; s++ {
		m.Sample(SampleSeed(7, s), net)
		h := z
		for k, l := range m.Layers {
			o := make([]float64, l.Out)
			for r := range o {
				o[r] = net.B[k][r]
				for i, v := range h {
					o[r] += net.W[k][r*l.In+i] * v
				}
				if k < len(m.Layers)-1 {
					o[r] = math.Max(o[r], 0)
				}
			}
			h = o
		}
		pr := make([]float64, len(h))
		Softmax(pr, h)
		mean += pr[0] / 50
	}
	if math.Abs(mean-a.P(0, 0)) > 1e-12 {
		t.Errorf("Sample's networks give %v, the engine %v", mean, a.P(0, 0))
	}
	if _, _, err := Encode(m); err == nil || !strings.Contains(err.Error(), "MC Dropout") {
		t.Errorf("Encode of a dropout model: %v", err)
	}
}

// TestDropoutMaskKeepsTheExpectedInput: MC Dropout's prediction masks are inverted dropout, as
// training's are: each input of a hidden layer is dropped with probability p and scaled by
// 1 / (1 - p) when kept, so that its expected value is unchanged (a network predicting with
// masks computes, in expectation, the pre-activations training fitted); the features are never
// dropped. Checked on 20,000 masks, to four standard errors.
func TestDropoutMaskKeepsTheExpectedInput(t *testing.T) {
	for _, p := range []float64{0.5, 0.2} {
		m := &Model{Dropout: p, Layers: []Layer{{In: 30, Out: 16}, {In: 16, Out: 2}}}
		rng := rand.New(rand.NewPCG(1, 2))
		var buf []float64
		const draws = 20000
		var sum, dropped float64
		for range draws {
			buf = m.dropoutMask(1, rng, buf)
			for _, v := range buf {
				sum += v
				if v == 0 {
					dropped++
				}
			}
		}
		n := float64(draws * m.Layers[1].In)
		// A kept input is 1/(1-p) with probability 1-p: mean 1, variance p/(1-p).
		if mean, se := sum/n, math.Sqrt(p/(1-p)/n); math.Abs(mean-1) > 4*se {
			t.Errorf("p = %v: mean mask value %.5f, want 1 (±%.5f)", p, mean, 4*se)
		}
		if frac, se := dropped/n, math.Sqrt(p*(1-p)/n); math.Abs(frac-p) > 4*se {
			t.Errorf("p = %v: %.5f of the inputs dropped, want %v (±%.5f)", p, frac, p, 4*se)
		}
		for _, v := range m.dropoutMask(0, rng, buf) {
			if v != 1 {
				t.Fatalf("p = %v: a feature scaled by %v: the first layer's inputs are never dropped", p, v)
			}
		}
	}
}
