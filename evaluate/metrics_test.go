package evaluate

import (
	"math"
	"testing"
)

// TestRobustnessRatioSumsOverEveryFeature pins RR(x'; kappa) = ||G(x+kappa) - x'||^2 / ||x' - x||^2
// (the paper's supplementary "Robustness Ratio"): both squared norms sum over every feature, not
// only the one the nudge happened to move. Worked by hand from the definition.
func TestRobustnessRatioSumsOverEveryFeature(t *testing.T) {
	for _, tc := range []struct {
		name         string
		z, zCF, zKCF []float64
		want         float64
	}{
		// x' - x = (1, 2, 2): 9. G(x+k) - x' = (1, 0, 2): 5.
		{"moves in two features", []float64{0, 0, 0}, []float64{1, 2, 2}, []float64{2, 2, 4}, 5.0 / 9},
		// G(x+k) - x' = (0.3, 0, 0): 0.09 / 9, the difference in the first feature only.
		{"moves in the first feature", []float64{0, 0, 0}, []float64{1, 2, 2}, []float64{1.3, 2, 2}, 0.01},
		// x' - x = (-2, 0, 1) from x = (1, 1, 1): 5. G(x+k) - x' = (0, -1, 0): 1.
		{"offset origin", []float64{1, 1, 1}, []float64{-1, 1, 2}, []float64{-1, 0, 2}, 0.2},
	} {
		if got := RobustnessRatio(tc.z, tc.zCF, tc.zKCF); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("%s: RR = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestImplausibilityIsTheMeanOfDistances pins Imp(x') = (1/|X_y'|) sum ||x - x'||_2: the
// arithmetic mean of the Euclidean distances, not the root of the summed squares nor the norm
// of the vector of distances. Worked by hand (3-4-5 and 6-8-10 triangles).
func TestImplausibilityIsTheMeanOfDistances(t *testing.T) {
	for _, tc := range []struct {
		name string
		z    []float64
		rows [][]float64
		want float64
	}{
		// Distances 5 and 10: mean 7.5 (the norm of (5, 10) over 2 would be 5.59).
		{"two distances", []float64{0, 0}, [][]float64{{3, 4}, {6, 8}}, 7.5},
		// From (1, 1, 1): (1, 4, 5) is at distance 5, (1, 1, 1) at 0, (3, 1, 1) at 2: mean 7/3.
		{"three rows, three features", []float64{1, 1, 1}, [][]float64{{1, 4, 5}, {1, 1, 1}, {3, 1, 1}}, 7.0 / 3},
		{"one row", []float64{-1, 2}, [][]float64{{2, -2}}, 5},
	} {
		if got := Implausibility(tc.z, tc.rows); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("%s: Imp = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestSummarizeIsMeanAndSampleStd pins Stat's rule: the mean and the sample standard deviation
// (n-1) of the defined seeds, NaN seeds left out and counted out of N; with no defined seed both
// the mean and the standard deviation are undefined. The figures are worked by hand: for
// 2, 4, 4, 4, 5, 5, 7, 9 the squared deviations from 5 sum to 32, so the sample std is
// sqrt(32/7).
func TestSummarizeIsMeanAndSampleStd(t *testing.T) {
	nan := math.NaN()
	for _, tc := range []struct {
		name      string
		xs        []float64
		mean, std float64
		n         int
	}{
		{"eight seeds", []float64{2, 4, 4, 4, 5, 5, 7, 9}, 5, math.Sqrt(32.0 / 7), 8},
		{"eight seeds and NaNs", []float64{nan, 2, 4, 4, nan, 4, 5, 5, 7, 9, nan}, 5, math.Sqrt(32.0 / 7), 8},
		// 1, 2, 6: mean 3, squared deviations 4 + 1 + 9 = 14, std sqrt(14/2).
		{"three seeds", []float64{1, 2, 6}, 3, math.Sqrt(7), 3},
		{"one seed", []float64{nan, -2.5}, -2.5, 0, 1},
		{"all undefined", []float64{nan, nan}, nan, nan, 0},
		{"no seeds", nil, nan, nan, 0},
	} {
		s := summarize(tc.xs)
		same := func(got, want float64) bool {
			if math.IsNaN(want) {
				return math.IsNaN(got)
			}
			return math.Abs(got-want) <= 1e-12
		}
		if !same(s.Mean, tc.mean) || !same(s.Std, tc.std) || s.N != tc.n {
			t.Errorf("%s: summarize = %+v, want mean %v std %v over %d", tc.name, s, tc.mean, tc.std, tc.n)
		}
	}
}

// TestFracIsUndefinedOverNothing pins frac's documented rule: k/n, and NaN (not Inf) whenever
// n is 0.
func TestFracIsUndefinedOverNothing(t *testing.T) {
	for _, k := range []int{0, 1, 5} {
		if got := frac(k, 0); !math.IsNaN(got) {
			t.Errorf("frac(%d, 0) = %v, want NaN", k, got)
		}
	}
	if got := frac(1, 8); got != 0.125 {
		t.Errorf("frac(1, 8) = %v, want 0.125", got)
	}
}
