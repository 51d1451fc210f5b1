package certify

import (
	"math"
	"math/rand/v2"
	"testing"
)

// The paper's Table "Empirical example for the theoretical bound" (breast cancer, lr 1e-5).
// Its p1 is printed to 4 decimals (+-5e-5) and its KL to 3 significant figures, so the bound is
// reproduced to 1e-4.
func TestProbLowerPaperTable(t *testing.T) {
	rows := []struct{ p1, kl, bound float64 }{
		{0.9977, 0.000330, 0.9720},
		{0.9981, 0.000355, 0.9714},
		{0.9971, 0.000096, 0.9832},
		{0.9976, 0.000423, 0.9685},
		{0.9998, 0.000477, 0.9689},
	}
	for _, r := range rows {
		got := ProbLower(r.p1, r.kl, Paper)
		if math.Abs(got-r.bound) > 1e-4 {
			t.Errorf("p1=%v KL=%v: bound %.5f, paper %.4f", r.p1, r.kl, got, r.bound)
		}
	}
}

func TestBudgets(t *testing.T) {
	if got := KLBudget(0.05); math.Abs(got-0.10125) > 1e-15 {
		t.Fatalf("KLBudget(0.05) = %v, want 0.10125", got)
	}
	// At the budget the delta-form bound is exactly 1/2.
	if b := ProbLower(0.95, KLBudget(0.05), Paper); math.Abs(b-0.5) > 1e-12 {
		t.Fatalf("bound at budget = %v", b)
	}
	// Paper's remark: with p1 ~ 0.97 in place of 1 - delta the budget is ~0.111.
	if b := KLBudgetForP1(0.971); math.Abs(b-0.111) > 0.0005 {
		t.Fatalf("KLBudgetForP1(0.971) = %v, want ~0.111", b)
	}
	if KLBudget(0.5) != 0 || KLBudget(0.7) != 0 || KLBudgetForP1(0.3) != 0 {
		t.Fatal("no budget expected when p1 <= 1/2")
	}
	// Variance budget: eps + 6 sqrt(KL/2) <= epsMax at the budget, with equality.
	vb := KLBudgetForVar(0.004, 0.01)
	if math.Abs(VarUpper(0.004, vb, Paper)-0.01) > 1e-15 || math.Abs(vb-0.000036/18) > 1e-18 {
		t.Fatalf("KLBudgetForVar = %v", vb)
	}
	if KLBudgetForVar(0.02, 0.01) != 0 {
		t.Fatal("no variance budget when eps >= epsMax")
	}
}

func TestTightIsTighter(t *testing.T) {
	for _, kl := range []float64{0, 1e-6, 1e-3, 0.1, 1, 5, 50} {
		if ProbLower(0.97, kl, Tight) < ProbLower(0.97, kl, Paper) {
			t.Errorf("KL=%v: tight bound below paper bound", kl)
		}
		if VarUpper(0.001, kl, Tight) > VarUpper(0.001, kl, Paper) {
			t.Errorf("KL=%v: tight variance bound above paper bound", kl)
		}
		if tv := TVUpper(kl); tv < 0 || tv > 1 {
			t.Errorf("TVUpper(%v) = %v outside [0,1]", kl, tv)
		}
	}
	// Small KL: Pinsker wins; large KL: Bretagnolle-Huber wins.
	if TVUpper(0.01) != Pinsker(0.01) || TVUpper(5) != math.Sqrt(1-math.Exp(-5)) {
		t.Fatal("TVUpper should pick the smaller of Pinsker and Bretagnolle-Huber")
	}
}

