//go:build !openblas

package bnn

import (
	"unsafe"

	"gonum.org/v1/gonum/blas/gonum"
)

// Backend names the BLAS behind the predictive engine's matrix products: "gonum" (pure Go, the
// default) or "openblas" (built with -tags openblas).
const Backend = "gonum"

// chunkMin: calls of fewer inputs go one at a time (gemv per layer). With gonum's products the
// chunked path costs more per input in small calls (1000 draws, 30 -> 64 -> 32 -> 2: 0.79 ms
// per input at 16 in chunks against 0.63 one at a time; BenchmarkPredictBatchSizes in daemon
// with chunkMin set to 4).
const chunkMin = 32

// gemmTN sets c = a^T b for a (k x m), b (k x n) and c (m x n), all row-major, as k rank-one
// updates c += a[l, :]^T b[l, :] from c = 0 with gonum's Dger/Sger, whose assembly kernel
// updates four rows of c per pass over b[l, :] (23% faster here than gonum's Dgemm, which makes
// one axpy per row). Each c[o, j] still adds a[l, o] b[l, j] for l = 0, 1, ... in order, the
// order forwardOne's gemv uses.
func gemmTN[F float](m, n, k int, a, b, c []F) {
	clear(c[:m*n])
	if unsafe.Sizeof(a[0]) == 8 {
		a, b, c := as[float64](a), as[float64](b), as[float64](c)
		for l := 0; l < k; l++ {
			gonum.Implementation{}.Dger(m, n, 1, a[l*m:(l+1)*m], 1, b[l*n:(l+1)*n], 1, c, n)
		}
		return
	}
	a32, b32, c32 := as[float32](a), as[float32](b), as[float32](c)
	for l := 0; l < k; l++ {
		gonum.Implementation{}.Sger(m, n, 1, a32[l*m:(l+1)*m], 1, b32[l*n:(l+1)*n], 1, c32, n)
	}
}

// biasActBlock applies biasAct to every row of o (len(b) rows of rows elements), row j with bias
// b[j].
func biasActBlock[F float](o, b []F, rows int, act Activation, output bool) {
	for j, bj := range b {
		biasAct(o[j*rows:(j+1)*rows], bj, act, output)
	}
}

// denseOut is the OpenBLAS build's C output layer; this build has none and reports false.
func denseOut[F float](o, wt, h, b []F, in, out, rows int) bool { return false }
