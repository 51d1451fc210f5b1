package bnn

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// fixedEps is a deterministic noise function for tests.
func fixedEps(seed uint64) func(s, k int, bias bool, i int) float64 {
	return func(s, k int, bias bool, i int) float64 {
		b := uint64(0)
		if bias {
			b = 1
		}
		r := rand.New(rand.NewPCG(seed, uint64(s)<<40|uint64(k)<<32|b<<31|uint64(i)))
		return r.NormFloat64()
	}
}

// refObjective computes the graph's loss in plain Go, independently of gorgonia:
// (1/S) sum_s mean_i -log softmax(f(x_i; W_s))[y_i] + scale * KL(q_trainable || target).
func refObjective(m *Model, rows [][]float64, y []int, samples int, eps func(s, k int, bias bool, i int) float64,
	lastOnly bool, scale float64, prev *Model) (loss, nll, kl float64) {
	for s := 0; s < samples; s++ {
		for r, x := range rows {
			h := x
			for k := range m.Layers {
				l := &m.Layers[k]
				a := make([]float64, l.Out)
				for o := 0; o < l.Out; o++ {
					b := l.BiasMu[o] + math.Exp(l.BiasLogSigma[o])*eps(s, k, true, o)
					for i := 0; i < l.In; i++ {
						j := o*l.In + i
						b += (l.WeightMu[j] + math.Exp(l.WeightLogSigma[j])*eps(s, k, false, j)) * h[i]
					}
					if k < len(m.Layers)-1 {
						b = naiveAct(m, b)
					}
					a[o] = b
				}
				h = a
			}
			mx := math.Inf(-1)
			for _, v := range h {
				mx = math.Max(mx, v)
			}
			z := 0.0
			for _, v := range h {
				z += math.Exp(v - mx)
			}
			nll -= (h[y[r]] - mx - math.Log(z)) / float64(len(rows)*samples)
		}
	}
	for k := range m.Layers {
		if lastOnly && k < len(m.Layers)-1 {
			continue
		}
		l := &m.Layers[k]
		mu := append(append([]float64(nil), l.WeightMu...), l.BiasMu...)
		ls := append(append([]float64(nil), l.WeightLogSigma...), l.BiasLogSigma...)
		for j := range mu {
			m0, ls0 := 0.0, math.Log(m.PriorSigma)
			if prev != nil {
				a := &prev.Layers[k]
				m0 = append(append([]float64(nil), a.WeightMu...), a.BiasMu...)[j]
				ls0 = append(append([]float64(nil), a.WeightLogSigma...), a.BiasLogSigma...)[j]
			}
			kl += ls0 - ls[j] + (math.Exp(2*ls[j])+(mu[j]-m0)*(mu[j]-m0))/(2*math.Exp(2*ls0)) - 0.5
		}
	}
	return nll + scale*kl, nll, kl
}

func smallProblem(seed uint64, n, d, classes int) ([][]float64, []int) {
	rng := rand.New(rand.NewPCG(seed, 7))
	X := make([][]float64, n)
	y := make([]int, n)
	for i := range X {
		X[i] = make([]float64, d)
		for j := range X[i] {
			X[i][j] = rng.NormFloat64()
		}
		y[i] = rng.IntN(classes)
	}
	return X, y
}

// perturbed returns a copy of m with every mu and log_sigma moved by a small random amount, so
// that a previous posterior differs from the model.
func perturbed(m *Model, seed uint64, scale float64) *Model {
	rng := rand.New(rand.NewPCG(seed, 11))
	c := m.Clone()
	for k := range c.Layers {
		l := &c.Layers[k]
		for _, v := range [][]float64{l.WeightMu, l.WeightLogSigma, l.BiasMu, l.BiasLogSigma} {
			for i := range v {
				v[i] += scale * rng.NormFloat64()
			}
		}
	}
	return c
}

