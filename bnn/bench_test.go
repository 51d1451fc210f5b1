package bnn

import (
	"math/rand/v2"
	"testing"

	"gonum.org/v1/gonum/mat"
)

// BenchmarkPredict measures the posterior predictive for 10,000 inputs x 100 samples on the
// paper's tabular architecture (30 -> 64 -> 32 -> 2); the custom metric is inputs*samples/s.
// BenchmarkPredictBaselineForward is the reference in the same run: 100 plain deterministic
// forward passes of the posterior-mean network over the same inputs (no sampling, no running
// moments). The ratio of the two is the cost of being Bayesian on this path.
func BenchmarkPredict(b *testing.B) {
	m, X := benchModel()
	const S = 100
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := m.Predict(X, S, uint64(i)); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(len(X)*S*b.N)/b.Elapsed().Seconds(), "inputs*samples/s")
}

func BenchmarkPredictBaselineForward(b *testing.B) {
	m, X := benchModel()
	const S = 100
	z, err := m.Standardize(X)
	if err != nil {
		b.Fatal(err)
	}
	net := m.NewNet()
	m.Mean(net)
	probs := mat.NewDense(len(X), m.NumClasses(), nil)
	var work []*mat.Dense
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for s := 0; s < S; s++ {
			work = net.Probs(z, probs, work)
		}
	}
	b.ReportMetric(float64(len(X)*S*b.N)/b.Elapsed().Seconds(), "inputs*samples/s")
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
