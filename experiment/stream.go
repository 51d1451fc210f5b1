package experiment

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/quality"
	"github.com/cfguard/cfguard/update"
)

// StreamConfig configures Stream: a model fitted on part of a data set, then a stream of
// increments drawn from another part (correct labels, then a drift), judged on a held-out part,
// with the daemon's update code and its per-version seeds.
type StreamConfig struct {
	Data    *dataset.Set
	Classes []string
	Seed    uint64
	// Train configures the first posterior's fit on the first FitFrac of a seeded shuffle
	// (default 0.8); the rest is held out. The increments draw their records from the fitted rows
	// (cycled through seeded permutations: correct labels, from the distribution the model was
	// fitted on), or, with StreamFrac > 0, from the next StreamFrac of the shuffle (rows the fit
	// never saw; the held-out part is then what remains).
	Train               bnn.TrainConfig
	FitFrac, StreamFrac float64
	// Settle, when set, moves the fitted posterior's last layer to the optimum of its own
	// training objective before the stream starts (update.Settle over the fitted rows, seeded
	// by Seed). The daemon does not: this measures what it changes.
	Settle         bool
	SettleMeans    bool          // without Settle: the means only (update.SettleMeans)
	Update         update.Config // its Seed is the daemon's update.seed
	Increment      int           // records per increment; with RandomSize, the most
	RandomSize     bool          // sizes uniform in [1, Increment]
	Correct, Drift int           // increments with correct labels, then with the drift
	Shift          string        // the drift: "flip" (every label changed) or "region" (see Stream)
	// Order is how the increments take the stream's rows: "shuffled" (default; seeded
	// permutations, so that every increment holds the labels in about their proportions) or
	// "label" (the rows of label 0, then those of label 1, ..., each label's in the seeded
	// shuffle's order, over and over: a backlog sorted by class, whose increments hold one label).
	Order                   string
	EvalEvery               int     // held-out evaluation every that many increments (default 50)
	Samples                 int     // predictive draws for evaluations (default 400)
	StandIns                int     // CE stand-ins (default 10)
	VerdictAlpha, Delta     float64 // for stand-ins' verdicts (defaults 0.01, 0.05)
	Progress                func(StreamPoint)
	Budget                  float64 // the step KL budget, for counting breaches (default (0.5-Delta)^2/2)
	StandInLow, StandInHigh float64 // stand-ins start at p(target) in [low, high] (0.95, 0.99)
}

// StreamPoint is the state after one increment. Held-out figures and stand-ins are filled at
// evaluation points only (Evaluated).
type StreamPoint struct {
	Increment  int           `json:"increment"`
	Records    int           `json:"records"` // records applied so far
	Drifted    int           `json:"drifted"` // records of the drift applied so far
	Labels     []int         `json:"labels"`  // the increment's records per label (after the drift's change)
	KL         float64       `json:"kl"`
	Iterations int           `json:"iterations"`
	Converged  bool          `json:"converged"`
	Took       time.Duration `json:"took_ns"`
	Represents float64       `json:"represents"`
	Evaluated  bool          `json:"evaluated"`
	NLL        float64       `json:"nll"` // held-out, of the predictive
	ECE        float64       `json:"ece"`
	Accuracy   float64       `json:"accuracy"`
	// Stand-ins: mean and min p(target); how many are invalidated (upper Bernstein bound < 1/2)
	// and how many renewable (lower bound >= 1 - delta).
	StandInMean float64 `json:"stand_in_mean"`
	StandInMin  float64 `json:"stand_in_min"`
	Invalidated int     `json:"invalidated"`
	Renewable   int     `json:"renewable"`
}

// StreamResult summarises a run.
type StreamResult struct {
	Start StreamPoint // before the first increment (evaluated)
	// AfterCorrect is the last increment of correct labels (evaluated).
	AfterCorrect StreamPoint
	Points       []StreamPoint
	// FirstAllInvalidated is the drifted records applied when every stand-in was first seen
	// invalidated (0: never), and First80 when 80% were.
	FirstAllInvalidated, First80 int
	Breaches                     int // increments whose KL exceeded the budget
	// Settled describes the Settle or SettleMeans step (zero without either): its
	// KL(settled || fitted), its objective at the fitted and the settled last layer (LossStart,
	// LossEnd) and whether it converged.
	Settled update.Stats
}

