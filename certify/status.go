package certify

import (
	"fmt"
	"math"
)

// Status is where a stored counterfactual (CE) stands against the current posterior q_now.
//
//	certified    Theorem 1 keeps p_now >= 1/2 AND Theorem 2 keeps V_now within the variance budget,
//	             both from the anchor's (p1, V1) and KL(q_now || q_anchor); no sampling needed.
//	at_risk      a bound fails and the certificate could not be renewed; decided when a
//	             Monte-Carlo verdict's lower confidence bound puts p2 >= 1/2 (so the target is the
//	             argmax) and carries to q_now; otherwise kept by hysteresis, or a lapsed certificate
//	             with no verdict yet (Verdict, VerdictBound).
//	invalidated  a bound fails and a verdict's upper confidence bound put p2 < 1/2; decided while
//	             that verdict carries to q_now, else kept by hysteresis.
//	uncertified  not admitted at registration: outside the <delta, eps>-set (p1 < 1 - delta or
//	             V1 > eps), or, when the ledger admits by evidence (Certificate.Admits, the
//	             daemon's), lower(p1) < 1 - delta at confidence 1 - alpha; no theorem applies.
//
// The zero value is not a status; ParseStatus and UnmarshalText never produce it.
type Status uint8

// The statuses. Their numeric values are part of the ledger's on-disk format: never renumber.
const (
	Uncertified Status = iota + 1
	Certified
	AtRisk
	Invalidated
)

// Statuses returns every status in a fixed order (certified, at_risk, invalidated, uncertified),
// for metrics that create all label values up front.
func Statuses() []Status { return []Status{Certified, AtRisk, Invalidated, Uncertified} }

// String is the status's name as used in config, JSON and metric labels.
func (s Status) String() string {
	switch s {
	case Certified:
		return "certified"
	case AtRisk:
		return "at_risk"
	case Invalidated:
		return "invalidated"
	case Uncertified:
		return "uncertified"
	}
	return fmt.Sprintf("status(%d)", uint8(s))
}

// Valid reports whether s is one of the four statuses.
func (s Status) Valid() bool { return s >= Uncertified && s <= Invalidated }

// ParseStatus is the inverse of String.
func ParseStatus(name string) (Status, error) {
	for _, s := range Statuses() {
		if s.String() == name {
			return s, nil
		}
	}
	return 0, fmt.Errorf("unknown counterfactual status %q (want certified, at_risk, invalidated or uncertified)", name)
}

// MarshalText encodes the status by name; an invalid status is an error.
func (s Status) MarshalText() ([]byte, error) {
	if !s.Valid() {
		return nil, fmt.Errorf("invalid counterfactual status %d", uint8(s))
	}
	return []byte(s.String()), nil
}

// UnmarshalText decodes a status name.
func (s *Status) UnmarshalText(b []byte) error {
	v, err := ParseStatus(string(b))
	if err != nil {
		return err
	}
	*s = v
	return nil
}

// Defaults of Policy.
const (
	// DefaultEpsilonMax is the default variance ceiling for Theorem 2 (config certify.epsilon_max):
	// 1/4, the largest variance of a [0,1]-valued variable, so by default only Theorem 1 decides.
	// Lower it to make Theorem 2 bite: at 0.05 (five times the paper's eps = 0.01) a CE with
	// V1 = 0.01 tolerates KL <= (0.05 - 0.01)^2 / 18 = 8.9e-5 in paper mode (3.6e-4 in tight mode).
	DefaultEpsilonMax = 0.25
	// DefaultAlpha is the default Hoeffding miss probability for p1's lower confidence bound.
	DefaultAlpha = 0.01
)

