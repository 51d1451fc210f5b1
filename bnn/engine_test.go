package bnn

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

// paperModel is the paper's architecture (30 -> 64 -> 32 -> 2) with torchbnn's initialisation,
// its log-sigmas spread around the prior's, and n inputs of standard normal raw features.
func paperModel(seed uint64, act Activation, n int) (*Model, [][]float64) {
	rng := rand.New(rand.NewPCG(seed, 9))
	m := New(30, DefaultHidden, []string{"a", "b"}, DefaultPriorSigma, rng)
	m.Activation = act
	for k := range m.Layers {
		for i := range m.Layers[k].WeightLogSigma {
			m.Layers[k].WeightLogSigma[i] += 0.5 * rng.NormFloat64()
		}
	}
	X := make([][]float64, n)
	for i := range X {
		X[i] = make([]float64, 30)
		for j := range X[i] {
			X[i][j] = rng.NormFloat64()
		}
	}
	return m, X
}

// refPredict is the predictive computed with naiveProbs over the draws Sample(SampleSeed(seed, s)),
// with the textbook formulas mean = sum f / S and var = sum (f - mean)^2 / (S - 1).
func refPredict(m *Model, X [][]float64, samples int, seed uint64) (mean, vr [][]float64) {
	c := m.NumClasses()
	fs := make([][][]float64, len(X)) // input, draw, class
	net := m.NewNet()
	for s := 0; s < samples; s++ {
		m.Sample(SampleSeed(seed, s), net)
		for i, x := range X {
			fs[i] = append(fs[i], naiveProbs(m, net, x))
		}
	}
	mean, vr = make([][]float64, len(X)), make([][]float64, len(X))
	for i := range X {
		mean[i], vr[i] = make([]float64, c), make([]float64, c)
		for j := 0; j < c; j++ {
			for _, f := range fs[i] {
				mean[i][j] += f[j] / float64(samples)
			}
			for _, f := range fs[i] {
				vr[i][j] += (f[j] - mean[i][j]) * (f[j] - mean[i][j]) / float64(samples-1)
			}
		}
	}
	return mean, vr
}

// TestEngineMatchesReference checks the float64 engine against the plain-loop reference to 1e-12
// (absolute, on probabilities and variances) for every activation, on both of its paths (one
// input at a time below chunkMin inputs, chunks above, with a partial last chunk) and, under
// -tags openblas, with OpenBLAS's products.
func TestEngineMatchesReference(t *testing.T) {
	for _, act := range []Activation{ReLU, Tanh, Sigmoid} {
		for _, n := range []int{1, chunkMin - 1, chunkMin, 2*chunkRows + 17} {
			m, X := paperModel(uint64(n), act, n)
			const S = 7
			p, err := m.Predict(X, S, 11)
			if err != nil {
				t.Fatal(err)
			}
			mean, vr := refPredict(m, X, S, 11)
			for i := range X {
				for c := 0; c < 2; c++ {
					if math.Abs(p.P(i, c)-mean[i][c]) > 1e-12 || math.Abs(p.V(i, c)-vr[i][c]) > 1e-12 {
						t.Fatalf("%s, %d inputs (%s), input %d class %d: engine (%v, %v), reference (%v, %v)",
							act, n, Backend, i, c, p.P(i, c), p.V(i, c), mean[i][c], vr[i][c])
					}
				}
			}
		}
	}
}

