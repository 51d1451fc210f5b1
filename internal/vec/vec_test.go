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
