package certify

import (
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
)

// Hand-computed values (sqrt by hand to 7 digits):
//
//	sqrt(0.000330/2) = sqrt(0.000165) = 0.0128452     paper row 1: 0.9977 - 2*0.0128452 = 0.9720
//	sqrt(0.000355/2) = 0.0133229                      row 2: 0.9981 - 0.0266458 = 0.9715 (paper prints 0.9714)
//	sqrt(0.000096/2) = 0.0069282                      row 3: 0.9971 - 0.0138564 = 0.9832
//	sqrt(0.000423/2) = 0.0145430                      row 4: 0.9976 - 0.0290861 = 0.9685
//	sqrt(0.000477/2) = 0.0154434                      row 5: 0.9998 - 0.0308869 = 0.9689
//	Hoeffding S=1000, alpha=0.01: sqrt(ln(100)/2000) = sqrt(0.00230259) = 0.0479853
//	sqrt(1 - exp(-0.00033)) = sqrt(0.00032995) = 0.0181645 > 0.0128452, so tight TV_ub = 0.0128452
//	KL = 2: tight TV_ub = min(1, sqrt(1 - exp(-2)) = 0.9298730) = 0.9298730
func TestPolicyBounds(t *testing.T) {
	paper := Policy{Mode: Paper, EpsilonMax: 0.05}
	wide := Policy{Mode: Paper, EpsilonMax: 0.1}
	tight := Policy{Mode: Tight, EpsilonMax: 0.05}
	hoef := Policy{Mode: Paper, EpsilonMax: 0.05, Hoeffding: true, Alpha: 0.01}
	cert := func(p1, v1 float64) Certificate {
		return Certificate{P1: p1, Var1: v1, Samples: 1000, Delta: 0.05, Epsilon: 0.01}
	}
	tests := []struct {
		name      string
		pol       Policy
		c         Certificate
		kl        float64
		lower     float64 // to 4 decimals
		upper     float64 // to 4 decimals
		certified bool
	}{
		// Paper table, V1 = 0.001: the mean bound holds but 0.001 + 6*0.0128452 = 0.0781 > 0.05.
		{"paper row 1, default ceiling", paper, cert(0.9977, 0.001), 0.000330, 0.9720, 0.0781, false},
		{"paper row 1, ceiling 0.1", wide, cert(0.9977, 0.001), 0.000330, 0.9720, 0.0781, true},
		{"paper row 2", wide, cert(0.9981, 0.001), 0.000355, 0.9715, 0.0809, true},
		{"paper row 3", paper, cert(0.9971, 0.001), 0.000096, 0.9832, 0.0426, true},
		{"paper row 4", wide, cert(0.9976, 0.001), 0.000423, 0.9685, 0.0883, true},
		{"paper row 5", wide, cert(0.9998, 0.001), 0.000477, 0.9689, 0.0937, true},
		// Tight mode halves the slack: 0.9977 - 0.0128452, 0.001 + 3*0.0128452.
		{"tight row 1", tight, cert(0.9977, 0.001), 0.000330, 0.9849, 0.0395, true},
		// Hoeffding: 0.99 - 0.0479853 = 0.9420; minus 2 sqrt(0.005) = 0.1414214 gives 0.8006.
		{"hoeffding lcb", hoef, cert(0.99, 0.001), 0.01, 0.8006, 0.25 /* V1 + 6 sqrt(KL/2) = 0.4253, capped */, false},
		{"hoeffding lcb, no drift", hoef, cert(0.99, 0.001), 0, 0.9420, 0.0010, true},
		// Mean bound fails: 0.96 - 2 sqrt(0.06) = 0.96 - 0.4898979 = 0.4701.
		{"mean bound fails", Policy{Mode: Paper, EpsilonMax: 0.25}, cert(0.96, 0.001), 0.12, 0.4701, 0.25 /* 1.4707 capped at 1/4 */, false},
		// EpsilonMax = 0: the CE's own eps is the ceiling. 0.004 + 6 sqrt(0.5e-6) = 0.004 + 0.0042426.
		{"strict ceiling = eps", Policy{Mode: Paper}, cert(0.99, 0.004), 1e-6, 0.9886, 0.0082, true},
		{"strict ceiling = eps, fails", Policy{Mode: Paper}, cert(0.99, 0.004), 4e-6, 0.9872, 0.0125, false},
		// Tight variance cap at 1/4: 0.2 + 3 min(sqrt(1), sqrt(1-e^-2)) = 0.2 + 3*0.9298 -> 0.25.
		{"tight variance cap", Policy{Mode: Tight, EpsilonMax: 0.25}, Certificate{P1: 0.99, Var1: 0.2, Samples: 10, Delta: 0.05, Epsilon: 0.25}, 2, 0.0601, 0.25, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := tt.pol.Bounds(tt.c, tt.kl)
			if math.Abs(b.ProbLower-tt.lower) > 0.5e-4 {
				t.Errorf("ProbLower = %.6f, want %.4f", b.ProbLower, tt.lower)
			}
			if math.Abs(b.VarUpper-tt.upper) > 0.5e-4 {
				t.Errorf("VarUpper = %.6f, want %.4f", b.VarUpper, tt.upper)
			}
			if b.Certified != tt.certified {
				t.Errorf("Certified = %v, want %v (bounds %+v)", b.Certified, tt.certified, b)
			}
		})
	}
}