// Stream runs the protocol of StreamConfig. It returns ctx's error if ctx ends first.
func Stream(ctx context.Context, cfg StreamConfig) (*StreamResult, error) {
	cfg.FitFrac = cmp.Or(cfg.FitFrac, 0.8)
	cfg.EvalEvery = cmp.Or(cfg.EvalEvery, 50)
	cfg.Samples = cmp.Or(cfg.Samples, 400)
	cfg.StandIns = cmp.Or(cfg.StandIns, 10)
	cfg.VerdictAlpha = cmp.Or(cfg.VerdictAlpha, 0.01)
	cfg.Delta = cmp.Or(cfg.Delta, 0.05)
	cfg.Budget = cmp.Or(cfg.Budget, (0.5-cfg.Delta)*(0.5-cfg.Delta)/2)
	cfg.StandInLow, cfg.StandInHigh = cmp.Or(cfg.StandInLow, 0.95), cmp.Or(cfg.StandInHigh, 0.99)
	cfg.Shift = cmp.Or(cfg.Shift, "flip")
	cfg.Order = cmp.Or(cfg.Order, "shuffled")
	if cfg.Order != "shuffled" && cfg.Order != "label" {
		return nil, fmt.Errorf("stream: order %q, want shuffled or label", cfg.Order)
	}
	if cfg.Data == nil || cfg.Increment < 1 {
		return nil, errors.New("stream: need a data set and an increment size >= 1")
	}
	perm := cfg.Data.Permutation(cfg.Seed)
	nFit := int(math.Round(cfg.FitFrac * float64(len(perm))))
	nStream := int(math.Round(cfg.StreamFrac * float64(len(perm))))
	fit, pool, held := cfg.Data.Subset(perm[:nFit]), cfg.Data.Subset(perm[nFit:nFit+nStream]), cfg.Data.Subset(perm[nFit+nStream:])
	if nStream == 0 {
		pool = fit
	}
	if pool.Len() == 0 || held.Len() == 0 {
		return nil, errors.New("stream: empty stream pool or held-out part")
	}
	m, _, err := bnn.Fit(ctx, fit, cfg.Classes, cfg.Train)
	if err != nil {
		return nil, fmt.Errorf("stream: fit: %w", err)
	}
	res := &StreamResult{}
	if cfg.Settle {
		if m, res.Settled, err = update.Settle(ctx, m, fit.X, fit.Y, cfg.Train.KLWeight, cfg.Seed); err != nil {
			return nil, fmt.Errorf("stream: settle: %w", err)
		}
	} else if cfg.SettleMeans {
		if m, res.Settled, err = update.SettleMeans(ctx, m, fit.X, fit.Y, cfg.Train.KLWeight, cfg.Seed); err != nil {
			return nil, fmt.Errorf("stream: settle means: %w", err)
		}
	}
	// Stand-ins: held-out and pool points whose predicted class, their label, has p in
	// [low, high]: in the target class's region, as a counterfactual that PSCE found plausible is.
	cand := append(append([][]float64(nil), held.X...), pool.X...)
	candY := append(append([]int(nil), held.Y...), pool.Y...)
	pr, err := m.Predict(cand, cfg.Samples, cfg.Seed^0x5eed)
	if err != nil {
		return nil, err
	}
	var si [][]float64
	var target []int
	for i := range cand {
		c := pr.Argmax(i)
		if cfg.Shift == "region" && !inRegion(m, cand[i]) {
			continue // the drift changes nothing outside its region: only the region's stand-ins must fall
		}
		if p := pr.P(i, c); c == candY[i] && p >= cfg.StandInLow && p <= cfg.StandInHigh && len(si) < cfg.StandIns {
			si, target = append(si, cand[i]), append(target, c)
		}
	}
	eval := func(pt *StreamPoint, m *bnn.Model, version uint64) error {
		p, err := m.Predict(held.X, cfg.Samples, cfg.Seed^version)
		if err != nil {
			return err
		}
		pt.Evaluated = true
		if pt.NLL, _, pt.ECE, pt.Accuracy, err = HeldOut(p, held.Y); err != nil {
			return err
		}
		if len(si) == 0 {
			return nil
		}
		q, err := m.Predict(si, 1000, cfg.Seed^version^0xce)
		if err != nil {
			return err
		}
		pt.StandInMin = 1
		for i, c := range target {
			e := certify.Evidence{P: q.P(i, c), Var: q.V(i, c), Samples: q.S}
			lo, hi := e.Interval(cfg.VerdictAlpha)
			pt.StandInMean += e.P / float64(len(si))
			pt.StandInMin = min(pt.StandInMin, e.P)
			if hi < 0.5 {
				pt.Invalidated++
			}
			if lo >= 1-cfg.Delta {
				pt.Renewable++
			}
		}
		return nil
	}
	if err := eval(&res.Start, m, 0); err != nil {
		return nil, err
	}
	order := rand.New(rand.NewPCG(cfg.Seed, 0x57e4))
	sizes := rand.New(rand.NewPCG(cfg.Seed, 0x512e))
	var ord []int
	next := func() int {
		if len(ord) == 0 {
			ord = order.Perm(pool.Len())
			if cfg.Order == "label" {
				slices.SortStableFunc(ord, func(a, b int) int { return cmp.Compare(pool.Y[a], pool.Y[b]) })
			}
		}
		i := ord[0]
		ord = ord[1:]
		return i
	}
	records, drifted := 0, 0
	for k := 1; k <= cfg.Correct+cfg.Drift; k++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		n := cfg.Increment
		if cfg.RandomSize {
			n = 1 + sizes.IntN(cfg.Increment)
		}
		drift := k > cfg.Correct
		X, y := make([][]float64, 0, n), make([]int, 0, n)
		for len(X) < n {
			i := next()
			x, label := pool.X[i], pool.Y[i]
			if drift {
				switch cfg.Shift {
				case "flip":
					label = (label + 1) % len(cfg.Classes)
				case "region":
					// A population whose outcome changed: records above the mean of the first
					// feature come with the other label; the rest keep theirs.
					if inRegion(m, x) {
						label = (label + 1) % len(cfg.Classes)
					}
				default:
					return nil, fmt.Errorf("stream: shift %q, want flip or region", cfg.Shift)
				}
			}
			X, y = append(X, x), append(y, label)
		}
		uc := cfg.Update
		uc.Seed = cfg.Update.Seed ^ (m.Version+1)*0x9e3779b97f4a7c15
		next, st, err := update.LastLayer(ctx, m, X, y, uc)
		if err != nil {
			return nil, fmt.Errorf("stream: increment %d: %w", k, err)
		}
		m = next
		records += n
		if drift {
			drifted += n
		}
		pt := StreamPoint{Increment: k, Records: records, Drifted: drifted, KL: st.KL, Iterations: st.Iterations,
			Converged: st.Converged, Took: st.Duration, Represents: m.Records, Labels: make([]int, len(m.Classes))}
		for _, label := range y {
			pt.Labels[label]++
		}
		if st.KL > cfg.Budget {
			res.Breaches++
		}
		if k%cfg.EvalEvery == 0 || k == cfg.Correct || k == cfg.Correct+cfg.Drift || (drift && k%max(1, cfg.EvalEvery/5) == 0) {
			if err := eval(&pt, m, m.Version); err != nil {
				return nil, err
			}
			if drift && len(si) > 0 {
				if res.First80 == 0 && pt.Invalidated*5 >= 4*len(si) {
					res.First80 = drifted
				}
				if res.FirstAllInvalidated == 0 && pt.Invalidated == len(si) {
					res.FirstAllInvalidated = drifted
				}
			}
		}
		if k == cfg.Correct {
			res.AfterCorrect = pt
		}
		res.Points = append(res.Points, pt)
		if cfg.Progress != nil {
			cfg.Progress(pt)
		}
	}
	return res, nil
}

