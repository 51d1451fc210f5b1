package update

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

// TestConvergedStatsAreTheObjective: the converged solver's Stats report J and its data term at
// the previous posterior and at the new one. Without forgetting the KL target is the previous
// posterior itself, so
//
//	LossStart = NLLStart (KL(q_prev || q_prev) = 0),   NLLStart > 0 (an expected NLL),
//	LossEnd   = NLLEnd + KLWeight / n * KL(q_new || q_prev) = NLLEnd + KLWeight / n * Stats.KL,
//
// and J does not increase from the start (L-BFGS only accepts descent steps).
func TestConvergedStatsAreTheObjective(t *testing.T) {
	m, test := trained(t)
	for _, tc := range []struct {
		name string
		rows int
		beta float64
	}{{"default weight", 12, 0}, {"beta 8", 5, 8}} {
		t.Run(tc.name, func(t *testing.T) {
			X, y := test.X[:tc.rows], test.Y[:tc.rows]
			cfg := Config{Objective: ObjectiveVCL, Solver: SolverConverge, Seed: 3, KLWeight: tc.beta}
			_, st, err := LastLayer(context.Background(), m, X, y, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if !(st.NLLStart > 0) || math.Abs(st.LossStart-st.NLLStart) > 1e-12*st.NLLStart {
				t.Errorf("at the previous posterior: loss %.12g, NLL %.12g; want equal and > 0", st.LossStart, st.NLLStart)
			}
			want := st.NLLEnd + cfg.withDefaults().KLWeight/float64(tc.rows)*st.KL
			if math.Abs(st.LossEnd-want) > 1e-9*want {
				t.Errorf("at the new posterior: loss %.12g, want NLL + KLWeight / n * KL = %.12g", st.LossEnd, want)
			}
			if !(st.LossEnd <= st.LossStart) {
				t.Errorf("J rose from %.12g to %.12g", st.LossStart, st.LossEnd)
			}
		})
	}
}

// TestConvergedDependsOnItsSeed: the converged objective averages over body draws seeded by
// Config.Seed (common random numbers), so the update is a function of the seed: equal seeds give
// bit-identical posteriors and different seeds, other body draws and so other posteriors (the
// trained model's body has non-zero sigmas).
func TestConvergedDependsOnItsSeed(t *testing.T) {
	m, test := trained(t)
	X, y := test.X[:10], test.Y[:10]
	run := func(seed uint64) *bnn.Model {
		out, _, err := LastLayer(context.Background(), m, X, y, Config{Objective: ObjectiveVCL, Solver: SolverConverge, Seed: seed})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	a, again, other := run(1), run(1), run(2)
	if !reflect.DeepEqual(a, again) {
		t.Error("seed 1 twice: posteriors differ")
	}
	amu, _ := lastLayerParams(a)
	omu, _ := lastLayerParams(other)
	if bnn.BitsEqual(amu, omu) {
		t.Error("seeds 1 and 2: identical last-layer means, want the body draws to differ")
	}
}

// TestConvergedCancelled: a context cancelled before or during the converged solver's search
// (ctx is checked at every L-BFGS iteration) ends the update with ctx's error, not a refusal
// (ErrRefused is for a result that is unusable), returns no model and leaves prev untouched.
func TestConvergedCancelled(t *testing.T) {
	m, test := trained(t)
	prev := m.Clone()
	snapshot := prev.Clone()
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
	}{
		{"before", cancelled},
		{"after two checks", &countdown{Context: context.Background(), n: 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A tolerance no search meets, so that the search is still running when ctx ends it.
			cfg := Config{Objective: ObjectiveVCL, Solver: SolverConverge, Seed: 3, Tolerance: 1e-300}
			next, _, err := LastLayer(tc.ctx, prev, test.X[:20], test.Y[:20], cfg)
			if !errors.Is(err, context.Canceled) || errors.Is(err, ErrRefused) {
				t.Errorf("error %v, want context.Canceled and not ErrRefused", err)
			}
			if next != nil {
				t.Error("a model was returned with an error")
			}
			if !reflect.DeepEqual(prev, snapshot) {
				t.Error("prev modified")
			}
		})
	}
}

// TestConvergedThreeClassesIsShiftInvariant: softmax is invariant to adding a constant to every
// logit, so adding K to every class's bias mean leaves the expected NLL and its gradient in the
// weights unchanged. With |K| = 1000 the logits' exponentials overflow (K > 0) or underflow to 0
// (K < 0) unless the largest logit is taken out first:
//
//	log sum_c e^{z_c} = z_max + log sum_c e^{z_c - z_max}.
func TestConvergedThreeClassesIsShiftInvariant(t *testing.T) {
	_, prev, z, y := randomProblem([]int{5, 4}, 3, 7)
	cfg := Config{Objective: ObjectivePrior, Solver: SolverConverge, Draws: 2, Seed: 5}.withDefaults()
	rng := rand.New(rand.NewPCG(1, 2))
	l := prev.Last()
	x := make([]float64, 2*l.Out*(l.In+1))
	for i := range x {
		x[i] = 0.3 * rng.NormFloat64()
	}
	eval := func(m *bnn.Model) (float64, []float64) {
		c, err := newConverged(m, z, y, cfg)
		if err != nil {
			t.Fatal(err)
		}
		c.set(x)
		g := make([]float64, len(x))
		c.eval(g)
		return c.lastNLL, g
	}
	want, wg := eval(prev)
	for _, k := range []float64{1000, -1000} {
		shifted := prev.Clone()
		for c := range shifted.Last().BiasMu {
			shifted.Last().BiasMu[c] += k
		}
		got, gg := eval(shifted)
		if !(math.Abs(got-want) <= 1e-9*want) {
			t.Errorf("expected NLL with every bias mean %+g: %.12g, unshifted %.12g", k, got, want)
		}
		// The prior objective's KL term on the weights has the same target (0) in both, so
		// the weights' gradient is the data term's and must agree too.
		for j := range l.In * l.Out {
			if !(math.Abs(gg[j]-wg[j]) <= 1e-6*max(math.Abs(wg[j]), 1e-6)) {
				t.Errorf("bias means %+g, gradient coordinate %d: %.12g, unshifted %.12g", k, j, gg[j], wg[j])
				break
			}
		}
	}
}

// TestConvergedVerdictIsTheLargestMagnitude: minimize's verdict is max_i |g_i| < threshold, the
// gradient's largest coordinate in magnitude whatever its sign: with a threshold just below that
// magnitude the same search (same iterations) does not converge, and with one just above it
// converges. Three and four classes after one to four iterations give largest coordinates of
// both signs.
func TestConvergedVerdictIsTheLargestMagnitude(t *testing.T) {
	negative := 0
	for _, classes := range []int{3, 4} {
		for iters := 1; iters <= 4; iters++ {
			_, prev, z, y := randomProblem([]int{5, 4}, classes, 30)
			cfg := Config{Objective: ObjectiveVCL, Solver: SolverConverge, Draws: 3, Seed: 5, KLWeight: 1}.withDefaults()
			c, err := newConverged(prev, z, y, cfg)
			if err != nil {
				t.Fatal(err)
			}
			x, n, _, err := c.minimize(context.Background(), 1e-300, iters)
			if err != nil {
				t.Fatal(err)
			}
			g := make([]float64, len(x))
			c.set(x)
			c.eval(g)
			worst, signed := 0.0, 0.0
			for _, v := range g {
				if math.Abs(v) > worst {
					worst, signed = math.Abs(v), v
				}
			}
			if signed < 0 {
				negative++
			}
			threshold := 0.99 * worst
			_, again, ok, err := c.minimize(context.Background(), threshold, iters)
			if err != nil {
				t.Fatal(err)
			}
			if again != n {
				t.Errorf("%d classes, %d iterations: the search with threshold %.4g took %d iterations, not %d: it ended elsewhere and the verdict is not compared", classes, iters, threshold, again, n)
			} else if ok {
				t.Errorf("%d classes, %d iterations: converged with largest |gradient| %.4g (coordinate %.4g) above the threshold %.4g", classes, iters, worst, signed, threshold)
			}
			// Just above that magnitude the search converges (there, or sooner).
			if _, _, ok, err := c.minimize(context.Background(), 1.01*worst, iters); err != nil || !ok {
				t.Errorf("%d classes, %d iterations: not converged (%v) with largest |gradient| %.4g below the threshold %.4g", classes, iters, err, worst, 1.01*worst)
			}
		}
	}
	if negative == 0 {
		t.Error("no case has a negative largest coordinate")
	}
}

// TestConvergedRefusesANonFiniteObjective: a previous posterior whose last-layer bias mean is
// finite but so large that J overflows (tau~ (mu - mu~)^2 / 2 is +Inf: with forgetting mu~ is
// lambda tau mu / tau~ != mu, and the prior's target is 0) gives no usable update: it is refused
// with ErrRefused and bnn.ErrNonFinite, no model is returned and prev is untouched.
func TestConvergedRefusesANonFiniteObjective(t *testing.T) {
	m, test := trained(t)
	for _, objective := range []string{ObjectiveVCL, ObjectivePrior} {
		t.Run(objective, func(t *testing.T) {
			prev := m.Clone()
			prev.Last().BiasMu[0] = 1e200
			snapshot := prev.Clone()
			cfg := Config{Objective: objective, Solver: SolverConverge, Seed: 3, Memory: 100}
			next, _, err := LastLayer(context.Background(), prev, test.X[:10], test.Y[:10], cfg)
			if !errors.Is(err, ErrRefused) || !errors.Is(err, bnn.ErrNonFinite) {
				t.Errorf("error %v, want ErrRefused and bnn.ErrNonFinite", err)
			}
			if next != nil {
				t.Error("a model was returned")
			}
			if !reflect.DeepEqual(prev, snapshot) {
				t.Error("prev modified")
			}
		})
	}
}
