package certify

import (
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"testing"
)

// measure draws n values of f ~ Beta(a, b) and returns their mean and unbiased variance.
func measure(r *rand.Rand, a, b float64, n int) Evidence {
	var mean, m2 float64
	for i := 1; i <= n; i++ {
		f := betaDraw(r, a, b)
		d := f - mean
		mean += d / float64(i)
		m2 += d * (f - mean)
	}
	return Evidence{P: mean, Var: m2 / float64(n-1), Samples: n}
}

// betaDraw is Beta(a, b) as X / (X + Y) with X ~ Gamma(a), Y ~ Gamma(b) (a, b >= 1, Marsaglia-Tsang).
func betaDraw(r *rand.Rand, a, b float64) float64 {
	if a < 1 || b < 1 {
		panic(fmt.Sprintf("betaDraw(%v, %v): this sampler needs both shapes >= 1", a, b))
	}
	x, y := gammaDraw(r, a), gammaDraw(r, b)
	return x / (x + y)
}

func gammaDraw(r *rand.Rand, a float64) float64 {
	d := a - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		z := r.NormFloat64()
		v := 1 + c*z
		if v <= 0 {
			continue
		}
		v = v * v * v
		if u := r.Float64(); math.Log(u) < 0.5*z*z+d-d*v+d*math.Log(v) {
			return d * v
		}
	}
}

// TestBernsteinCoverage checks the empirical Bernstein bounds against simulation: over many
// independent measurements of S = 200 draws, each one-sided bound misses the true mean with a
// frequency at most alpha (plus three binomial standard errors), for means near 1/2 (large
// variance) and near 1 (small variance), where the bound is widest and narrowest.
func TestBernsteinCoverage(t *testing.T) {
	const trials, n, alpha = 2000, 200, 0.05
	r := rand.New(rand.NewPCG(1, 2))
	for _, c := range []struct{ a, b float64 }{{1, 1}, {5, 5}, {40, 1}, {200, 2}} {
		mu := c.a / (c.a + c.b)
		var missLo, missHi int
		for range trials {
			lo, hi := measure(r, c.a, c.b, n).Interval(alpha)
			if mu < lo {
				missLo++
			}
			if mu > hi {
				missHi++
			}
		}
		limit := alpha + 3*math.Sqrt(alpha*(1-alpha)/trials)
		for side, miss := range map[string]int{"lower": missLo, "upper": missHi} {
			if f := float64(miss) / trials; f > limit {
				t.Errorf("Beta(%v, %v), mean %.4f: the %s bound missed in %.4f of %d trials, want <= %.4f", c.a, c.b, mu, side, f, trials, limit)
			}
		}
	}
}

func TestBernsteinMargin(t *testing.T) {
	// The figure the doc comment quotes: n = 1000, alpha = 0.01, v = 0.001.
	if m := BernsteinMargin(0.001, 1000, 0.01); math.Abs(m-0.0160) > 5e-4 {
		t.Errorf("margin(0.001, 1000, 0.01) = %v, want ~0.016", m)
	}
	for _, c := range []struct {
		v     float64
		n     int
		alpha float64
	}{{0.01, 1, 0.01}, {0.01, 0, 0.01}, {0.01, 100, 0}, {0.01, 100, 1}, {-1, 100, 0.01}, {math.NaN(), 100, 0.01},
		// n <= 0 is refused before the formula, which there gives NaN (sqrt(0/0), sqrt(-x)), not +Inf;
		// so is alpha = -0 (ln(2 / -0) = ln(-Inf) is NaN).
		{0, 0, 0.01}, {0.01, -1, 0.01}, {0.01, 100, math.Copysign(0, -1)}} {
		if m := BernsteinMargin(c.v, c.n, c.alpha); !math.IsInf(m, 1) {
			t.Errorf("BernsteinMargin(%v, %d, %v) = %v, want +Inf", c.v, c.n, c.alpha, m)
		}
	}
	// Monotone: more draws or a smaller variance never widen it.
	if BernsteinMargin(0.01, 2000, 0.01) >= BernsteinMargin(0.01, 1000, 0.01) ||
		BernsteinMargin(0.001, 1000, 0.01) >= BernsteinMargin(0.01, 1000, 0.01) {
		t.Error("the margin does not shrink with more draws or a smaller variance")
	}
}

