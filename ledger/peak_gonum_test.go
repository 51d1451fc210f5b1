//go:build !openblas

package ledger

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// benchDgemm is the dgemm of this build's predictive engine: gonum's pure Go.
func benchDgemm() blas.Float64 { return gonum.Implementation{} }
