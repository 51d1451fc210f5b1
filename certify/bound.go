package certify

import (
	"fmt"
	"math"
)

// Mode selects the constants of the bounds.
type Mode string

const (
	// Paper is Theorems 1 and 2 as published: p2 >= p1 - 2 sqrt(KL/2), V2 <= V1 + 6 sqrt(KL/2).
	Paper Mode = "paper"
	// Tight uses TV_ub = min(sqrt(KL/2), sqrt(1-exp(-KL))): p2 >= p1 - TV_ub, V2 <= V1 + 3 TV_ub.
	// Beyond the paper; opt-in.
	Tight Mode = "tight"
)

// ParseMode accepts "paper" and "tight".
func ParseMode(s string) (Mode, error) {
	switch Mode(s) {
	case Paper:
		return Paper, nil
	case Tight:
		return Tight, nil
	}
	return "", fmt.Errorf("unknown bound mode %q (want paper or tight)", s)
}

// Pinsker is the Pinsker bound on total variation, sqrt(KL/2).
func Pinsker(kl float64) float64 { return math.Sqrt(math.Max(kl, 0) / 2) }

// TVUpper is an upper bound on TV(q2, q1) given KL(q2 || q1):
// min(sqrt(KL/2), sqrt(1 - exp(-KL))) (Pinsker; Bretagnolle-Huber, better for large KL), never above 1.
func TVUpper(kl float64) float64 {
	kl = math.Max(kl, 0)
	return math.Min(math.Min(Pinsker(kl), math.Sqrt(-math.Expm1(-kl))), 1)
}

// meanSlack is how far p can fall: 2 sqrt(KL/2) (paper) or TV_ub (tight).
func meanSlack(kl float64, mode Mode) float64 {
	if mode == Tight {
		return TVUpper(kl)
	}
	return 2 * Pinsker(kl)
}

// ProbLower is Theorem 1 with an observed p1: a lower bound on p2 = E_{q2}[f] when p1 = E_{q1}[f].
// Pass p1 = 1 - delta for the (1 - delta) form. The value is not clipped at 0, so that how far a
// bound fails stays visible; a bound below 0 says nothing.
func ProbLower(p1, kl float64, mode Mode) float64 { return p1 - meanSlack(kl, mode) }

// VarUpper is Theorem 2 with an observed V1: an upper bound on V2 = Var_{q2}[f], capped in both
// modes at 1/4, the largest variance of a [0, 1]-valued variable (so a budget of 1/4 never fails):
//
//	paper: min(V1 + 6 sqrt(KL/2), 1/4)     tight: min(V1 + 3 TV_ub, 1/4)
func VarUpper(v1, kl float64, mode Mode) float64 {
	if mode == Tight {
		return math.Min(v1+3*TVUpper(kl), 0.25)
	}
	return math.Min(v1+6*Pinsker(kl), 0.25)
}

// KLBudget is the largest KL(q2 || q1) for which Theorem 1 (paper mode) keeps a CE with
// p1 >= 1 - delta at or above 1/2:
//
//	(1 - delta) - 2 sqrt(KL/2) >= 1/2  <=>  KL <= (1/2 - delta)^2 / 2      (0.10125 at delta = 0.05)
//
// It returns 0 when delta >= 1/2 (no budget).
func KLBudget(delta float64) float64 {
	if delta >= 0.5 {
		return 0
	}
	return (0.5 - delta) * (0.5 - delta) / 2 // not KLBudgetForP1(1-delta): 1-0.05 rounds below 0.95
}

// KLBudgetForP1 is the per-CE budget from its observed p1: KL <= (p1 - 1/2)^2 / 2 (0 if p1 <= 1/2).
func KLBudgetForP1(p1 float64) float64 {
	if p1 <= 0.5 {
		return 0
	}
	return (p1 - 0.5) * (p1 - 0.5) / 2
}

// KLBudgetForP1In is KLBudgetForP1 in mode: the largest KL(q2 || q1) at which ProbLower(p1, KL,
// mode) stays at or above 1/2. With g = p1 - 1/2 (0 if p1 <= 1/2):
//
//	paper: g^2 / 2
//	tight: max(2 g^2, -ln(1 - g^2))      (TV_ub <= g: Pinsker's sqrt(KL/2) <= g, or Bretagnolle-Huber's
//	                                      sqrt(1 - exp(-KL)) <= g, whichever allows more)
func KLBudgetForP1In(p1 float64, mode Mode) float64 {
	if mode != Tight {
		return KLBudgetForP1(p1)
	}
	if p1 <= 0.5 {
		return 0
	}
	g := p1 - 0.5
	return math.Max(2*g*g, -math.Log1p(-g*g))
}

// KLBudgetForVar is the largest KL for which Theorem 2 keeps V2 <= epsMax from V1 <= eps:
//
//	eps + 6 sqrt(KL/2) <= epsMax  <=>  KL <= (epsMax - eps)^2 / 18        (0 if eps >= epsMax)
func KLBudgetForVar(eps, epsMax float64) float64 {
	if eps >= epsMax {
		return 0
	}
	return (epsMax - eps) * (epsMax - eps) / 18
}

// HoeffdingLower is a lower confidence bound on p = E[f] from the mean pHat of S independent
// draws of f in [0, 1]: with probability at least 1 - alpha,
//
//	p >= pHat - sqrt(ln(1/alpha) / (2 S)).
//
// A certificate started from this value is not fooled by Monte-Carlo noise in p1.
func HoeffdingLower(pHat float64, samples int, alpha float64) float64 {
	if !(alpha > 0 && alpha < 1) { // NaN too: no confidence is no bound
		return math.Inf(-1)
	}
	return hoeffdingLower(pHat, samples, math.Log(1/alpha))
}

// hoeffdingLower is HoeffdingLower with ln(1/alpha) given, computed once per scan by Gate.
func hoeffdingLower(pHat float64, samples int, logInvAlpha float64) float64 {
	if samples <= 0 {
		return math.Inf(-1)
	}
	return pHat - math.Sqrt(logInvAlpha/(2*float64(samples)))
}
