//go:build openblas

package bnn

// The OpenBLAS backend: the engine's matrix products go to OpenBLAS's dgemm and sgemm through
// gonum's cgo bindings (gonum.org/v1/netlib). It needs the OpenBLAS library and headers at build
// time (Debian: apt-get install libopenblas-dev) and is selected with
//
//	go test -tags openblas ./bnn/...
//
// OpenBLAS is set to one thread: the engine is called from goroutines that the caller already
// spreads over the cores, and OpenBLAS's own threads would compete with them.

/*
#cgo LDFLAGS: -lopenblas
void openblas_set_num_threads(int);
*/
import "C"

import (
	"sync"
	"unsafe"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/netlib/blas/netlib"
)

// Backend names the BLAS behind the predictive engine's matrix products: "gonum" (pure Go, the
// default) or "openblas" (built with -tags openblas).
const Backend = "openblas"

var openblasThreads sync.Once

func openblas() netlib.Implementation {
	openblasThreads.Do(func() { C.openblas_set_num_threads(1) })
	return netlib.Implementation{}
}

// gemmTN sets c = a^T b for a (k x m), b (k x n) and c (m x n), all row-major, with OpenBLAS.
func gemmTN[F float](m, n, k int, a, b, c []F) {
	if unsafe.Sizeof(a[0]) == 8 {
		openblas().Dgemm(blas.Trans, blas.NoTrans, m, n, k, 1, as[float64](a), m, as[float64](b), n, 0, as[float64](c), n)
		return
	}
	openblas().Sgemm(blas.Trans, blas.NoTrans, m, n, k, 1, as[float32](a), m, as[float32](b), n, 0, as[float32](c), n)
}
