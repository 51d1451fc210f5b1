package bnn

import (
	"fmt"
	"math"
	"math/rand/v2"

	"gonum.org/v1/gonum/mat"
)

// Net is one draw of every weight and bias of a Model: an ordinary, deterministic network.
// W[k] has the shape of layer k's weight (Out x In, row-major), B[k] of its bias.
type Net struct {
	W, B [][]float64
}

// NewNet allocates a Net shaped like m.
func (m *Model) NewNet() *Net {
	n := &Net{W: make([][]float64, len(m.Layers)), B: make([][]float64, len(m.Layers))}
	for k, l := range m.Layers {
		n.W[k] = make([]float64, l.In*l.Out)
		n.B[k] = make([]float64, l.Out)
	}
	return n
}

// Sample draws every parameter into dst: w = mu + exp(log_sigma) * e, e ~ N(0, 1).
func (m *Model) Sample(rng *rand.Rand, dst *Net) { m.sampleWith(m.sigmas(), rng, dst) }

// sigmas returns exp(log_sigma) for every parameter, in the layout of a Net, so that repeated
// draws need no transcendental functions.
func (m *Model) sigmas() *Net {
	s := m.NewNet()
	for k := range m.Layers {
		l := &m.Layers[k]
		for i, ls := range l.WeightLogSigma {
			s.W[k][i] = math.Exp(ls)
		}
		for i, ls := range l.BiasLogSigma {
			s.B[k][i] = math.Exp(ls)
		}
	}
	return s
}

// sampleWith draws w = mu + sigma * e with precomputed sigmas (see sigmas). The order of draws
// is the same as Sample's, so results agree bit for bit.
func (m *Model) sampleWith(sig *Net, rng *rand.Rand, dst *Net) {
	for k := range m.Layers {
		l := &m.Layers[k]
		for i, mu := range l.WeightMu {
			dst.W[k][i] = mu + sig.W[k][i]*rng.NormFloat64()
		}
		for i, mu := range l.BiasMu {
			dst.B[k][i] = mu + sig.B[k][i]*rng.NormFloat64()
		}
	}
}

// Mean sets dst to the posterior means (the "MAP-like" deterministic network).
func (m *Model) Mean(dst *Net) {
	for k := range m.Layers {
		copy(dst.W[k], m.Layers[k].WeightMu)
		copy(dst.B[k], m.Layers[k].BiasMu)
	}
}

// Standardize returns the scaled inputs as an N x D matrix, checking dimensions and finiteness.
func (m *Model) Standardize(X [][]float64) (*mat.Dense, error) {
	d := m.Inputs()
	if len(X) == 0 {
		return nil, fmt.Errorf("no inputs")
	}
	z := mat.NewDense(len(X), d, nil)
	for i, x := range X {
		if len(x) != d {
			return nil, fmt.Errorf("input %d has %d features, model expects %d", i, len(x), d)
		}
		for j, v := range x {
			if math.IsNaN(v) || math.IsInf(v, 0) {
				return nil, fmt.Errorf("input %d feature %d is %v", i, j, v)
			}
		}
		m.Scaler.Apply(z.RawRowView(i), x)
	}
	return z, nil
}

// Probs computes softmax class probabilities of the net for standardised inputs z (N x D) into
// out (N x C). work holds per-layer activations and is reused between calls; pass nil at first.
func (n *Net) Probs(z *mat.Dense, out *mat.Dense, work []*mat.Dense) []*mat.Dense {
	rows, _ := z.Dims()
	if work == nil {
		work = make([]*mat.Dense, len(n.W))
	}
	h := z
	for k := range n.W {
		outDim := len(n.B[k])
		inDim := len(n.W[k]) / outDim
		if work[k] == nil {
			work[k] = mat.NewDense(rows, outDim, nil)
		}
		a := work[k]
		a.Mul(h, mat.NewDense(outDim, inDim, n.W[k]).T())
		last := k == len(n.W)-1
		for i := 0; i < rows; i++ {
			row := a.RawRowView(i)
			for j := range row {
				row[j] += n.B[k][j]
				if !last && row[j] < 0 {
					row[j] = 0
				}
			}
		}
		h = a
	}
	for i := 0; i < rows; i++ {
		Softmax(out.RawRowView(i), h.RawRowView(i))
	}
	return work
}

// Softmax writes softmax(logits) into dst (len(dst) == len(logits)), stable against overflow:
//
//	dst_j = exp(l_j - max l) / sum_k exp(l_k - max l)
func Softmax(dst, logits []float64) {
	mx := math.Inf(-1)
	for _, v := range logits {
		mx = math.Max(mx, v)
	}
	s := 0.0
	for j, v := range logits {
		dst[j] = math.Exp(v - mx)
		s += dst[j]
	}
	for j := range dst {
		dst[j] /= s
	}
}

// Predictive holds Monte-Carlo estimates of the posterior predictive for N inputs and C classes:
//
//	Mean[i*C+c] = (1/S) sum_s f_c(x_i; w_s)                       ~ E_q[f_c(x_i; w)]
//	Var[i*C+c]  = 1/(S-1) sum_s (f_c(x_i; w_s) - Mean[i*C+c])^2    ~ Var_q[f_c(x_i; w)]
//
// with w_s ~ q drawn independently. Every input shares the same S weight draws.
type Predictive struct {
	N, C, S   int
	Mean, Var []float64
}

// P returns the estimated predictive probability of class c for input i.
func (p *Predictive) P(i, c int) float64 { return p.Mean[i*p.C+c] }

// V returns the estimated variance over the posterior of f_c(x_i; w).
func (p *Predictive) V(i, c int) float64 { return p.Var[i*p.C+c] }

// Argmax returns the class with the highest predictive probability for input i.
func (p *Predictive) Argmax(i int) int {
	best := 0
	for c := 1; c < p.C; c++ {
		if p.Mean[i*p.C+c] > p.Mean[i*p.C+best] {
			best = c
		}
	}
	return best
}

// SampleSeed returns the seed pair of draw s of a predictive run with the given seed, so that
// results are reproducible and independent of how the work is split.
func SampleSeed(seed uint64, s int) *rand.Rand {
	return rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15^uint64(s)))
}

// Predict estimates the posterior predictive of every class for the raw inputs X with S
// Monte-Carlo weight draws (S >= 2). The result is a deterministic function of (m, X, S, seed).
func (m *Model) Predict(X [][]float64, samples int, seed uint64) (*Predictive, error) {
	if samples < 2 {
		return nil, fmt.Errorf("need at least 2 samples for a variance, got %d", samples)
	}
	z, err := m.Standardize(X)
	if err != nil {
		return nil, err
	}
	n, c := len(X), m.NumClasses()
	p := &Predictive{N: n, C: c, S: samples, Mean: make([]float64, n*c), Var: make([]float64, n*c)}
	net, sig := m.NewNet(), m.sigmas()
	probs := mat.NewDense(n, c, nil)
	var work []*mat.Dense
	// Welford's running mean and sum of squared deviations (kept in Var until the end).
	for s := 0; s < samples; s++ {
		m.sampleWith(sig, SampleSeed(seed, s), net)
		work = net.Probs(z, probs, work)
		raw := probs.RawMatrix().Data
		k := float64(s + 1)
		for i, f := range raw {
			d := f - p.Mean[i]
			p.Mean[i] += d / k
			p.Var[i] += d * (f - p.Mean[i])
		}
	}
	for i := range p.Var {
		p.Var[i] /= float64(samples - 1)
	}
	return p, nil
}
