// Package experiment reproduces the paper's incremental-update experiment (Table "Empirical
// example for the theoretical bound" and the learning-rate figures): train a BNN on 95% of the
// training data, certify a counterfactual (CE) with p1 >= 1 - delta, then update the last layer
// five times with 1% more data at a small learning rate, and check Theorem 1's bound
// p2 >= p1 - 2 sqrt(KL(q2 || q1) / 2) at every update and from the anchor posterior.
package experiment

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/update"
)

// Protocol constants (the paper's): an 80/20 train/test split, the anchor trained on 95% of the
// training split, each update adding 1% of it.
const (
	TrainFrac = 0.80
	StartPct  = 95
)

// Defaults applied by Increments and SweepLR to zero fields of IncrementsConfig.
const (
	DefaultSamples = 2000 // Monte-Carlo draws for p and Var
	DefaultDelta   = 0.05
	DefaultUpdates = 5
	// CESearchSteps is the number of equal steps of the straight-line CE search.
	CESearchSteps = 50
	// ceScreenSamples is the number of draws used to screen rows in the CE search.
	ceScreenSamples = 200
)

// DefaultSweepLRs are the learning rates of the paper's sweep.
var DefaultSweepLRs = []float64{1e-5, 1e-4, 1e-3}

// Update-data policies (IncrementsConfig.UpdateData).
const (
	// Cumulative: update u trains on D_prev ∪ D_new, the first (95+u)% of the training split,
	// as the paper's p2(w | D_prev ∪ D_new). Default for the prior objective.
	Cumulative = "cumulative"
	// NewOnly: update u trains on the new 1% alone, as an online stream delivers it. Default for
	// vcl, whose KL(q || q_prev) term already carries D_prev.
	NewOnly = "new"
)

// IncrementsConfig configures Increments. Zero fields take the defaults.
type IncrementsConfig struct {
	Data    *dataset.Set // required: the whole labelled data set
	Classes []string     // class names, at least Data.NumClasses of them
	Seed    uint64       // seeds the split, training, updates and Monte-Carlo draws
	// LR is the updates' learning rate. Default update.DefaultLR (1e-5, the paper's).
	LR float64
	// Objective is the update objective, "prior" (default, the paper's) or "vcl".
	Objective string
	// Steps is the number of Adam iterations per update. Default update.DefaultIterations.
	Steps int
	// Samples is the number of posterior draws used to estimate p = E_q[p(y'|x', w)] and
	// V = Var_q[p(y'|x', w)]. Default DefaultSamples.
	Samples int
	// Delta is the CE's safety level: it is chosen with p1 >= 1 - Delta. Default 0.05.
	Delta float64
	// Updates is the number of 1% increments. Default 5 (95% -> 100%).
	Updates int
	// UpdateData is Cumulative or NewOnly; default Cumulative for prior, NewOnly for vcl.
	UpdateData string
	// Train configures the anchor's training; zero fields take bnn's defaults and Seed.
	Train bnn.TrainConfig
}

// Row is one update's outcome. The JSON field names update, p1, p2, kl, bound and holds are
// the paper's table's columns; the rest extend it.
type Row struct {
	Update string  `json:"update"` // e.g. "95%->96%"
	P1     float64 `json:"p1"`     // p(y'|x') under the previous posterior
	P2     float64 `json:"p2"`     // p(y'|x') under the new posterior
	KL     float64 `json:"kl"`     // KL(q_new || q_prev), closed form over every parameter
	Bound  float64 `json:"bound"`  // Theorem 1: p1 - 2 sqrt(KL/2)
	Holds  bool    `json:"holds"`  // p2 >= bound
	// Theorem 2 and the tight (opt-in) bound for the same step.
	V1         float64 `json:"v1"`
	V2         float64 `json:"v2"`
	VarBound   float64 `json:"var_bound"` // V1 + 6 sqrt(KL/2)
	VarHolds   bool    `json:"var_holds"` // V2 <= VarBound
	TightBound float64 `json:"tight_bound"`
	// From the anchor (the posterior the CE was certified under), computed directly, not summed.
	AnchorP     float64 `json:"anchor_p"`
	AnchorKL    float64 `json:"anchor_kl"`
	AnchorBound float64 `json:"anchor_bound"`
	AnchorHolds bool    `json:"anchor_holds"`
	// Context.
	LR         float64 `json:"lr"`
	Objective  string  `json:"objective"`
	UpdateRows int     `json:"update_rows"` // rows the update trained on
	Version    uint64  `json:"version"`     // posterior version after the update
	LossStart  float64 `json:"loss_start"`
	LossEnd    float64 `json:"loss_end"`
}