// TestEngineBatchIndependent: an input's estimate does not depend on which other inputs share the
// call. In the default build both paths add every output's products in the same order without
// fused multiply-adds, so the equality is exact; OpenBLAS sums in its own order (1e-12). Every
// input of the chunked call is compared with the one-at-a-time path (calls of chunkMin-1
// inputs), the means and the variances.
func TestEngineBatchIndependent(t *testing.T) {
	m, X := paperModel(3, ReLU, 3*chunkRows/2)
	for _, prec := range []Precision{Float64, Float32} {
		all, err := m.PredictWith(context.Background(), X, 5, 2, prec)
		if err != nil {
			t.Fatal(err)
		}
		for lo := 0; lo < len(X); lo += chunkMin - 1 {
			hi := min(lo+chunkMin-1, len(X))
			few, err := m.PredictWith(context.Background(), X[lo:hi], 5, 2, prec)
			if err != nil {
				t.Fatal(err)
			}
			for i := lo; i < hi; i++ {
				for c := 0; c < 2; c++ {
					for _, v := range [][2]float64{{all.P(i, c), few.P(i-lo, c)}, {all.V(i, c), few.V(i-lo, c)}} {
						if Backend == "gonum" && v[0] != v[1] {
							t.Fatalf("%s input %d class %d: %v in the batch, %v one at a time (mean, then variance)", prec, i, c, v[0], v[1])
						}
						if tol := map[Precision]float64{Float64: 1e-12, Float32: 1e-6}[prec]; math.Abs(v[0]-v[1]) > tol {
							t.Fatalf("%s input %d class %d: %v in the batch, %v one at a time (%s)", prec, i, c, v[0], v[1], Backend)
						}
					}
				}
			}
		}
	}
}

// f32Bound returns the float64 class probabilities of standardised input z under net, and a
// bound on how far the float32 engine's probabilities can be from them (see Precision). With
// u = 2^-24 and gamma(n) = n u / (1 - n u), the error e of a layer's outputs obeys
//
//	e_0 = u |z|                                         (rounding the inputs)
//	e_k <= (1 + g) |W_k| e_{k-1} + g (|W_k| |h_{k-1}| + |b_k|),   g = gamma(n_k + 3)
//	     (+ u |act(a_k)| for tanh and sigmoid, whose results are rounded to float32)
//
// where the first term propagates the inputs' error through the layer (every activation is
// 1-Lipschitz), and g covers the float32 dot product (gamma(n)), the bias addition and the
// rounding of the weights and bias to float32. A softmax probability moves by at most
// sum_j |dp_c/dl_j| max|dl| = 2 p_c (1 - p_c) max|dl| <= max|dl| / 2.
func f32Bound(m *Model, net *Net, z []float64) (probs []float64, bound float64) {
	const u = 0x1p-24
	gamma := func(n int) float64 { return float64(n) * u / (1 - float64(n)*u) }
	h := z
	e := make([]float64, len(z))
	for j, v := range z {
		e[j] = u * math.Abs(v)
	}
	for k, l := range m.Layers {
		hk, ek := make([]float64, l.Out), make([]float64, l.Out)
		g := gamma(l.In + 3)
		for o := 0; o < l.Out; o++ {
			s, abs, prop := net.B[k][o], math.Abs(net.B[k][o]), 0.0
			for i := 0; i < l.In; i++ {
				w := net.W[k][o*l.In+i]
				s += w * h[i]
				abs += math.Abs(w * h[i])
				prop += math.Abs(w) * e[i]
			}
			ek[o] = (1+g)*prop + g*abs
			if k < len(m.Layers)-1 {
				s = naiveAct(m, s)
				if m.Activation != ReLU {
					ek[o] += u * (math.Abs(s) + ek[o])
				}
			}
			hk[o] = s
		}
		h, e = hk, ek
	}
	probs = make([]float64, len(h))
	Softmax(probs, h)
	for _, v := range e {
		bound = math.Max(bound, v/2)
	}
	return probs, bound
}