// TestGraphObjectiveAndGradient checks the graph's loss against a plain-Go evaluation of the
// same formula and its gradient against central finite differences at fixed noise:
//
//	|g - (L(p+h) - L(p-h))/(2h)| <= 1e-6 * max(1, |g|),  h = 1e-5.
//
// The truncation error of the central difference is O(h^2 * third derivative) ~ 1e-10 and the rounding error
// O(1e-16 |L| / h) ~ 1e-11, so 1e-6 is generous yet catches any wrong term.
func TestGraphObjectiveAndGradient(t *testing.T) {
	classes := []string{"a", "b", "c"}
	base := New(4, []int{5, 3}, classes, 0.1, rand.New(rand.NewPCG(1, 2)))
	base = perturbed(base, 3, 0.3) // sigmas no longer all equal to the prior's
	X, y := smallProblem(5, 6, 4, 3)
	for _, tc := range []struct {
		name     string
		cfg      GraphConfig
		rows     int
		withPrev bool
	}{
		{"all layers, prior, one draw, full batch", GraphConfig{Batch: 6, KLScale: 0.05}, 6, false},
		{"all layers, prior, two draws, padded batch", GraphConfig{Batch: 6, Samples: 2, KLScale: 0.2}, 4, false},
		{"last layer, prior", GraphConfig{Batch: 6, Samples: 2, LastOnly: true, KLScale: 0.1}, 5, false},
		{"last layer, previous posterior (vcl)", GraphConfig{Batch: 6, Samples: 3, LastOnly: true, KLScale: 0.5}, 6, true},
		{"all layers, previous posterior, no KL in loss", GraphConfig{Batch: 7, LastOnly: false, KLScale: 0}, 6, true},
	} {
		for _, act := range []Activation{ReLU, Tanh, Sigmoid} {
			base.Activation = act
			t.Run(tc.name+", "+act.String(), func(t *testing.T) {
				var prev *Model
				if tc.withPrev {
					prev = perturbed(base, 9, 0.05)
					tc.cfg.Prev = prev
				}
				gr, err := NewGraph(base, tc.cfg)
				if err != nil {
					t.Fatal(err)
				}
				defer gr.Close()
				eps := fixedEps(42)
				gr.SetEps(eps)
				if err := gr.SetBatch(X[:tc.rows], y[:tc.rows]); err != nil {
					t.Fatal(err)
				}
				ev, err := gr.Run()
				if err != nil {
					t.Fatal(err)
				}
				samples := max(tc.cfg.Samples, 1)
				wantLoss, wantNLL, wantKL := refObjective(base, X[:tc.rows], y[:tc.rows], samples, eps, tc.cfg.LastOnly, tc.cfg.KLScale, prev)
				for _, c := range []struct {
					name      string
					got, want float64
				}{{"loss", ev.Loss, wantLoss}, {"nll", ev.NLL, wantNLL}, {"kl", ev.KL, wantKL}} {
					if math.Abs(c.got-c.want) > 1e-10*math.Max(1, math.Abs(c.want)) {
						t.Errorf("%s = %.15g, plain Go gives %.15g", c.name, c.got, c.want)
					}
				}
				if got := gr.KL(); math.Abs(got-wantKL) > 1e-10*math.Max(1, wantKL) {
					t.Errorf("Graph.KL() = %.15g, plain Go gives %.15g", got, wantKL)
				}
				const h = 1e-5
				checked := 0
				for _, p := range gr.Params() {
					grad := append([]float64(nil), p.Grad...)
					for j := range p.Value {
						orig := p.Value[j]
						p.Value[j] = orig + h
						up, err := gr.Run()
						if err != nil {
							t.Fatal(err)
						}
						p.Value[j] = orig - h
						down, err := gr.Run()
						if err != nil {
							t.Fatal(err)
						}
						p.Value[j] = orig
						fd := (up.Loss - down.Loss) / (2 * h)
						if math.Abs(grad[j]-fd) > 1e-6*math.Max(1, math.Abs(grad[j])) {
							t.Errorf("%s[%d]: gradient %.10g, finite difference %.10g", p.Name, j, grad[j], fd)
						}
						checked++
					}
				}
				want := 0
				for k, l := range base.Layers {
					if !tc.cfg.LastOnly || k == len(base.Layers)-1 {
						want += 2 * l.NumParams()
					}
				}
				if checked != want {
					t.Errorf("checked %d parameters, want %d", checked, want)
				}
			})
		}
	}
}