// CE is the counterfactual the experiment follows.
type CE struct {
	TestIndex int       // row of the test split it was made for
	X         []float64 // the original instance
	XCF       []float64 // the counterfactual x'
	From      int       // class predicted for X
	Target    int       // y', the counterfactual class
	Alpha     float64   // x' = X + Alpha (nearest - X)
	Nearest   int       // row of the training split it moves towards
	P         float64   // p(y'|x') under the anchor
	V         float64   // Var over the anchor of p(y'|x', w)
}

// IncrementsResult is the outcome of one run.
type IncrementsResult struct {
	Config       IncrementsConfig // with defaults applied
	TestAccuracy float64          // of the anchor on the test split (posterior-predictive argmax)
	TrainStats   bnn.TrainStats
	CE           CE
	Rows         []Row
	Duration     time.Duration
}

// AllHold reports whether Theorem 1's bound held at every update, stepwise and from the anchor.
func (r *IncrementsResult) AllHold() bool {
	for _, row := range r.Rows {
		if !row.Holds || !row.AnchorHolds {
			return false
		}
	}
	return true
}

// WriteJSONRows writes one JSON object per update, one per line.
func (r *IncrementsResult) WriteJSONRows(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false) // keep "95%->96%" readable
	for _, row := range r.Rows {
		if err := enc.Encode(row); err != nil {
			return err
		}
	}
	return nil
}

func (cfg IncrementsConfig) withDefaults() IncrementsConfig {
	cfg.LR = cmp.Or(cfg.LR, update.DefaultLR)
	cfg.Objective = cmp.Or(cfg.Objective, update.ObjectivePrior)
	cfg.Steps = cmp.Or(cfg.Steps, update.DefaultIterations)
	cfg.Samples = cmp.Or(cfg.Samples, DefaultSamples)
	cfg.Delta = cmp.Or(cfg.Delta, DefaultDelta)
	cfg.Updates = cmp.Or(cfg.Updates, DefaultUpdates)
	if cfg.UpdateData == "" {
		cfg.UpdateData = Cumulative
		if cfg.Objective == update.ObjectiveVCL {
			cfg.UpdateData = NewOnly
		}
	}
	cfg.Train.Seed = cmp.Or(cfg.Train.Seed, cfg.Seed)
	return cfg
}

func (cfg IncrementsConfig) validate() error {
	switch {
	case cfg.Data == nil || len(cfg.Data.X) == 0:
		return errors.New("increments: no data")
	case cfg.Data.NumClasses < 2 || len(cfg.Classes) < cfg.Data.NumClasses:
		return fmt.Errorf("increments: %d class names for %d classes", len(cfg.Classes), cfg.Data.NumClasses)
	case cfg.Samples < 2:
		return fmt.Errorf("increments: samples %d, want >= 2", cfg.Samples)
	case certify.CheckDelta(cfg.Delta) != nil:
		return fmt.Errorf("increments: %w", certify.CheckDelta(cfg.Delta))
	case cfg.Updates < 1 || cfg.Updates > 100-StartPct:
		return fmt.Errorf("increments: updates %d, want 1..%d", cfg.Updates, 100-StartPct)
	case cfg.UpdateData != Cumulative && cfg.UpdateData != NewOnly:
		return fmt.Errorf("increments: update data %q, want %q or %q", cfg.UpdateData, Cumulative, NewOnly)
	}
	return update.Config{Objective: cfg.Objective, LR: cfg.LR, Iterations: cfg.Steps}.Validate()
}