// TestBoundsAgainstSimulation draws two Gaussian posteriors, a [0,1]-valued f (a logistic
// unit), estimates p and Var under each by Monte-Carlo, and checks both theorems in both modes.
// The MC error allowance is 5 standard errors.
func TestBoundsAgainstSimulation(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	const d, S = 4, 200000
	a := []float64{1.5, -2, 0.7, 1}
	for trial := 0; trial < 6; trial++ {
		m1, ls1, m2, ls2 := make([]float64, d), make([]float64, d), make([]float64, d), make([]float64, d)
		shift := 0.05 * float64(trial*trial)
		for i := 0; i < d; i++ {
			m1[i] = 0.5 + 0.3*rng.NormFloat64()
			ls1[i] = math.Log(0.3)
			m2[i] = m1[i] - shift*math.Abs(rng.NormFloat64())
			ls2[i] = ls1[i] + 0.2*rng.NormFloat64()
		}
		f := func(w []float64) float64 {
			z := 0.0
			for i := range w {
				z += a[i] * w[i]
			}
			return 1 / (1 + math.Exp(-z))
		}
		est := func(m, ls []float64) (p, v, se float64) {
			w := make([]float64, d)
			var s, s2 float64
			for k := 0; k < S; k++ {
				for i := range w {
					w[i] = m[i] + math.Exp(ls[i])*rng.NormFloat64()
				}
				y := f(w)
				s += y
				s2 += y * y
			}
			p = s / S
			v = s2/S - p*p
			return p, v, math.Sqrt(v / S)
		}
		p1, v1, se1 := est(m1, ls1)
		p2, v2, se2 := est(m2, ls2)
		kl := KLDiag(m2, ls2, m1, ls1)
		slack := 5 * (se1 + se2)
		for _, mode := range []Mode{Paper, Tight} {
			if lb := ProbLower(p1, kl, mode); p2 < lb-slack {
				t.Errorf("trial %d %s: p2 = %.4f below bound %.4f (p1 %.4f, KL %.4f)", trial, mode, p2, lb, p1, kl)
			}
			if ub := VarUpper(v1, kl, mode); v2 > ub+0.01 {
				t.Errorf("trial %d %s: V2 = %.4f above bound %.4f", trial, mode, v2, ub)
			}
		}
		// |p2 - p1| <= TV <= TVUpper(KL): the tight slack itself must cover the observed change.
		if math.Abs(p2-p1) > TVUpper(kl)+slack {
			t.Errorf("trial %d: |p2-p1| = %.4f exceeds TV bound %.4f", trial, math.Abs(p2-p1), TVUpper(kl))
		}
		t.Logf("KL %.4f: p1 %.4f p2 %.4f paper %.4f tight %.4f", kl, p1, p2, ProbLower(p1, kl, Paper), ProbLower(p1, kl, Tight))
	}
}

func TestHoeffdingLower(t *testing.T) {
	// MATHS.md: S = 1000, alpha = 0.01 costs 0.048; S = 1e4 costs 0.015.
	if m := 1 - HoeffdingLower(1, 1000, 0.01); math.Abs(m-0.048) > 0.0005 {
		t.Fatalf("margin %v, want 0.048", m)
	}
	if m := 1 - HoeffdingLower(1, 10000, 0.01); math.Abs(m-0.0152) > 0.0005 {
		t.Fatalf("margin %v, want 0.015", m)
	}
	if !math.IsInf(HoeffdingLower(0.9, 0, 0.01), -1) || !math.IsInf(HoeffdingLower(0.9, 10, 0), -1) {
		t.Fatal("degenerate inputs should give -Inf (no certificate)")
	}
	// Coverage: the bound exceeds the true p in at most ~alpha of trials.
	rng := rand.New(rand.NewPCG(3, 3))
	const p, S, trials, alpha = 0.9, 500, 4000, 0.05
	bad := 0
	for k := 0; k < trials; k++ {
		hits := 0
		for s := 0; s < S; s++ {
			if rng.Float64() < p {
				hits++
			}
		}
		if HoeffdingLower(float64(hits)/S, S, alpha) > p {
			bad++
		}
	}
	if frac := float64(bad) / trials; frac > alpha {
		t.Fatalf("lower bound above truth in %.3f of trials, want <= %v", frac, alpha)
	}
}

func TestParseMode(t *testing.T) {
	for in, want := range map[string]Mode{"paper": Paper, "tight": Tight} {
		if got, err := ParseMode(in); err != nil || got != want {
			t.Errorf("ParseMode(%q) = %v, %v", in, got, err)
		}
	}
	for _, in := range []string{"loose", ""} {
		if _, err := ParseMode(in); err == nil {
			t.Errorf("ParseMode(%q) should fail", in)
		}
	}
}

