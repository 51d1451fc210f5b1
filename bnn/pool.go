package bnn

import (
	"context"
	"fmt"
	"runtime"
	"unsafe"
)

// Pool is S networks drawn once from one posterior and reused for every predictive of that
// posterior version: registration, confirmations, audits, the Monte-Carlo fallback and
// counterfactual search can share one Pool instead of drawing S x (number of parameters)
// normals per call, which dominates small calls (one input, 1000 draws: 4.1 million normals on
// the paper's network).
//
// Network s is Sample(SampleSeed(seed, s)), rounded to the Pool's precision, so
//
//	NewPool(m, S, seed, prec).Predict(ctx, X)  ==  m.PredictWith(ctx, X, S, seed, prec)
//
// (bit for bit in the default build; to rounding with -tags openblas), and every call uses all
// S networks: a Predictive from a Pool never has fewer draws than the Pool was built with.
//
// Common random numbers. Every input of every call sees the same S networks. For one input the
// estimate is an ordinary Monte-Carlo estimate with S independent draws, so its guarantees hold
// as before, per input: Hoeffding's bound P(p_hat - p >= t) <= exp(-2 S t^2) holds for each
// counterfactual separately. They do not hold jointly: the errors of two inputs' estimates are
// correlated (a draw that flatters one input may flatter its neighbours), so a union over many
// counterfactuals cannot assume independent errors, and an input chosen by looking at the pool's
// own estimates (for instance a search that stops where this pool says it succeeded) is measured
// on the draws that selected it. Draw a fresh Pool (another seed) for an estimate that must be
// independent of such a choice.
//
// A Pool is immutable and safe for concurrent use. Its memory is S x (number of parameters) x 8
// bytes in float64 and half that in float32 (Bytes).
type Pool struct {
	version uint64
	samples int
	seed    uint64
	prec    Precision
	arch    arch
	scaler  Scaler
	size    int // elements of all networks' weights and biases
	nets64  []wnet[float64]
	nets32  []wnet[float32]
}

// NewPool draws samples networks (>= 2) from the posterior m in the given precision; see Pool.
func NewPool(m *Model, samples int, seed uint64, prec Precision) (*Pool, error) {
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("pool: %w", err)
	}
	if samples < 2 {
		return nil, fmt.Errorf("pool: need at least 2 samples for a variance, got %d", samples)
	}
	if err := checkPrecision(prec); err != nil {
		return nil, fmt.Errorf("pool: %w", err)
	}
	a, sig := m.arch(), m.sigmas()
	p := &Pool{version: m.Version, samples: samples, seed: seed, prec: prec, arch: a,
		scaler: Scaler{Mean: append([]float64(nil), m.Scaler.Mean...), Std: append([]float64(nil), m.Scaler.Std...)}}
	n := a.params()
	if prec == Float32 {
		block := make([]float32, samples*n)
		for s := 0; s < samples; s++ {
			w := wnetIn(a, block[s*n:(s+1)*n])
			sampleWnet(m, sig, SampleSeed(seed, s), w)
			p.nets32 = append(p.nets32, w)
		}
		p.size = len(block)
		return p, nil
	}
	block := make([]float64, samples*n)
	for s := 0; s < samples; s++ {
		w := wnetIn(a, block[s*n:(s+1)*n])
		sampleWnet(m, sig, SampleSeed(seed, s), w)
		p.nets64 = append(p.nets64, w)
	}
	p.size = len(block)
	return p, nil
}

// Version is the posterior version the networks were drawn from.
func (p *Pool) Version() uint64 { return p.version }

// Samples is S, the number of networks; every Predict uses all of them.
func (p *Pool) Samples() int { return p.samples }

// Seed is the seed the networks were drawn with (see SampleSeed).
func (p *Pool) Seed() uint64 { return p.seed }

// Precision is the precision of the networks and of the forward passes.
func (p *Pool) Precision() Precision { return p.prec }

// Bytes is the memory held by the networks' weights and biases.
func (p *Pool) Bytes() int {
	if p.prec == Float32 {
		return p.size * int(unsafe.Sizeof(float32(0)))
	}
	return p.size * int(unsafe.Sizeof(float64(0)))
}

// Predict estimates the posterior predictive of every class for the raw inputs X with the
// Pool's S networks. Large batches are split over GOMAXPROCS goroutines by ranges of inputs
// (each input's result does not depend on the split). It returns ctx's error if ctx ends first
// (checked before every network).
func (p *Pool) Predict(ctx context.Context, X [][]float64) (*Predictive, error) {
	z, err := standardizeRows(&p.scaler, p.arch.sizes[0], X)
	if err != nil {
		return nil, err
	}
	workers := runtime.GOMAXPROCS(0)
	if p.prec == Float32 {
		return predictive(ctx, p.arch, z, p.samples, p.prec, workers, func(s int) wnet[float32] { return p.nets32[s] })
	}
	return predictive(ctx, p.arch, z, p.samples, p.prec, workers, func(s int) wnet[float64] { return p.nets64[s] })
}
