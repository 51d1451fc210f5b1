package certify

import (
	"fmt"
	"math"

	"github.com/cfguard/cfguard/bnn"
)

// KLDiag is the KL divergence between two diagonal Gaussians given by means and log standard
// deviations, q2 = N(m2, diag(exp(2 ls2))) relative to q1 = N(m1, diag(exp(2 ls1))):
//
//	KL(q2 || q1) = sum_i [ ls1_i - ls2_i + (exp(2(ls2_i - ls1_i)) + (m2_i - m1_i)^2 exp(-2 ls1_i)) / 2 - 1/2 ]
//
// It is a sum over every parameter (never a mean, unlike torchbnn's default reduction), it is 0
// exactly when the two agree (for ls1_i above about -354, where exp(-2 ls1_i) is finite; valid
// models keep |log sigma| <= bnn.MaxLogSigma), and it is asymmetric: KLDiag(a, b) != KLDiag(b, a)
// in general.
// Working in log-sigma avoids dividing by tiny variances. All four slices must have equal length.
func KLDiag(m2, ls2, m1, ls1 []float64) float64 {
	s := 0.0
	for i := range m2 {
		dl := ls2[i] - ls1[i]
		dm := m2[i] - m1[i]
		s += 0.5*expm1MinusX(2*dl) + 0.5*dm*dm*math.Exp(-2*ls1[i])
	}
	return s
}

// expm1MinusX is exp(x) - 1 - x without cancellation for small x: a Taylor series to x^4 below
// |x| = 1e-3 (truncation error ~ |x|^5/120, relative to the value ~x^2/2 that is ~|x|^3/60, at
// most 1.7e-11 at |x| = 1e-3), math.Exp above, where the cancellation costs at most ~2.2e-10
// relative (just above |x| = 1e-3: 2.18e-10 at 1.0063e-3). math.Expm1 would do, but is several
// times slower.
func expm1MinusX(x float64) float64 {
	if math.Abs(x) < 1e-3 {
		return x * x * (0.5 + x*(1.0/6+x/24))
	}
	return math.Exp(x) - 1 - x
}

// KL returns KL(q2 || q1) summed over every weight and bias of every layer, and the number of
// parameters it covers. Layers that are bit-for-bit identical contribute exactly 0 and are
// skipped, so a last-layer update costs only the last layer's terms.
func KL(q2, q1 *bnn.Model) (kl float64, params int, err error) {
	if len(q2.Layers) != len(q1.Layers) {
		return 0, 0, fmt.Errorf("kl: models have %d and %d layers", len(q2.Layers), len(q1.Layers))
	}
	for k := range q2.Layers {
		a, b := &q2.Layers[k], &q1.Layers[k]
		if a.In != b.In || a.Out != b.Out {
			return 0, 0, fmt.Errorf("kl: layer %d shapes differ: %dx%d vs %dx%d", k, a.Out, a.In, b.Out, b.In)
		}
		params += a.NumParams()
		if bnn.LayersEqual(a, b) {
			continue
		}
		kl += KLDiag(a.WeightMu, a.WeightLogSigma, b.WeightMu, b.WeightLogSigma)
		kl += KLDiag(a.BiasMu, a.BiasLogSigma, b.BiasMu, b.BiasLogSigma)
	}
	if math.IsNaN(kl) || math.IsInf(kl, 0) {
		return 0, params, fmt.Errorf("kl: not finite (%v)", kl)
	}
	return kl, params, nil
}

// KLToPrior is KL(q || N(0, sigma_p^2 I)) over every parameter of q, the Bayes-by-backprop
// regulariser (as a sum):
//
//	sum_i [ log sigma_p - ls_i + (exp(2 ls_i) + m_i^2) / (2 sigma_p^2) - 1/2 ]
func KLToPrior(q *bnn.Model, priorSigma float64) float64 {
	lp := math.Log(priorSigma)
	s := 0.0
	for k := range q.Layers {
		l := &q.Layers[k]
		s += klToPrior(l.WeightMu, l.WeightLogSigma, lp) + klToPrior(l.BiasMu, l.BiasLogSigma, lp)
	}
	return s
}

func klToPrior(m, ls []float64, lp float64) float64 {
	s := 0.0
	for i := range m {
		s += lp - ls[i] + 0.5*(math.Exp(2*(ls[i]-lp))+m[i]*m[i]*math.Exp(-2*lp)) - 0.5
	}
	return s
}