func TestRenewableAndVerdict(t *testing.T) {
	const alpha = 0.01
	m := BernsteinMargin(0.001, 1000, alpha)
	e := func(p float64) Evidence { return Evidence{P: p, Var: 0.001, Samples: 1000} }
	cases := []struct {
		name      string
		e         Evidence
		renewable bool
	}{
		{"lower bound at 1 - delta", e(0.95 + m), true},
		{"point estimate in the set, lower bound not", e(0.95 + m/2), false},
		{"variance over epsilon", Evidence{P: 0.999, Var: 0.011, Samples: 1000}, false},
		{"too few draws", Evidence{P: 1, Var: 0, Samples: 1}, false},
	}
	for _, c := range cases {
		if got := Renewable(c.e, 0.05, 0.01, alpha); got != c.renewable {
			t.Errorf("%s: Renewable = %v, want %v", c.name, got, c.renewable)
		}
	}
	verdicts := []struct {
		prev Status
		p    float64
		want Status
	}{
		{Certified, 0.5 - 1.01*m, Invalidated},
		{Certified, 0.5 - 0.99*m, AtRisk}, // no verdict yet: at_risk until the evidence says p < 1/2
		{AtRisk, 0.5 - 0.99*m, AtRisk},
		{Invalidated, 0.5 - 0.99*m, Invalidated},
		{Invalidated, 0.5 + 0.99*m, Invalidated},
		{Invalidated, 0.5 + 1.01*m, AtRisk},
		{AtRisk, 0.5 - 1.01*m, Invalidated},
		{AtRisk, 0.9, AtRisk},
	}
	for _, v := range verdicts {
		if got := Verdict(v.prev, e(v.p), alpha); got != v.want {
			t.Errorf("Verdict(%v, p = 0.5 %+.4f margins) = %v, want %v", v.prev, (v.p-0.5)/m, got, v.want)
		}
	}
}

// TestVerdictNearHalfDoesNotFlap holds a CE at p = 1/2 across 100 posterior versions, each
// measured afresh with S = 1000 draws, and counts status changes: with the point estimate
// deciding (Observed) the status flips about every other version; with Verdict it may move once
// from its first verdict and then stays.
func TestVerdictNearHalfDoesNotFlap(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	const versions = 100
	for _, mu := range []float64{0.5, 0.49, 0.51} {
		a := 20 * mu
		b := 20 * (1 - mu)
		status, naive := AtRisk, AtRisk
		var flips, naiveFlips int
		for range versions {
			e := measure(r, a, b, 1000)
			if s := Verdict(status, e, DefaultVerdictAlpha); s != status {
				flips++
				status = s
			}
			if s := Observed(e.P, 0, 0); e.P < 0.5 {
				if s != Invalidated {
					t.Fatalf("Observed(%v) = %v", e.P, s)
				}
				if naive != Invalidated {
					naiveFlips++
				}
				naive = Invalidated
			} else {
				if naive != AtRisk {
					naiveFlips++
				}
				naive = AtRisk
			}
		}
		if flips > 1 {
			t.Errorf("p = %v: %d status changes over %d versions, want at most 1", mu, flips, versions)
		}
		if mu == 0.5 && naiveFlips < 10 {
			t.Errorf("p = 0.5: the point estimate flipped only %d times over %d versions: the test does not exercise the noise", naiveFlips, versions)
		}
		t.Logf("p = %v: %d status changes with Verdict, %d with the point estimate, over %d versions", mu, flips, naiveFlips, versions)
	}
}

