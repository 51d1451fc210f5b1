package explain

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

// The tests in this file pin the rules that decide a counterfactual: the defaults (the paper's
// hyper-parameters), the configuration's validation, the stopping rules on hand-made estimates,
// and the search drivers on a one-layer model whose posterior is (almost) a point mass, so that
// every expected iterate follows from softmax(W z + b) and Adam's first step written out here.

// linearModel is a one-layer (multinomial logistic) BNN over len(w[0]) features with mean
// weights w (one row per class), mean biases b and every posterior sigma sigma, and a
// non-trivial scaler (raw x_j = (j + 2) z_j + j - 1), so that raw and standardised units differ.
func linearModel(t *testing.T, w [][]float64, b []float64, sigma float64) *bnn.Model {
	t.Helper()
	c, d := len(w), len(w[0])
	l := bnn.Layer{Name: "fc1", In: d, Out: c, WeightMu: make([]float64, c*d), WeightLogSigma: make([]float64, c*d),
		BiasMu: append([]float64(nil), b...), BiasLogSigma: make([]float64, c)}
	for k := range w {
		copy(l.WeightMu[k*d:(k+1)*d], w[k])
	}
	for i := range l.WeightLogSigma {
		l.WeightLogSigma[i] = math.Log(sigma)
	}
	for i := range l.BiasLogSigma {
		l.BiasLogSigma[i] = math.Log(sigma)
	}
	m := &bnn.Model{Layers: []bnn.Layer{l}, PriorSigma: 1, Scaler: bnn.Scaler{Mean: make([]float64, d), Std: make([]float64, d)}}
	for j := 0; j < d; j++ {
		m.Scaler.Mean[j], m.Scaler.Std[j] = float64(j-1), float64(j+2)
	}
	for k := 0; k < c; k++ {
		m.Classes = append(m.Classes, string(rune('a'+k)))
	}
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	return m
}

// rawOf maps a standardised z to raw features with m's scaler, written out: x = z std + mean.
func rawOf(m *bnn.Model, z []float64) []float64 {
	x := make([]float64, len(z))
	for j := range z {
		x[j] = z[j]*m.Scaler.Std[j] + m.Scaler.Mean[j]
	}
	return x
}

// stdOf maps raw features to standardised units: z = (x - mean) / std.
func stdOf(m *bnn.Model, x []float64) []float64 {
	z := make([]float64, len(x))
	for j := range x {
		z[j] = (x[j] - m.Scaler.Mean[j]) / m.Scaler.Std[j]
	}
	return z
}

// softmaxAt is softmax(W z + b) written out.
func softmaxAt(w [][]float64, b, z []float64) []float64 {
	p := make([]float64, len(w))
	s := 0.0
	for k := range w {
		l := b[k]
		for j := range z {
			l += w[k][j] * z[j]
		}
		p[k] = math.Exp(l)
		s += p[k]
	}
	for k := range p {
		p[k] /= s
	}
	return p
}