// Policy fixes how a certificate is judged: the bound constants, the variance budget, and whether
// Theorem 1 starts from the Monte-Carlo point estimate of p1 or from its Hoeffding lower bound.
//
// The variance budget. The literal reading is "Theorem 2's bound <= the CE's epsilon". A CE admitted
// with V1 <= eps cannot keep V_now <= eps under any KL > 0 unless V1 < eps strictly, and then
// only for KL <= (eps - V1)^2 / 18, typically ~1e-6: the paper's threshold is an admission test,
// not a useful ceiling. So the ceiling is a separate, configured number:
//
//	budget(CE) = max(EpsilonMax, eps_CE)        (EpsilonMax = 0: budget(CE) = eps_CE, the strict reading)
//	certified  <=>  p1' - slack_p(KL) >= 1/2  AND  V1 + slack_V(KL) <= budget(CE)
//
// where p1' = p1 or HoeffdingLower(p1, S, Alpha), and (slack_p, slack_V) = (2 sqrt(KL/2), 6 sqrt(KL/2))
// in paper mode or (TV_ub, 3 TV_ub) in tight mode. The max() keeps a CE that was admitted under
// its own eps from failing at KL = 0 when the configured ceiling is lower. Note that in paper mode
// the variance condition binds long before the mean condition: at V1 = 0.01, EpsilonMax = 0.05 it
// allows KL <= 8.9e-5, while Theorem 1 from p1 = 0.99 allows KL <= 0.12.
type Policy struct {
	Mode       Mode
	EpsilonMax float64
	Hoeffding  bool
	Alpha      float64
}

// DefaultPolicy is paper mode, EpsilonMax = DefaultEpsilonMax (1/4), point-estimate p1 (Hoeffding off, Alpha = 0.01).
func DefaultPolicy() Policy {
	return Policy{Mode: Paper, EpsilonMax: DefaultEpsilonMax, Alpha: DefaultAlpha}
}

// Validate checks the policy's fields, naming the bad one.
func (p Policy) Validate() error {
	if p.Mode != Paper && p.Mode != Tight {
		return fmt.Errorf("certify policy: mode %q (want paper or tight)", p.Mode)
	}
	if !(p.EpsilonMax >= 0 && p.EpsilonMax <= 0.25) {
		return fmt.Errorf("certify policy: epsilon_max = %v, want within [0, 0.25] (0.25 is the largest variance of a [0,1] variable)", p.EpsilonMax)
	}
	if p.Hoeffding && !(p.Alpha > 0 && p.Alpha < 1) {
		return fmt.Errorf("certify policy: hoeffding alpha = %v, want within (0, 1)", p.Alpha)
	}
	return nil
}

// Certificate is what was measured for a CE under its anchor posterior q1: the Monte-Carlo
// estimates p1 = E_q1[f] and V1 = Var_q1[f] from S draws, and the <delta, eps>-set it was
// admitted to.
type Certificate struct {
	P1, Var1       float64
	Samples        int
	Delta, Epsilon float64
}

// Validate checks ranges: p1 in [0, 1], V1 in [0, MaxSampleVar(S)], S >= 1, delta in (0, 1/2),
// eps in (0, 1/4].
func (c Certificate) Validate() error {
	switch {
	case !(c.P1 >= 0 && c.P1 <= 1):
		return fmt.Errorf("certificate: p1 = %v, want within [0, 1]", c.P1)
	case c.Samples < 1:
		return fmt.Errorf("certificate: samples = %d, want >= 1 (the Monte-Carlo draws p1 was measured with)", c.Samples)
	case !(c.Var1 >= 0 && c.Var1 <= MaxSampleVar(c.Samples)):
		return fmt.Errorf("certificate: var1 = %v, want within [0, %v] (the largest unbiased sample variance of %d draws in [0, 1])",
			c.Var1, MaxSampleVar(c.Samples), c.Samples)
	}
	if err := CheckDelta(c.Delta); err != nil {
		return fmt.Errorf("certificate: %w", err)
	}
	if err := CheckEpsilon(c.Epsilon); err != nil {
		return fmt.Errorf("certificate: %w", err)
	}
	return nil
}

// MaxSampleVar is the largest unbiased sample variance n values in [0, 1] can have, n/(4(n - 1))
// for n >= 2 (half of them 0, half 1, n even), and 1/4 for n < 2. It is above 1/4, the largest
// variance of a [0, 1]-valued variable, by the factor n/(n - 1): a measured V1 may exceed 1/4 by
// that much (0.25025 at 1000 draws).
func MaxSampleVar(n int) float64 {
	if n < 2 {
		return 0.25
	}
	return float64(n) / (4 * float64(n-1))
}

