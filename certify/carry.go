package certify

import "math"

// VerdictBound is the confidence bound that puts a verdict on its side of 1/2, from the evidence
// e it was measured with (at miss probability alpha, as Verdict uses it):
//
//	at_risk      lower(p) when lower(p) >= 1/2: p >= 1/2 at confidence 1 - alpha
//	invalidated  upper(p) when upper(p) < 1/2:  p < 1/2 at confidence 1 - alpha
//
// ok is false when the evidence decides neither (the status was kept by hysteresis, or s is
// neither verdict): such a verdict says nothing beyond its own posterior, so it never carries.
func VerdictBound(s Status, e Evidence, alpha float64) (bound float64, ok bool) {
	lo, hi := e.Interval(alpha)
	switch {
	case s == AtRisk && lo >= 0.5:
		return lo, true
	case s == Invalidated && hi < 0.5:
		return hi, true
	}
	return 0, false
}

// Carries reports whether a verdict s, decided under a posterior q_v with the confidence bound b
// (VerdictBound), still holds under a later posterior q, given the slack of KL(q || q_v)
// (Policy.Slack):
//
//	at_risk      b - slack.Mean >= 1/2   (then p_q >= 1/2)
//	invalidated  b + slack.Mean <  1/2   (then p_q <  1/2)
//
// Proof. With probability 1 - alpha over the draws of the measurement, b bounds p_v = E_{q_v}[f]
// on its side. Theorem 1 with q1 = q_v, q2 = q gives p_q >= p_v - slack for f = p(target | x', w)
// in [0, 1] (slack = 2 sqrt(KL(q||q_v)/2) in paper mode, TV_ub in tight mode; both bound
// |E_q f - E_{q_v} f|, since TV(q, q_v) <= sqrt(KL(q||q_v)/2)); applied to 1 - f, also in [0, 1],
// it gives p_q <= p_v + slack. So an at_risk verdict carried this way still has p_q >= 1/2, and
// an invalidated one p_q < 1/2, on the same event of probability 1 - alpha as the verdict itself:
// carrying adds no miss probability, for any number of later posteriors, each judged with its own
// KL from q_v (never a sum of KLs). The ends match Verdict's: at_risk inclusive, invalidated
// strict. A NaN bound or slack carries nothing.
func Carries(s Status, b float64, slack Slack) bool {
	if math.IsNaN(b) || math.IsNaN(slack.Mean) {
		return false
	}
	switch s {
	case AtRisk:
		return b-slack.Mean >= 0.5
	case Invalidated:
		return b+slack.Mean < 0.5
	}
	return false
}

// CarryMargin is how much mean slack a verdict with bound b can absorb: b - 1/2 for at_risk,
// 1/2 - b for invalidated (-Inf for any other status). Carries(s, b, slack) implies
// slack.Mean <= CarryMargin(s, b) up to rounding; an index sorted by it finds the verdicts a
// growing KL stops carrying with one range scan.
func CarryMargin(s Status, b float64) float64 {
	switch s {
	case AtRisk:
		return b - 0.5
	case Invalidated:
		return 0.5 - b
	}
	return math.Inf(-1)
}