// generate runs g.Generate and returns its Result, or the best attempt of its NotFoundError, and
// whether it was a Result.
func generate(t *testing.T, g *Generator, x []float64, target int) (*Result, bool) {
	t.Helper()
	r, err := g.Generate(context.Background(), x, target)
	var nf *NotFoundError
	if errors.As(err, &nf) {
		return nf.Best, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return r, true
}

// TestDefaultsAreThePapers pins every default to its source: the paper's supplementary table
// "Hyperparameters for Counterfactual Generation Methods on the Wisconsin Breast Cancer Dataset"
// (Adam, lr 0.1, 2000 iterations; delta 0.05, epsilon 0.01; Schut step 0.1, 10 changes per
// feature, confidence 0.95; PSCE lambda_prox(latent) 0.2, lambda_ELBO 0.1, lambda_delta 0.2,
// lambda_eps 0.1, lambda_class 0.1; BayesCF lambda_prox 0.1), ROAR's paper (delta_max 0.1,
// lambda 0.1) and the documented choices of this package (DefaultWeights: Class and Delta 1;
// the ensembles' sizes; the TrainConfig defaults, 40 hidden units being the paper's tabular
// architecture). The values are literals here, not the constants under test.
func TestDefaultsAreThePapers(t *testing.T) {
	for _, tc := range []struct {
		method Method
		w      Weights
	}{
		{MethodPSCE, Weights{Class: 1, Delta: 1, Latent: 0.2, Var: 0.1, ELBO: 0.1}},
		{MethodBayesCF, Weights{Pred: 1, Prox: 0.1}},
		{MethodSchut, Weights{Class: 1, Prox: 0.1}},
		{MethodWachter, Weights{Class: 1, Prox: 0.1}},
		{MethodROAR, Weights{Robust: 1, ProxL1: 0.1}},
	} {
		c := DefaultConfig(tc.method)
		if c.Method != tc.method || c.LR != 0.1 || c.MaxIter != 2000 || c.Samples != 32 || c.PoolSize != 256 ||
			c.CheckSamples != 500 || c.FinalSamples != 1000 || c.Precision != bnn.Float64 || c.Delta != 0.05 ||
			c.Epsilon != 0.01 || c.MoveSize != 0.1 || c.MaxChanges != 10 || c.Confidence != 0.95 ||
			c.DeltaMax != 0.1 || c.Stop != StopConfirmed || c.Alpha != 0.01 || c.TargetAlpha != 0 {
			t.Errorf("%s: defaults %+v", tc.method, c)
		}
		if *c.Weights != tc.w {
			t.Errorf("%s: default weights %+v, want %+v", tc.method, *c.Weights, tc.w)
		}
	}
	if c := (Config{}).withDefaults(); c.Method != MethodPSCE {
		t.Errorf("default method %q, want psce", c.Method)
	}
	if want := (Weights{Class: 0.1, Delta: 0.2, Latent: 0.2, Var: 0.1, ELBO: 0.1}); PaperWeights != want {
		t.Errorf("PaperWeights %+v, want the paper's breast-cancer table %+v", PaperWeights, want)
	}
	tc := TrainConfig{}.withDefaults(1000)
	if tc.Hidden != 40 || tc.Latent != 8 || tc.Epochs != 200 || tc.BatchSize != 64 || tc.LR != 1e-3 {
		t.Errorf("TrainConfig defaults %+v", tc)
	}
	// A data set smaller than a minibatch is trained on all its rows at once.
	if b := (TrainConfig{}).withDefaults(10).BatchSize; b != 10 {
		t.Errorf("batch size %d for 10 rows, want 10", b)
	}
}

// TestConfigValidateBoundaries: every field's admissible range, at and just beyond its edge
// (config.go's validate and Weights.validate). Zero fields are defaults, so the edges tested are
// the non-zero ones.
func TestConfigValidateBoundaries(t *testing.T) {
	inf := math.Inf(1)
	for _, tc := range []struct {
		name string
		cfg  Config
		want string // "" accepted
	}{
		{"lr inf", Config{LR: inf}, "lr +Inf"},
		{"max_iter -1", Config{MaxIter: -1}, "max_iter -1"},
		{"samples 1", Config{Samples: 1, PoolSize: 10}, "samples 1"},
		{"samples 2", Config{Samples: 2, PoolSize: 2}, ""},
		{"pool = samples", Config{Samples: 40, PoolSize: 40}, ""},
		{"pool < samples", Config{Samples: 40, PoolSize: 39}, "pool_size 39"},
		{"check 1", Config{CheckSamples: 1}, "check_samples 1"},
		{"final 1", Config{FinalSamples: 1}, "final_samples 1"},
		{"check and final 2", Config{CheckSamples: 2, FinalSamples: 2}, ""},
		{"move_size inf", Config{MoveSize: inf}, "move_size +Inf"},
		{"max_changes -1", Config{MaxChanges: -1}, "max_changes -1"},
		{"confidence 1", Config{Confidence: 1}, "confidence 1"},
		{"confidence 0.999", Config{Confidence: 0.999}, ""},
		{"alpha 1", Config{Alpha: 1}, "alpha 1"},
		{"delta_max -0.5", Config{DeltaMax: -0.5}, "delta_max -0.5"},
		{"delta_max inf", Config{DeltaMax: inf}, "delta_max +Inf"},
		{"stop", Config{Stop: "never"}, `stop "never"`},
		{"target_alpha -0.1", Config{TargetAlpha: -0.1}, "target_alpha -0.1"},
		{"target_alpha 1", Config{TargetAlpha: 1}, "target_alpha 1"},
		// At delta 0.05 and target_alpha 0.01 an estimate needs 249 draws to reach the set.
		{"target_alpha with the default ensembles", Config{TargetAlpha: 0.01}, ""},
		{"target_alpha, stopping on the 32 draws' estimate", Config{TargetAlpha: 0.01, Stop: StopEstimate}, "samples 32: with target_alpha 0.01"},
		{"target_alpha, stopping on 248 draws' estimate", Config{TargetAlpha: 0.01, Stop: StopEstimate, Samples: 248, PoolSize: 248}, "want >= 249 draws"},
		{"target_alpha, stopping on 249 draws' estimate", Config{TargetAlpha: 0.01, Stop: StopEstimate, Samples: 249, PoolSize: 249}, ""},
		{"target_alpha, confirming with 248 draws", Config{TargetAlpha: 0.01, CheckSamples: 248}, "check_samples 248"},
		{"target_alpha, confirmed stop ignores the minibatch", Config{TargetAlpha: 0.01, Samples: 2, PoolSize: 2}, ""},
		{"target_alpha, a final estimate of 248 draws", Config{TargetAlpha: 0.01, FinalSamples: 248}, "final_samples 248"},
		{"target_alpha, Schut stops by its confidence", Config{Method: MethodSchut, TargetAlpha: 0.01, Stop: StopEstimate}, ""},
		{"target_alpha, Schut's final estimate of 248 draws", Config{Method: MethodSchut, TargetAlpha: 0.01, FinalSamples: 248}, "final_samples 248"},
		{"weight inf", Config{Weights: &Weights{Class: inf}}, "weight class = +Inf"},
		{"weight prox_l1", Config{Weights: &Weights{ProxL1: -1}}, "weight prox_l1 = -1"},
		{"weight robust", Config{Weights: &Weights{Robust: -1}}, "weight robust = -1"},
		{"weight pred", Config{Weights: &Weights{Pred: math.NaN()}}, "weight pred = NaN"},
		{"zero weights", Config{Weights: &Weights{}}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.withDefaults().validate()
			if tc.want == "" {
				if err != nil {
					t.Fatalf("rejected: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
	for _, tc := range []struct {
		cfg  TrainConfig
		want string
	}{
		{TrainConfig{Hidden: -1}, "hidden width -1"},
		{TrainConfig{Latent: -1}, "latent dimension -1"},
		{TrainConfig{LR: inf}, "learning rate +Inf"},
	} {
		if err := tc.cfg.withDefaults(100).validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: got %v, want %q", tc.cfg, err, tc.want)
		}
	}
}

// bernsteinLower is the empirical-Bernstein lower bound of certify.Renewable written out:
// p - sqrt(2 v ln(2/alpha) / n) - 7 ln(2/alpha) / (3 (n - 1)).
func bernsteinLower(p, v float64, n int, alpha float64) float64 {
	l := math.Log(2 / alpha)
	return p - math.Sqrt(2*v*l/float64(n)) - 7*l/(3*float64(n-1))
}

// TestInSetRule: PSCE's <delta, epsilon>-set is the paper's point-estimate rule p >= 1 - delta
// and Var <= epsilon; with Config.TargetAlpha it is the renewal rule, the lower Bernstein bound
// at level TargetAlpha (not Alpha, the Hoeffding level of P1Lower) over the estimate's own
// number of draws, >= 1 - delta, and Var <= epsilon. Cases straddle each threshold.
func TestInSetRule(t *testing.T) {
	for _, tc := range []struct {
		ta      float64
		p, v    float64
		n       int
		inSet   bool
		formula bool // the expectation is bernsteinLower(...) >= 1 - delta && v <= epsilon
	}{
		{0, 0.96, 0.005, 1000, true, false},
		{0, 0.94, 0, 1000, false, false},
		{0, 0.99, 0.011, 1000, false, false},
		{0, 0.951, 0.0099, 2, true, false}, // the point rule ignores n
		// lower(0.967, 0.005, 1000, 0.05) = 0.9523: in; at Alpha = 0.01 it would be 0.9474.
		{0.05, 0.967, 0.005, 1000, true, true},
		// the same estimate from 200 draws: lower 0.910, out (from 1000 draws it would be in).
		{0.05, 0.967, 0.005, 200, false, true},
		{0.05, 0.999, 0.011, 100000, false, true},
	} {
		g := &Generator{cfg: Config{TargetAlpha: tc.ta}.withDefaults()}
		want := tc.inSet
		if tc.formula {
			if f := bernsteinLower(tc.p, tc.v, tc.n, tc.ta) >= 0.95 && tc.v <= 0.01; f != tc.inSet {
				t.Fatalf("case %+v: the formula says %v; fix the table", tc, f)
			}
		}
		if got := g.inSet(tc.p, tc.v, tc.n); got != want {
			t.Errorf("TargetAlpha %v: inSet(p %v, var %v, n %d) = %v, want %v", tc.ta, tc.p, tc.v, tc.n, got, want)
		}
	}
	// The two levels of the first TargetAlpha case differ as the comment says.
	if bernsteinLower(0.967, 0.005, 1000, 0.01) >= 0.95 || bernsteinLower(0.967, 0.005, 1000, 0.05) < 0.95 {
		t.Fatal("table comment is wrong")
	}
}

// probsOf lays out S draws of a two-class predictive with p(target = 1) = p1[s] as the S x C
// matrix of objectiveEval.Probs.
func probsOf(p1 ...float64) []float64 {
	out := make([]float64, 0, 2*len(p1))
	for _, p := range p1 {
		out = append(out, 1-p, p)
	}
	return out
}

// TestGateMargins: the minibatch pre-test before the confirmation ensemble is consulted asks the
// minibatch mean to put the target first and, for PSCE, to be within 0.05 of 1 - delta, for
// Schut within 0.05 of Confidence (generate.go, gate). Means 0.01 either side of each edge.
func TestGateMargins(t *testing.T) {
	for _, tc := range []struct {
		method Method
		p1     float64 // every draw's p(target)
		want   bool
	}{
		{MethodPSCE, 0.91, true}, // 1 - 0.05 - 0.05 = 0.90
		{MethodPSCE, 0.89, false},
		{MethodSchut, 0.91, true}, // 0.95 - 0.05
		{MethodSchut, 0.89, false},
		{MethodWachter, 0.51, true}, // target first suffices
		{MethodWachter, 0.45, false},
		{MethodROAR, 0.45, false},
	} {
		g := &Generator{cfg: Config{Method: tc.method}.withDefaults()}
		if got := g.gate(probsOf(tc.p1, tc.p1, tc.p1, tc.p1), 2, 1); got != tc.want {
			t.Errorf("%s: gate at minibatch mean %v = %v, want %v", tc.method, tc.p1, got, tc.want)
		}
	}
}

// TestMeetsAtItsEdges: the methods' rules on a confirmation estimate at their thresholds: Schut
// stops at p(y'|x') >= Confidence (the paper's "confidence >= 0.95"), equality included; the
// baselines need only y' first; PSCE needs the <delta, epsilon>-set.
func TestMeetsAtItsEdges(t *testing.T) {
	for _, tc := range []struct {
		method Method
		p1, v  float64
		want   bool
	}{
		{MethodSchut, 0.95, 0, true},
		{MethodSchut, 0.9499, 0, false},
		{MethodWachter, 0.51, 0.2, true},
		{MethodBayesCF, 0.49, 0, false},
		{MethodPSCE, 0.96, 0.009, true},
		{MethodPSCE, 0.96, 0.011, false},
		{MethodPSCE, 0.94, 0, false},
	} {
		g := &Generator{cfg: Config{Method: tc.method}.withDefaults()}
		e := estimate{mean: []float64{1 - tc.p1, tc.p1}, vr: []float64{tc.v, tc.v}, samples: 500}
		if got := g.meets(e, 1); got != tc.want {
			t.Errorf("%s: meets(p1 %v, var %v) = %v, want %v", tc.method, tc.p1, tc.v, got, tc.want)
		}
	}
}

// twoClassGenerator is a generator for a point-mass two-class linear model whose predictive at
// every x is (1 - p1, p1), with its ensembles drawn.
func twoClassGenerator(t *testing.T, p1 float64, cfg Config) *Generator {
	t.Helper()
	m := linearModel(t, [][]float64{{0, 0}, {0, 0}}, []float64{0, math.Log(p1 / (1 - p1))}, 1e-9)
	cfg.WithoutVAE = true
	g := NewGenerator(m, nil, cfg)
	if g.err != nil {
		t.Fatal(g.err)
	}
	if err := g.ensembles(); err != nil {
		t.Fatal(err)
	}
	return g
}

// TestStopEstimateMoments: the paper's stopping rule (StopEstimate) applies the method's rule to
// the minibatch's own moments, the mean (1/S) sum_s p_s and the unbiased variance
// 1/(S-1) sum_s (p_s - mean)^2 over its S draws, and, with TargetAlpha, S draws as the sample
// size of the Bernstein bound. The minibatches are made by hand; a non-nil Result means "stop".
func TestStopEstimateMoments(t *testing.T) {
	ctx := context.Background()
	z := []float64{0.3, -0.2}
	for _, tc := range []struct {
		name  string
		cfg   Config
		final float64 // p(target) of the final ensemble; 0: 0.99
		p1    []float64
		stop  bool
	}{
		{"in the set", Config{}, 0, []float64{0.97, 0.97, 0.97, 0.97}, true},
		// mean 0.94 < 0.95 (a 1/(S-1) mean would be 1.25).
		{"mean below 1 - delta", Config{}, 0, []float64{0.94, 0.94, 0.94, 0.94}, false},
		// mean 0.97; unbiased variance 4 (0.03^2) / 3 = 0.0012 > 0.001 >= 0.0009, the 1/S one.
		{"unbiased variance above epsilon", Config{Epsilon: 0.001}, 0, []float64{1, 0.94, 1, 0.94}, false},
		{"variance below epsilon", Config{Epsilon: 0.0013}, 0, []float64{1, 0.94, 1, 0.94}, true},
		// Var 0, p 0.97 from S = 32 draws, TargetAlpha 0.05: lower 0.97 - 7 ln 40 / 93 = 0.692 < 0.7;
		// from 64 draws (S x C) it would be 0.833. (32 draws can reach the set: p = 1 gives 0.722.)
		{"bernstein over S draws", Config{Delta: 0.3, TargetAlpha: 0.05}, 0, repeat(0.97, 32), false},
		// The minibatch is in the set, the final ensemble says class 0: the iterate is handed
		// back, invalid, with the reason.
		{"invalid under the final ensemble", Config{}, 0.3, []float64{0.97, 0.97, 0.97, 0.97}, true},
		{"bernstein over S draws, looser delta", Config{Delta: 0.3, TargetAlpha: 0.05}, 0, repeat(0.99, 32), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.Stop = StopEstimate
			final := tc.final
			if final == 0 {
				final = 0.99
			}
			g := twoClassGenerator(t, final, cfg)
			if tc.cfg.TargetAlpha > 0 {
				lo := bernsteinLower(tc.p1[0], 0, len(tc.p1), tc.cfg.TargetAlpha)
				if (lo >= 1-tc.cfg.Delta) != tc.stop || bernsteinLower(tc.p1[0], 0, 2*len(tc.p1), tc.cfg.TargetAlpha) < 1-tc.cfg.Delta {
					t.Fatalf("lower bound %v: fix the table", lo)
				}
			}
			s := &search{g: g, o: &objective{C: 2}, target: 1, ev: objectiveEval{Probs: probsOf(tc.p1...)}}
			r, err := s.done(ctx, z, z, 3)
			if err != nil {
				t.Fatal(err)
			}
			if (r != nil) != tc.stop {
				t.Fatalf("stopped %v, want %v", r != nil, tc.stop)
			}
			if r == nil {
				return
			}
			if r.Iterations != 3 || r.Valid != (final > 0.5) {
				t.Errorf("result %+v", r)
			}
			want := ""
			if !r.Valid {
				want = fmt.Sprintf("the optimiser's %d draws met the rule; the final 1000 draws put class 1 below another", len(tc.p1))
			}
			if !strings.HasPrefix(r.Reason, want) || (want == "") != (r.Reason == "") {
				t.Errorf("reason %q, want %q", r.Reason, want)
			}
		})
	}
}

func repeat(v float64, n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = v
	}
	return out
}

// TestConfirmationRules: under StopConfirmed an iterate whose minibatch passes the gate is
// accepted only if the confirmation ensemble meets the method's rule and then the final ensemble
// does too (meetsResult: valid; for PSCE in the set; for Schut p1 >= Confidence). A failed
// confirmation skips the next 5 confirmations, a failed final estimate the next 10 (the
// cooldown): during a cooldown done consults no ensemble, which a cancelled context makes
// visible (consulting one would return its error). The ensembles here come from point-mass
// models with a constant predictive, so each rule's verdict is known in advance.
func TestConfirmationRules(t *testing.T) {
	for _, tc := range []struct {
		name           string
		method         Method
		check, final   float64 // p(target) of the confirmation and the final ensemble
		accept         bool
		cooldownLength int
	}{
		{"psce final in set", MethodPSCE, 0.99, 0.99, true, 0},
		{"psce final valid, not in set", MethodPSCE, 0.99, 0.9, false, 10},
		{"psce check not in set", MethodPSCE, 0.9, 0.99, false, 5},
		{"schut final below confidence", MethodSchut, 0.99, 0.9, false, 10},
		{"schut check below confidence", MethodSchut, 0.9, 0.99, false, 5},
		{"wachter final invalid", MethodWachter, 0.99, 0.3, false, 10},
		{"wachter check invalid", MethodWachter, 0.3, 0.99, false, 5},
		{"wachter final valid", MethodWachter, 0.6, 0.6, true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{Method: tc.method, CheckSamples: 20, FinalSamples: 30}
			g := twoClassGenerator(t, tc.check, cfg)
			g.finalPool = twoClassGenerator(t, tc.final, cfg).finalPool
			s := &search{g: g, o: &objective{C: 2}, target: 1, ev: objectiveEval{Probs: probsOf(0.99, 0.99)}}
			z := []float64{0.1, 0.2}
			r, err := s.done(context.Background(), z, z, 7)
			if err != nil {
				t.Fatal(err)
			}
			if (r != nil) != tc.accept {
				t.Fatalf("accepted %v (%+v), want %v", r != nil, r, tc.accept)
			}
			if tc.accept {
				if math.Abs(r.P1-tc.final) > 1e-6 || r.Iterations != 7 || r.Samples != 30 {
					t.Errorf("result %+v, want the final ensemble's p1 %v", r, tc.final)
				}
				return
			}
			cancelled, cancel := context.WithCancel(context.Background())
			cancel()
			for i := 0; i < tc.cooldownLength; i++ {
				if r, err := s.done(cancelled, z, z, 8+i); r != nil || err != nil {
					t.Fatalf("iteration %d of the cooldown: (%v, %v), want no confirmation", i+1, r, err)
				}
			}
			if _, err := s.done(cancelled, z, z, 8+tc.cooldownLength); !errors.Is(err, context.Canceled) {
				t.Fatalf("after %d skipped iterations: %v, want the confirmation (and its context error)", tc.cooldownLength, err)
			}
		})
	}
}

// TestSeedsAreIndependentStreams: the optimiser's networks, the confirmation ensemble and the
// final ensemble are three different random streams (splitmix64 of seed ^ tag), so that the
// confirmation is "disjoint from the pool" and the final ensemble measures with draws of its own.
func TestSeedsAreIndependentStreams(t *testing.T) {
	for _, seed := range []uint64{0, 1, 42} {
		g := twoClassGenerator(t, 0.7, Config{Seed: seed})
		pool := seedFor(seed, tagPool)
		if c, f := g.checkPool.Seed(), g.finalPool.Seed(); c == f || c == pool || f == pool || c == seed || f == seed {
			t.Errorf("seed %d: pool %x, check %x, final %x: the streams coincide", seed, pool, c, f)
		}
	}
}

// TestAdamStepAndDistance: the gradient search is Adam with learning rate Config.LR from x' = x.
// Adam's first step is lr g / (|g| + 1e-8) per coordinate, i.e. lr towards the target: with
// L_clf on a point-mass logistic model, g = -(1 - p1) (w_1 - w_0), so z_1 = z_0 + lr sign(w_1 -
// w_0). The Result's Distance is ||z_1 - z_0||_2 in standardised units, lr sqrt(D).
func TestAdamStepAndDistance(t *testing.T) {
	w := [][]float64{{0.5, -1, 0.2}, {-0.5, 1, 0.7}}
	b := []float64{6, 0}
	m := linearModel(t, w, b, 1e-9)
	z0 := []float64{0.4, -0.3, 1.1}
	for _, lr := range []float64{0, 0.05} { // 0: the default, 0.1
		g := NewGenerator(m, nil, Config{Method: MethodWachter, LR: lr, MaxIter: 1, Weights: &Weights{Class: 1}})
		r, ok := generate(t, g, rawOf(m, z0), 1)
		if ok || r.Iterations != 1 {
			t.Fatalf("lr %v: %+v, want the cap after one step", lr, r)
		}
		step := lr
		if lr == 0 {
			step = 0.1
		}
		z1 := stdOf(m, r.XCF)
		for j := range z1 {
			want := z0[j] + step*math.Copysign(1, w[1][j]-w[0][j])
			if math.Abs(z1[j]-want) > 1e-6*step {
				t.Errorf("lr %v: z_1[%d] = %v, want %v", lr, j, z1[j], want)
			}
		}
		if want := step * math.Sqrt(3); math.Abs(r.Distance-want) > 1e-6 {
			t.Errorf("lr %v: distance %v, want ||z_1 - z_0|| = %v", lr, r.Distance, want)
		}
	}
}

// TestAnchorsAreTheQuery: the proximity terms are anchored at the query: L_prox at z_0 = x
// itself, L_ldist at mu_enc(x). With either as the only term, x is the minimum and its gradient
// is 0 (to rounding in the VAE's encoder), so Adam's first step, lr g / (|g| + 1e-8), stays
// within 1e-6 of x, where an anchor elsewhere would move every coordinate by lr (0.1).
func TestAnchorsAreTheQuery(t *testing.T) {
	m := linearModel(t, [][]float64{{0.5, -1, 0.2}, {-0.5, 1, 0.7}}, []float64{6, 0}, 1e-9)
	v := testVAE(t, m, 2, 3)
	x := rawOf(m, []float64{0.4, -0.3, 1.1})
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"prox", Config{Method: MethodWachter, Weights: &Weights{Prox: 1}}},
		{"prox_l1", Config{Method: MethodROAR, Weights: &Weights{ProxL1: 1}}},
		{"latent", Config{Method: MethodPSCE, Weights: &Weights{Latent: 1}}},
	} {
		cfg := tc.cfg
		cfg.MaxIter = 1
		r, ok := generate(t, NewGenerator(m, v, cfg), x, 1)
		if ok || r.Iterations != 1 || r.Distance > 1e-6 {
			t.Errorf("%s: moved to distance %v in %d iterations; the anchor is not the query", tc.name, r.Distance, r.Iterations)
		}
	}
}

