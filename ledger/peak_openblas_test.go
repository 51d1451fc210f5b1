//go:build openblas

package ledger

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/netlib/blas/netlib"
)

// benchDgemm is the dgemm of this build's predictive engine: OpenBLAS, which bnn sets to one
// thread on its first product (so call it after a prediction).
func benchDgemm() blas.Float64 { return netlib.Implementation{} }
