package certify

import (
	"fmt"
	"math"
	"testing"
)

// TestRejudge is the rule's whole table: every standing a CE can have (and a new one), with its
// bound holding and failing.
func TestRejudge(t *testing.T) {
	var (
		fresh     = Standing{}
		certified = Standing{Status: Certified}
		lapsed    = Standing{Status: Certified, Lapsed: true}
		atRisk    = Standing{Status: AtRisk}
		invalid   = Standing{Status: Invalidated}
		outside   = Standing{Status: Uncertified}
	)
	for _, tc := range []struct {
		from        Standing
		holds, fail Standing
	}{
		{fresh, certified, atRisk},
		{certified, certified, lapsed},
		{lapsed, certified, lapsed},
		{atRisk, certified, atRisk},
		{invalid, certified, invalid},
		{outside, outside, outside},
	} {
		for _, holds := range []bool{true, false} {
			want := map[bool]Standing{true: tc.holds, false: tc.fail}[holds]
			if got := Rejudge(tc.from, holds); got != want {
				t.Errorf("Rejudge(%+v, holds %v) = %+v, want %+v", tc.from, holds, got, want)
			}
			if got := Rejudge(tc.from, holds); got.Holds() != (holds && tc.from.Status != Uncertified) {
				t.Errorf("Rejudge(%+v, holds %v) = %+v: Holds() = %v", tc.from, holds, got, got.Holds())
			}
		}
	}
}

// TestRejudgeAtTheEdges: a CE whose bound lands exactly on its threshold is certified (both
// bounds are ">=" and "<="), and one ulp past the threshold lapses. The numbers are exact in
// binary, so that the edge is the comparison's, not the rounding's: each case checks that its
// bound lands exactly on the threshold. Every path gives the same answer: Evaluate, Gate.Check
// and Rejudge from a certificate, from a lapsed one and from a new CE.
func TestRejudgeAtTheEdges(t *testing.T) {
	half := DefaultPolicy()
	capped := Policy{Mode: Paper, EpsilonMax: 1.0 / 16, Alpha: DefaultAlpha}
	for _, tc := range []struct {
		name   string
		pol    Policy
		c      Certificate
		kl     float64
		nudge  func(c *Certificate) // one ulp past the edge
		atEdge func(b Bounds) bool
	}{
		{"Theorem 1: p1 - 2 sqrt(KL/2) = 1/2, p1 = 1 - delta at KL = KLBudget(delta = 0.25)", half,
			Certificate{P1: 0.75, Samples: 1000, Delta: 0.25, Epsilon: 0.01}, KLBudget(0.25),
			func(c *Certificate) { c.P1 = math.Nextafter(c.P1, 0) }, func(b Bounds) bool { return b.ProbLower == 0.5 }},
		{"Theorem 1 at the budget of delta = 0.1", half,
			Certificate{P1: 1 - 0.1, Samples: 1000, Delta: 0.1, Epsilon: 0.01}, KLBudget(0.1),
			func(c *Certificate) { c.P1 = math.Nextafter(c.P1, 0) }, func(b Bounds) bool { return b.ProbLower == 0.5 }},
		{"Theorem 1 at the budget of delta = 0.01", half,
			Certificate{P1: 1 - 0.01, Samples: 1000, Delta: 0.01, Epsilon: 0.01}, KLBudget(0.01),
			func(c *Certificate) { c.P1 = math.Nextafter(c.P1, 0) }, func(b Bounds) bool { return b.ProbLower == 0.5 }},
		{"Theorem 1 from p1 = 1 at KL = 1/8", half,
			Certificate{P1: 1, Samples: 1000, Delta: 0.05, Epsilon: 0.01}, 1.0 / 8,
			func(c *Certificate) { c.P1 = math.Nextafter(c.P1, 0) }, func(b Bounds) bool { return b.ProbLower == 0.5 }},
		// 6 sqrt(2^-14) = 3/64: V1 + 3/64 reaches the ceiling 1/16 exactly, up to V1 = 1/64 and
		// the floats just above it that round to the same sum; V1 is the largest of them.
		{"Theorem 2: V1 + 6 sqrt(KL/2) = epsilon_max", capped,
			Certificate{P1: 1, Var1: lastBelow(3.0/64, 1.0/16), Samples: 1000, Delta: 0.05, Epsilon: 0.01}, 1.0 / (1 << 13),
			func(c *Certificate) { c.Var1 = math.Nextafter(c.Var1, 1) }, func(b Bounds) bool { return b.VarUpper == b.VarCeiling && b.VarCeiling == 1.0/16 }},
		{"Theorem 2 against the CE's own epsilon above epsilon_max", capped,
			Certificate{P1: 1, Var1: lastBelow(3.0/64, 1.0/8), Samples: 1000, Delta: 0.05, Epsilon: 1.0 / 8}, 1.0 / (1 << 13),
			func(c *Certificate) { c.Var1 = math.Nextafter(c.Var1, 1) }, func(b Bounds) bool { return b.VarUpper == 1.0/8 && b.VarCeiling == 1.0/8 }},
		// The Hoeffding margin is not exact in binary: p1 is the float whose lower bound is 3/4.
		{"Theorem 1 from the Hoeffding lower bound", Policy{Mode: Paper, EpsilonMax: 0.25, Hoeffding: true, Alpha: 0.5},
			hoeffdingAt(0.75, 1000, 0.5), 1.0 / 32,
			func(c *Certificate) { c.P1 = math.Nextafter(c.P1, 0) }, func(b Bounds) bool { return b.ProbLower == 0.5 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.pol.Slack(tc.kl)
			g := tc.pol.Gate(s)
			past := tc.c
			tc.nudge(&past)
			for _, c := range []Certificate{tc.c, past} {
				want := c == tc.c
				b := tc.pol.Evaluate(c, s)
				if want && !tc.atEdge(b) {
					t.Fatalf("the bounds %+v are not exactly at the threshold: the test's numbers are not exact", b)
				}
				if b.Certified != want {
					t.Errorf("Evaluate(%+v) = %+v, want certified %v", c, b, want)
				}
				if lower, ok := g.Check(c.P1, c.Var1, c.Epsilon, c.Samples); ok != want || math.Float64bits(lower) != math.Float64bits(b.ProbLower) {
					t.Errorf("Gate.Check(%+v) = %v, %v; Evaluate %+v", c, lower, ok, b)
				}
				for from, to := range map[Standing]Standing{
					{Status: Certified}:               {Status: Certified, Lapsed: !want},
					{Status: Certified, Lapsed: true}: {Status: Certified, Lapsed: !want},
					{}:                                {Status: map[bool]Status{true: Certified, false: AtRisk}[want]},
				} {
					if got := Rejudge(from, b.Certified); got != to {
						t.Errorf("Rejudge(%+v) for %+v = %+v, want %+v", from, c, got, to)
					}
				}
			}
		})
	}
}