// TestROARShiftUsesDeltaMax: Config.DeltaMax is ROAR's bound on the local model's weight shift:
// the worst-case logit is lowered by DeltaMax (||x'||_1 + 1). With DeltaMax 50, far above the
// model's |w_1 - w_0| <= 1, softplus is linear there and d L_roar / d z_j = 50 sign(z_j) - (w_1 -
// w_0)_j has the sign of z_j, so Adam's first step moves every coordinate lr towards 0 (with the
// default 0.1 it would follow w_1 - w_0, against z's sign in coordinate 0).
func TestROARShiftUsesDeltaMax(t *testing.T) {
	w := [][]float64{{-0.5, -1, 0.2}, {0.5, 1, -0.3}}
	m := linearModel(t, w, []float64{6, 0}, 1e-9)
	z0 := []float64{1.2, -0.3, 0.8}
	g := NewGenerator(m, nil, Config{Method: MethodROAR, DeltaMax: 50, LR: 0.05, MaxIter: 1, Weights: &Weights{Robust: 1}})
	r, _ := generate(t, g, rawOf(m, z0), 1)
	z1 := stdOf(m, r.XCF)
	for j := range z1 {
		if want := z0[j] - 0.05*math.Copysign(1, z0[j]); math.Abs(z1[j]-want) > 1e-6 {
			t.Errorf("z_1[%d] = %v, want %v", j, z1[j], want)
		}
	}
}