// The paper's table quotes 0.9714 for row 2, but 0.9981 - sqrt(0.00071) = 0.97145 rounds to
// 0.9715 (or truncates to 0.9714); our value must agree with the paper to within rounding.
func TestPaperTableWithinRounding(t *testing.T) {
	rows := []struct{ p1, kl, paper float64 }{
		{0.9977, 0.000330, 0.9720}, {0.9981, 0.000355, 0.9714}, {0.9971, 0.000096, 0.9832},
		{0.9976, 0.000423, 0.9685}, {0.9998, 0.000477, 0.9689},
	}
	for _, r := range rows {
		got := DefaultPolicy().Bounds(Certificate{P1: r.p1, Var1: 0, Samples: 1, Delta: 0.05, Epsilon: 0.01}, r.kl).ProbLower
		if math.Abs(got-r.paper) > 1e-4 {
			t.Errorf("p1=%v KL=%v: bound %.5f, paper %.4f", r.p1, r.kl, got, r.paper)
		}
	}
}

// The bounds cross their thresholds exactly at the closed-form budgets of bound.go:
// KL <= (p1 - 1/2)^2 / 2 (Theorem 1) and KL <= (budget - V1)^2 / 18 (Theorem 2). (At the
// Theorem 1 edge Theorem 2 has long failed, so that edge is checked on ProbLower itself.)
func TestBudgetEdges(t *testing.T) {
	p := Policy{Mode: Paper, EpsilonMax: 0.25}
	c := Certificate{P1: 0.97, Var1: 0, Samples: 100, Delta: 0.05, Epsilon: 0.01}
	klp := KLBudgetForP1(c.P1)
	if p.Bounds(c, klp*(1-1e-9)).ProbLower < 0.5 || p.Bounds(c, klp*(1+1e-9)).ProbLower >= 0.5 {
		t.Errorf("Theorem 1 edge at KL = %v not where the closed form puts it", klp)
	}
	p = Policy{Mode: Paper, EpsilonMax: 0.05}
	c = Certificate{P1: 0.999, Var1: 0.01, Samples: 100, Delta: 0.05, Epsilon: 0.01}
	klv := KLBudgetForVar(c.Var1, p.EpsilonMax) // (0.04)^2/18 = 8.89e-5
	if math.Abs(klv-8.8889e-5) > 1e-8 {
		t.Fatalf("KLBudgetForVar = %v, want 8.8889e-5", klv)
	}
	if !p.Bounds(c, klv*(1-1e-9)).Certified || p.Bounds(c, klv*(1+1e-9)).Certified {
		t.Errorf("Theorem 2 edge at KL = %v not where the closed form puts it", klv)
	}
}