// TestFloat32WithinDerivedBound checks the float32 engine against float64 within the bound of
// f32Bound, per input and class:
//
//	|mean32 - mean64| <= M = (1/S) sum_s B_s
//	|var32 - var64|   <= 2/(S-1) sum_s (B_s + M)
//
// (each term (f - mean)^2 moves by at most (|df| + |dmean|) (|f - mean| + |f' - mean'|) and
// both deviations are at most 1), plus 1e-13 for float64 rounding. It also checks that the bound
// is far below the Monte-Carlo error it competes with: 10 times below the standard error of a
// 1000-draw estimate of p = 1/2, sqrt(0.25 / 1000) = 0.0158.
func TestFloat32WithinDerivedBound(t *testing.T) {
	for _, act := range []Activation{ReLU, Tanh, Sigmoid} {
		for _, n := range []int{3, chunkRows + 5} {
			m, X := paperModel(7, act, n)
			const S = 20
			p32, err := m.PredictWith(context.Background(), X, S, 5, Float32)
			if err != nil {
				t.Fatal(err)
			}
			p64, err := m.PredictWith(context.Background(), X, S, 5, Float64)
			if err != nil {
				t.Fatal(err)
			}
			if p32.Precision != Float32 || p64.Precision != Float64 {
				t.Fatal("Predictive.Precision not set")
			}
			z, _ := m.standardizeRows(X)
			net := m.NewNet()
			bounds := make([][]float64, n)
			for s := 0; s < S; s++ {
				m.Sample(SampleSeed(5, s), net)
				for i := range X {
					_, b := f32Bound(m, net, z[i])
					bounds[i] = append(bounds[i], b)
				}
			}
			worstBound, worstErr := 0.0, 0.0
			for i := range X {
				mb := 0.0
				for _, b := range bounds[i] {
					mb += b / S
				}
				vb := 0.0
				for _, b := range bounds[i] {
					vb += 2 * (b + mb) / (S - 1)
				}
				worstBound = math.Max(worstBound, mb)
				for c := 0; c < 2; c++ {
					dm, dv := math.Abs(p32.P(i, c)-p64.P(i, c)), math.Abs(p32.V(i, c)-p64.V(i, c))
					worstErr = math.Max(worstErr, dm)
					if dm > mb+1e-13 || dv > vb+1e-13 {
						t.Fatalf("%s input %d class %d: |dmean| %.3g (bound %.3g), |dvar| %.3g (bound %.3g)", act, i, c, dm, mb, dv, vb)
					}
				}
			}
			t.Logf("%s, %d inputs (%s): largest bound on |mean32 - mean64| %.2g, largest error %.2g", act, n, Backend, worstBound, worstErr)
			if worstBound > 0.00158 {
				t.Fatalf("%s: the float32 bound %.3g is not 10x below the 1000-draw Monte-Carlo error", act, worstBound)
			}
		}
	}
}

// handModel is 1 input -> 2 hidden -> 2 classes with (almost) no posterior spread, small enough
// to compute by hand:
//
//	a = (x + 0.5, -2x + 0.25),  h = act(a),  logits = (h0 + h1, -h0 + 2 h1 + 0.1).
func handModel(act Activation) *Model {
	m := New(1, []int{2}, []string{"no", "yes"}, DefaultPriorSigma, rand.New(rand.NewPCG(1, 1)))
	m.Activation = act
	m.Layers[0].WeightMu, m.Layers[0].BiasMu = []float64{1, -2}, []float64{0.5, 0.25}
	m.Layers[1].WeightMu, m.Layers[1].BiasMu = []float64{1, 1, -1, 2}, []float64{0, 0.1}
	for k := range m.Layers {
		for _, ls := range [][]float64{m.Layers[k].WeightLogSigma, m.Layers[k].BiasLogSigma} {
			for i := range ls {
				ls[i] = -60 // sigma ~ 1e-26: the draws are the means to within 1e-25
			}
		}
	}
	return m
}

// TestActivationIsHonoured: the same weights give different predictions under relu, tanh and
// sigmoid, each equal to the hand computation at x = 0.3,
//
//	relu:    h = (0.8, 0)                          p(yes) = 1 / (1 + e^1.5)      = 0.18242552380635635
//	tanh:    h = (tanh 0.8, tanh -0.35)            p(yes) = 1 / (1 + e^(l0-l1))  = 0.1730091589753393
//	sigmoid: h = (sigmoid 0.8, sigmoid -0.35)                                    = 0.2959692352507125
//
// (computed independently, in Python's math module), on both engine paths and both precisions.
func TestActivationIsHonoured(t *testing.T) {
	want := map[Activation]float64{ReLU: 0.18242552380635635, Tanh: 0.1730091589753393, Sigmoid: 0.2959692352507125}
	for act, p := range want {
		m := handModel(act)
		for _, n := range []int{1, chunkMin} {
			X := make([][]float64, n)
			for i := range X {
				X[i] = []float64{0.3}
			}
			for _, prec := range []Precision{Float64, Float32} {
				got, err := m.PredictWith(context.Background(), X, 4, 1, prec)
				if err != nil {
					t.Fatal(err)
				}
				tol := map[Precision]float64{Float64: 1e-12, Float32: 1e-6}[prec]
				for i := 0; i < n; i++ {
					if math.Abs(got.P(i, 1)-p) > tol {
						t.Fatalf("%s, %d inputs, %s: p(yes) = %.17g, want %.17g", act, n, prec, got.P(i, 1), p)
					}
				}
			}
		}
	}
}

