package certify

import (
	"math/rand/v2"
	"testing"
)

const benchParams = 1_000_000

func benchArrays() (m2, ls2, m1, ls1 []float64) {
	rng := rand.New(rand.NewPCG(1, 2))
	m2, ls2, m1, ls1 = make([]float64, benchParams), make([]float64, benchParams), make([]float64, benchParams), make([]float64, benchParams)
	for i := range m2 {
		m1[i], ls1[i] = rng.NormFloat64(), -2+0.1*rng.NormFloat64()
		m2[i], ls2[i] = m1[i]+1e-3*rng.NormFloat64(), ls1[i]+1e-3*rng.NormFloat64()
	}
	return
}

// BenchmarkKL1M is the closed-form KL over 10^6 parameters; compare with BenchmarkReadPass1M,
// a plain pass that only reads the same four arrays (the memory-bandwidth floor).
func BenchmarkKL1M(b *testing.B) {
	m2, ls2, m1, ls1 := benchArrays()
	b.SetBytes(4 * 8 * benchParams)
	b.ResetTimer()
	s := 0.0
	for i := 0; i < b.N; i++ {
		s += KLDiag(m2, ls2, m1, ls1)
	}
	sink = s
}

func BenchmarkReadPass1M(b *testing.B) {
	m2, ls2, m1, ls1 := benchArrays()
	b.SetBytes(4 * 8 * benchParams)
	b.ResetTimer()
	s := 0.0
	for i := 0; i < b.N; i++ {
		for j := range m2 {
			s += m2[j] + ls2[j] + m1[j] + ls1[j]
		}
	}
	sink = s
}

var sink float64
