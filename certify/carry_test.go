package certify

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestVerdictBound(t *testing.T) {
	const alpha = 0.01
	e := func(p float64) Evidence { return Evidence{P: p, Var: 0.01, Samples: 1000} }
	m := BernsteinMargin(0.01, 1000, alpha)
	for _, c := range []struct {
		name string
		s    Status
		p    float64
		want float64
		ok   bool
	}{
		{"at_risk decided", AtRisk, 0.7, 0.7 - m, true},
		{"at_risk at the edge", AtRisk, 0.5 + m, 0.5 + m - m, true},
		{"at_risk whose lower bound is just under 1/2", AtRisk, 0.5 + m - 1e-4, 0, false},
		{"at_risk by hysteresis", AtRisk, 0.5, 0, false},
		{"invalidated decided", Invalidated, 0.3, 0.3 + m, true},
		{"invalidated by hysteresis", Invalidated, 0.5, 0, false},
		{"invalidated whose upper bound is 1/2", Invalidated, 0.5 - m, 0, false},
		{"invalidated whose upper bound is just under 1/2", Invalidated, 0.5 - m - 1e-4, 0.5 - m - 1e-4 + m, true},
		{"certified", Certified, 0.99, 0, false},
	} {
		b, ok := VerdictBound(c.s, e(c.p), alpha)
		if ok != c.ok || ok && b != c.want {
			t.Errorf("%s: VerdictBound = (%v, %v), want (%v, %v)", c.name, b, ok, c.want, c.ok)
		}
		// A verdict Verdict would not give from this evidence never has a bound.
		if ok && Verdict(0, e(c.p), alpha) != c.s {
			t.Errorf("%s: a bound for a verdict the evidence does not give", c.name)
		}
	}
}

func TestCarriesEdges(t *testing.T) {
	s := func(mean float64) Slack { return Slack{Mean: mean} }
	for _, c := range []struct {
		name  string
		st    Status
		b     float64
		slack Slack
		want  bool
	}{
		{"at_risk, no drift", AtRisk, 0.6, s(0), true},
		{"at_risk, slack exactly the margin", AtRisk, 0.75, s(0.25), true},
		{"at_risk, slack past the margin", AtRisk, 0.75, s(math.Nextafter(0.25, 1)), false},
		{"invalidated, no drift", Invalidated, 0.4, s(0), true},
		{"invalidated, slack exactly the margin", Invalidated, 0.25, s(0.25), false},
		{"invalidated, slack under the margin", Invalidated, 0.25, s(0.2499999), true},
		{"certified never carries", Certified, 0.99, s(0), false},
		{"uncertified never carries", Uncertified, 0.99, s(0), false},
		{"NaN bound", AtRisk, math.NaN(), s(0), false},
		{"NaN slack", Invalidated, 0.1, s(math.NaN()), false},
	} {
		if got := Carries(c.st, c.b, c.slack); got != c.want {
			t.Errorf("%s: Carries(%v, %v, %v) = %v, want %v", c.name, c.st, c.b, c.slack.Mean, got, c.want)
		}
		if got := Carries(c.st, c.b, c.slack); got && c.slack.Mean > CarryMargin(c.st, c.b)+1e-15 {
			t.Errorf("%s: carried with slack %v over the margin %v", c.name, c.slack.Mean, CarryMargin(c.st, c.b))
		}
	}
	if !math.IsInf(CarryMargin(Certified, 0.9), -1) {
		t.Error("CarryMargin of a certified CE is not -Inf")
	}
	// The margin is exact both ways, up to rounding: a verdict carries when the slack is under
	// its margin and stops carrying when the slack passes it (an index sorted by the margin
	// finds every verdict that stops carrying, and only those). Besides a grid of slacks, each
	// bound is tried at 1e-9 either side of its margin, so that a margin off by more than that
	// fails.
	for _, st := range []Status{AtRisk, Invalidated} {
		for b := 0.0; b <= 1; b += 1.0 / 64 {
			m := CarryMargin(st, b)
			slacks := []float64{m - 1e-9, m + 1e-9}
			for slack := 0.0; slack <= 0.6; slack += 1.0 / 128 {
				slacks = append(slacks, slack)
			}
			for _, slack := range slacks {
				if slack < 0 {
					continue
				}
				carries := Carries(st, b, s(slack))
				if carries && slack > m+1e-15 || !carries && slack < m-1e-15 {
					t.Errorf("%v with bound %v: Carries = %v at slack %v, but its margin is %v", st, b, carries, slack, m)
				}
			}
		}
	}
}