// TestRenewalThresholdDoesNotFlap holds a CE's p at the renewal threshold (lower(p) = 1 - delta
// on average) across 100 versions, each measured afresh, its certificate lapsing at each: the
// certificate is renewed while Renewable holds, and once lost comes back only when Reenters holds.
// With Renewable both ways the status would follow the noise.
func TestRenewalThresholdDoesNotFlap(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	const versions, n, alpha, delta, eps = 100, 1000, DefaultVerdictAlpha, 0.05, 0.01
	// Beta(a, b) with mean mu and variance 0.0008 (b >= 1, as gammaDraw needs), mu chosen so
	// that mu - m = 1 - delta.
	v := 0.0008
	m := BernsteinMargin(v, n, alpha)
	mu := 1 - delta + m
	k := mu*(1-mu)/v - 1
	a, b := mu*k, (1-mu)*k
	certified, naive := true, true
	flips, naiveFlips := 0, 0
	for range versions {
		e := measure(r, a, b, n)
		next := Renewable(e, delta, eps, alpha)
		if !certified {
			next = Reenters(e, delta, eps, alpha)
		}
		if next != certified {
			flips++
			certified = next
		}
		if nn := Renewable(e, delta, eps, alpha); nn != naive {
			naiveFlips++
			naive = nn
		}
	}
	t.Logf("p at the renewal threshold over %d versions: %d status changes with re-entry hysteresis, %d without", versions, flips, naiveFlips)
	if flips > 3 {
		t.Errorf("%d status changes over %d versions, want at most 3", flips, versions)
	}
	if naiveFlips < 10 {
		t.Errorf("without hysteresis only %d changes: p is not at the threshold and the test shows nothing", naiveFlips)
	}
}

// TestBernsteinMarginAgainstAnIndependentComputation checks the margin's formula term by term,
// sqrt(2 v ln(2/alpha) / n) + 7 ln(2/alpha) / (3 (n - 1)), at n = 2, 10, 100 and 1000 against
// the same formula evaluated in 256-bit big.Float arithmetic with its own logarithm, to 1e-12
// relative (float64 rounding is ~1e-15), and at v = 0.001, alpha = 0.01 against values written
// out to 16 digits. Each n is also checked to tell the formula from nearby ones (n for n - 1 in
// the second term, n - 1 for n in the first, 3 ln(2/alpha) for 7), so that none of those would
// pass.
func TestBernsteinMarginAgainstAnIndependentComputation(t *testing.T) {
	const rel = 1e-12
	exact := marginFormula{"7 ln(2/alpha) / (3 (n - 1))", func(n int64) int64 { return n }, func(n int64) int64 { return n - 1 }, 7}
	nearby := []marginFormula{
		{"7 ln(2/alpha) / (3 n)", func(n int64) int64 { return n }, func(n int64) int64 { return n }, 7},
		{"sqrt(2 v ln(2/alpha) / (n - 1))", func(n int64) int64 { return n - 1 }, func(n int64) int64 { return n - 1 }, 7},
		{"3 ln(2/alpha) / (3 (n - 1))", func(n int64) int64 { return n }, func(n int64) int64 { return n - 1 }, 3},
	}
	for _, n := range []int{2, 10, 100, 1000} {
		for _, v := range []float64{0, 0.001, 0.0625, 0.25} {
			for _, alpha := range []float64{1e-6, 0.01, 0.05, 0.5} {
				got := BernsteinMargin(v, n, alpha)
				want := bigMargin(exact, v, n, alpha)
				if math.Abs(got-want) > rel*want {
					t.Errorf("BernsteinMargin(%v, %d, %v) = %.17g, independent computation %.17g", v, n, alpha, got, want)
				}
				for _, f := range nearby {
					if f.name != "sqrt(2 v ln(2/alpha) / (n - 1))" || v > 0 { // with v = 0 the first term is 0 either way
						if o := bigMargin(f, v, n, alpha); math.Abs(o-want) <= rel*want {
							t.Errorf("n = %d, v = %v, alpha = %v: %s gives %.17g, within %g of the margin: the check cannot tell them apart", n, v, alpha, f.name, o, rel)
						}
					}
				}
			}
		}
	}
	// v = 0.001, alpha = 0.01, evaluated to 40 digits with decimal arithmetic outside Go.
	for _, c := range []struct {
		n    int
		want float64
	}{{2, 12.43553006354686078}, {10, 1.406190308386087798}, {100, 0.1351701625815055357}, {1000, 0.01563036289902046043}} {
		if got := BernsteinMargin(0.001, c.n, 0.01); math.Abs(got-c.want) > rel*c.want {
			t.Errorf("BernsteinMargin(0.001, %d, 0.01) = %.17g, want %.17g", c.n, got, c.want)
		}
	}
}

