//go:build openblas

package main

/*
#cgo LDFLAGS: -lopenblas
void openblas_set_num_threads(int);
*/
import "C"

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/netlib/blas/netlib"
)

// OpenBLAS on one thread, as bnn runs it.
func blas64() blas.Float64 {
	C.openblas_set_num_threads(1)
	return netlib.Implementation{}
}

func blas32() blas.Float32 {
	C.openblas_set_num_threads(1)
	return netlib.Implementation{}
}