// TestSchutGreedy follows Schut et al.'s greedy search on a point-mass logistic model, where
// |d E[log p(1|z)] / dz_j| = (1 - p1) |w_j| ranks the features by |w_j| (w = w_1 - w_0): each
// move takes the feature with the largest |gradient| among those changed fewer than MaxChanges
// times and moves it by exactly MoveSize towards the target (sign of w_j); the search stops when
// every feature is spent.
func TestSchutGreedy(t *testing.T) {
	w := []float64{0.5, -3, 1.5, -0.2}
	m := linearModel(t, [][]float64{{0, 0, 0, 0}, w}, []float64{0, -8}, 1e-9)
	z0 := []float64{0, 0, 0, 0}
	const move = 0.25
	// Order of the moves: feature 1, 1, 2, 2, 0, 0, 3, 3 (MaxChanges 2).
	for _, tc := range []struct {
		maxIter int
		delta   []float64 // z - z_0
		reason  string
	}{
		{1, []float64{0, -move, 0, 0}, "iteration cap 1"},
		{3, []float64{0, -2 * move, move, 0}, "iteration cap 3"},
		{7, []float64{2 * move, -2 * move, 2 * move, -move}, "iteration cap 7"},
		{100, []float64{2 * move, -2 * move, 2 * move, -2 * move}, "every feature was changed 2 times"},
	} {
		g := NewGenerator(m, nil, Config{Method: MethodSchut, MoveSize: move, MaxChanges: 2, MaxIter: tc.maxIter})
		r, ok := generate(t, g, rawOf(m, z0), 1)
		z := stdOf(m, r.XCF)
		for j := range z {
			if math.Abs(z[j]-z0[j]-tc.delta[j]) > 1e-9 {
				t.Errorf("max_iter %d: z - z0 = %v, want %v", tc.maxIter, sub(z, z0), tc.delta)
				break
			}
		}
		// logit -8 + 0.25 * 2 * (0.5 + 3 + 1.5 + 0.2) = -5.4: never valid.
		if ok || !strings.Contains(r.Reason, tc.reason) || r.Iterations != min(tc.maxIter, 8) {
			t.Errorf("max_iter %d: %d iterations, reason %q; want %q", tc.maxIter, r.Iterations, r.Reason, tc.reason)
		}
	}
}