func TestPredictWithStopsOnCancel(t *testing.T) {
	m, X := paperModel(1, ReLU, 40)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := m.PredictWith(ctx, X, 10, 1, Float64); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v, want context.Canceled", err)
	}
	if _, err := m.PredictWith(context.Background(), X, 10, 1, Precision(7)); err == nil || !strings.Contains(err.Error(), "precision") {
		t.Fatalf("unknown precision: %v", err)
	}
}

func TestPrecisionAndActivationText(t *testing.T) {
	for _, tc := range []struct {
		text string
		prec Precision
		ok   bool
	}{{"float64", Float64, true}, {"float32", Float32, true}, {"", 0, false}, {"f32", 0, false}, {"Float32", 0, false}} {
		var p Precision
		err := p.UnmarshalText([]byte(tc.text))
		if (err == nil) != tc.ok || (tc.ok && p != tc.prec) {
			t.Errorf("Precision.UnmarshalText(%q) = %v, %v", tc.text, p, err)
		}
		if tc.ok {
			if b, _ := p.MarshalText(); string(b) != tc.text {
				t.Errorf("MarshalText(%v) = %q", p, b)
			}
		} else if err == nil || !strings.Contains(err.Error(), "float64 or float32") {
			t.Errorf("error for %q does not list the choices: %v", tc.text, err)
		}
	}
	for _, tc := range []struct {
		text string
		act  Activation
		ok   bool
	}{{"relu", ReLU, true}, {"tanh", Tanh, true}, {"sigmoid", Sigmoid, true}, {"gelu", 0, false}, {"ReLU", 0, false}, {"", 0, false}} {
		var a Activation
		err := a.UnmarshalText([]byte(tc.text))
		if (err == nil) != tc.ok || (tc.ok && a != tc.act) {
			t.Errorf("Activation.UnmarshalText(%q) = %v, %v", tc.text, a, err)
		}
		if tc.ok {
			if b, _ := a.MarshalText(); string(b) != tc.text {
				t.Errorf("MarshalText(%v) = %q", a, b)
			}
		}
	}
	if _, err := Precision(9).MarshalText(); err == nil {
		t.Error("an unknown precision was marshalled")
	}
	if _, err := Activation(9).MarshalText(); err == nil {
		t.Error("an unknown activation was marshalled")
	}
	m := smallModel(1)
	m.Activation = Activation(9)
	if err := m.Validate(); err == nil || !errors.Is(err, ErrInvalidModel) {
		t.Errorf("Validate accepted activation 9: %v", err)
	}
}

// TestBlockKernelsMatchGo checks the per-block passes of this build (in the OpenBLAS build, C
// loops the compiler vectorizes) against the plain Go loops they stand for, bit for bit, on rows
// of every length modulo the vector width and on values at the edges of max(x, 0): NaN, -0,
// +-Inf, values that round to zero with the bias.
func TestBlockKernelsMatchGo(t *testing.T) {
	edges := []float64{math.NaN(), math.Copysign(0, -1), 0, math.Inf(1), math.Inf(-1), -0.25, 0.25, 1e-300, -1e-300}
	t.Run("float64", func(t *testing.T) { blockKernelsMatchGo[float64](t, edges) })
	t.Run("float32", func(t *testing.T) { blockKernelsMatchGo[float32](t, edges) })
}