// lastBelow is the largest v with v + s <= ceiling in floating point.
func lastBelow(s, ceiling float64) float64 {
	v := ceiling - s
	for v+s > ceiling {
		v = math.Nextafter(v, 0)
	}
	for math.Nextafter(v, 1)+s <= ceiling {
		v = math.Nextafter(v, 1)
	}
	return v
}

// hoeffdingAt is a certificate whose Hoeffding lower bound at alpha is exactly p (the p1 found
// by stepping one ulp at a time from p + the Hoeffding margin).
func hoeffdingAt(p float64, samples int, alpha float64) Certificate {
	p1 := p + math.Sqrt(math.Log(1/alpha)/(2*float64(samples)))
	steps := 0
	for HoeffdingLower(p1, samples, alpha) > p {
		p1 = math.Nextafter(p1, 0)
		ulpSteps(&steps, "Hoeffding's lower bound")
	}
	for HoeffdingLower(p1, samples, alpha) < p {
		p1 = math.Nextafter(p1, 1)
		ulpSteps(&steps, "Hoeffding's lower bound")
	}
	if HoeffdingLower(p1, samples, alpha) != p {
		panic(fmt.Sprintf("no p1 has a Hoeffding lower bound of exactly %v", p))
	}
	return Certificate{P1: p1, Samples: samples, Delta: 0.05, Epsilon: 0.01}
}