func sub(a, b []float64) []float64 {
	d := make([]float64, len(a))
	for i := range a {
		d[i] = a[i] - b[i]
	}
	return d
}

// TestSchutStopsAtConfidence: Schut's rule is p(y'|x') >= Confidence, not merely y' first, under
// either stopping rule. One feature dominates (w = 4 against 0.1), so move k sets the logit to
// -3.1 + 4 (0.25 k): the class flips at k = 4 (logit 0.9) and p1 >= 0.9 first holds at k = 6
// (logit 2.9 >= ln 9 = 2.197; k = 5 gives 1.9). The paper's rule (StopEstimate) stops there.
// The default rule (StopConfirmed) checks move 5 (p1 = sigmoid(1.9) = 0.870 passes the minibatch
// gate, whose margin admits it), its confirmation ensemble refuses it (0.870 < 0.9), the next 5
// moves go unchecked, and it stops at move 11 (logit 7.9), five moves past the first that meets
// the rule: the cost of not confirming at every iteration, as the Stop documentation says.
func TestSchutStopsAtConfidence(t *testing.T) {
	w := []float64{4, 0.1, 0.1}
	m := linearModel(t, [][]float64{{0, 0, 0}, w}, []float64{0, -3.1}, 1e-9)
	for _, tc := range []struct {
		stop  Stop
		moves int
		logit float64
	}{{StopEstimate, 6, 2.9}, {StopConfirmed, 11, 7.9}} {
		g := NewGenerator(m, nil, Config{Method: MethodSchut, MoveSize: 0.25, MaxChanges: 20, Confidence: 0.9, Stop: tc.stop})
		r, ok := generate(t, g, rawOf(m, []float64{0, 0, 0}), 1)
		if !ok || r.Iterations != tc.moves {
			t.Fatalf("%s: stopped after %d moves (valid %v, p1 %v), want %d", tc.stop, r.Iterations, ok, r.P1, tc.moves)
		}
		if want := 1 / (1 + math.Exp(-tc.logit)); math.Abs(r.P1-want) > 1e-6 {
			t.Errorf("%s: p1 %v, want %v", tc.stop, r.P1, want)
		}
	}
}