// marginFormula is sqrt(2 v L / root(n)) + seven L / (3 tail(n)), L = ln(2 / alpha).
type marginFormula struct {
	name       string
	root, tail func(n int64) int64
	seven      int64
}

// bigMargin evaluates f at (v, n, alpha) in 256-bit arithmetic, L from bigLog.
func bigMargin(f marginFormula, v float64, n int, alpha float64) float64 {
	const prec = 256
	num := func(x float64) *big.Float { return new(big.Float).SetPrec(prec).SetFloat64(x) }
	integer := func(x int64) *big.Float { return new(big.Float).SetPrec(prec).SetInt64(x) }
	l := bigLog(new(big.Float).SetPrec(prec).Quo(integer(2), num(alpha)))
	first := new(big.Float).SetPrec(prec).Mul(integer(2), num(v))
	first.Mul(first, l).Quo(first, integer(f.root(int64(n)))).Sqrt(first)
	second := new(big.Float).SetPrec(prec).Mul(integer(f.seven), l)
	second.Quo(second, integer(3*f.tail(int64(n))))
	r, _ := first.Add(first, second).Float64()
	return r
}

// bigLog is the natural logarithm of x > 0 to the precision of x: x = m 2^e with m in [1/2, 1),
// ln x = ln m + e ln 2, each from ln y = 2 atanh((y - 1) / (y + 1)) = 2 sum_k z^(2k+1) / (2k+1),
// z = (y - 1) / (y + 1), |z| <= 1/3.
func bigLog(x *big.Float) *big.Float {
	prec := x.Prec()
	atanhSeries := func(y *big.Float) *big.Float {
		one := new(big.Float).SetPrec(prec).SetInt64(1)
		z := new(big.Float).SetPrec(prec).Sub(y, one)
		z.Quo(z, new(big.Float).SetPrec(prec).Add(y, one))
		z2 := new(big.Float).SetPrec(prec).Mul(z, z)
		sum, pow := new(big.Float).SetPrec(prec), new(big.Float).SetPrec(prec).Set(z)
		for k := int64(1); ; k += 2 {
			term := new(big.Float).SetPrec(prec).Quo(pow, new(big.Float).SetPrec(prec).SetInt64(k))
			if term.Sign() == 0 || term.MantExp(nil)-sum.MantExp(nil) < -int(prec)-8 && sum.Sign() != 0 {
				break
			}
			sum.Add(sum, term)
			pow.Mul(pow, z2)
		}
		return sum.Mul(sum, new(big.Float).SetPrec(prec).SetInt64(2))
	}
	m := new(big.Float).SetPrec(prec)
	e := x.MantExp(m)
	ln := atanhSeries(m)
	ln2 := atanhSeries(new(big.Float).SetPrec(prec).SetInt64(2))
	return ln.Add(ln, ln2.Mul(ln2, new(big.Float).SetPrec(prec).SetInt64(int64(e))))
}