// InSet reports membership of the <delta, eps>-set (paper, Definition 5), on the point estimates:
//
//	p1 >= 1 - delta  AND  V1 <= eps
func InSet(p, v, delta, eps float64) bool { return p >= 1-delta && v <= eps }

// InSet reports whether the certificate's own measurements put the CE in its <delta, eps>-set.
func (c Certificate) InSet() bool { return InSet(c.P1, c.Var1, c.Delta, c.Epsilon) }

// Admits reports whether the certificate's measurements admit the CE as certified at
// registration: by the rule that renews a certificate (Renewable at confidence 1 - alpha:
// lower(p1) >= 1 - delta and Var1 <= eps), so that a CE admitted under a posterior is renewed
// under the same one. One criterion to enter and to stay.
func (c Certificate) Admits(alpha float64) bool {
	return Renewable(Evidence{P: c.P1, Var: c.Var1, Samples: c.Samples}, c.Delta, c.Epsilon, alpha)
}

// Slack is how far a KL lets the predictive move: p can fall by at most Mean and V rise by at most
// Var. It depends only on KL and the mode, so it is computed once per anchor, not once per CE.
type Slack struct {
	KL, Mean, Var float64
}

// Slack returns (2 sqrt(KL/2), 6 sqrt(KL/2)) in paper mode and (TV_ub, 3 TV_ub) in tight mode.
func (p Policy) Slack(kl float64) Slack {
	if p.Mode == Tight {
		tv := TVUpper(kl)
		return Slack{KL: kl, Mean: tv, Var: 3 * tv}
	}
	s := Pinsker(kl)
	return Slack{KL: kl, Mean: 2 * s, Var: 6 * s}
}

// Bounds is the evaluation of one certificate at one KL.
type Bounds struct {
	// P1 is what Theorem 1 starts from: the estimate p1, or its Hoeffding lower bound.
	P1 float64
	// ProbLower is Theorem 1's bound on p_now (not clipped at 0); VarUpper is Theorem 2's bound on
	// V_now (capped at 1/4, the largest variance of a [0,1] variable, in both modes); VarCeiling is the ceiling VarUpper is compared with.
	ProbLower, VarUpper, VarCeiling float64
	// Certified is ProbLower >= 1/2 && VarUpper <= VarCeiling.
	Certified bool
}

// VarCeiling is the variance ceiling for a CE admitted with threshold eps: max(EpsilonMax, eps).
func (p Policy) VarCeiling(eps float64) float64 { return varCeiling(p.EpsilonMax, eps) }

// varCeiling is max(epsMax, eps) with plain comparisons, not math.Max: it runs once per judged
// CE, and inputs are validated finite.
func varCeiling(epsMax, eps float64) float64 {
	if eps > epsMax {
		return eps
	}
	return epsMax
}

// StartP1 is the p1 Theorem 1 starts from: c.P1, or HoeffdingLower(c.P1, c.Samples, Alpha) when
// the policy asks for it.
func (p Policy) StartP1(c Certificate) float64 {
	if p.Hoeffding {
		return HoeffdingLower(c.P1, c.Samples, p.Alpha)
	}
	return c.P1
}

// Evaluate applies a precomputed slack to a certificate:
//
//	ProbLower = p1' - s.Mean,   VarUpper = min(V1 + s.Var, 1/4)
//
// Equal to ProbLower(p1', KL, mode) and VarUpper(V1, KL, mode). It is Gate.Check's arithmetic
// (one function does both), so the two give bit-identical answers.
func (p Policy) Evaluate(c Certificate, s Slack) Bounds {
	g := p.Gate(s)
	return g.bounds(c.P1, c.Var1, c.Epsilon, c.Samples)
}

// Gate is Evaluate specialised to one policy and one slack, for scans over many certificates
// (the ledger judges every stored CE under an anchor with one Gate).
type Gate struct {
	hoeffding    bool
	logInvAlpha  float64 // ln(1/alpha)
	epsMax       float64
	mean, vslack float64
}

// Gate fixes the policy and the slack.
func (p Policy) Gate(s Slack) Gate {
	g := Gate{hoeffding: p.Hoeffding, epsMax: p.EpsilonMax, mean: s.Mean, vslack: s.Var}
	if p.Hoeffding {
		g.logInvAlpha = math.Inf(1) // HoeffdingLower's -Inf for an alpha outside (0, 1)
		if p.Alpha > 0 && p.Alpha < 1 {
			g.logInvAlpha = math.Log(1 / p.Alpha)
		}
	}
	return g
}