// TestStopEstimateNeedsTheTarget: for the baselines the rule is that the target comes first; the
// paper's stopping rule does not stop before it does (here the model is a point mass, so the
// minibatch and the final ensemble agree, and the stop is a valid counterfactual).
func TestStopEstimateNeedsTheTarget(t *testing.T) {
	m := linearModel(t, [][]float64{{0, 0}, {1, 1}}, []float64{0, -2}, 1e-9)
	for _, method := range []Method{MethodWachter, MethodBayesCF, MethodROAR} {
		g := NewGenerator(m, nil, Config{Method: method, Stop: StopEstimate})
		r, ok := generate(t, g, rawOf(m, []float64{0, 0}), 1)
		if !ok || r.Iterations < 2 || r.P1 <= 0.5 {
			t.Errorf("%s: stopped after %d iterations with p1 %v (valid %v)", method, r.Iterations, r.P1, ok)
		}
	}
}

// TestMulticlassTargetAndValidity: with three classes, target -1 is the most probable class
// other than x's, and validity is the target being the argmax of the final estimate, which with
// three classes happens below p = 1/2. Here x has p = softmax(2, 0, 1) = (0.665, 0.090, 0.245),
// so target -1 is class 2. Towards class 2 with Wachter (L_clf only), logits (2 - a, 1, a) for
// a = (z_0 + z_1) / 2 growing by lr per step: class 2 comes first at a just above 1, where
// p(2) ~ e^1.1 / (e^0.9 + e^1 + e^1.1) = 0.37, and Wachter stops there with a valid result.
func TestMulticlassTargetAndValidity(t *testing.T) {
	m := linearModel(t, [][]float64{{0, 0}, {0, 0}, {0, 0}}, []float64{2, 0, 1}, 1e-9)
	if p := softmaxAt([][]float64{{0, 0}, {0, 0}, {0, 0}}, []float64{2, 0, 1}, []float64{0, 0}); !(p[2] > p[1]) {
		t.Fatal("fixture")
	}
	r, _ := generate(t, NewGenerator(m, nil, Config{Method: MethodWachter, MaxIter: 1}), rawOf(m, []float64{0, 0}), -1)
	if r.Target != 2 || r.Original != 0 {
		t.Errorf("target -1: original %d target %d, want 0 and 2", r.Original, r.Target)
	}

	w := [][]float64{{-0.5, -0.5}, {0, 0}, {0.5, 0.5}}
	b := []float64{2, 1, 0}
	m = linearModel(t, w, b, 1e-9)
	r, ok := generate(t, NewGenerator(m, nil, Config{Method: MethodWachter, Weights: &Weights{Class: 1}}), rawOf(m, []float64{0, 0}), 2)
	if !ok || !r.Valid || r.Target != 2 || r.Confirmed || r.InSet {
		t.Fatalf("%+v (ok %v), want a valid result, not confirmed, not in the set", r, ok)
	}
	p := softmaxAt(w, b, stdOf(m, r.XCF))
	if !(p[2] > p[0] && p[2] > p[1] && p[2] < 0.5) || math.Abs(r.P1-p[2]) > 1e-6 {
		t.Errorf("p1 %v, softmax at x' %v: want class 2 first below 1/2", r.P1, p)
	}
}