// TestCarriesMonteCarlo checks the carry rule against simulation. Posteriors are
// q_m = N(m, s^2) over one weight and f(w) = Phi(w), so p(m) = E_{q_m}[f] = Phi(m / sqrt(1 + s^2))
// exactly and KL(q_m2 || q_m1) = (m2 - m1)^2 / (2 s^2). Each trial measures a verdict under q_v
// from S draws, then walks the posterior away from q_v in steps and asks whether the verdict
// carries to each later posterior: a carried verdict must be true of the exact p there, in all
// but an alpha fraction of trials (plus three binomial standard errors), in both modes. The same
// trials carried without the slack (the verdict kept however far the posterior moved) are wrong
// far more often, so the test can fail; and the rule carries a verdict over a KL of real size,
// so it is not vacuous.
func TestCarriesMonteCarlo(t *testing.T) {
	const (
		trials = 3000
		n      = 1000
		alpha  = 0.05
		sd     = 1.0
	)
	p := func(m float64) float64 { return 0.5 * math.Erfc(-m/math.Sqrt(1+sd*sd)/math.Sqrt2) }
	for _, mode := range []Mode{Paper, Tight} {
		pol := Policy{Mode: mode}
		for _, c := range []struct {
			name   string
			mv     float64 // the posterior the verdict is measured under
			dir    float64 // the direction the posterior then moves: towards 1/2
			status Status
		}{
			{"at_risk", 0.35, -1, AtRisk},
			{"invalidated", -0.35, 1, Invalidated},
		} {
			r := rand.New(rand.NewPCG(7, uint64(c.status)))
			var decided, wrong, wrongNoSlack, carriedFar int
			for range trials {
				var mean, m2 float64
				for i := 1; i <= n; i++ {
					f := 0.5 * math.Erfc(-(c.mv+sd*r.NormFloat64())/math.Sqrt2)
					d := f - mean
					mean += d / float64(i)
					m2 += d * (f - mean)
				}
				e := Evidence{P: mean, Var: m2 / float64(n-1), Samples: n}
				b, ok := VerdictBound(c.status, e, alpha)
				if !ok {
					continue
				}
				decided++
				var w, wNo, far bool
				for step := 0; step <= 60; step++ {
					m := c.mv + c.dir*0.02*float64(step)
					kl := (m - c.mv) * (m - c.mv) / (2 * sd * sd)
					holds := p(m) >= 0.5 == (c.status == AtRisk)
					if Carries(c.status, b, pol.Slack(kl)) {
						w = w || !holds
						far = far || kl >= 0.001
					}
					wNo = wNo || Carries(c.status, b, Slack{}) && !holds
				}
				wrong += btoi(w)
				wrongNoSlack += btoi(wNo)
				carriedFar += btoi(far)
			}
			if decided < trials/2 {
				t.Fatalf("%s %s: only %d of %d measurements decided a verdict", mode, c.name, decided, trials)
			}
			limit := alpha + 3*math.Sqrt(alpha*(1-alpha)/float64(decided))
			t.Logf("%s %s: %d decided, wrong when carried %d (%.4f, limit %.4f), wrong without the slack %d, carried past KL 0.001 %d",
				mode, c.name, decided, wrong, float64(wrong)/float64(decided), limit, wrongNoSlack, carriedFar)
			if float64(wrong)/float64(decided) > limit {
				t.Errorf("%s %s: a carried verdict was wrong in %d of %d trials (%.4f > %.4f)", mode, c.name, wrong, decided,
					float64(wrong)/float64(decided), limit)
			}
			if wrongNoSlack < decided/2 {
				t.Errorf("%s %s: without the slack only %d of %d carried verdicts were wrong: the walk does not cross 1/2", mode, c.name, wrongNoSlack, decided)
			}
			if carriedFar < decided/2 {
				t.Errorf("%s %s: only %d of %d verdicts carried past KL 0.001: the rule is vacuous here", mode, c.name, carriedFar, decided)
			}
		}
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
