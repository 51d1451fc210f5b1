package bnn

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkTrainStep is one Bayes-by-backprop iteration on the paper's tabular architecture
// (30 -> 64 -> 32 -> 2) with a batch of 64: fresh noise, the gorgonia forward and backward
// pass, and an Adam iteration. BenchmarkTrainStepBaselineForward is the reference in the same run:
// one sampled forward pass through the predictive engine over the same batch, no gradient.
// Their ratio is the price of the gradient and of gorgonia's per-op overhead.
func BenchmarkTrainStep(b *testing.B) {
	m, rows, y := benchTrainBatch()
	gr, err := NewGraph(m, GraphConfig{Batch: len(rows), KLScale: 0.1 / 455})
	if err != nil {
		b.Fatal(err)
	}
	defer gr.Close()
	if err := gr.SetBatch(rows, y); err != nil {
		b.Fatal(err)
	}
	opt := NewAdam(gr.Params(), 1e-3)
	rng := rand.New(rand.NewPCG(1, 1))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		gr.DrawEps(rng)
		if _, err := gr.Run(); err != nil {
			b.Fatal(err)
		}
		opt.Step(gr.Params())
	}
}

func BenchmarkTrainStepBaselineForward(b *testing.B) {
	m, rows, _ := benchTrainBatch()
	a := m.arch()
	in := newBatch[float64](rows, a.sizes[0])
	net, sig := newWnet[float64](a), m.sigmas()
	bufs := make([][]float64, a.layers())
	for k := range bufs {
		bufs[k] = make([]float64, a.sizes[k+1]*chunkRows)
	}
	rng := rand.New(rand.NewPCG(1, 1))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		sampleWnet(m, sig, rng, net)
		forwardChunk(a, net, in.chunks[0], len(rows), bufs)
	}
}

func benchTrainBatch() (*Model, [][]float64, []int) {
	rng := rand.New(rand.NewPCG(2, 2))
	m := New(30, DefaultHidden, []string{"a", "b"}, DefaultPriorSigma, rng)
	rows := make([][]float64, 64)
	y := make([]int, len(rows))
	for i := range rows {
		rows[i] = make([]float64, 30)
		for j := range rows[i] {
			rows[i][j] = rng.NormFloat64()
		}
		y[i] = rng.IntN(2)
	}
	return m, rows, y
}