// TestObjectiveHingesInactive: L_delta = max(1 - delta - E[p], 0) and L_var = max(Var[p] -
// epsilon, 0) vanish, with their gradients, inside the set: with 1 - delta below E[p] and
// epsilon above Var[p] (both from the reference computation, netProbs), the two terms, the total
// of their weighted sum and its gradient are exactly 0.
func TestObjectiveHingesInactive(t *testing.T) {
	m := testModel(t, 5, []int{7}, 2, 11)
	const S = 6
	o, err := newObjective(m, nil, S)
	if err != nil {
		t.Fatal(err)
	}
	defer o.close()
	nets := sampleNets(m, S, 12)
	if err := o.setNets(nets); err != nil {
		t.Fatal(err)
	}
	z := randVec(rand.New(rand.NewPCG(13, 13)), 5)
	ps := make([]float64, S)
	mean := 0.0
	for s, n := range nets {
		ps[s] = netProbs(m.Activation, n, z)[1]
		mean += ps[s] / S
	}
	vr := 0.0
	for _, p := range ps {
		vr += (p - mean) * (p - mean) / (S - 1)
	}
	if vr == 0 {
		t.Fatal("fixture: no spread")
	}
	delta, epsilon := 1-mean+0.01, vr+0.01
	if err := o.setProblem(1, z, nil, Weights{Delta: 1, Var: 1}, delta, epsilon); err != nil {
		t.Fatal(err)
	}
	var ev objectiveEval
	if err := o.eval(z, &ev); err != nil {
		t.Fatal(err)
	}
	if ev.Terms[termDelta] != 0 || ev.Terms[termVar] != 0 || ev.Total != 0 {
		t.Errorf("inside the set: L_delta %v, L_var %v, total %v; want 0", ev.Terms[termDelta], ev.Terms[termVar], ev.Total)
	}
	for j, gj := range ev.Grad {
		if gj != 0 {
			t.Errorf("gradient[%d] = %v, want 0", j, gj)
		}
	}
}

// TestNewDenseInit: layers start as torch.nn.Linear's, W and b ~ U(-1/sqrt(In), 1/sqrt(In)).
func TestNewDenseInit(t *testing.T) {
	l := newDense(16, 200, rand.New(rand.NewPCG(1, 1)))
	hi := 0.0
	for _, v := range append(append([]float64(nil), l.W...), l.B...) {
		hi = math.Max(hi, math.Abs(v))
	}
	if hi > 0.25 || hi < 0.24 {
		t.Errorf("max |w| %v, want just below 1/sqrt(16) = 0.25", hi)
	}
}

// TestAEArchitecture: the IM1 autoencoder is the paper's D -> Hidden (ReLU) -> Latent (ReLU) ->
// Hidden (ReLU) -> D (linear), written out here for a hand-made AE whose pre-activations are
// negative at every ReLU for some input.
func TestAEArchitecture(t *testing.T) {
	rng := rand.New(rand.NewPCG(2, 2))
	a := &AE{Inputs: 3, Hidden: 4, Latent: 2}
	a.enc1, a.enc2, a.dec1, a.out = newDense(3, 4, rng), newDense(4, 2, rng), newDense(2, 4, rng), newDense(4, 3, rng)
	layer := func(l dense, x []float64, relu bool) []float64 {
		y := make([]float64, l.Out)
		for o := range y {
			y[o] = l.B[o]
			for i := range x {
				y[o] += l.W[o*l.In+i] * x[i]
			}
			if relu {
				y[o] = math.Max(y[o], 0)
			}
		}
		return y
	}
	negLatent := 0
	for trial := 0; trial < 20; trial++ {
		z := randVec(rng, 3)
		pre := layer(a.enc2, layer(a.enc1, z, true), false)
		for _, u := range pre {
			if u < 0 {
				negLatent++
			}
		}
		want := layer(a.out, layer(a.dec1, layer(a.enc2, layer(a.enc1, z, true), true), true), false)
		got := a.Reconstruct(z)
		e := 0.0
		for j := range z {
			if math.Abs(got[j]-want[j]) > 1e-12 {
				t.Fatalf("trial %d: AE(z) = %v, want %v", trial, got, want)
			}
			e += (z[j] - want[j]) * (z[j] - want[j])
		}
		if math.Abs(a.Error(z)-e) > 1e-12 {
			t.Fatalf("Error %v, want %v", a.Error(z), e)
		}
	}
	if negLatent == 0 {
		t.Fatal("no negative latent pre-activation; the test does not exercise the latent ReLU")
	}
}