// TestEvidenceAtTheEdges: renewals and verdicts at exactly their thresholds, at the one-sided
// Bernstein margin m. For each rule the smallest p whose bound reaches the threshold is found ulp
// by ulp (with S chosen from 1000 up so that the bound lands exactly on the threshold, not one
// rounding step past it); p decides one way, the float below it the other.
//
//	Renewable   p - m >= 1 - delta        Reenters   p - 2 m >= 1 - delta
//	Verdict     at_risk when p - m >= 1/2, invalidated when p + m < 1/2
func TestEvidenceAtTheEdges(t *testing.T) {
	const alpha, delta, eps, v = 0.01, 0.05, 0.01, 0.001
	lower := func(e Evidence) float64 { lo, _ := e.Interval(alpha); return lo }
	upper := func(e Evidence) float64 { _, hi := e.Interval(alpha); return hi }
	for _, tc := range []struct {
		name      string
		bound     func(e Evidence) float64 // what the rule compares with the threshold, rounded as the code rounds it
		threshold float64
		margins   float64 // the bound is p - margins * m
		decides   func(e Evidence) bool
	}{
		{"Renewable: lower(p) = 1 - delta", lower, 1 - delta, 1, func(e Evidence) bool { return Renewable(e, delta, eps, alpha) }},
		{"Reenters: p - 2 m = 1 - delta", func(e Evidence) float64 { return e.P - 2*BernsteinMargin(e.Var, e.Samples, alpha) }, 1 - delta, 2,
			func(e Evidence) bool { return Reenters(e, delta, eps, alpha) }},
		{"Verdict from invalidated: lower(p) = 1/2 gives at_risk", lower, 0.5, 1, func(e Evidence) bool { return Verdict(Invalidated, e, alpha) == AtRisk }},
		{"Verdict from at_risk: upper(p) = 1/2 is not invalidated", upper, 0.5, -1, func(e Evidence) bool { return Verdict(AtRisk, e, alpha) == AtRisk }},
		{"Verdict from a lapsed certificate: upper(p) = 1/2 gives at_risk", upper, 0.5, -1, func(e Evidence) bool { return Verdict(Certified, e, alpha) == AtRisk }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for n := 1000; n < 1100; n++ {
				ev := func(p float64) Evidence { return Evidence{P: p, Var: v, Samples: n} }
				bound := func(p float64) float64 { return tc.bound(ev(p)) }
				p := edge(bound, tc.threshold, tc.threshold+tc.margins*BernsteinMargin(v, n, alpha))
				if bound(p) != tc.threshold {
					continue // rounding steps over the threshold at this S
				}
				below := math.Nextafter(p, 0)
				if !tc.decides(ev(p)) || tc.decides(ev(below)) {
					t.Errorf("S %d: at p = %v (bound exactly %v) decided %v, want true; at p = %v (bound %v) decided %v, want false",
						n, p, tc.threshold, tc.decides(ev(p)), below, bound(below), tc.decides(ev(below)))
				}
				if tc.threshold == 1-delta && tc.margins == 1 && Reenters(ev(p), delta, eps, alpha) {
					t.Errorf("S %d, p = %v: lower(p) = 1 - delta renews a certificate and must not bring one back (Reenters)", n, p)
				}
				return
			}
			t.Fatalf("no S in [1000, 1100) puts the bound exactly at %v", tc.threshold)
		})
	}
}

// edge is the smallest float p with bound(p) >= threshold, for a bound non-decreasing in p,
// stepping one ulp at a time from guess.
func edge(bound func(float64) float64, threshold, guess float64) float64 {
	p, steps := guess, 0
	for bound(p) < threshold {
		p = math.Nextafter(p, 2)
		ulpSteps(&steps, "a bound")
	}
	for bound(math.Nextafter(p, -1)) >= threshold {
		p = math.Nextafter(p, -1)
		ulpSteps(&steps, "a bound")
	}
	return p
}

// maxULPSteps bounds the ulp-by-ulp searches of hoeffdingAt and edge: their guesses are the
// formulas' own values, a few ulps from the answer, so a search that takes a million steps means
// the bound is not the formula its guess assumes (and would otherwise run for minutes).
const maxULPSteps = 1_000_000

// ulpSteps counts one step of such a search and panics past maxULPSteps.
func ulpSteps(steps *int, what string) {
	if *steps++; *steps > maxULPSteps {
		panic(fmt.Sprintf("%s is not where its formula puts it: still searching after %d ulps", what, maxULPSteps))
	}
}