// inRegion says whether raw features x lie above the mean of the first feature (the model's
// scaler): the region of the "region" drift.
func inRegion(m *bnn.Model, x []float64) bool { return x[0] > m.Scaler.Mean[0] }

// HeldOut returns the mean log loss of the labels under the predictive p, their Brier score, the
// expected calibration error of the top class and the accuracy, as the daemon's prequential
// scores compute them (quality.Score).
func HeldOut(p *bnn.Predictive, y []int) (nll, brier, ece, acc float64, err error) {
	probs := make([][]float64, p.N)
	for i := range probs {
		probs[i] = p.Mean[i*p.C : (i+1)*p.C]
	}
	b, err := quality.Score(probs, y)
	if err != nil {
		return 0, 0, 0, 0, fmt.Errorf("experiment: held-out scores: %w", err)
	}
	nll, brier, acc, ece = b.Means()
	return nll, brier, ece, acc, nil
}

// DefaultUpdate is the daemon's update at its default settings (config.Default), as
// config.Update.Step builds it for a posterior's increment, with the configured seed; Stream
// tracks the records represented through the posterior itself.
func DefaultUpdate() update.Config {
	u := config.Default().Update
	_, c := u.Step(&bnn.Model{Records: 1}, 1, u.Seed)
	c.Seed = u.Seed
	return c
}
