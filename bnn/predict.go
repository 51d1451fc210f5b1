package bnn

import (
	"context"
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

// sampleWith draws w = mu + sigma * e with precomputed sigmas (see sigmas), or a dropout mask
// for an MC Dropout model. The order of draws is the same as Sample's, so results agree bit for
// bit.
func (m *Model) sampleWith(sig *Net, rng *rand.Rand, dst *Net) {
	if m.Dropout > 0 {
		var keep []float64
		for k := range m.Layers {
			l := &m.Layers[k]
			keep = m.dropoutMask(k, rng, keep)
			for o := 0; o < l.Out; o++ {
				for i := 0; i < l.In; i++ {
					dst.W[k][o*l.In+i] = l.WeightMu[o*l.In+i] * keep[i]
				}
			}
			copy(dst.B[k], l.BiasMu)
		}
		return
	}
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

// dropoutMask returns, in buf (reused), the scale of every input of layer k in one MC Dropout
// draw: 1 for the first layer's inputs (the features are not dropped), otherwise 0 with
// probability Dropout and 1 / (1 - Dropout) else, one rng.Float64 per input.
func (m *Model) dropoutMask(k int, rng *rand.Rand, buf []float64) []float64 {
	in := m.Layers[k].In
	if cap(buf) < in {
		buf = make([]float64, in)
	}
	buf = buf[:in]
	for i := range buf {
		buf[i] = 1
		if k > 0 {
			buf[i] = 0
			if rng.Float64() >= m.Dropout {
				buf[i] = 1 / (1 - m.Dropout)
			}
		}
	}
	return buf
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
	return standardize(&m.Scaler, m.Inputs(), X)
}

func standardize(sc *Scaler, d int, X [][]float64) (*mat.Dense, error) {
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
		sc.Apply(z.RawRowView(i), x)
	}
	return z, nil
}

// Softmax writes softmax(logits) into dst (len(dst) == len(logits)), stable against overflow:
//
//	dst_j = exp(l_j - max l) / sum_k exp(l_k - max l)
//
// exp(0) = 1 is not computed (it is exact): with two classes, one exp per call instead of two.
func Softmax(dst, logits []float64) {
	mx := math.Inf(-1)
	for _, v := range logits {
		mx = math.Max(mx, v)
	}
	s := 0.0
	for j, v := range logits {
		dst[j] = expShifted(v, mx) // NaN when v and mx are the same infinity, as exp(v - mx)
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
// with w_s ~ q drawn independently. Every input shares the same S weight draws. Precision is the
// precision the forward passes ran in.
type Predictive struct {
	N, C, S   int
	Precision Precision
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
// Monte-Carlo weight draws (S >= 2) in float64: PredictWith(context.Background(), X, samples,
// seed, Float64).
func (m *Model) Predict(X [][]float64, samples int, seed uint64) (*Predictive, error) {
	return m.PredictWith(context.Background(), X, samples, seed, Float64)
}

// PredictWith estimates the posterior predictive of every class for the raw inputs X with S
// Monte-Carlo weight draws (S >= 2), the forward passes in the given precision. Draw s is
// Sample(SampleSeed(seed, s)), so the result is a deterministic function of (m, X, S, seed,
// precision) and equals NewPool(m, S, seed, precision).Predict(X). Every draw is made afresh; to
// reuse draws across calls, use a Pool. It returns ctx's error if ctx ends first (checked before
// every draw).
func (m *Model) PredictWith(ctx context.Context, X [][]float64, samples int, seed uint64, prec Precision) (*Predictive, error) {
	if samples < 2 {
		return nil, fmt.Errorf("need at least 2 samples for a variance, got %d", samples)
	}
	if err := checkPrecision(prec); err != nil {
		return nil, err
	}
	z, err := m.standardizeRows(X)
	if err != nil {
		return nil, err
	}
	a, sig := m.arch(), m.sigmas()
	if prec == Float32 {
		w := newWnet[float32](a)
		return predictive(ctx, a, z, samples, prec, 1, func(s int) wnet[float32] {
			sampleWnet(m, sig, SampleSeed(seed, s), w)
			return w
		})
	}
	w := newWnet[float64](a)
	return predictive(ctx, a, z, samples, prec, 1, func(s int) wnet[float64] {
		sampleWnet(m, sig, SampleSeed(seed, s), w)
		return w
	})
}

func checkPrecision(p Precision) error {
	if p != Float64 && p != Float32 {
		return fmt.Errorf("unknown precision %d (want Float64 or Float32)", uint8(p))
	}
	return nil
}

// standardizeRows is Standardize as a slice of rows.
func (m *Model) standardizeRows(X [][]float64) ([][]float64, error) {
	return standardizeRows(&m.Scaler, m.Inputs(), X)
}

func standardizeRows(sc *Scaler, d int, X [][]float64) ([][]float64, error) {
	zm, err := standardize(sc, d, X)
	if err != nil {
		return nil, err
	}
	z := make([][]float64, len(X))
	for i := range z {
		z[i] = zm.RawRowView(i)
	}
	return z, nil
}
