package bnn

import (
	"context"
	"fmt"
	"testing"
)

// Benchmarks of shared draws on the paper's architecture (30 -> 64 -> 32 -> 2):
//
//	go test ./bnn -run '^$' -bench 'Pool' -benchtime 20x
//
// BenchmarkPoolOneInput: one input, 1000 draws, as a fresh-draw predictive (PredictWith: 4.13
// million normals per call) and from a Pool drawn beforehand; BenchmarkPoolBuild is the one-off
// cost of that Pool and reports its memory. BenchmarkPoolManyInputs: 10^5 inputs, 100 draws,
// fresh against pooled; here the draws are a small part of the work and the Pool's gain is that
// it splits the batch over GOMAXPROCS goroutines. BenchmarkPoolOneInputSizes: one input through
// pools of 100 to 1000 draws in both precisions, per network and as the bandwidth the pool is
// read at, either side of touchAbove (pools larger than that read each network ahead; see next).
func BenchmarkPoolOneInput(b *testing.B) {
	m, X := benchModel()
	const S = 1000
	for _, prec := range []Precision{Float64, Float32} {
		b.Run("fresh/"+prec.String(), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := m.PredictWith(context.Background(), X[i%len(X):i%len(X)+1], S, 1, prec); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("pool/"+prec.String(), func(b *testing.B) {
			pool, err := NewPool(m, S, 1, prec)
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := pool.Predict(context.Background(), X[i%len(X):i%len(X)+1]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkPoolBuild(b *testing.B) {
	m, _ := benchModel()
	for _, prec := range []Precision{Float64, Float32} {
		b.Run(prec.String(), func(b *testing.B) {
			var pool *Pool
			for i := 0; i < b.N; i++ {
				var err error
				if pool, err = NewPool(m, 1000, uint64(i), prec); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(pool.Bytes())/1e6, "MB")
		})
	}
}

func BenchmarkPoolManyInputs(b *testing.B) {
	m, X0 := benchModel()
	X := make([][]float64, 0, 100000)
	for len(X) < cap(X) {
		X = append(X, X0...)
	}
	const S = 100
	for _, prec := range []Precision{Float64, Float32} {
		b.Run(fmt.Sprintf("fresh/%s", prec), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := m.PredictWith(context.Background(), X, S, 1, prec); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, m, len(X)*S)
		})
		b.Run(fmt.Sprintf("pool/%s", prec), func(b *testing.B) {
			pool, err := NewPool(m, S, 1, prec)
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := pool.Predict(context.Background(), X); err != nil {
					b.Fatal(err)
				}
			}
			reportRate(b, m, len(X)*S)
		})
	}
}

func BenchmarkPoolOneInputSizes(b *testing.B) {
	m, X := benchModel()
	for _, prec := range []Precision{Float64, Float32} {
		for _, S := range []int{100, 500, 1000} {
			pool, err := NewPool(m, S, 1, prec)
			if err != nil {
				b.Fatal(err)
			}
			b.Run(fmt.Sprintf("%s/S=%d/%dMB/ahead=%v", prec, S, pool.Bytes()>>20, pool.readsAhead()), func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					if _, err := pool.Predict(context.Background(), X[i%len(X):i%len(X)+1]); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*S), "ns/network")
				b.ReportMetric(float64(pool.Bytes())*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
			})
		}
	}
}