// TestTrainAELossIsTheMeanPerRowError: TrainAE reports the last epoch's mean minibatch loss, the
// mean over rows of ||z - AE(z)||^2. With a learning rate too small to move the weights (1e-15),
// one epoch over 12 rows in minibatches of 4 reports (1/12) sum_i ||z_i - AE(z_i)||^2 of the
// returned AE.
func TestTrainAELossIsTheMeanPerRowError(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 3))
	Z := make([][]float64, 12)
	for i := range Z {
		Z[i] = randVec(rng, 3)
	}
	a, loss, err := TrainAE(context.Background(), Z, TrainConfig{Hidden: 5, Latent: 2, Epochs: 1, BatchSize: 4, LR: 1e-15, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	want := 0.0
	for _, z := range Z {
		want += a.Error(z) / float64(len(Z))
	}
	if math.Abs(loss-want) > 1e-9*want {
		t.Errorf("loss %v, want the mean per-row error %v", loss, want)
	}
}

// TestSchutFollowsTheExpectedLogLikelihood: Schut's greedy move is on the gradient of
// E_w[log p(y'|x',w)] (the mean over the sampled networks of each one's log-probability), not of
// log E_w[p]. The two differ when the networks disagree: here p_s = sigmoid(-6 + w_A z_A +
// w_B,s z_B) with w_A = 1 for every network and w_B ~ N(0, 1), at z_B = 3, z_A = 0. Per
// network d log p_s / dz = (1 - p_s) (w_A, w_B,s), so the expected log-likelihood's gradient is
// (E[1 - p], E[(1 - p) w_B]); the posterior expectations, by quadrature over w_B below, are about
// (0.96, -0.08), and A is moved first (32 draws estimate them to about +-0.18). log E[p] weighs
// each network by p_s, so the few with a large w_B, whose p_s is not small, decide it: its
// gradient's B component is larger than its A component (0.87 against 0.59), and it would move
// B first.
func TestSchutFollowsTheExpectedLogLikelihood(t *testing.T) {
	m := linearModel(t, [][]float64{{0, 0}, {1, 0}}, []float64{0, -6}, 1e-9)
	m.Layers[0].WeightLogSigma[1*2+1] = 0 // w_B of class 1 ~ N(0, 1)
	// The posterior expectations by quadrature (trapezoid on [-8, 8], step 1e-3).
	var ea, eb, pa, pb, ep float64
	for wb := -8.0; wb <= 8; wb += 1e-3 {
		dens := math.Exp(-wb*wb/2) / math.Sqrt(2*math.Pi) * 1e-3
		p := 1 / (1 + math.Exp(6-3*wb))
		ea += (1 - p) * dens
		eb += (1 - p) * wb * dens
		pa += p * (1 - p) * dens
		pb += p * (1 - p) * wb * dens
		ep += p * dens
	}
	if !(ea > 0.9 && math.Abs(eb) < 0.1) || !(math.Abs(pb/ep) > math.Abs(pa/ep)+0.2) {
		t.Fatalf("fixture: E log p gradient (%v, %v), log E p gradient (%v, %v)", ea, eb, pa/ep, pb/ep)
	}
	for _, seed := range []uint64{1, 2, 3} {
		g := NewGenerator(m, nil, Config{Method: MethodSchut, MoveSize: 0.5, MaxIter: 1, Seed: seed})
		r, _ := generate(t, g, rawOf(m, []float64{0, 3}), 1)
		if z := stdOf(m, r.XCF); math.Abs(z[0]-0.5) > 1e-9 || math.Abs(z[1]-3) > 1e-9 {
			t.Errorf("seed %d: first move to %v, want feature A by +0.5: (0.5, 3)", seed, z)
		}
	}
}

// TestTrainVAEReportsTheFullNegativeELBO: VAEStats.Loss is the last epoch's mean of -ELBO per
// row, the normalising constant (D/2) log(2 pi ObsVar) included (the training graph omits it).
// With a learning rate too small to move the weights (1e-15) and one epoch over 2048 rows, it is
// the mean over rows of a one-draw -ELBO, which the mean of -ELBO(z, 20 draws) (VAE.ELBO, from
// ELBOWith) estimates to well within 0.3; the constant is 3.68 here.
func TestTrainVAEReportsTheFullNegativeELBO(t *testing.T) {
	m, _, _ := blobFixture(t)
	set := blobs(2048, 4, 9)
	v, st, err := TrainVAE(context.Background(), m, set.X, TrainConfig{Seed: 2, Epochs: 1, Hidden: 8, Latent: 2, LR: 1e-15})
	if err != nil {
		t.Fatal(err)
	}
	Z, _ := standardize(m, set.X)
	rng := rand.New(rand.NewPCG(7, 7))
	want := 0.0
	for _, z := range Z {
		want -= v.ELBO(z, 20, rng) / float64(len(Z))
	}
	if math.Abs(st.Loss-want) > 0.3 {
		t.Errorf("reported loss %v, want the mean -ELBO %v (the constant is %v)", st.Loss, want, 2*math.Log(2*math.Pi))
	}
}
