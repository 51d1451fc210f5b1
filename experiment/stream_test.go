package experiment

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/update"
)

// defaultUpdate is the daemon's update at its default settings (config.Default), as
// config.Update.Step builds it; the records represented are tracked by the posterior itself.
func defaultUpdate() update.Config {
	u := config.Default().Update
	_, c := u.Step(&bnn.Model{Records: 1}, 1, u.Seed)
	c.Seed = u.Seed
	return c
}

func streamData(t *testing.T, name string) (*dataset.Set, []string) {
	t.Helper()
	set, d, err := assets.Load(name)
	if err != nil {
		t.Fatal(err)
	}
	return set, d.Classes
}

// TestDefaultsKeepQualityUnderCorrectLabels streams 1,000 increments of 10 correctly labelled
// records (drawn from the rows the model was fitted on) at the default update settings and
// checks what a served model must keep: the held-out log loss (x1.05) and calibration error
// (+0.03) no worse than at the start, the counterfactual stand-ins' mean p(target) within 0.02
// of the start, and every update KL well inside the budget (half of it), the later ones
// smaller than the first.
func TestDefaultsKeepQualityUnderCorrectLabels(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: 1,000 increments per data set")
	}
	for _, name := range []string{"breast_cancer", "german_credit"} {
		t.Run(name, func(t *testing.T) {
			set, classes := streamData(t, name)
			const incs = 1000
			var kls []float64
			res, err := Stream(context.Background(), StreamConfig{Data: set, Classes: classes, Seed: 1, Update: defaultUpdate(),
				Increment: 10, Correct: incs, EvalEvery: 250, Progress: func(p StreamPoint) { kls = append(kls, p.KL) }})
			if err != nil {
				t.Fatal(err)
			}
			s, e := res.Start, res.AfterCorrect
			t.Logf("held-out NLL %.4f -> %.4f, ECE %.4f -> %.4f, accuracy %.3f -> %.3f; stand-ins renewable %d -> %d (min p %.3f -> %.3f)",
				s.NLL, e.NLL, s.ECE, e.ECE, s.Accuracy, e.Accuracy, s.Renewable, e.Renewable, s.StandInMin, e.StandInMin)
			if e.NLL > s.NLL*1.05 {
				t.Errorf("held-out NLL rose from %.4f to %.4f (tolerance x1.05)", s.NLL, e.NLL)
			}
			if e.ECE > s.ECE+0.03 {
				t.Errorf("held-out ECE rose from %.4f to %.4f (tolerance +0.03)", s.ECE, e.ECE)
			}
			// The stand-ins' p(target) moves with the posterior (a random walk whose steps shrink as
			// evidence accumulates); their mean may fall by at most 0.02. Those near the renewal
			// threshold can cross it (the closing log line counts them).
			if e.StandInMean < s.StandInMean-0.02 {
				t.Errorf("stand-ins' mean p(target) fell from %.4f to %.4f (tolerance 0.02)", s.StandInMean, e.StandInMean)
			}
			budget := (0.5 - 0.05) * (0.5 - 0.05) / 2
			var first, last, worst float64
			for i, kl := range kls {
				worst = max(worst, kl)
				if i < 200 {
					first += kl / 200
				}
				if i >= incs-200 {
					last += kl / 200
				}
			}
			t.Logf("update KL: mean of the first 200 %.3g, of the last 200 %.3g, largest %.3g (budget %.5f)", first, last, worst, budget)
			if worst > budget/2 {
				t.Errorf("largest update KL %.4g, want <= half the budget (%.4g)", worst, budget/2)
			}
			if !(last < first) {
				t.Errorf("mean update KL of the last 200 increments %.3g, of the first 200 %.3g: want it to shrink", last, first)
			}
		})
	}
}

