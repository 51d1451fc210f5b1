package stream

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/update"
)

// adamStepBound is c_t, the most one Adam iteration t = 1, 2, ... can move a parameter, in
// units of the learning rate, whatever the gradients. With m_t = (1-b1) sum_i b1^(t-i) g_i and
// v_t = (1-b2) sum_i b2^(t-i) g_i^2, Cauchy-Schwarz on b1^k g = (b1/sqrt(b2))^k (sqrt(b2)^k g)
// gives |m_t| <= (1-b1) sqrt(sum_{k<t} (b1^2/b2)^k) sqrt(v_t / (1-b2)), so the bias-corrected
// step lr |m_t/(1-b1^t)| / sqrt(v_t/(1-b2^t)) is at most lr c_t with
//
//	c_t = (1-b1)/(1-b1^t) * sqrt((1-b2^t)/(1-b2)) * sqrt(sum_{k<t} (b1^2/b2)^k)
//
// (c_1 = 1: the first step is lr sign(g)). Adam's epsilon only shrinks the step.
func adamStepBound(t int, b1, b2 float64) float64 {
	var s float64
	for k := range t {
		s += math.Pow(b1*b1/b2, float64(k))
	}
	return (1 - b1) / (1 - math.Pow(b1, float64(t))) * math.Sqrt((1-math.Pow(b2, float64(t)))/(1-b2)) * math.Sqrt(s)
}

// TestUpdateKLDoesNotGrowWithIncrementSize is why, under update.SolverAdam (update.solver: adam),
// increments may grow to MaxRecordsBacklog when the consumer is behind without a larger update
// KL. It runs that solver's update (update.LastLayer: a fixed number T of Adam iterations on
// minibatches of 64, learning rate lr) from one posterior on increments
// of 64 to 4096 records, and checks the update KL against a bound that holds for every
// increment size. Each parameter moves by at most D = lr * sum_{t<=T} c_t (adamStepBound), so
// with delta_j = log sigma_new,j - log sigma_old,j and |delta_j|, |mu_new,j - mu_old,j| <= D,
//
//	KL(q_new || q_old) = sum_j (e^(2 delta_j) - 1)/2 - delta_j + (mu_new,j - mu_old,j)^2 / (2 sigma_old,j^2)
//	                  <= P ((e^(2D) - 1)/2 - D) + sum_j D^2 / (2 sigma_old,j^2)
//
// over the P weight-and-bias pairs of the last layer ((e^(2x)-1)/2 - x is convex, zero at 0, and
// larger at D than at -D). The bound depends on lr, T and the old posterior, not on the
// increment: the data only choose the direction of each step. The test also checks the
// parameter moves themselves against D, and logs the KL and the update's time per size.
func TestUpdateKLDoesNotGrowWithIncrementSize(t *testing.T) {
	set, ds, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	prev, _, err := bnn.Fit(context.Background(), set, ds.Classes, bnn.TrainConfig{Seed: 1, Epochs: 5})
	if err != nil {
		t.Fatal(err)
	}
	cfg := update.Config{Objective: update.ObjectivePrior, Solver: update.SolverAdam, LR: update.DefaultLR, Seed: 7}
	steps := update.DefaultIterations
	const b1, b2 = 0.9, 0.999 // bnn.NewAdam's
	var D float64
	for i := 1; i <= steps; i++ {
		D += cfg.LR * adamStepBound(i, b1, b2)
	}
	last := prev.Last()
	var bound float64
	pairs := 0
	for _, ls := range [][]float64{last.WeightLogSigma, last.BiasLogSigma} {
		for _, l := range ls {
			bound += math.Expm1(2*D)/2 - D + D*D/(2*math.Exp(2*l))
			pairs++
		}
	}
	t.Logf("lr %g, %d iterations: every parameter moves at most D = %.3g; KL bound %.3g over %d pairs", cfg.LR, steps, D, bound, pairs)
	rng := rand.New(rand.NewPCG(3, 4))
	var kls []float64
	for _, n := range []int{64, 128, 256, 512, 1024, 2048, 4096} {
		X, y := make([][]float64, n), make([]int, n)
		for i := range X {
			r := rng.IntN(set.Len())
			X[i], y[i] = set.X[r], set.Y[r]
		}
		t0 := time.Now()
		next, _, err := update.LastLayer(context.Background(), prev, X, y, cfg)
		took := time.Since(t0)
		if err != nil {
			t.Fatal(err)
		}
		kl, _, err := certify.KL(next, prev)
		if err != nil {
			t.Fatal(err)
		}
		var moved float64
		nl := next.Last()
		for _, pair := range [][2][]float64{{nl.WeightMu, last.WeightMu}, {nl.WeightLogSigma, last.WeightLogSigma},
			{nl.BiasMu, last.BiasMu}, {nl.BiasLogSigma, last.BiasLogSigma}} {
			for j := range pair[0] {
				moved = max(moved, math.Abs(pair[0][j]-pair[1][j]))
			}
		}
		t.Logf("increment %4d records: update KL %.4g (bound %.3g), largest parameter move %.3g (D %.3g), %v", n, kl, bound, moved, D, took.Round(time.Millisecond))
		if kl > bound || moved > D*(1+1e-9) {
			t.Fatalf("increment of %d: KL %g over the bound %g, or a move %g over D %g", n, kl, bound, moved, D)
		}
		kls = append(kls, kl)
	}
	t.Logf("update KL from 64 to 4096 records: %.4g", kls)
}