// TestGraphWriteTo checks the round trip model -> graph -> model (weights transposed inside
// the graph): written into a model of the same shape and other values, a last-only graph sets
// its last layer to the graph's model's, bit for bit, and leaves its body (not trainable) as it
// was; and non-finite values are refused without touching the model.
func TestGraphWriteTo(t *testing.T) {
	m := perturbed(New(3, []int{4}, []string{"x", "y"}, 0.1, rand.New(rand.NewPCG(4, 4))), 5, 0.1)
	gr, err := NewGraph(m, GraphConfig{Batch: 2, LastOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer gr.Close()
	other := perturbed(m, 6, 0.1)
	out := other.Clone()
	if err := gr.WriteTo(out); err != nil {
		t.Fatal(err)
	}
	last := len(m.Layers) - 1
	if !LayersEqual(&m.Layers[last], &out.Layers[last]) {
		t.Error("the last layer written is not the graph's model's")
	}
	for k := range last {
		if !LayersEqual(&other.Layers[k], &out.Layers[k]) {
			t.Errorf("body layer %d, not trainable, was written", k)
		}
	}
	if got := len(gr.Params()); got != 4 {
		t.Fatalf("last-only graph has %d parameter blocks, want 4", got)
	}
	gr.Params()[1].Value[2] = math.NaN()
	before := out.Clone()
	if err := gr.WriteTo(out); !errors.Is(err, ErrNonFinite) {
		t.Fatalf("WriteTo with NaN: err = %v, want ErrNonFinite", err)
	}
	if !LayersEqual(out.Last(), before.Last()) {
		t.Error("failed WriteTo modified the model")
	}
}

func TestGraphBadInput(t *testing.T) {
	m := New(3, []int{4}, []string{"x", "y"}, 0.1, rand.New(rand.NewPCG(4, 4)))
	for _, tc := range []struct {
		name string
		cfg  GraphConfig
	}{
		{"zero batch", GraphConfig{}},
		{"negative samples", GraphConfig{Batch: 1, Samples: -1}},
		{"NaN KL scale", GraphConfig{Batch: 1, KLScale: math.NaN()}},
		{"previous posterior of another shape", GraphConfig{Batch: 1, Prev: New(3, []int{5}, []string{"x", "y"}, 0.1, rand.New(rand.NewPCG(1, 1)))}},
		{"previous posterior with another activation", GraphConfig{Batch: 1, Prev: func() *Model { p := m.Clone(); p.Activation = Tanh; return p }()}},
	} {
		if _, err := NewGraph(m, tc.cfg); err == nil {
			t.Errorf("%s: no error", tc.name)
		}
	}
	gr, err := NewGraph(m, GraphConfig{Batch: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer gr.Close()
	if _, err := gr.Run(); err == nil {
		t.Error("Run without a batch: no error")
	}
	for i, tc := range []struct {
		rows [][]float64
		y    []int
	}{
		{nil, nil},
		{[][]float64{{1, 2, 3}, {1, 2, 3}, {1, 2, 3}}, []int{0, 0, 0}},
		{[][]float64{{1, 2}}, []int{0}},
		{[][]float64{{1, 2, 3}}, []int{2}},
		{[][]float64{{1, 2, 3}}, []int{0, 1}},
	} {
		if err := gr.SetBatch(tc.rows, tc.y); err == nil {
			t.Errorf("bad batch %d: no error", i)
		} else {
			t.Log(fmt.Sprint(err))
		}
	}
}