// TestDefaultsFollowDrift streams correct labels, then a drift, at the default settings, in
// increments of at most 64 records (random sizes) and of 10: 80% of the counterfactual stand-ins
// must be invalidated (upper confidence bound of p(target) < 1/2) within 1,000 records of the
// drift (docs/MATHS.md says so of the default), for flipped labels and for a covariate-and-label
// shift, and some increment of the drift must breach the KL budget. The drift runs on to 1,500
// records: past the bound, so that an invalidation later than it is seen and fails.
func TestDefaultsFollowDrift(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: thousands of records per case")
	}
	set, classes := streamData(t, "breast_cancer")
	for _, tc := range []struct {
		name    string
		inc     int
		random  bool
		shift   string
		correct int
	}{
		{"flip, up to 64", 64, true, "flip", 32},
		{"flip, 10", 10, false, "flip", 100},
		{"a region's labels change, up to 64", 64, true, "region", 32},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const driftRecords = 1500
			n := driftRecords / tc.inc
			if tc.random {
				n = 2 * driftRecords / (tc.inc + 1) // sizes average (inc+1)/2
			}
			res, err := Stream(context.Background(), StreamConfig{Data: set, Classes: classes, Seed: 2, Update: defaultUpdate(),
				Increment: tc.inc, RandomSize: tc.random, Correct: tc.correct, Drift: n, Shift: tc.shift, EvalEvery: 25})
			if err != nil {
				t.Fatal(err)
			}
			last := res.Points[len(res.Points)-1]
			t.Logf("80%% of the stand-ins invalidated after %d drifted records (all after %d); %d drifted records applied; %d increments over the KL budget",
				res.First80, res.FirstAllInvalidated, last.Drifted, res.Breaches)
			if res.First80 == 0 || res.First80 > 1000 {
				t.Errorf("80%% of the stand-ins invalidated after %d drifted records (0: never), want within 1,000", res.First80)
			}
			if res.Breaches == 0 {
				t.Error("no update KL over the budget during the drift: the KL does not follow the evidence")
			}
		})
	}
}

// TestStreamingAgainstBatchFits is the batch anchor, at the default settings, over five splits
// of two data sets: a model fitted on half of the rows, then 30% more streamed in increments of
// 10 (the daemon's update), judged on the last 20% (held-out NLL and ECE) against
//
//	start      the model before the stream
//	one        the same records in one increment (same objective, same kl_weight)
//	untempered the same records in one increment with kl_weight 1 (each record counts 1)
//	refit      one batch fit of the whole network on the fitted and streamed rows (bnn.Fit)
//
// What it holds the learner to: streaming learns (held-out NLL falls, on average over the
// splits), loses no held-out NLL and no Brier score (at most 1% of
// either: no forgetting, no calibration lost; the Brier score is calibration plus refinement), and
// in increments of 10 it ends within 0.5% of the NLL of one increment of the same records (the
// streaming update is a faithful sequential form of one Bayesian update). ECE is logged, not
// checked: over 200 held-out rows in 10 bins it is 0.059 streamed and 0.029 in one increment
// where no prediction of the two differs by more than 0.013 (german_credit, split 1). The paper's protocol (update.objective: prior, Adam) fails
// on breast_cancer: its prior pulls the last layer back at every increment.
// It does not hold it to the refit: the refit retrains the body too and counts every record
// once, where the daemon learns the last layer only and counts a streamed record 1/8
// (update.kl_weight); the logged figures say how far apart they end (docs/MATHS.md, "Against a
// batch fit").
func TestStreamingAgainstBatchFits(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	for _, name := range []string{"breast_cancer", "german_credit"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			set, classes := streamData(t, name)
			gain := 0.0 // the held-out NLL the stream gained, summed over the splits
			for seed := uint64(1); seed <= 5; seed++ {
				s := batchAnchor(t, set, classes, seed)
				gain += s.start.nll - s.streamed.nll
				t.Logf("split %d: held-out NLL / Brier / ECE: start %s, streamed %s, one increment %s, untempered %s, refit %s; "+
					"largest difference of a prediction, streamed and one increment: %.4f", seed, s.start, s.streamed, s.one, s.untempered, s.refit,
					maxDiff(s.streamed, s.one))
				if s.streamed.nll > 1.01*s.start.nll {
					t.Errorf("split %d: streamed NLL %.4f, start %.4f: the stream lost held-out quality (want at most 1%% more)", seed, s.streamed.nll, s.start.nll)
				}
				if s.streamed.brier > 1.01*s.start.brier {
					t.Errorf("split %d: streamed Brier score %.4f, start %.4f: the stream lost calibration or refinement (want at most 1%% more)",
						seed, s.streamed.brier, s.start.brier)
				}
				if math.Abs(s.streamed.nll-s.one.nll) > 0.005*s.one.nll {
					t.Errorf("split %d: streamed NLL %.4f, the same records in one increment %.4f: want within 0.5%%", seed, s.streamed.nll, s.one.nll)
				}
			}
			// The checks above hold for a learner that learns nothing (streamed = one = start).
			// The stream must learn: over the five splits its held-out NLL falls, on average by
			// at least 1e-4 nats (the defaults gain 4e-4 on breast_cancer, 6e-4 on german_credit).
			if gain/5 < 1e-4 {
				t.Errorf("the stream gained %.2g nats of held-out NLL on average over five splits, want at least 1e-4: it does not learn", gain/5)
			}
			t.Logf("the stream gained %.2g nats of held-out NLL on average over five splits", gain/5)
		})
	}
}

