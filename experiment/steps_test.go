package experiment

import (
	"context"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/update"
)

// At the daemon's default settings a step is what the records and the prior say it is, whatever
// the increment's size: one increment of correct records fitted under two seeds (two sets of
// body draws) lands on two posteriors a small KL apart, at 1,024 records (an increment of a
// backlog, kafka.max_records_backlog) as at 64. Every row of an increment shares its body
// draws, so their noise does not average out over rows: an increment fitted to fewer draws
// measures the draws it got, and its step KL (the KL the budget and the alerts watch) with it.
// The same fits under one draw are logged beside, and must be further apart.
func TestDefaultStepDoesNotDependOnItsDrawsAtAnySize(t *testing.T) {
	for _, data := range []string{"breast_cancer", "german_credit"} {
		set, d, err := assets.Load(data)
		if err != nil {
			t.Fatal(err)
		}
		train, _ := set.Split(0.5, 1)
		m, _, err := bnn.Fit(context.Background(), train, d.Classes, bnn.TrainConfig{Seed: 1, Epochs: 10})
		if err != nil {
			t.Fatal(err)
		}
		m.Records = float64(len(train.X))
		for _, n := range []int{64, 1024} {
			X, y := make([][]float64, n), make([]int, n)
			for i := range n {
				X[i], y[i] = set.X[i%len(set.X)], set.Y[i%len(set.X)]
			}
			// apart is the KL between the fits of X, y under two seeds with draws body draws.
			apart := func(draws int) float64 {
				var fits [2]*bnn.Model
				for k := range fits {
					cfg := DefaultUpdate()
					cfg.Seed, cfg.Draws = uint64(11+k), draws
					next, st, err := update.LastLayer(context.Background(), m, X, y, cfg)
					if err != nil {
						t.Fatal(err)
					}
					if !st.Converged {
						t.Fatalf("%s, %d records, %d draws, seed %d: did not converge", data, n, draws, cfg.Seed)
					}
					fits[k] = next
				}
				kl, _, err := certify.KL(fits[0], fits[1])
				if err != nil {
					t.Fatal(err)
				}
				return kl
			}
			kl, one := apart(DefaultUpdate().Draws), apart(1)
			t.Logf("%s, %d records: the fits under two seeds are KL %.3g apart (%.3g under one draw)", data, n, kl, one)
			if !(one > kl) {
				t.Errorf("%s, %d records: the fits under two seeds are KL %.3g apart under one draw, %.3g under %d: want fewer draws noisier",
					data, n, one, kl, DefaultUpdate().Draws)
			}
			if most := certify.KLBudget(config.Default().Certify.Delta) / 2; !(kl < most) {
				t.Errorf("%s, %d correct records fitted under two seeds: KL %.3g apart, want < %.4g (half the default KL budget)",
					data, n, kl, most)
			}
		}
	}
}

