package gradcheck

import (
	"math"
	"testing"
)

// For a cubic, the central difference's error is h^2 times the third derivative over 6, and
// every value is put back: the difference of f(a, b) = a^3 + a b at (2, 3) is 3 a^2 + b + h^2 in
// a and a in b.
func TestCentralOfACubic(t *testing.T) {
	a, b := []float64{2}, []float64{3}
	const h = 1e-3
	want := [][]float64{{3*4 + 3 + h*h}, {2}}
	n := 0
	Central([][]float64{a, b}, h, func() float64 { return a[0]*a[0]*a[0] + a[0]*b[0] }, func(i, j int, fd float64) {
		n++
		if math.Abs(fd-want[i][j]) > 1e-9 {
			t.Errorf("block %d[%d]: %.12g, want %.12g", i, j, fd, want[i][j])
		}
	})
	if n != 2 || a[0] != 2 || b[0] != 3 {
		t.Errorf("%d components; values after %v %v, want 2 and 3", n, a, b)
	}
}