func blockKernelsMatchGo[F float](t *testing.T, edges []float64) {
	rng := rand.New(rand.NewPCG(3, 4))
	val := func() F {
		if rng.IntN(4) == 0 {
			return F(edges[rng.IntN(len(edges))])
		}
		return F(rng.NormFloat64())
	}
	same := func(a, b F) bool {
		return math.Float64bits(float64(a)) == math.Float64bits(float64(b)) || (a != a && b != b)
	}
	for _, rows := range []int{0, 1, 3, 7, 8, 9, 16, 17, 31, 192} {
		for _, out := range []int{0, 1, 2, 3, 4, 5} {
			b := make([]F, out) // every edge value is some row's bias, -0 + -0 among the sums
			for j := range b {
				b[j] = F(edges[(j+rows)%len(edges)])
			}
			for _, act := range []Activation{ReLU, Tanh, Sigmoid} {
				for _, output := range []bool{false, true} {
					o := make([]F, out*rows)
					for i := range o {
						o[i] = val()
					}
					want := append([]F(nil), o...)
					for j := range b {
						biasAct(want[j*rows:(j+1)*rows], b[j], act, output)
					}
					biasActBlock(o, b, rows, act, output)
					for i := range o {
						if !same(o[i], want[i]) {
							t.Fatalf("biasActBlock %s output=%v, %d x %d, element %d: %v, Go loop %v", act, output, out, rows, i, o[i], want[i])
						}
					}
				}
			}
			in := rng.IntN(41) // 0 too: the output is the bias
			wt, h := make([]F, in*out), make([]F, in*rows)
			for i := range wt {
				wt[i] = F(rng.NormFloat64())
			}
			for i := range h {
				h[i] = val()
			}
			o := make([]F, out*rows)
			if !denseOut(o, wt, h, b, in, out, rows) {
				continue // this build has no separate output-layer pass
			}
			for j := 0; j < out; j++ {
				for i := 0; i < rows; i++ {
					var s F
					for k := 0; k < in; k++ {
						s += wt[k*out+j] * h[k*rows+i]
					}
					if want := s + b[j]; !same(o[j*rows+i], want) {
						t.Fatalf("denseOut %d -> %d, %d rows, element (%d, %d): %v, Go loop %v", in, out, rows, j, i, o[j*rows+i], want)
					}
				}
			}
		}
	}
}

// TestTwoClassFoldMatchesSoftmax checks addChunk2, the written-out two-class fold, against the
// general one (Softmax, then Welford) bit for bit, over draws of logits at the edges: ties, -0,
// differences beyond exp's range, +-Inf on either side or both, NaN.
func TestTwoClassFoldMatchesSoftmax(t *testing.T) {
	inf, nan := math.Inf(1), math.NaN()
	vals := []float64{0, math.Copysign(0, -1), 1, -1, 1e-300, 745, -745, 800, -800, 3.5, inf, -inf, nan}
	var pairs [][2]float64
	for _, a := range vals {
		for _, b := range vals {
			pairs = append(pairs, [2]float64{a, b})
		}
	}
	rows := len(pairs)
	rng := rand.New(rand.NewPCG(5, 6))
	fast := &Predictive{N: rows, C: 2, S: 4, Mean: make([]float64, 2*rows), Var: make([]float64, 2*rows)}
	slow := &Predictive{N: rows, C: 2, S: 4, Mean: make([]float64, 2*rows), Var: make([]float64, 2*rows)}
	mo := &moments{p: slow, probs: make([]float64, 2)}
	for k := 1; k <= fast.S; k++ {
		logits := make([]float64, 2*rows) // C x rows
		for r, pr := range pairs {
			if k > 1 { // later draws move the finite logits, so the running moments are not trivial
				pr[0] += rng.NormFloat64()
				pr[1] += rng.NormFloat64()
			}
			logits[r], logits[rows+r] = pr[0], pr[1]
		}
		addChunk2(fast, 0, rows, logits, 1/float64(k))
		for r := range pairs {
			mo.probs[0], mo.probs[1] = logits[r], logits[rows+r]
			mo.fold(r, 1/float64(k))
		}
	}
	for i := range fast.Mean {
		for _, v := range [][2]float64{{fast.Mean[i], slow.Mean[i]}, {fast.Var[i], slow.Var[i]}} {
			if math.Float64bits(v[0]) != math.Float64bits(v[1]) && !(math.IsNaN(v[0]) && math.IsNaN(v[1])) {
				t.Fatalf("logits %v, class %d: two-class fold %v, Softmax fold %v", pairs[i/2], i%2, v[0], v[1])
			}
		}
	}
}