// setup is everything before the updates: split, anchor, CE. SweepLR shares one between runs.
type setup struct {
	cfg         IncrementsConfig
	train, test *dataset.Set
	cut         []int // cut[pct] = rows of the training split in the first pct percent
	anchor      *bnn.Model
	acc         float64
	stats       bnn.TrainStats
	ce          CE
	mcSeed      uint64
}

// Increments runs the paper's incremental-update experiment:
//
//  1. split cfg.Data 80/20 (seeded) and train the anchor posterior q_0 (bnn.Fit) on the first
//     95% of the training split;
//  2. pick a delta-safe CE x' with p(y'|x') >= 1 - Delta under q_0 (a straight-line search
//     standing in for PSCE, see below);
//  3. for u = 1..Updates, update the last layer on the first (95+u)% of the training split
//     (Cumulative) or on the new 1% (NewOnly) with update.LastLayer at cfg.LR, and record
//     p1 = p(y'|x') under q_{u-1}, p2 under q_u, KL = certify.KL(q_u, q_{u-1}),
//     bound = p1 - 2 sqrt(KL/2), holds = p2 >= bound, the variance bound, and the same from the
//     anchor: KL(q_u || q_0) computed directly (never a sum of step KLs) and p(y'|x') under q_0.
//
// CE search (PSCE comes later; this is a plain stand-in): test rows are tried in order; for test
// row x with predicted class y, let n be its nearest training row (Euclidean, standardised
// features) with a label y' != y that q_0 itself puts in class y' with p >= 1 - Delta/2
// (screened with 200 draws); x' is the first of x + (j/50)(n - x), j = 1..50, with
// p(y'|x') >= 1 - Delta. Rows without such a point are skipped. So x' sits just past the
// 1 - Delta level set, which makes p1 ~ 0.95 and the bound a real test rather than a formality. All p and Var are Monte-Carlo estimates from cfg.Samples draws with one fixed seed,
// so the same draws serve every posterior (common random numbers): p2 - p1 then carries far
// less Monte-Carlo noise than either value.
//
// log may be nil.
func Increments(ctx context.Context, cfg IncrementsConfig, log *slog.Logger) (*IncrementsResult, error) {
	s, err := prepare(ctx, cfg, log)
	if err != nil {
		return nil, err
	}
	return s.run(ctx, s.cfg, log)
}

// SweepLR runs Increments once per learning rate (nil lrs: DefaultSweepLRs) from one shared
// split, anchor and CE, so that the rows differ only by the learning rate. cfg.LR is ignored.
func SweepLR(ctx context.Context, cfg IncrementsConfig, lrs []float64, log *slog.Logger) (map[float64]*IncrementsResult, error) {
	if len(lrs) == 0 {
		lrs = DefaultSweepLRs
	}
	s, err := prepare(ctx, cfg, log)
	if err != nil {
		return nil, err
	}
	out := make(map[float64]*IncrementsResult, len(lrs))
	for _, lr := range lrs {
		c := s.cfg
		c.LR = lr
		if err := c.validate(); err != nil {
			return nil, err
		}
		r, err := s.run(ctx, c, log)
		if err != nil {
			return nil, fmt.Errorf("lr %g: %w", lr, err)
		}
		out[lr] = r
	}
	return out, nil
}

func discard(log *slog.Logger) *slog.Logger {
	if log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return log
}