// TestEvidenceVarianceAndInterval: the variance half of the renewal and re-entry rules, and the
// interval's clipping. At alpha = 0.01 and 1000 draws of variance 0.01 the margin is
// m = sqrt(2 * 0.01 * ln 200 / 1000) + 7 ln 200 / 2997 = 0.0226692, so p = 0.999 passes both
// rules' bound on p (p - m = 0.976, p - 2 m = 0.954 >= 0.95): Var = eps passes (the rules say
// Var <= eps), the float above it fails both, whatever p says. With 10 draws of variance 1/4 the
// margin (1.89) passes both ends of [0, 1]: the interval is [0, 1].
func TestEvidenceVarianceAndInterval(t *testing.T) {
	const alpha, delta, eps = 0.01, 0.05, 0.01
	at := Evidence{P: 0.999, Var: eps, Samples: 1000}
	over := Evidence{P: 0.999, Var: math.Nextafter(eps, 1), Samples: 1000}
	for _, tc := range []struct {
		name string
		got  bool
		want bool
	}{
		{"Renewable at Var = eps", Renewable(at, delta, eps, alpha), true},
		{"Reenters at Var = eps", Reenters(at, delta, eps, alpha), true},
		{"Renewable at Var just over eps", Renewable(over, delta, eps, alpha), false},
		{"Reenters at Var just over eps", Reenters(over, delta, eps, alpha), false},
	} {
		if tc.got != tc.want {
			t.Errorf("%s (p = 0.999, 1000 draws): %v, want %v", tc.name, tc.got, tc.want)
		}
	}
	if lo, hi := (Evidence{P: 0.5, Var: 0.25, Samples: 10}).Interval(alpha); lo != 0 || hi != 1 {
		t.Errorf("Interval of 10 draws of variance 1/4 around 1/2 = [%v, %v], want [0, 1]", lo, hi)
	}
}

// MinRenewableSamples is the fewest draws whose estimate can be Renewable at all: with n of them
// a measurement of p = 1 and Var = 0 is renewable, with n - 1 none is.
func TestMinRenewableSamples(t *testing.T) {
	for _, delta := range []float64{0.01, 0.05, 0.1, 0.3} {
		for _, alpha := range []float64{1e-6, 0.001, 0.01, 0.05, 0.2} {
			n := MinRenewableSamples(delta, alpha)
			if !Renewable(Evidence{P: 1, Var: 0, Samples: n}, delta, 0.01, alpha) {
				t.Errorf("delta %v, alpha %v: %d draws of p = 1 are not renewable (margin %v)", delta, alpha, n, BernsteinMargin(0, n, alpha))
			}
			if Renewable(Evidence{P: 1, Var: 0, Samples: n - 1}, delta, 0.01, alpha) {
				t.Errorf("delta %v, alpha %v: %d draws of p = 1 are renewable, fewer than MinRenewableSamples %d", delta, alpha, n-1, n)
			}
		}
	}
}

// Where no count of draws can meet the renewal rule, MinRenewableSamples is the largest int on
// every platform, rather than what converting an infinite or too large count gives there.
func TestMinRenewableSamplesWhenNoCountCan(t *testing.T) {
	for _, c := range []struct {
		name         string
		delta, alpha float64
	}{
		{"delta 0", 0, 0.01},
		{"negative delta", -0.1, 0.01},
		{"delta NaN", math.NaN(), 0.01},
		{"alpha 0", 0.05, 0},
		{"alpha 1", 0.05, 1},
		{"negative alpha", 0.05, -0.01},
		{"alpha NaN", 0.05, math.NaN()},
		{"a count past the largest int", 1e-300, 0.01},
		// 7 ln(200) / (3 delta) = 2^63 exactly: the count is float64(math.MaxInt), one past it.
		{"a count of 2^63", 7 * math.Log(200) / (3 * math.Exp2(63)), 0.01},
	} {
		if got := MinRenewableSamples(c.delta, c.alpha); got != math.MaxInt {
			t.Errorf("%s: MinRenewableSamples(%v, %v) = %d, want math.MaxInt", c.name, c.delta, c.alpha, got)
		}
	}
	// The largest count below the cut: 7 ln(200) / (3 delta) + 2 is about 2^62 here.
	delta := 7 * math.Log(200) / (3 * math.Exp2(62))
	if got := MinRenewableSamples(delta, 0.01); got <= 1<<61 || got == math.MaxInt {
		t.Errorf("MinRenewableSamples(%v, 0.01) = %d, want about 2^62", delta, got)
	}
}