// Check returns Theorem 1's bound (Bounds.ProbLower) and whether both bounds hold
// (Bounds.Certified) for a certificate with the given p1, V1, eps and samples.
func (g *Gate) Check(p1, v1, eps float64, samples int) (lower float64, certified bool) {
	b := g.bounds(p1, v1, eps, samples)
	return b.ProbLower, b.Certified
}

// Theorem1 reports whether Theorem 1's bound holds for a certificate whose p1' (Policy.StartP1)
// is p1s: p1' - slack_p >= 1/2, with bounds' arithmetic, so that it agrees with Check bit for bit.
// It is monotone in p1s: the certificates under one gate that fail it are those below a threshold.
func (g *Gate) Theorem1(p1s float64) bool { return p1s-g.mean >= 0.5 }

// Theorem2 reports whether Theorem 2's bound holds for a certificate with variance v1 and variance
// ceiling ceiling (Policy.VarCeiling): min(V1 + slack_V, 1/4) <= ceiling, with bounds' arithmetic.
func (g *Gate) Theorem2(v1, ceiling float64) bool {
	u := v1 + g.vslack
	if u > 0.25 {
		u = 0.25
	}
	return u <= ceiling
}

// bounds is the one place Theorems 1 and 2 are applied to a certificate:
//
//	certified  <=>  p1' - slack_p >= 1/2  AND  min(V1 + slack_V, 1/4) <= max(epsilon_max, eps)
//
// Both ends are inclusive: a bound exactly at 1/2, or exactly at the ceiling, certifies.
func (g *Gate) bounds(p1, v1, eps float64, samples int) Bounds {
	b := Bounds{P1: p1, VarCeiling: varCeiling(g.epsMax, eps)}
	if g.hoeffding {
		b.P1 = hoeffdingLower(p1, samples, g.logInvAlpha)
	}
	b.ProbLower = b.P1 - g.mean
	b.VarUpper = v1 + g.vslack
	if b.VarUpper > 0.25 {
		b.VarUpper = 0.25
	}
	b.Certified = b.ProbLower >= 0.5 && b.VarUpper <= b.VarCeiling
	return b
}

// Bounds evaluates a certificate at KL(q_now || q_anchor); see Evaluate.
func (p Policy) Bounds(c Certificate, kl float64) Bounds { return p.Evaluate(c, p.Slack(kl)) }

// Observed classifies a CE whose bound failed from a Monte-Carlo estimate under q_now: AtRisk when
// it still gives the target (p2 >= 1/2 and argmax = target), Invalidated otherwise.
func Observed(p2 float64, argmax, target int) Status {
	if p2 >= 0.5 && argmax == target {
		return AtRisk
	}
	return Invalidated
}

// RangeError is a parameter outside its range.
type RangeError struct {
	Name  string  // delta or epsilon
	Value float64 // what was given
	Want  string  // the range, as an interval: "(0, 0.5)"
}

func (e *RangeError) Error() string {
	return fmt.Sprintf("%s = %v, want within %s", e.Name, e.Value, e.Want)
}

// CheckDelta checks that delta lies in (0, 1/2), the range where a delta-safe CE has
// p1 >= 1 - delta > 1/2 and so a positive KL budget; every layer that takes a delta uses it.
// The error is a *RangeError.
func CheckDelta(delta float64) error {
	if !(delta > 0 && delta < 0.5) {
		return &RangeError{Name: "delta", Value: delta, Want: "(0, 0.5)"}
	}
	return nil
}

// CheckEpsilon checks that epsilon lies in (0, 1/4], 1/4 being the largest variance of a
// [0, 1]-valued variable; every layer that takes an epsilon uses it. The error is a *RangeError.
func CheckEpsilon(epsilon float64) error {
	if !(epsilon > 0 && epsilon <= 0.25) {
		return &RangeError{Name: "epsilon", Value: epsilon, Want: "(0, 0.25]"}
	}
	return nil
}
