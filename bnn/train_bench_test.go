package bnn

import (
	"math/rand/v2"
	"testing"

	"gonum.org/v1/gonum/mat"
)

// BenchmarkTrainStep is one Bayes-by-backprop step on the paper's tabular architecture
// (30 -> 64 -> 32 -> 2) with a batch of 64: fresh noise, the gorgonia forward and backward
// pass, and an Adam step. BenchmarkTrainStepBaselineForward is the reference in the same run:
// one plain-Go sampled forward pass (bnn.Sample + Net.Probs) over the same batch, no gradient.
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
	z := mat.NewDense(len(rows), m.Inputs(), nil)
	for i, r := range rows {
		copy(z.RawRowView(i), r)
	}
	net := m.NewNet()
	probs := mat.NewDense(len(rows), m.NumClasses(), nil)
	var work []*mat.Dense
	rng := rand.New(rand.NewPCG(1, 1))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		m.Sample(rng, net)
		work = net.Probs(z, probs, work)
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