// Evaluate with a per-anchor Slack must agree with ProbLower / VarUpper computed directly, and
// Gate.Check with Evaluate bit for bit.
func TestEvaluateMatchesBoundFunctions(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 2000; i++ {
		mode := Paper
		if i%2 == 1 {
			mode = Tight
		}
		p := Policy{Mode: mode, EpsilonMax: rng.Float64() * 0.25, Hoeffding: i%3 == 0, Alpha: 0.05}
		c := Certificate{P1: rng.Float64(), Var1: rng.Float64() / 4, Samples: 1 + rng.IntN(5000), Delta: 0.05, Epsilon: 0.01}
		kl := math.Exp(rng.Float64()*20 - 15)
		b := p.Bounds(c, kl)
		p1 := c.P1
		if p.Hoeffding {
			p1 = HoeffdingLower(c.P1, c.Samples, p.Alpha)
		}
		if b.ProbLower != ProbLower(p1, kl, mode) || b.VarUpper != VarUpper(c.Var1, kl, mode) {
			t.Fatalf("case %d: Evaluate %+v disagrees with ProbLower %v / VarUpper %v", i, b, ProbLower(p1, kl, mode), VarUpper(c.Var1, kl, mode))
		}
		g := p.Gate(p.Slack(kl))
		if lower, ok := g.Check(c.P1, c.Var1, c.Epsilon, c.Samples); math.Float64bits(lower) != math.Float64bits(b.ProbLower) || ok != b.Certified {
			t.Fatalf("case %d: Gate.Check = (%v, %v), Evaluate %+v", i, lower, ok, b)
		}
		want := b.ProbLower >= 0.5 && b.VarUpper <= math.Max(p.EpsilonMax, c.Epsilon)
		if b.Certified != want {
			t.Fatalf("case %d: Certified = %v, want %v", i, b.Certified, want)
		}
	}
}

// Theorem1 and Theorem2, which judge a certificate from p1', V1 and the ceiling, must agree with
// Gate.Check bit for bit, also at the edges, where rounding decides: p1' and V1 within a few ulps
// of the thresholds 1/2 + slack_p and ceiling - slack_V.
func TestTheoremsMatchCheck(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	near := func(x float64) float64 {
		for range rng.IntN(4) {
			x = math.Nextafter(x, math.Inf(2*rng.IntN(2)-1))
		}
		return x
	}
	for i := range 20000 {
		p := Policy{Mode: []Mode{Paper, Tight}[i%2], EpsilonMax: rng.Float64() * 0.25, Hoeffding: i%3 == 0, Alpha: 0.05}
		if i%5 == 0 {
			p.EpsilonMax = 0.25 // the default ceiling: the 1/4 cap on V1 + slack_V decides
		}
		kl := math.Exp(rng.Float64()*20 - 15)
		s := p.Slack(kl)
		g := p.Gate(s)
		c := Certificate{P1: rng.Float64(), Var1: rng.Float64() / 4, Samples: 1 + rng.IntN(5000), Epsilon: rng.Float64() / 4}
		if i%4 != 0 {
			c.P1 = near(0.5 + s.Mean)
			if p.Hoeffding {
				c.P1 = near(c.P1 + math.Sqrt(math.Log(1/p.Alpha)/(2*float64(c.Samples))))
			}
			c.Var1 = max(0, near(p.VarCeiling(c.Epsilon)-s.Var))
		}
		if i%5 == 0 && i%2 == 0 {
			c.Var1 = max(0, 0.25-s.Var/2+rng.Float64()*0.01) // V1 + slack_V past 1/4: only the cap certifies
		}
		_, want := g.Check(c.P1, c.Var1, c.Epsilon, c.Samples)
		if got := g.Theorem1(p.StartP1(c)) && g.Theorem2(c.Var1, p.VarCeiling(c.Epsilon)); got != want {
			t.Fatalf("case %d (%+v, policy %+v, KL %v): Theorem1 && Theorem2 = %v, Check %v", i, c, p, kl, got, want)
		}
	}
}

