//go:build !openblas

package main

import (
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

func blas64() blas.Float64 { return gonum.Implementation{} }

func blas32() blas.Float32 { return gonum.Implementation{} }
