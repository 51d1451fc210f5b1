//go:build !openblas

package bnn

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// Backend names the BLAS behind the predictive engine's matrix products: "gonum" (pure Go, the
// default) or "openblas" (built with -tags openblas).
const Backend = "gonum"

// gemmTN with gonum's (Trans, NoTrans) kernel: for every input l in order, c[o, :] += a[l, o]
// b[l, :] by assembly axpys, from c = 0; the per-output order is the one forwardOne uses.
func (la64) gemmTN(m, n, k int, a, b, c []float64) {
	gonum.Implementation{}.Dgemm(blas.Trans, blas.NoTrans, m, n, k, 1, a, m, b, n, 0, c, n)
}

func (la32) gemmTN(m, n, k int, a, b, c []float32) {
	gonum.Implementation{}.Sgemm(blas.Trans, blas.NoTrans, m, n, k, 1, a, m, b, n, 0, c, n)
}
