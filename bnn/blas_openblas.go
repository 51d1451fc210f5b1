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
#cgo CFLAGS: -O3
#include <stddef.h>

// No fused multiply-adds: a product is rounded before it is added, as in the Go paths (the avx2
// clones below do not enable FMA either).
#pragma GCC optimize("fp-contract=off")
void openblas_set_num_threads(int);

// Each kernel is defined once for T = double and T = float (suffixes 64 and 32) and cloned for
// AVX2 with a baseline fallback, chosen at load time.
#define KERNEL __attribute__((target_clones("avx2", "default"))) static void

// The fused bias + ReLU / bias pass over one layer's block (out rows of n), written so that the
// C compiler vectorizes it (Go's does not): x <= 0 ? 0 : x is Go's max(x, 0), NaN kept, -0 to +0.
#define BIAS_ACT(NAME, T) \
KERNEL NAME(T *o, const T *b, int out, int n, int relu) { \
	for (int j = 0; j < out; j++) { \
		T *r = o + (size_t)j * n, bj = b[j]; \
		if (relu) { \
			for (int i = 0; i < n; i++) { T x = r[i] + bj; r[i] = x <= 0 ? 0 : x; } \
		} else { \
			for (int i = 0; i < n; i++) r[i] += bj; \
		} \
	} \
}
BIAS_ACT(bias_act64, double)
BIAS_ACT(bias_act32, float)

// The output layer of a classifier (out of a few classes) in one vectorized pass, where a dgemm
// call would spend most of its time packing: o[j, i] = (sum_k wt[k, j] h[k, i]) + b[j], the
// products added in order of k from zero and the bias last, as gemmTN + biasAct do.
#define DENSE_OUT(NAME, T) \
KERNEL NAME(T *o, const T *wt, const T *h, const T *b, int in, int out, int n) { \
	for (int j = 0; j < out; j++) { \
		T *r = o + (size_t)j * n; \
		for (int i = 0; i < n; i++) r[i] = 0; \
		for (int k = 0; k < in; k++) { \
			const T w = wt[(size_t)k * out + j], *x = h + (size_t)k * n; \
			for (int i = 0; i < n; i++) r[i] += w * x[i]; \
		} \
		for (int i = 0; i < n; i++) r[i] += b[j]; \
	} \
}
DENSE_OUT(dense_out64, double)
DENSE_OUT(dense_out32, float)
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

// chunkMin: calls of fewer inputs go one at a time (gemv per layer, pure Go). OpenBLAS's dgemm
// makes the chunked path cheaper per input from 4 inputs on (1000 draws, 30 -> 64 -> 32 -> 2, per
// input: 0.60 ms at 4, 0.23 ms at 16, against 0.85 and 0.63 one at a time; BenchmarkPredictBatchSizes
// in daemon), which is what concurrent predictions batched together (daemon's batcher) and
// registrations measured together are.
const chunkMin = 4

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

// biasActBlock applies biasAct to every row of o (len(b) rows of rows elements), row j with bias
// b[j]: ReLU and the output layer's bias in one vectorized C pass, other activations in Go.
func biasActBlock[F float](o, b []F, rows int, act Activation, output bool) {
	if !output && act != ReLU {
		for j, bj := range b {
			biasAct(o[j*rows:(j+1)*rows], bj, act, output)
		}
		return
	}
	relu := C.int(0)
	if !output {
		relu = 1
	}
	o = o[:len(b)*rows]
	if unsafe.Sizeof(F(0)) == 8 {
		C.bias_act64(cptr[C.double](o), cptr[C.double](b), C.int(len(b)), C.int(rows), relu)
		return
	}
	C.bias_act32(cptr[C.float](o), cptr[C.float](b), C.int(len(b)), C.int(rows), relu)
}

// denseOut sets o = wt^T h + b for the output layer (wt in x out, h in x rows, o out x rows) when
// out is small enough that one C pass beats a dgemm call, and reports whether it did.
func denseOut[F float](o, wt, h, b []F, in, out, rows int) bool {
	if out > 4 {
		return false
	}
	o, wt, h, b = o[:out*rows], wt[:in*out], h[:in*rows], b[:out]
	if unsafe.Sizeof(F(0)) == 8 {
		C.dense_out64(cptr[C.double](o), cptr[C.double](wt), cptr[C.double](h), cptr[C.double](b), C.int(in), C.int(out), C.int(rows))
		return true
	}
	C.dense_out32(cptr[C.float](o), cptr[C.float](wt), cptr[C.float](h), cptr[C.float](b), C.int(in), C.int(out), C.int(rows))
	return true
}

// cptr is the address of v's first element as a C pointer (T is C.double for float64, C.float for
// float32), without indexing: an empty slice, which the kernels never read, gives its base (or nil).
func cptr[T C.double | C.float, F float](v []F) *T {
	return (*T)(unsafe.Pointer(unsafe.SliceData(v)))
}