// TestInSetAndObserved: the <delta, eps>-set at its edges (p1 = 1 - delta and V1 = eps are in
// it), and the point-estimate classification of a CE whose bound failed.
func TestInSetAndObserved(t *testing.T) {
	for _, tc := range []struct {
		p, v float64
		want bool
	}{
		{0.75, 0.25, true}, {math.Nextafter(0.75, 0), 0.25, false}, {1, 0, true}, {0.75, math.Nextafter(0.25, 1), false},
	} {
		if got := InSet(tc.p, tc.v, 0.25, 0.25); got != tc.want {
			t.Errorf("InSet(p %v, v %v, delta 0.25, eps 0.25) = %v, want %v", tc.p, tc.v, got, tc.want)
		}
	}
	obs := []struct {
		p2             float64
		argmax, target int
		want           Status
	}{
		{0.7, 1, 1, AtRisk}, {0.5, 1, 1, AtRisk}, {0.4999, 1, 1, Invalidated}, {0.5, 0, 1, Invalidated}, {0.9, 2, 1, Invalidated},
	}
	for _, o := range obs {
		if got := Observed(o.p2, o.argmax, o.target); got != o.want {
			t.Errorf("Observed(%v, %d, %d) = %v, want %v", o.p2, o.argmax, o.target, got, o.want)
		}
	}
}

func TestStatusText(t *testing.T) {
	for _, s := range Statuses() {
		b, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		var back Status
		if err := json.Unmarshal(b, &back); err != nil || back != s {
			t.Errorf("%v: round trip gave %v, %v (json %s)", s, back, err, b)
		}
	}
	if _, err := ParseStatus("valid"); err == nil {
		t.Error("ParseStatus accepted an unknown name")
	}
	if _, err := json.Marshal(Status(0)); err == nil {
		t.Error("zero Status marshalled")
	}
}

func TestPolicyValidate(t *testing.T) {
	bad := []Policy{
		{Mode: "loose", EpsilonMax: 0.05},
		{Mode: Paper, EpsilonMax: -0.1},
		{Mode: Paper, EpsilonMax: 0.3},
		{Mode: Paper, EpsilonMax: math.NaN()},
		{Mode: Paper, EpsilonMax: 0.05, Hoeffding: true, Alpha: 0},
		{Mode: "", EpsilonMax: 0.05}, // no mode is not paper mode
		{},
	}
	for _, p := range bad {
		if p.Validate() == nil {
			t.Errorf("%+v validated", p)
		}
	}
	if err := DefaultPolicy().Validate(); err != nil {
		t.Errorf("default policy: %v", err)
	}
	badCert := []Certificate{
		{P1: 1.1, Var1: 0, Samples: 1, Delta: 0.05, Epsilon: 0.01},
		{P1: 0.9, Var1: 0.3, Samples: 1, Delta: 0.05, Epsilon: 0.01},
		{P1: 0.9, Var1: 0, Samples: 0, Delta: 0.05, Epsilon: 0.01},
		{P1: 0.9, Var1: 0, Samples: 1, Delta: 0.5, Epsilon: 0.01},
		{P1: 0.9, Var1: 0, Samples: 1, Delta: 0.05, Epsilon: 0},
		{P1: math.NaN(), Var1: 0, Samples: 1, Delta: 0.05, Epsilon: 0.01},
		{P1: 0.9, Var1: 0, Samples: 1, Delta: 0, Epsilon: 0.01}, // delta in (0, 1/2): 0 is out
		{P1: -0.1, Var1: 0, Samples: 1, Delta: 0.05, Epsilon: 0.01},
		{P1: 0.9, Var1: -0.01, Samples: 1, Delta: 0.05, Epsilon: 0.01},
	}
	for _, c := range badCert {
		if c.Validate() == nil {
			t.Errorf("%+v validated", c)
		}
	}
}

