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
	return p.PredictWorkers(ctx, X, runtime.GOMAXPROCS(0))
}

// PredictWorkers is Predict on at most workers goroutines (>= 1), for work that must leave the
// other cores free (the daemon's audits and confirmations run on one). An input's estimate does
// not depend on the number of workers.
func (p *Pool) PredictWorkers(ctx context.Context, X [][]float64, workers int) (*Predictive, error) {
	z, err := standardizeRows(&p.scaler, p.arch.sizes[0], X)
	if err != nil {
		return nil, err
	}
	ahead := p.readsAhead()
	if p.prec == Float32 {
		return predictive(ctx, p.arch, z, p.samples, p.prec, workers, func(s int) wnet[float32] { return next(p.nets32, s, ahead) })
	}
	return predictive(ctx, p.arch, z, p.samples, p.prec, workers, func(s int) wnet[float64] { return next(p.nets64, s, ahead) })
}

// touchAbove is the size above which a float64 Pool is read ahead (see next).
const touchAbove = 8 << 20

// readsAhead reports whether Predict reads each network ahead (see next).
func (p *Pool) readsAhead() bool { return p.prec == Float64 && p.Bytes() > touchAbove }

// next returns network s of nets, after reading one byte per cache line of network s+1 when
// ahead is set.
//
// A Pool of 1000 float64 networks of the paper's shape is 34 MB, more than the L3 cache, so a
// predictive of one or a few inputs streams it from memory, and the forward passes over a
// network's weights (short matrix-vector products) ask for them too slowly for the hardware
// prefetcher: 2.8 us per network against 0.69 us when the pool is cached (11.6 GB/s, where a
// plain read of the same memory runs at 32 GB/s). Reading the next network's lines first, as
// independent loads that the core overlaps, brings it in at nearly the plain read's rate while
// this network, brought in by the previous call, is computed: 1.5 us per network. At 500
// networks (16 MB) the pool is cached or not depending on what the other cores do: 1.3 to 2.3 us
// per network, 1.1 to 1.3 with the reads ahead. A pool of 100 (3 MB) stays cached and would only
// pay the extra loads (+20%), and float32 forward passes (gonum's Sgemv) are slow enough for
// the prefetcher at every size, where the reads ahead cost 40%; hence ahead only for float64
// pools larger than touchAbove. (BenchmarkPoolOneInputSizes; figures from a 2-core EPYC VM.)
func next[F float](nets []wnet[F], s int, ahead bool) wnet[F] {
	if ahead && s+1 < len(nets) {
		touch(nets[s+1])
	}
	return nets[s]
}

// touch reads one byte per 64-byte cache line of n's weights and biases (xor-ed together: a
// one-cycle dependency between loads that are otherwise independent; runtime.KeepAlive keeps the
// compiler from dropping them, without a shared variable that concurrent calls would race on).
func touch[F float](n wnet[F]) {
	var acc byte
	for k := range n.wt {
		for _, v := range [][]F{n.wt[k], n.b[k]} {
			b := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), len(v)*int(unsafe.Sizeof(F(0))))
			for i := 0; i < len(b); i += 64 {
				acc ^= b[i]
			}
		}
	}
	runtime.KeepAlive(acc)
}
