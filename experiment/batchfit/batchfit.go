// Package batchfit is the batch anchor of the learner, at the default settings, over five splits
// of a data set: a model fitted on half of the rows, then 30% more streamed in increments of
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
// where no prediction of the two differs by more than 0.013 (german_credit, split 1). The
// paper's protocol (update.objective: prior, Adam) fails on breast_cancer: its prior pulls the
// last layer back at every increment.
// It does not hold it to the refit: the refit retrains the body too and counts every record
// once, where the daemon learns the last layer only and counts a streamed record 1/8
// (update.kl_weight); the logged figures say how far apart they end (docs/MATHS.md, "Against a
// batch fit").
package batchfit

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/experiment"
	"github.com/cfguard/cfguard/update"
)

// Check runs the batch anchor on the bundled data set name: five splits, each a fit, a stream
// and the models it is judged against, scored on held-out rows; the test fails where the stream
// loses quality, strays from one increment of the same records, or learns nothing.
func Check(t *testing.T, name string) {
	t.Helper()
	set, d, err := assets.Load(name)
	if err != nil {
		t.Fatal(err)
	}
	classes := d.Classes
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
		m, uc := start, experiment.DefaultUpdate()
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
		nll, brier, ece, _, err := experiment.HeldOut(p, held.Y)
		if err != nil {
			t.Fatal(err)
		}
		return heldOutScore{nll: nll, brier: brier, ece: ece, mean: p.Mean}
	}
	kw := experiment.DefaultUpdate().KLWeight
	return anchorScores{start: score(start), streamed: score(stream(kw, 10)), one: score(stream(kw, pool.Len())),
		untempered: score(stream(1, pool.Len())), refit: score(refit)}
}
