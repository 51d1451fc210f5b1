package evaluate

import (
	"math"

	"github.com/cfguard/cfguard/explain"
)

// IM1 is the ratio of the reconstruction errors of x' under the autoencoder of the
// counterfactual class y' and under that of the original class y (Van Looveren and Klaise 2021;
// the paper's supplementary "Metrics"):
//
//	IM1(x') = ||x' - AE_y'(x')||^2 / ||x' - AE_y(x')||^2.
//
// Below 1, x' looks more like the target class than like its origin. z is standardised.
func IM1(z []float64, target, original *explain.AE) float64 {
	return target.Error(z) / original.Error(z)
}

// Implausibility is the mean Euclidean distance from x' to the training rows of the
// counterfactual class (Altmeyer et al. 2024), here in the model's standardised units:
//
//	Imp(x') = (1/|X_y'|) sum_{x in X_y'} ||x - x'||_2.
func Implausibility(z []float64, classRows [][]float64) float64 {
	s := 0.0
	for _, r := range classRows {
		d := 0.0
		for j, v := range r {
			d += (v - z[j]) * (v - z[j])
		}
		s += math.Sqrt(d)
	}
	return s / float64(len(classRows))
}

// RobustnessRatio compares the counterfactual of a slightly moved input with the original one
// (Batten et al. 2025; the paper uses kappa = 1e-3):
//
//	RR(x'; kappa) = ||G(x + kappa) - x'||^2 / ||x' - x||^2,
//
// with kappa added to every standardised feature; zKappaCF is G(x + kappa) standardised. 0 means
// the generator is insensitive to the nudge; 1 means the nudge moves the answer as far as the
// counterfactual itself moved.
func RobustnessRatio(z, zCF, zKappaCF []float64) float64 {
	num, den := 0.0, 0.0
	for j := range z {
		num += (zKappaCF[j] - zCF[j]) * (zKappaCF[j] - zCF[j])
		den += (zCF[j] - z[j]) * (zCF[j] - z[j])
	}
	return num / den
}

// Stat is a mean and a sample standard deviation (n-1; 0 for a single value) over seeds. Seeds
// where the metric is undefined (NaN, e.g. no valid counterfactual to measure) are left out; N
// says how many were used.
type Stat struct {
	Mean, Std float64
	N         int
}

func summarize(xs []float64) Stat {
	var v []float64
	for _, x := range xs {
		if !math.IsNaN(x) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return Stat{Mean: math.NaN(), Std: math.NaN()}
	}
	m := 0.0
	for _, x := range v {
		m += x
	}
	m /= float64(len(v))
	s := 0.0
	for _, x := range v {
		s += (x - m) * (x - m)
	}
	if len(v) > 1 {
		s = math.Sqrt(s / float64(len(v)-1))
	}
	return Stat{Mean: m, Std: s, N: len(v)}
}

// mean of xs, NaN when empty.
func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}

// frac is k/n, NaN when n is 0.
func frac(k, n int) float64 {
	if n == 0 {
		return math.NaN()
	}
	return float64(k) / float64(n)
}
