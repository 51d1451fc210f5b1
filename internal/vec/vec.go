// Package vec holds the few element-wise helpers on []float64 that the model packages (bnn,
// update) share, so that each exists once.
package vec

import "math"

// Transpose returns src, a rows x cols row-major matrix, transposed into a new cols x rows
// row-major slice: dst[c*rows+r] = src[r*cols+c]. It panics if len(src) != rows*cols.
func Transpose(src []float64, rows, cols int) []float64 {
	if len(src) != rows*cols {
		panic("vec.Transpose: length does not match the shape")
	}
	dst := make([]float64, len(src))
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			dst[c*rows+r] = src[r*cols+c]
		}
	}
	return dst
}

// Clone returns a copy of x (nil for nil).
func Clone(x []float64) []float64 { return append([]float64(nil), x...) }

// ExpInPlace replaces every v[i] by exp(v[i]) and returns v.
func ExpInPlace(v []float64) []float64 {
	for i := range v {
		v[i] = math.Exp(v[i])
	}
	return v
}