// Theorem 1 certifies at p1' - slack = 1/2 exactly (the bound is ">= 1/2"), in Evaluate, in
// Gate.Check and in Rejudge. The numbers are exact in binary: KL = 1/32 gives 2 sqrt(KL/2) = 1/4,
// KL = 1/8 gives 1/2, so p1 = 3/4 and p1 = 1 land on 1/2 with no rounding; one ulp below does not
// certify. (The variance bound is capped at 1/4 = EpsilonMax, so it holds throughout.)
func TestTheorem1HoldsAtExactlyOneHalf(t *testing.T) {
	p := DefaultPolicy()
	for _, tc := range []struct{ p1, kl float64 }{{0.75, 1.0 / 32}, {1, 1.0 / 8}} {
		s := p.Slack(tc.kl)
		if tc.p1-s.Mean != 0.5 {
			t.Fatalf("p1 %v - slack %v = %v, not exactly 1/2: the test's numbers are not exact", tc.p1, s.Mean, tc.p1-s.Mean)
		}
		g := p.Gate(s)
		for _, p1 := range []float64{tc.p1, math.Nextafter(tc.p1, 0)} {
			want := p1 == tc.p1
			c := Certificate{P1: p1, Var1: 0, Samples: 1000, Delta: 0.05, Epsilon: 0.01}
			b := p.Evaluate(c, s)
			if b.Certified != want {
				t.Errorf("Evaluate(p1 %v, KL %v): bound %v, certified %v, want %v", p1, tc.kl, b.ProbLower, b.Certified, want)
			}
			if lower, ok := g.Check(p1, 0, 0.01, 1000); ok != want || lower != b.ProbLower {
				t.Errorf("Gate.Check(p1 %v, KL %v) = %v, %v; want %v, %v", p1, tc.kl, lower, ok, b.ProbLower, want)
			}
			if st := Rejudge(Standing{Status: AtRisk}, b.Certified); (st.Status == Certified) != want {
				t.Errorf("Rejudge(at_risk, p1 %v, KL %v) = %+v, certified want %v", p1, tc.kl, st, want)
			}
		}
	}
}

// TestAdmitsIsTheRenewalRule: a CE is admitted as certified exactly when its registration's
// measurement would renew a certificate (Renewable at confidence 1 - alpha), not by re-entry's
// wider margin nor at another confidence. At 1000 draws of variance 0.001 and alpha = 0.01 the
// margin is m = 0.0156304 (0.0137910 at alpha = 0.02), so the smallest admitted p1 is
// 0.95 + m = 0.96563: p1 = 0.964 is refused (it would pass at alpha = 0.02), p1 = 0.95 + 1.5 m
// is admitted (re-entry, which takes p1 - 2 m >= 0.95, would refuse it).
func TestAdmitsIsTheRenewalRule(t *testing.T) {
	const alpha = 0.01
	for _, tc := range []struct {
		p1   float64
		var1 float64
		want bool
	}{
		{0.964, 0.001, false},
		{0.9734455443485306, 0.001, true},
		{0.999, 0.01, true},                     // Var1 = eps
		{0.999, math.Nextafter(0.01, 1), false}, // Var1 over eps, whatever p1
	} {
		c := Certificate{P1: tc.p1, Var1: tc.var1, Samples: 1000, Delta: 0.05, Epsilon: 0.01}
		if got := c.Admits(alpha); got != tc.want {
			t.Errorf("Certificate{p1 %v, V1 %v, 1000 draws}.Admits(%v) = %v, want %v", tc.p1, tc.var1, alpha, got, tc.want)
		}
	}
}

