package explain

import (
	"context"
	"errors"
	"math"
	"sync"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/dataset"
)

// Benchmarks on breast cancer (seed 1, 80/20 split). Speed is read as ratios within one run:
//
//	go test ./explain -run '^$' -bench . -benchtime 20x
//
// BenchmarkGeneratePSCE (one counterfactual, 2000-iteration cap; its confirmation and final
// ensembles are bnn.Pools drawn once per Generator, outside the timer) against
// BenchmarkPoolPredict1000 (the final estimate from the pool: one input, 1000 networks),
// BenchmarkPredict1000 (the same estimate with fresh draws, as before the pools) and
// BenchmarkPredictSameDraws (one m.Predict with as many draws as the search evaluated networks,
// (iterations+1) x Samples, averaged over the benchmark's rows); BenchmarkObjectiveEval (one
// iteration: gorgonia forward and backward over S = 32 networks and the VAE) against
// BenchmarkPredict32. BenchmarkGeneratePSCEFloat32 runs the ensembles in float32.

var (
	benchOnce sync.Once
	benchM    *bnn.Model
	benchV    *VAE
	benchTest *dataset.Set
	benchErr  error
	benchIter float64 // mean PSCE iterations over the benchmark rows
)

const benchRows = 20

func benchFixture(b *testing.B) (*bnn.Model, *VAE, *dataset.Set) {
	b.Helper()
	benchOnce.Do(func() {
		set, ds, err := assets.Load("breast_cancer")
		if err != nil {
			benchErr = err
			return
		}
		train, test := set.Split(0.8, 1)
		benchTest = test
		ctx := context.Background()
		if benchM, _, benchErr = bnn.Fit(ctx, train, ds.Classes, bnn.TrainConfig{Seed: 1}); benchErr != nil {
			return
		}
		if benchV, _, benchErr = TrainVAE(ctx, benchM, train.X, TrainConfig{Seed: 1, Epochs: 100}); benchErr != nil {
			return
		}
		g := NewGenerator(benchM, benchV, Config{Seed: 1})
		for i := 0; i < benchRows; i++ {
			r, err := g.Generate(ctx, test.X[i], -1)
			var nf *NotFoundError
			if errors.As(err, &nf) {
				r = nf.Best
			} else if err != nil {
				benchErr = err
				return
			}
			benchIter += float64(r.Iterations) / benchRows
		}
	})
	if benchErr != nil {
		b.Fatal(benchErr)
	}
	return benchM, benchV, benchTest
}

func benchGenerate(b *testing.B, cfg Config) {
	m, v, test := benchFixture(b)
	g := NewGenerator(m, v, cfg)
	ctx := context.Background()
	if _, err := g.Generate(ctx, test.X[0], -1); err != nil && !errors.Is(err, ErrNotFound) {
		b.Fatal(err) // also draws the ensembles and builds the graph outside the timer
	}
	iters := 0
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		r, err := g.Generate(ctx, test.X[i%benchRows], -1)
		var nf *NotFoundError
		if errors.As(err, &nf) {
			r = nf.Best
		} else if err != nil {
			b.Fatal(err)
		}
		iters += r.Iterations
	}
	b.ReportMetric(float64(iters)/float64(b.N), "iters/CE")
}

func BenchmarkGeneratePSCE(b *testing.B) { benchGenerate(b, Config{Seed: 1}) }

// BenchmarkGeneratePSCEFloat32 is PSCE with its confirmation and final ensembles in float32.
func BenchmarkGeneratePSCEFloat32(b *testing.B) {
	benchGenerate(b, Config{Seed: 1, Precision: bnn.Float32})
}

// BenchmarkGeneratePSCEPaperWeights is the slow case: with the paper's literal weights most
// searches run to the 2000-iteration cap.
func BenchmarkGeneratePSCEPaperWeights(b *testing.B) {
	benchGenerate(b, Config{Seed: 1, Weights: &PaperWeights})
}

func BenchmarkGenerateWachter(b *testing.B) { benchGenerate(b, Config{Method: MethodWachter, Seed: 1}) }

func BenchmarkGenerateSchut(b *testing.B) { benchGenerate(b, Config{Method: MethodSchut, Seed: 1}) }

func benchPredict(b *testing.B, samples int) {
	m, _, test := benchFixture(b)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := m.Predict([][]float64{test.X[i%benchRows]}, samples, uint64(i)); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkPredict1000(b *testing.B) { benchPredict(b, 1000) }

func BenchmarkPoolPredict1000(b *testing.B) {
	m, _, test := benchFixture(b)
	for _, prec := range []bnn.Precision{bnn.Float64, bnn.Float32} {
		b.Run(prec.String(), func(b *testing.B) {
			pool, err := bnn.NewPool(m, 1000, 1, prec)
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := pool.Predict(context.Background(), [][]float64{test.X[i%benchRows]}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkPredict32(b *testing.B) { benchPredict(b, 32) }

func BenchmarkPredictSameDraws(b *testing.B) {
	benchFixture(b)
	draws := int(math.Round((benchIter + 1) * 32))
	b.ReportMetric(float64(draws), "draws")
	benchPredict(b, draws)
}

func BenchmarkObjectiveEval(b *testing.B) {
	m, v, test := benchFixture(b)
	o, err := newObjective(m, v, 32)
	if err != nil {
		b.Fatal(err)
	}
	defer o.close()
	nets := sampleNets(m, 32, 1)
	z := make([]float64, m.Inputs())
	m.Scaler.Apply(z, test.X[0])
	mu0, _ := v.Encode(z)
	if err := o.setProblem(0, z, mu0, DefaultWeights, 0.05, 0.01); err != nil {
		b.Fatal(err)
	}
	var ev objectiveEval
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := o.setNets(nets); err != nil {
			b.Fatal(err)
		}
		if err := o.eval(z, &ev); err != nil {
			b.Fatal(err)
		}
	}
}