func prepare(ctx context.Context, cfg IncrementsConfig, log *slog.Logger) (*setup, error) {
	log = discard(log)
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	s := &setup{cfg: cfg, mcSeed: cfg.Seed ^ 0x6d6331}
	s.train, s.test = cfg.Data.Split(TrainFrac, cfg.Seed)
	s.cut = make([]int, 101)
	for pct := range s.cut {
		s.cut[pct] = int(math.Round(float64(pct) / 100 * float64(s.train.Len())))
	}
	for pct := StartPct; pct < StartPct+cfg.Updates; pct++ {
		if s.cut[pct+1] == s.cut[pct] {
			return nil, fmt.Errorf("increments: %d training rows give an empty 1%% increment at %d%%", s.train.Len(), pct)
		}
	}
	if s.test.Len() == 0 {
		return nil, errors.New("increments: empty test split")
	}
	base := s.train.Subset(seq(s.cut[StartPct]))
	var err error
	s.anchor, s.stats, err = bnn.Fit(ctx, base, cfg.Classes[:cfg.Data.NumClasses], cfg.Train)
	if err != nil {
		return nil, fmt.Errorf("increments: anchor: %w", err)
	}
	pt, err := s.anchor.Predict(s.test.X, ceScreenSamples, s.mcSeed)
	if err != nil {
		return nil, fmt.Errorf("increments: %w", err)
	}
	for i, y := range s.test.Y {
		if pt.Argmax(i) == y {
			s.acc++
		}
	}
	s.acc /= float64(s.test.Len())
	log.Info("anchor trained", "rows", base.Len(), "test_accuracy", s.acc, "epochs", s.stats.Epochs, "duration", s.stats.Duration)
	if s.ce, err = s.findCE(ctx); err != nil {
		return nil, err
	}
	log.Info("counterfactual chosen", "test_row", s.ce.TestIndex, "from", s.ce.From, "target", s.ce.Target, "alpha", s.ce.Alpha, "p", s.ce.P, "var", s.ce.V)
	return s, nil
}