// TestRangesIncludeTheirEnds: the largest valid values are valid (epsilon = V1 = 1/4, p1 = 1),
// and a Hoeffding policy without a confidence in (0, 1) is refused, and its gate, if one is made
// all the same, certifies nothing: alpha = 1 would be a bound with no margin.
func TestRangesIncludeTheirEnds(t *testing.T) {
	if err := CheckEpsilon(0.25); err != nil {
		t.Errorf("CheckEpsilon(0.25): %v", err)
	}
	if err := (Certificate{P1: 1, Var1: 0.25, Samples: 1, Delta: 0.05, Epsilon: 0.25}).Validate(); err != nil {
		t.Errorf("a certificate at p1 = 1, V1 = eps = 1/4: %v", err)
	}
	for _, a := range []float64{0, 1, math.Copysign(0, -1)} { // -0: ln(1 / -0) would be NaN, not +Inf
		p := Policy{Mode: Paper, EpsilonMax: 0.25, Hoeffding: true, Alpha: a}
		if p.Validate() == nil {
			t.Errorf("%+v validated", p)
		}
		g := p.Gate(Slack{})
		if lower, certified := g.Check(0.99, 0, 0.01, 1000); !math.IsInf(lower, -1) || certified {
			t.Errorf("the gate of %+v: Check(p1 0.99, 1000 draws) = %v, %v; want -Inf, false", p, lower, certified)
		}
	}
}

// TestValidAtTheLowerEnds: the lower ends of the ranges Validate documents are valid.
// EpsilonMax = 0 is the strict reading of the variance budget (budget(CE) = eps_CE); a policy
// without Hoeffding's bound does not use Alpha, so any Alpha goes; a certificate may have
// p1 = 0 and V1 = 0 (p1 in [0, 1], V1 in [0, 1/4]: a CE outside its set, stored as uncertified,
// still has a valid certificate).
func TestValidAtTheLowerEnds(t *testing.T) {
	for _, p := range []Policy{
		{Mode: Paper, EpsilonMax: 0},
		{Mode: Tight, EpsilonMax: 0.05, Alpha: 0},
		{Mode: Paper, EpsilonMax: 0.05, Alpha: 2},
	} {
		if err := p.Validate(); err != nil {
			t.Errorf("%+v: %v", p, err)
		}
	}
	for _, c := range []Certificate{
		{P1: 0, Var1: 0.01, Samples: 1, Delta: 0.05, Epsilon: 0.01},
		{P1: 0.9, Var1: 0, Samples: 1, Delta: 0.05, Epsilon: 0.01},
		{P1: 0, Var1: 0, Samples: 1, Delta: 0.05, Epsilon: 0.01},
	} {
		if err := c.Validate(); err != nil {
			t.Errorf("%+v: %v", c, err)
		}
	}
}

// TestStatusesAreTheFour: Statuses lists each of the four statuses once (metrics create their
// label values from it), and each name parses back to its status.
func TestStatusesAreTheFour(t *testing.T) {
	want := map[string]Status{"certified": Certified, "at_risk": AtRisk, "invalidated": Invalidated, "uncertified": Uncertified}
	got := Statuses()
	if len(got) != len(want) {
		t.Fatalf("Statuses() = %v, want the %d statuses", got, len(want))
	}
	seen := map[Status]bool{}
	for _, s := range got {
		if seen[s] || want[s.String()] != s {
			t.Errorf("Statuses() = %v: %v repeated or not one of the four", got, s)
		}
		seen[s] = true
	}
	for name, s := range want {
		if back, err := ParseStatus(name); err != nil || back != s {
			t.Errorf("ParseStatus(%q) = %v, %v; want %v", name, back, err, s)
		}
	}
}

// TestSlackIsItsFormula: Slack at a KL, against the formulas written out here: paper mode
// (2 sqrt(KL/2), 6 sqrt(KL/2)), tight mode (TV_ub, 3 TV_ub) with
// TV_ub = min(sqrt(KL/2), sqrt(1 - exp(-KL))), and the KL it was computed at (Slack.KL).
func TestSlackIsItsFormula(t *testing.T) {
	for _, kl := range []float64{0, 1e-6, 0.000330, 0.1, 2, 30} {
		pin := math.Sqrt(kl / 2)
		tv := math.Min(pin, math.Sqrt(1-math.Exp(-kl)))
		for _, tc := range []struct {
			mode           Mode
			mean, variance float64
		}{{Paper, 2 * pin, 6 * pin}, {Tight, tv, 3 * tv}} {
			s := Policy{Mode: tc.mode}.Slack(kl)
			if s.KL != kl || math.Abs(s.Mean-tc.mean) > 1e-15 || math.Abs(s.Var-tc.variance) > 1e-15 {
				t.Errorf("%s Slack(%v) = %+v, want {KL: %v, Mean: %v, Var: %v}", tc.mode, kl, s, kl, tc.mean, tc.variance)
			}
		}
	}
}