// heldOutScore is a model's held-out log loss, Brier score and calibration error, and its
// predictive means.
type heldOutScore struct {
	nll, brier, ece float64
	mean            []float64
}

// maxDiff is the largest difference between two models' predictive probabilities of one class
// for one held-out row.
func maxDiff(a, b heldOutScore) float64 {
	d := 0.0
	for i := range a.mean {
		d = max(d, math.Abs(a.mean[i]-b.mean[i]))
	}
	return d
}

func (s heldOutScore) String() string {
	return fmt.Sprintf("%.4f / %.4f / %.4f", s.nll, s.brier, s.ece)
}

// anchorScores are the models TestStreamingAgainstBatchFits compares, scored on held-out rows.
type anchorScores struct{ start, streamed, one, untempered, refit heldOutScore }

// batchAnchor fits on the first half of split seed's rows, streams the next 30% and scores
// each model on the rest.
func batchAnchor(t *testing.T, set *dataset.Set, classes []string, seed uint64) anchorScores {
	t.Helper()
	perm := set.Permutation(seed)
	nFit, nStream := len(perm)/2, len(perm)*3/10
	fit, pool, held := set.Subset(perm[:nFit]), set.Subset(perm[nFit:nFit+nStream]), set.Subset(perm[nFit+nStream:])
	ctx := context.Background()
	start, _, err := bnn.Fit(ctx, fit, classes, bnn.TrainConfig{Seed: seed})
	if err != nil {
		t.Fatal(err)
	}
	stream := func(klWeight float64, increment int) *bnn.Model {
		m, uc := start, defaultUpdate()
		uc.KLWeight = klWeight
		for lo := 0; lo < pool.Len(); lo += increment {
			hi := min(lo+increment, pool.Len())
			c := uc
			c.Seed = uc.Seed ^ (m.Version+1)*0x9e3779b97f4a7c15
			if m, _, err = update.LastLayer(ctx, m, pool.X[lo:hi], pool.Y[lo:hi], c); err != nil {
				t.Fatal(err)
			}
		}
		return m
	}
	refit, _, err := bnn.Fit(ctx, set.Subset(perm[:nFit+nStream]), classes, bnn.TrainConfig{Seed: seed})
	if err != nil {
		t.Fatal(err)
	}
	score := func(m *bnn.Model) heldOutScore {
		p, err := m.Predict(held.X, 1000, 5)
		if err != nil {
			t.Fatal(err)
		}
		nll, brier, ece, _, err := heldOut(p, held.Y)
		if err != nil {
			t.Fatal(err)
		}
		return heldOutScore{nll: nll, brier: brier, ece: ece, mean: p.Mean}
	}
	kw := defaultUpdate().KLWeight
	return anchorScores{start: score(start), streamed: score(stream(kw, 10)), one: score(stream(kw, pool.Len())),
		untempered: score(stream(1, pool.Len())), refit: score(refit)}
}
