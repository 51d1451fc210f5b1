//go:build !openblas

package bnn

import (
	"unsafe"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// Backend names the BLAS behind the predictive engine's matrix products: "gonum" (pure Go, the
// default) or "openblas" (built with -tags openblas).
const Backend = "gonum"

// gemmTN sets c = a^T b for a (k x m), b (k x n) and c (m x n), all row-major, with gonum's
// (Trans, NoTrans) kernel: for every input l in order, c[o, :] += a[l, o] b[l, :] by assembly
// axpys, from c = 0; the per-output order is the one forwardOne uses.
func gemmTN[F float](m, n, k int, a, b, c []F) {
	if unsafe.Sizeof(a[0]) == 8 {
		gonum.Implementation{}.Dgemm(blas.Trans, blas.NoTrans, m, n, k, 1, as[float64](a), m, as[float64](b), n, 0, as[float64](c), n)
		return
	}
	gonum.Implementation{}.Sgemm(blas.Trans, blas.NoTrans, m, n, k, 1, as[float32](a), m, as[float32](b), n, 0, as[float32](c), n)
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