// TestDocumentedDefaults pins the defaults the config layer and the ledger take from this package,
// and the figures their comments quote: S = 1000 draws, alpha = 0.01 for p1's Hoeffding bound
// (margin sqrt(ln(100) / 2000) = 0.0480), for verdicts (Bernstein margin 0.0156 at V = 0.001) and
// for ConditionalKL's upper bound (Mean + ParamKL sqrt(ln(100) / (2 S))).
func TestDocumentedDefaults(t *testing.T) {
	if DefaultSamples != 1000 || DefaultAlpha != 0.01 || DefaultVerdictAlpha != 0.01 || ConditionalKLAlpha != 0.01 || DefaultEpsilonMax != 0.25 {
		t.Fatalf("defaults: samples %d, alpha %v, verdict alpha %v, conditional KL alpha %v, epsilon_max %v; want 1000, 0.01, 0.01, 0.01, 0.25",
			DefaultSamples, DefaultAlpha, DefaultVerdictAlpha, ConditionalKLAlpha, DefaultEpsilonMax)
	}
	if m := 1 - HoeffdingLower(1, DefaultSamples, DefaultAlpha); math.Abs(m-0.0479853) > 1e-6 {
		t.Errorf("Hoeffding margin at the defaults %v, want 0.0479853", m)
	}
	if m := BernsteinMargin(0.001, DefaultSamples, DefaultVerdictAlpha); math.Abs(m-0.01563036289902046) > 1e-12 {
		t.Errorf("Bernstein margin at the defaults %v, want 0.0156304", m)
	}
}

// TestPolicyEnumsText: the config names of on_breach and uncertified decode to their values, and
// nothing else does.
func TestPolicyEnumsText(t *testing.T) {
	for _, name := range []string{"alert", "reject", "clip"} {
		var p OnBreach
		if err := p.UnmarshalText([]byte(name)); err != nil || string(p) != name {
			t.Errorf("OnBreach.UnmarshalText(%q) = %q, %v", name, p, err)
		}
	}
	for _, name := range []string{"refuse", "store"} {
		var o OutsideSet
		if err := o.UnmarshalText([]byte(name)); err != nil || string(o) != name {
			t.Errorf("OutsideSet.UnmarshalText(%q) = %q, %v", name, o, err)
		}
	}
	for _, name := range []string{"paper", "tight"} {
		var m Mode
		if err := m.UnmarshalText([]byte(name)); err != nil || string(m) != name {
			t.Errorf("Mode.UnmarshalText(%q) = %q, %v", name, m, err)
		}
	}
	for _, bad := range []string{"", "Alert", "refuse ", "loose"} {
		var p OnBreach
		var o OutsideSet
		var m Mode
		if p.UnmarshalText([]byte(bad)) == nil || o.UnmarshalText([]byte(bad)) == nil || m.UnmarshalText([]byte(bad)) == nil {
			t.Errorf("%q decoded as an on_breach policy, an uncertified policy or a mode", bad)
		}
	}
}