// TestBoundsAtTheirDomainsEdges: the budgets, bounds and Hoeffding's bound at the ends of their
// domains, against the values their formulas give by hand. A budget of 0 means "no KL keeps
// the theorem": below or at p1 = 1/2 (or delta >= 1/2) it must be 0, never a positive budget
// that would certify a CE whose target is not the argmax.
func TestBoundsAtTheirDomainsEdges(t *testing.T) {
	for _, tc := range []struct {
		name      string
		got, want float64
	}{
		// KL from a rounding below 0 counts as 0 (a KL is never negative).
		{"Pinsker(-1e-3)", Pinsker(-1e-3), 0},
		{"TVUpper(-1e-3)", TVUpper(-1e-3), 0},
		{"ProbLower(0.9, -1e-12, paper)", ProbLower(0.9, -1e-12, Paper), 0.9},
		// (1/2 - delta)^2 / 2 and (p1 - 1/2)^2 / 2, and 0 from 1/2 on.
		{"KLBudget(0.4)", KLBudget(0.4), 0.1 * 0.1 / 2},
		{"KLBudget(0.45)", KLBudget(0.45), 0.05 * 0.05 / 2},
		{"KLBudgetForP1(0.55)", KLBudgetForP1(0.55), 0.05 * 0.05 / 2},
		{"KLBudgetForP1(0.5)", KLBudgetForP1(0.5), 0},
		{"KLBudgetForP1(0.45)", KLBudgetForP1(0.45), 0},
		// Next to the ends: a p1 just below 1/2 has no budget, in either mode; delta = 0.4999 has
		// its small one.
		{"KLBudgetForP1(1/2 - ulp)", KLBudgetForP1(math.Nextafter(0.5, 0)), 0},
		{"KLBudgetForP1(0.4999)", KLBudgetForP1(0.4999), 0},
		{"KLBudgetForP1In(0.4999, tight)", KLBudgetForP1In(0.4999, Tight), 0},
		{"KLBudget(0.4999)", KLBudget(0.4999), 0.0001 * 0.0001 / 2},
		// One draw: p_hat - sqrt(ln(1/alpha) / 2); alpha = 1/2: 1 - sqrt(ln 2 / 2).
		{"HoeffdingLower(1, 1, 0.5)", HoeffdingLower(1, 1, 0.5), 0.41129498874226267},
		// No confidence (alpha outside (0, 1)) is no bound.
		{"HoeffdingLower(0.9, 10, 1)", HoeffdingLower(0.9, 10, 1), math.Inf(-1)},
		{"HoeffdingLower(0.9, 10, 0)", HoeffdingLower(0.9, 10, 0), math.Inf(-1)},
		// -0 is outside (0, 1) too: 1/-0 = -Inf, and ln(-Inf) would be NaN, not a bound of -Inf.
		{"HoeffdingLower(0.9, 10, -0)", HoeffdingLower(0.9, 10, math.Copysign(0, -1)), math.Inf(-1)},
		{"HoeffdingLower(0.9, 10, NaN)", HoeffdingLower(0.9, 10, math.NaN()), math.Inf(-1)},
	} {
		// A want of 0 (no budget, no bound) is exact: a positive budget, however small, is wrong.
		if !(tc.got == tc.want || tc.want != 0 && math.Abs(tc.got-tc.want) <= 1e-15) { // NaN fails both
			t.Errorf("%s = %v, want %v", tc.name, tc.got, tc.want)
		}
	}
}

// KLBudgetForP1In is the KL at which ProbLower(p1, KL, mode) reaches 1/2, found here by bisection
// on ProbLower itself (decreasing in KL), in both modes, to 1e-9 relative; tight mode's is never
// below paper's. A budget that is not a number fails both checks.
func TestKLBudgetForP1InIsWhereTheBoundReachesOneHalf(t *testing.T) {
	for _, mode := range []Mode{Paper, Tight} {
		for _, p1 := range []float64{0.501, 0.55, 0.6, 0.75, 0.9, 0.95, 0.99, 1} {
			lo, hi := 0.0, 50.0
			for range 200 {
				mid := (lo + hi) / 2
				if ProbLower(p1, mid, mode) >= 0.5 {
					lo = mid
				} else {
					hi = mid
				}
			}
			got := KLBudgetForP1In(p1, mode)
			if !(math.Abs(got-lo) <= 1e-9*lo) { // NaN fails
				t.Errorf("%s, p1 %v: KLBudgetForP1In = %v, the bound reaches 1/2 at %v", mode, p1, got, lo)
			}
			if mode == Tight && !(got >= KLBudgetForP1(p1)) {
				t.Errorf("p1 %v: tight budget %v below paper's %v", p1, got, KLBudgetForP1(p1))
			}
		}
		for _, p1 := range []float64{0.5, 0.3, 0} {
			if b := KLBudgetForP1In(p1, mode); b != 0 {
				t.Errorf("%s, p1 %v: budget %v, want 0", mode, p1, b)
			}
		}
	}
}