// The projection is not order-invariant: at the default settings the 569 records of
// breast_cancer with every label flipped, applied in one increment, leave more of the data set
// predicted on the side it was before than the same records in increments of 32 (docs/MATHS.md,
// "What it does not do").
func TestOneLargeIncrementMovesThePosteriorLessThanSmallOnes(t *testing.T) {
	set, d, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	m0, _, err := bnn.Fit(context.Background(), set, d.Classes, bnn.TrainConfig{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	m0.Records = float64(len(set.X))
	flipped := make([]int, len(set.Y))
	for i, y := range set.Y {
		flipped[i] = 1 - y
	}
	before, err := m0.Predict(set.X, 200, 7)
	if err != nil {
		t.Fatal(err)
	}
	// oldSide is the fraction of the data set whose predicted class under m is the one m0 predicts.
	oldSide := func(m *bnn.Model) float64 {
		after, err := m.Predict(set.X, 200, 7)
		if err != nil {
			t.Fatal(err)
		}
		same := 0
		for i := range set.X {
			if (before.Mean[2*i+1] >= 0.5) == (after.Mean[2*i+1] >= 0.5) {
				same++
			}
		}
		return float64(same) / float64(len(set.X))
	}
	var side [2]float64
	for k, inc := range []int{len(set.X), 32} {
		m := m0
		for from := 0; from < len(set.X); from += inc {
			to := min(from+inc, len(set.X))
			cfg := DefaultUpdate()
			cfg.Seed = uint64(from + 1)
			if m, _, err = update.LastLayer(context.Background(), m, set.X[from:to], flipped[from:to], cfg); err != nil {
				t.Fatal(err)
			}
		}
		side[k] = oldSide(m)
		t.Logf("flipped labels in increments of %d: %.2f of the data set predicted on its old side", inc, side[k])
	}
	if !(side[0] > side[1]) {
		t.Errorf("on its old side: %.2f after one increment, %.2f after increments of 32; want more after one", side[0], side[1])
	}
}

// Stream's orders: shuffled increments hold every label, as the rows do; label-ordered ones
// hold one label each, but for the increment that crosses from one label to the next.
func TestStreamOrders(t *testing.T) {
	set, d, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	for _, order := range []string{"shuffled", "label"} {
		res, err := Stream(context.Background(), StreamConfig{Data: set, Classes: d.Classes, Seed: 1, Update: DefaultUpdate(),
			Train: bnn.TrainConfig{Epochs: 2}, Increment: 64, Correct: 14, EvalEvery: 100, Order: order})
		if err != nil {
			t.Fatal(err)
		}
		mixed := 0
		for _, p := range res.Points {
			if len(p.Labels) != 2 || p.Labels[0]+p.Labels[1] != 64 {
				t.Fatalf("%s: increment %d counts the labels %v, want 64 records of 2 labels", order, p.Increment, p.Labels)
			}
			if p.Labels[0] > 0 && p.Labels[1] > 0 {
				mixed++
			}
		}
		// 14 increments of 64 pass through the 455 fitted rows about twice: two label changes each.
		if order == "shuffled" && mixed != len(res.Points) || order == "label" && (mixed < 1 || mixed > 4) {
			t.Errorf("%s: %d of %d increments hold both labels", order, mixed, len(res.Points))
		}
	}
}

// StreamConfig.Settle starts the stream at the optimum of the fit's own objective over the last
// layer: the settle step itself is converged and moves the under-trained fit, and the first
// increment of fitted rows then steps less than it does from the fitted posterior, which moves
// towards that optimum as well as to where its records hold it.
func TestStreamSettleStartsAtTheFitsOptimum(t *testing.T) {
	set, d, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	var first [2]float64
	for k, settle := range []bool{false, true} {
		res, err := Stream(context.Background(), StreamConfig{Data: set, Classes: d.Classes, Seed: 1, Update: DefaultUpdate(),
			Train: bnn.TrainConfig{Epochs: 5}, Increment: 256, Correct: 1, EvalEvery: 100, Settle: settle})
		if err != nil {
			t.Fatal(err)
		}
		first[k] = res.Points[0].KL
		if !settle {
			if res.Settled != (update.Stats{}) {
				t.Errorf("without Settle: Settled %+v, want zero", res.Settled)
			}
			continue
		}
		if !res.Settled.Converged || !(res.Settled.KL > 0) || !(res.Settled.LossEnd < res.Settled.LossStart) {
			t.Errorf("settle: converged %v, KL %v, objective %v -> %v; want converged, a move, a lower objective",
				res.Settled.Converged, res.Settled.KL, res.Settled.LossStart, res.Settled.LossEnd)
		}
		t.Logf("settle: KL(settled || fitted) %.3f, objective %.5f -> %.5f in %d iterations",
			res.Settled.KL, res.Settled.LossStart, res.Settled.LossEnd, res.Settled.Iterations)
	}
	t.Logf("first increment of 256 fitted rows: KL %.4f from the fit, %.4f from the settled fit", first[0], first[1])
	if !(first[1] < first[0]/2) {
		t.Errorf("first step KL %.4f from the settled fit, %.4f from the fit; want under half", first[1], first[0])
	}
}
