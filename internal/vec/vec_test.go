package vec

import (
	"math"
	"testing"
)

func TestTranspose(t *testing.T) {
	// 2 x 3:  [1 2 3; 4 5 6]  ->  3 x 2: [1 4; 2 5; 3 6]
	got := Transpose([]float64{1, 2, 3, 4, 5, 6}, 2, 3)
	want := []float64{1, 4, 2, 5, 3, 6}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("Transpose = %v, want %v", got, want)
		}
	}
	back := Transpose(got, 3, 2)
	for i, v := range []float64{1, 2, 3, 4, 5, 6} {
		if back[i] != v {
			t.Fatalf("transposing twice gave %v", back)
		}
	}
	defer func() {
		if recover() == nil {
			t.Fatal("a shape that does not match the length must panic")
		}
	}()
	Transpose([]float64{1, 2, 3}, 2, 2)
}

func TestCloneAndExp(t *testing.T) {
	x := []float64{0, 1, -2}
	c := Clone(x)
	c[0] = 7
	if x[0] != 0 {
		t.Fatal("Clone shares memory")
	}
	if Clone(nil) != nil {
		t.Fatal("Clone(nil) should be nil")
	}
	e := ExpInPlace(x)
	if &e[0] != &x[0] || e[0] != 1 || e[1] != math.E || e[2] != math.Exp(-2) {
		t.Fatalf("ExpInPlace = %v", e)
	}
}

// TestTransposeRejectsAMismatchedShape pins that Transpose checks the length both ways, before
// it touches the data: a slice shorter or longer than rows*cols panics with the package's own
// message, not with an index error half-way or a silently truncated result.
func TestTransposeRejectsAMismatchedShape(t *testing.T) {
	const want = "vec.Transpose: length does not match the shape"
	for _, tc := range []struct {
		name       string
		n          int
		rows, cols int
	}{
		{"shorter", 5, 2, 3},
		{"longer", 7, 2, 3},
		{"empty shape", 1, 0, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			defer func() {
				if got := recover(); got != want {
					t.Fatalf("Transpose of %d values as %d x %d: panic %v, want %q", tc.n, tc.rows, tc.cols, got, want)
				}
			}()
			Transpose(make([]float64, tc.n), tc.rows, tc.cols)
		})
	}
}
