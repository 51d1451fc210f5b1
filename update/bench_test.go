package update

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
)

// benchProblem is the daemon's increment on the paper's architecture: a breast-cancer network
// 30 -> 64 -> 32 -> 2 (torchbnn initialisation, scaler fitted on the data) and 64 records.
func benchProblem(b *testing.B) (*bnn.Model, [][]float64, []int) {
	b.Helper()
	set, d, err := assets.Load("breast_cancer")
	if err != nil {
		b.Fatal(err)
	}
	m := bnn.New(len(set.X[0]), bnn.DefaultHidden, d.Classes, bnn.DefaultPriorSigma, rand.New(rand.NewPCG(1, 2)))
	m.Scaler = bnn.FitScaler(set.X)
	return m, set.X[:64], set.Y[:64]
}

func benchUpdate(b *testing.B, m *bnn.Model, X [][]float64, y []int, engine string, seed uint64) {
	if _, _, err := LastLayer(context.Background(), m, X, y, Config{Engine: engine, Seed: seed}); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkLastLayer times one increment (64 records, default config: 50 Adam iterations) with each
// engine. The ratio sub-benchmark interleaves the two in every iteration and reports
// gorgonia-time / go-time, which a shared, loaded machine disturbs far less than comparing
// separate benchmarks run at different moments.
func BenchmarkLastLayer(b *testing.B) {
	m, X, y := benchProblem(b)
	for _, e := range engines {
		b.Run(e, func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				benchUpdate(b, m, X, y, e, uint64(i))
			}
			b.ReportMetric(float64(len(X)*b.N)/b.Elapsed().Seconds(), "records/s")
		})
	}
	b.Run("ratio", func(b *testing.B) {
		var tGo, tGr time.Duration
		for i := 0; i < b.N; i++ {
			t0 := time.Now()
			benchUpdate(b, m, X, y, EngineGo, uint64(i))
			t1 := time.Now()
			benchUpdate(b, m, X, y, EngineGorgonia, uint64(i))
			t2 := time.Now()
			tGo, tGr = tGo+t1.Sub(t0), tGr+t2.Sub(t1)
		}
		b.ReportMetric(float64(tGr)/float64(tGo), "gorgonia/go")
		b.ReportMetric(float64(tGo.Nanoseconds())/float64(b.N), "go-ns/update")
	})
}

// BenchmarkConvergedAgainstAdam times the converged solver (the daemon's default: vcl,
// kl_weight 8, memory 50,000) against the paper's 50 Adam iterations on the same increment, 10
// and 64 records, interleaved in every iteration, and reports converged-time / adam-time.
func BenchmarkConvergedAgainstAdam(b *testing.B) {
	m, X, y := benchProblem(b)
	m.Records = 569
	for _, n := range []int{10, 64} {
		b.Run(fmt.Sprintf("records=%d", n), func(b *testing.B) {
			var tc, ta time.Duration
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				if _, _, err := LastLayer(context.Background(), m, X[:n], y[:n], Config{Objective: ObjectiveVCL, Solver: SolverConverge,
					KLWeight: 8, Memory: 50000, Seed: uint64(i)}); err != nil {
					b.Fatal(err)
				}
				t1 := time.Now()
				if _, _, err := LastLayer(context.Background(), m, X[:n], y[:n], Config{Seed: uint64(i)}); err != nil {
					b.Fatal(err)
				}
				t2 := time.Now()
				tc, ta = tc+t1.Sub(t0), ta+t2.Sub(t1)
			}
			b.ReportMetric(float64(tc)/float64(ta), "converged/adam")
			b.ReportMetric(float64(tc.Nanoseconds())/float64(b.N), "converged-ns/update")
		})
	}
}
