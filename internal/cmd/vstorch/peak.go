package main

import (
	"math/rand/v2"
	"time"

	"gonum.org/v1/gonum/blas"
)

// peakN is the size of the square products that measure the GEMM peak.
const peakN = 1024

// peakGFLOPS is the best rate of three n x n x n products (2 n^3 flops each) with this build's
// BLAS, in float32 (sgemm) or float64 (dgemm).
func peakGFLOPS(single bool) float64 {
	rng := rand.New(rand.NewPCG(3, 3))
	best := 0.0
	if single {
		a, b, c := make([]float32, peakN*peakN), make([]float32, peakN*peakN), make([]float32, peakN*peakN)
		for i := range a {
			a[i], b[i] = float32(rng.NormFloat64()), float32(rng.NormFloat64())
		}
		for r := 0; r < 3; r++ {
			start := time.Now()
			blas32().Sgemm(blas.NoTrans, blas.NoTrans, peakN, peakN, peakN, 1, a, peakN, b, peakN, 0, c, peakN)
			best = max(best, 2*peakN*peakN*peakN/time.Since(start).Seconds()/1e9)
		}
		return best
	}
	a, b, c := make([]float64, peakN*peakN), make([]float64, peakN*peakN), make([]float64, peakN*peakN)
	for i := range a {
		a[i], b[i] = rng.NormFloat64(), rng.NormFloat64()
	}
	for r := 0; r < 3; r++ {
		start := time.Now()
		blas64().Dgemm(blas.NoTrans, blas.NoTrans, peakN, peakN, peakN, 1, a, peakN, b, peakN, 0, c, peakN)
		best = max(best, 2*peakN*peakN*peakN/time.Since(start).Seconds()/1e9)
	}
	return best
}