// A certificate's V1 is the unbiased sample variance of its draws, which n values in [0, 1] push
// highest with half of them 0 and half 1: sum (x - mean)^2 / (n - 1) = (n/4) / (n - 1), above 1/4.
// Validate takes V1 up to that, computed here from the values themselves, and no further; random
// draws in [0, 1] never pass it.
func TestCertificateVarianceUpToTheUnbiasedMaximum(t *testing.T) {
	unbiased := func(xs []float64) float64 {
		mean := 0.0
		for _, x := range xs {
			mean += x
		}
		mean /= float64(len(xs))
		ss := 0.0
		for _, x := range xs {
			ss += (x - mean) * (x - mean)
		}
		return ss / float64(len(xs)-1)
	}
	for _, n := range []int{2, 10, 1000} {
		xs := make([]float64, n)
		for i := range n / 2 {
			xs[i] = 1
		}
		v := unbiased(xs)
		if v <= 0.25 {
			t.Fatalf("%d draws, half 0 and half 1: unbiased variance %v, want above 1/4", n, v)
		}
		c := Certificate{P1: 0.5, Var1: v, Samples: n, Delta: 0.05, Epsilon: 0.01}
		if err := c.Validate(); err != nil {
			t.Errorf("%d draws, half 0 and half 1 (V1 = %v): %v", n, v, err)
		}
		if c.InSet() {
			t.Errorf("%d draws: V1 = %v is in the set of epsilon 0.01", n, v)
		}
		c.Var1 = math.Nextafter(v, 1)
		if c.Validate() == nil {
			t.Errorf("%d draws: V1 = %v, above the largest unbiased variance %v, validated", n, c.Var1, v)
		}
		rng := rand.New(rand.NewPCG(uint64(n), 1))
		for range 200 {
			for i := range xs {
				xs[i] = float64(rng.IntN(2))
				if rng.IntN(4) == 0 {
					xs[i] = rng.Float64()
				}
			}
			if v := unbiased(xs); v > MaxSampleVar(n)*(1+1e-12) {
				t.Fatalf("%d draws in [0, 1] with unbiased variance %v, above MaxSampleVar %v", n, v, MaxSampleVar(n))
			}
		}
	}
	if c := (Certificate{P1: 0.5, Var1: math.Nextafter(0.25, 1), Samples: 1, Delta: 0.05, Epsilon: 0.01}); c.Validate() == nil {
		t.Errorf("one draw: V1 above 1/4 validated")
	}
}

// TestCheckDeltaAndEpsilonAtTheirEnds: CheckDelta takes exactly (0, 1/2) and CheckEpsilon exactly
// (0, 1/4], the float next to each end on the inside included and on the outside refused, NaN
// refused; a refusal is a *RangeError naming the parameter, its value and the range.
func TestCheckDeltaAndEpsilonAtTheirEnds(t *testing.T) {
	for _, tc := range []struct {
		name  string
		check func(float64) error
		v     float64
		ok    bool
		want  string
	}{
		{"delta", CheckDelta, 0, false, "(0, 0.5)"},
		{"delta", CheckDelta, math.SmallestNonzeroFloat64, true, ""},
		{"delta", CheckDelta, math.Nextafter(0.5, 0), true, ""},
		{"delta", CheckDelta, 0.5, false, "(0, 0.5)"},
		{"delta", CheckDelta, math.NaN(), false, "(0, 0.5)"},
		{"epsilon", CheckEpsilon, 0, false, "(0, 0.25]"},
		{"epsilon", CheckEpsilon, math.SmallestNonzeroFloat64, true, ""},
		{"epsilon", CheckEpsilon, 0.25, true, ""},
		{"epsilon", CheckEpsilon, math.Nextafter(0.25, 1), false, "(0, 0.25]"},
		{"epsilon", CheckEpsilon, math.NaN(), false, "(0, 0.25]"},
	} {
		err := tc.check(tc.v)
		if tc.ok {
			if err != nil {
				t.Errorf("%s %v: %v, want accepted", tc.name, tc.v, err)
			}
			continue
		}
		var re *RangeError
		if !errors.As(err, &re) || re.Name != tc.name || re.Want != tc.want || math.Float64bits(re.Value) != math.Float64bits(tc.v) {
			t.Errorf("%s %v: %v (%+v), want a *RangeError of %s, its value, range %s", tc.name, tc.v, err, re, tc.name, tc.want)
		}
	}
}
