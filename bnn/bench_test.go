package bnn

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"gonum.org/v1/gonum/mat"
)

// Benchmarks of the predictive engine on the paper's tabular architecture (30 -> 64 -> 32 -> 2),
// 10,000 inputs x 100 samples, read as ratios within one run:
//
//	go test ./bnn -run '^$' -bench 'Predict' -benchtime 5x
//	go test -tags openblas ./bnn -run '^$' -bench 'Predict' -benchtime 5x
//
// BenchmarkPredict/{float64,float32} is Model.PredictWith; BenchmarkPredictBefore is the engine
// this one replaced (gonum mat.Dense products with the transposed weight view, a branchy bias +
// ReLU loop, gonum's goroutine-parallel Dgemm), kept as the "before" of the ratio;
// BenchmarkPredictBaselineForward is 100 deterministic forward passes of the posterior-mean
// network through the same engine (no sampling, no moments), the cost floor of the path. GFLOP/s
// counts the multiply-adds of the products, 2 (30*64 + 64*32 + 32*2) per input and draw.
func BenchmarkPredict(b *testing.B) {
	m, X := benchModel()
	const S = 100
	for _, prec := range []Precision{Float64, Float32} {
		b.Run(prec.String(), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := m.PredictWith(context.Background(), X, S, uint64(i), prec); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, m, len(X)*S)
		})
	}
}

func BenchmarkPredictBefore(b *testing.B) {
	m, X := benchModel()
	const S = 100
	for i := 0; i < b.N; i++ {
		if _, err := predictBefore(m, X, S, uint64(i)); err != nil {
			b.Fatal(err)
		}
	}
	reportRate(b, m, len(X)*S)
}

func BenchmarkPredictBaselineForward(b *testing.B) {
	m, X := benchModel()
	const S = 100
	z, err := m.standardizeRows(X)
	if err != nil {
		b.Fatal(err)
	}
	a := m.arch()
	mean := newWnet[float64](a)
	for k, l := range m.Layers {
		for o := 0; o < l.Out; o++ {
			for i := 0; i < l.In; i++ {
				mean.wt[k][i*l.Out+o] = l.WeightMu[o*l.In+i]
			}
		}
		copy(mean.b[k], l.BiasMu)
	}
	in := newBatch[float64](z, a.sizes[0])
	bufs := make([][]float64, a.layers())
	for k := range bufs {
		bufs[k] = make([]float64, a.sizes[k+1]*chunkRows)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for s := 0; s < S; s++ {
			for ci, x := range in.chunks {
				forwardChunk(a, mean, x, min(chunkRows, len(X)-ci*chunkRows), bufs)
			}
		}
	}
	reportRate(b, m, len(X)*S)
}

// reportRate reports inputs*draws per second and the products' GFLOP/s.
func reportRate(b *testing.B, m *Model, forwards int) {
	sec := b.Elapsed().Seconds()
	b.ReportMetric(float64(forwards*b.N)/sec, "inputs*samples/s")
	b.ReportMetric(float64(forwards*b.N)*float64(flopsPerForward(m))/sec/1e9, "GFLOP/s")
}

// flopsPerForward is 2 sum_k In_k Out_k: the multiply-adds of one input's forward pass.
func flopsPerForward(m *Model) int {
	f := 0
	for _, l := range m.Layers {
		f += 2 * l.In * l.Out
	}
	return f
}

func benchModel() (*Model, [][]float64) {
	rng := rand.New(rand.NewPCG(1, 1))
	m := New(30, DefaultHidden, []string{"a", "b"}, 0.1, rng)
	X := make([][]float64, 10000)
	for i := range X {
		X[i] = make([]float64, 30)
		for j := range X[i] {
			X[i][j] = rng.NormFloat64()
		}
	}
	return m, X
}

// predictBefore is the predictive engine as it was before the chunked engine (ReLU only), kept
// as the "before" of BenchmarkPredictBefore: per draw, mat.Dense products H W^T and a bias +
// ReLU loop.
func predictBefore(m *Model, X [][]float64, samples int, seed uint64) (*Predictive, error) {
	if m.Activation != ReLU {
		return nil, fmt.Errorf("predictBefore evaluates ReLU models only")
	}
	z, err := m.Standardize(X)
	if err != nil {
		return nil, err
	}
	n, c := len(X), m.NumClasses()
	p := &Predictive{N: n, C: c, S: samples, Mean: make([]float64, n*c), Var: make([]float64, n*c)}
	net, sig := m.NewNet(), m.sigmas()
	probs := mat.NewDense(n, c, nil)
	work := make([]*mat.Dense, len(net.W))
	for s := 0; s < samples; s++ {
		m.sampleWith(sig, SampleSeed(seed, s), net)
		h := z
		for k := range net.W {
			outDim := len(net.B[k])
			if work[k] == nil {
				work[k] = mat.NewDense(n, outDim, nil)
			}
			work[k].Mul(h, mat.NewDense(outDim, len(net.W[k])/outDim, net.W[k]).T())
			for i := 0; i < n; i++ {
				row := work[k].RawRowView(i)
				for j := range row {
					row[j] += net.B[k][j]
					if k < len(net.W)-1 && row[j] < 0 {
						row[j] = 0
					}
				}
			}
			h = work[k]
		}
		for i := 0; i < n; i++ {
			Softmax(probs.RawRowView(i), h.RawRowView(i))
		}
		k := float64(s + 1)
		for i, f := range probs.RawMatrix().Data {
			d := f - p.Mean[i]
			p.Mean[i] += d / k
			p.Var[i] += d * (f - p.Mean[i])
		}
	}
	for i := range p.Var {
		p.Var[i] /= float64(samples - 1)
	}
	if math.IsNaN(p.Mean[0]) {
		return nil, fmt.Errorf("NaN")
	}
	return p, nil
}