func seq(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

// findCE is the straight-line search described at Increments.
func (s *setup) findCE(ctx context.Context) (CE, error) {
	m, cfg := s.anchor, s.cfg
	zTrain, err := m.Standardize(s.train.X)
	if err != nil {
		return CE{}, err
	}
	// Endpoints: training rows the anchor itself puts in their labelled class with p >= 1 - delta/2.
	pTrain, err := m.Predict(s.train.X, ceScreenSamples, s.mcSeed)
	if err != nil {
		return CE{}, err
	}
	var ends []int
	for j, y := range s.train.Y {
		if pTrain.P(j, y) >= 1-cfg.Delta/2 {
			ends = append(ends, j)
		}
	}
	pTest, err := m.Predict(s.test.X, ceScreenSamples, s.mcSeed)
	if err != nil {
		return CE{}, err
	}
	d := m.Inputs()
	zx := make([]float64, d)
	for i, x := range s.test.X {
		if err := ctx.Err(); err != nil {
			return CE{}, fmt.Errorf("increments: CE search: %w", err)
		}
		from := pTest.Argmax(i)
		m.Scaler.Apply(zx, x)
		nearest, best := -1, math.Inf(1)
		for _, j := range ends {
			if s.train.Y[j] == from {
				continue
			}
			dist := 0.0
			for k, v := range zTrain.RawRowView(j) {
				dist += (v - zx[k]) * (v - zx[k])
			}
			if dist < best {
				nearest, best = j, dist
			}
		}
		if nearest < 0 {
			continue
		}
		target, xn := s.train.Y[nearest], s.train.X[nearest]
		path := make([][]float64, CESearchSteps)
		for j := range path {
			a := float64(j+1) / CESearchSteps
			path[j] = make([]float64, d)
			for k := range path[j] {
				path[j][k] = x[k] + a*(xn[k]-x[k])
			}
		}
		p, err := m.Predict(path, cfg.Samples, s.mcSeed)
		if err != nil {
			return CE{}, err
		}
		for j := range path {
			if p.P(j, target) >= 1-cfg.Delta {
				return CE{TestIndex: i, X: x, XCF: path[j], From: from, Target: target,
					Alpha: float64(j+1) / CESearchSteps, Nearest: nearest, P: p.P(j, target), V: p.V(j, target)}, nil
			}
		}
	}
	return CE{}, fmt.Errorf("increments: no test row has a counterfactual with p >= %v on its way to a confidently classified training row of another class", 1-cfg.Delta)
}

// predictCE returns p(y'|x') and its variance under m with the experiment's fixed draws.
func (s *setup) predictCE(m *bnn.Model) (p, v float64, err error) {
	pr, err := m.Predict([][]float64{s.ce.XCF}, s.cfg.Samples, s.mcSeed)
	if err != nil {
		return 0, 0, err
	}
	return pr.P(0, s.ce.Target), pr.V(0, s.ce.Target), nil
}

func (s *setup) run(ctx context.Context, cfg IncrementsConfig, log *slog.Logger) (*IncrementsResult, error) {
	log = discard(log)
	start := time.Now()
	res := &IncrementsResult{Config: cfg, TestAccuracy: s.acc, TrainStats: s.stats, CE: s.ce}
	prev := s.anchor
	p1, v1 := s.ce.P, s.ce.V
	for u := 1; u <= cfg.Updates; u++ {
		lo, hi := s.cut[StartPct+u-1], s.cut[StartPct+u]
		if cfg.UpdateData == Cumulative {
			lo = 0
		}
		rows := s.train.Subset(seqFrom(lo, hi))
		next, st, err := update.LastLayer(ctx, prev, rows.X, rows.Y, update.Config{Objective: cfg.Objective,
			LR: cfg.LR, Iterations: cfg.Steps, Seed: cfg.Seed + uint64(u)})
		if err != nil {
			return nil, fmt.Errorf("increments: update %d: %w", u, err)
		}
		p2, v2, err := s.predictCE(next)
		if err != nil {
			return nil, fmt.Errorf("increments: update %d: %w", u, err)
		}
		kl, _, err := certify.KL(next, prev)
		if err != nil {
			return nil, fmt.Errorf("increments: update %d: %w", u, err)
		}
		akl, _, err := certify.KL(next, s.anchor)
		if err != nil {
			return nil, fmt.Errorf("increments: update %d: %w", u, err)
		}
		row := Row{Update: fmt.Sprintf("%d%%->%d%%", StartPct+u-1, StartPct+u), P1: p1, P2: p2, KL: kl,
			Bound: certify.ProbLower(p1, kl, certify.Paper), V1: v1, V2: v2,
			VarBound: certify.VarUpper(v1, kl, certify.Paper), TightBound: certify.ProbLower(p1, kl, certify.Tight),
			AnchorP: s.ce.P, AnchorKL: akl, AnchorBound: certify.ProbLower(s.ce.P, akl, certify.Paper),
			LR: cfg.LR, Objective: cfg.Objective, UpdateRows: rows.Len(), Version: next.Version,
			LossStart: st.LossStart, LossEnd: st.LossEnd}
		row.Holds, row.VarHolds, row.AnchorHolds = p2 >= row.Bound, v2 <= row.VarBound, p2 >= row.AnchorBound
		res.Rows = append(res.Rows, row)
		log.Info("update", "update", row.Update, "lr", cfg.LR, "p1", p1, "p2", p2, "kl", kl, "bound", row.Bound,
			"holds", row.Holds, "anchor_kl", akl, "anchor_bound", row.AnchorBound)
		prev, p1, v1 = next, p2, v2
	}
	res.Duration = time.Since(start)
	return res, nil
}

func seqFrom(lo, hi int) []int {
	s := make([]int, 0, hi-lo)
	for i := lo; i < hi; i++ {
		s = append(s, i)
	}
	return s
}
