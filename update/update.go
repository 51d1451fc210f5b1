// Package update applies cfguard's online posterior updates to the last layer of a Bayesian MLP,
// the body kept bit-for-bit, so that the change KL(q_new || q_prev) is cheap to compute exactly
// (last layer only) and certifiable with the paper's Theorems 1 and 2. Two solvers:
//
//   - SolverConverge (the daemon's default; converge.go): the increment's negative ELBO under the
//     previous posterior, made deterministic and minimised to a tolerance, so that a step is what
//     the records say (small while they agree with the posterior, large under a drift);
//   - SolverAdam (the paper's protocol): Config.Iterations Adam steps at Config.LR with fresh weight
//     noise, whose step is capped by the optimiser (about iterations x lr per parameter).
//
// It also offers the trust-region helpers the daemon's "clip" policy uses (Interpolate and
// ClipToBudget), and Predictive, with which the daemon scores records before it learns from them.
//
// The Adam solver's two objectives (per update of N labelled rows, B a minibatch):
//
//	prior (the paper):  (1/|B|) sum_B -log p(y|x,w) + KLWeight * KL(q_L || N(0, sigma_p^2)) / N
//	vcl (variational continual learning, Nguyen et al. 2018):
//	                    (1/|B|) sum_B -log p(y|x,w) + KLWeight * KL(q_L || q_prev,L) / N
//
// where N is the increment's rows for vcl and, for prior, Config.Represented (the records the new
// posterior stands for, as the daemon passes it) or the increment's rows (the paper's protocol);
// q_L is the last layer's posterior and w = mu + sigma*eps is sampled for every layer (the
// body too; its parameters are just not trained, so the body's share of the prior KL is a
// constant and is left out). vcl penalises exactly the divergence that certification pays for;
// prior keeps it small only through the small learning rate. Measured on breast_cancer (50 Adam
// iterations, 5 or 50 new rows, 5 seeds): KL(q_new || q_prev) under prior is ~7e-4, ~0.07 and ~5
// at lr 1e-5, 1e-4 and 1e-3 (Adam moves each parameter by about lr per iteration, so
// KL ~ lr^2); vcl's is
// 2 to 1000 times smaller at the same lr, and saturates at the vcl optimum instead of growing.
//
// The objective and its gradient are evaluated by one of two engines (Config.Engine) that see
// the same minibatches and the same noise: plain Go with the closed-form gradient of the last
// layer (the default; see goObjective for the maths) or the gorgonia graph bnn.Graph (the
// reference, kept selectable and tested against the Go engine to ~1e-12).
package update

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"gonum.org/v1/gonum/mat"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// Objectives accepted by Config.Objective.
const (
	ObjectivePrior = "prior"
	ObjectiveVCL   = "vcl"
)

// Solvers accepted by Config.Solver.
const (
	// SolverAdam takes Config.Iterations Adam steps at Config.LR with fresh weight noise each
	// (the paper's protocol): the step is capped by the optimiser, about Iterations x LR per
	// parameter, whatever the records say.
	SolverAdam = "adam"
	// SolverConverge minimises a deterministic form of the objective by L-BFGS until its
	// gradient is below Config.Tolerance (see converge.go): the step is what the records and the
	// prior say it is.
	SolverConverge = "converge"
)

// Defaults applied by LastLayer to zero fields of Config.
const (
	// DefaultLR is the paper's learning rate for model changes (Section "Robustness Under Model
	// Changes"): small enough that Theorem 1's bound stays meaningful.
	DefaultLR         = 1e-5
	DefaultIterations = 50
	DefaultBatchSize  = 64
	DefaultSamples    = 1
	// DefaultVCLKLWeight is the KL weight of the vcl objective (the variational free energy has
	// weight 1). The prior objective's default is bnn.DefaultKLWeight, as in training.
	DefaultVCLKLWeight = 1.0
	// DefaultDraws is the number of fixed body draws of the converged objective.
	DefaultDraws = 16
	// DefaultTolerance is the converged solver's tolerance, in previous-posterior standard
	// deviations of the remaining step.
	DefaultTolerance = 1e-4
	// DefaultMaxIterations caps the converged solver's L-BFGS iterations (a safety net).
	DefaultMaxIterations = 500
)

// Config configures one last-layer update. Zero fields take the defaults.
type Config struct {
	// Objective is "prior" (default; the paper's NLL + KLWeight * KL(q || prior) / N) or "vcl"
	// (NLL + KLWeight * KL(q || q_prev) / N).
	Objective string
	// LR is Adam's learning rate. Default DefaultLR (1e-5).
	LR float64
	// Iterations is the number of Adam iterations. Default DefaultIterations.
	Iterations int
	// BatchSize is the number of rows per iteration; with more rows than that, iterations walk through
	// seeded shuffles of the data. Default DefaultBatchSize.
	BatchSize int
	// KLWeight scales the KL term. Default bnn.DefaultKLWeight (prior) or DefaultVCLKLWeight (vcl).
	KLWeight float64
	// Samples is the number of weight draws averaged in each iteration's NLL. Default DefaultSamples.
	Samples int
	// Seed seeds the minibatch order and the weight noise; equal seeds give bit-identical results.
	Seed uint64
	// Solver is SolverAdam (default) or SolverConverge.
	Solver string
	// Memory is the posterior's memory in records (M): the records it stands for are
	// N_t = lambda N_{t-1} + n with lambda = exp(-n / M), about M at most; with the vcl objective
	// (either solver) the previous posterior is first flattened towards the prior by stabilised
	// forgetting with the same lambda (see converge.go). 0: no forgetting.
	Memory float64
	// Represented is the number of records the new posterior stands for; the prior objective
	// divides its KL term by it (as training divides by its rows). 0: the increment's rows (the
	// paper's protocol).
	Represented float64
	// Draws is the converged solver's number of fixed body draws. Default DefaultDraws.
	Draws int
	// Tolerance is the converged solver's stopping rule: the largest gradient coordinate in
	// previous-posterior standard deviations, times KLWeight / D. Default DefaultTolerance.
	Tolerance float64
	// MaxIterations caps the converged solver's iterations. Default DefaultMaxIterations.
	MaxIterations int
	// Engine evaluates the objective and its gradient: "go" (default; plain Go with the
	// closed-form last-layer gradient, about 4.5x faster on the paper's architecture, see
	// BenchmarkLastLayer) or "gorgonia" (bnn.Graph's autodiff, the reference). Both see the same
	// minibatches and the same weight noise and compute the same objective, so their results
	// agree up to floating-point rounding (KL(q_new || q_prev) to ~1e-14 relative).
	Engine string
	// FreezeSigma makes the converged solver move the last layer's means only: the log sigmas
	// stay prev's, bit for bit (SettleMeans). The Adam solver refuses it.
	FreezeSigma bool
}

// Stats describes an update. LossStart and LossEnd are the loss of the first minibatch under the
// same weight noise, for the parameters before and after the update, so they are comparable.
type Stats struct {
	Objective          string
	Iterations         int
	Rows               int
	LossStart, LossEnd float64
	NLLStart, NLLEnd   float64
	// KL is the exact KL(q_new || q_prev) over every parameter (certify.KL; only the last layer
	// contributes).
	KL       float64
	Duration time.Duration
	// Converged is the converged solver's verdict: the tolerance was met before MaxIterations.
	// Always false for the Adam solver. Evaluations counts its objective evaluations.
	Converged   bool
	Evaluations int
	// Forgetting is lambda = exp(-n / Memory) (1 without forgetting).
	Forgetting float64
}

// ErrRefused is wrapped by the error LastLayer returns when the update ran but its result is
// unusable (NaN, infinite, or a sigma that is not a positive normal float64).
var ErrRefused = errors.New("update refused")

func (cfg Config) withDefaults() Config {
	cfg.Objective = cmp.Or(cfg.Objective, ObjectivePrior)
	cfg.Solver = cmp.Or(cfg.Solver, SolverAdam)
	cfg.Draws = cmp.Or(cfg.Draws, DefaultDraws)
	cfg.Tolerance = cmp.Or(cfg.Tolerance, DefaultTolerance)
	cfg.MaxIterations = cmp.Or(cfg.MaxIterations, DefaultMaxIterations)
	cfg.Engine = cmp.Or(cfg.Engine, EngineGo)
	cfg.LR = cmp.Or(cfg.LR, DefaultLR)
	cfg.Iterations = cmp.Or(cfg.Iterations, DefaultIterations)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, DefaultBatchSize)
	cfg.Samples = cmp.Or(cfg.Samples, DefaultSamples)
	if cfg.KLWeight == 0 {
		if cfg.Objective == ObjectiveVCL {
			cfg.KLWeight = DefaultVCLKLWeight
		} else {
			cfg.KLWeight = bnn.DefaultKLWeight
		}
	}
	return cfg
}

// Validate checks a Config after defaults; errors name the field and value.
func (cfg Config) Validate() error {
	c := cfg.withDefaults()
	switch {
	case c.Objective != ObjectivePrior && c.Objective != ObjectiveVCL:
		return fmt.Errorf("update: objective %q, want %q or %q", c.Objective, ObjectivePrior, ObjectiveVCL)
	case c.Solver != SolverAdam && c.Solver != SolverConverge:
		return fmt.Errorf("update: solver %q, want %q or %q", c.Solver, SolverAdam, SolverConverge)
	case c.FreezeSigma && c.Solver != SolverConverge:
		return fmt.Errorf("update: freeze sigma with solver %q: only %q keeps the sigmas", c.Solver, SolverConverge)
	case !(c.Memory >= 0) || math.IsInf(c.Memory, 0):
		return fmt.Errorf("update: memory %v records, want finite and >= 0 (0: no forgetting)", c.Memory)
	case !(c.Represented >= 0) || math.IsInf(c.Represented, 0):
		return fmt.Errorf("update: represented records %v, want finite and >= 0", c.Represented)
	case c.Draws < 1:
		return fmt.Errorf("update: draws %d, want >= 1", c.Draws)
	case !(c.Tolerance > 0) || math.IsInf(c.Tolerance, 0):
		return fmt.Errorf("update: tolerance %v, want finite and > 0", c.Tolerance)
	case c.MaxIterations < 1:
		return fmt.Errorf("update: max iterations %d, want >= 1", c.MaxIterations)
	case c.Engine != EngineGo && c.Engine != EngineGorgonia:
		return fmt.Errorf("update: engine %q, want %q or %q", c.Engine, EngineGo, EngineGorgonia)
	case !(c.LR > 0) || math.IsInf(c.LR, 0):
		return fmt.Errorf("update: lr %v, want finite and > 0", c.LR)
	case c.Iterations < 1:
		return fmt.Errorf("update: iterations %d, want >= 1", c.Iterations)
	case c.BatchSize < 1:
		return fmt.Errorf("update: batch size %d, want >= 1", c.BatchSize)
	case c.Samples < 1:
		return fmt.Errorf("update: samples %d, want >= 1", c.Samples)
	case !(c.KLWeight >= 0) || math.IsInf(c.KLWeight, 0):
		return fmt.Errorf("update: kl weight %v, want finite and >= 0", c.KLWeight)
	}
	return nil
}

// LastLayer returns a new posterior: prev with its last layer trained on the raw rows (X, y) on
// the chosen objective (see the package comment) by cfg.Solver: SolverConverge (the daemon's
// default, update.solver) minimises it with L-BFGS until the largest gradient is below
// cfg.Tolerance on the KL's scale, at most cfg.MaxIterations iterations; SolverAdam (this
// package's zero value, the paper's optimiser) takes cfg.Iterations Adam iterations. The
// result's body layers are bit-for-bit prev's, its Version is prev.Version+1, and it is a
// deterministic function of (prev, X, y, cfg).
//
// prev is never modified, whatever happens. Bad input (empty, wrong width, NaN/Inf, label out of
// range) and bad configuration give an error naming the problem; a cancelled ctx (checked before
// every iteration of either solver) returns ctx's error; a result with a NaN/Inf value or an unusable sigma is refused
// with an error wrapping ErrRefused (and bnn.ErrNonFinite). No model is returned with an error.
func LastLayer(ctx context.Context, prev *bnn.Model, X [][]float64, y []int, cfg Config) (*bnn.Model, Stats, error) {
	start := time.Now()
	if err := cfg.Validate(); err != nil {
		return nil, Stats{}, err
	}
	cfg = cfg.withDefaults()
	if err := prev.Validate(); err != nil {
		return nil, Stats{}, fmt.Errorf("update: previous posterior: %w", err)
	}
	z, err := prev.Standardize(X)
	if err != nil {
		return nil, Stats{}, fmt.Errorf("update: %w", err)
	}
	if err := bnn.CheckLabels(y, len(X), prev.NumClasses()); err != nil {
		return nil, Stats{}, fmt.Errorf("update: %w", err)
	}
	n := len(X)
	if cfg.Solver == SolverConverge {
		return lastLayerConverged(ctx, start, prev, z, y, cfg)
	}
	gr, err := newObjective(prev, n, cfg)
	if err != nil {
		return nil, Stats{}, fmt.Errorf("update: %w", err)
	}
	defer gr.Close()

	st := Stats{Objective: cfg.Objective, Rows: n}
	order := rand.New(rand.NewPCG(cfg.Seed, 0x0bde))
	noise := func(it int) *rand.Rand { return rand.New(rand.NewPCG(cfg.Seed, 0xe95<<32|uint64(it))) }
	var perm []int
	pos := n // forces a shuffle before the first iteration
	next := func() []int {
		idx := make([]int, 0, gr.Batch())
		for len(idx) < gr.Batch() {
			if pos == n {
				perm, pos = order.Perm(n), 0
			}
			idx = append(idx, perm[pos])
			pos++
		}
		return idx
	}
	bind := func(idx []int) error {
		rows, labels := make([][]float64, len(idx)), make([]int, len(idx))
		for i, r := range idx {
			rows[i], labels[i] = z.RawRowView(r), y[r]
		}
		return gr.SetBatch(rows, labels)
	}
	var first []int
	opt := bnn.NewAdam(gr.Params(), cfg.LR)
	for it := 0; it < cfg.Iterations; it++ {
		if err := ctx.Err(); err != nil {
			return nil, st, fmt.Errorf("update: iteration %d: %w", it+1, err)
		}
		idx := next()
		if it == 0 {
			first = idx
		}
		if err := bind(idx); err != nil {
			return nil, st, fmt.Errorf("update: %w", err)
		}
		gr.DrawEps(noise(it))
		ev, err := gr.Run()
		if err != nil {
			return nil, st, fmt.Errorf("update: iteration %d: %w: %w", it+1, ErrRefused, err)
		}
		if it == 0 {
			st.LossStart, st.NLLStart = ev.Loss, ev.NLL
		}
		opt.Step(gr.Params())
		st.Iterations++
	}
	// The first minibatch and noise again, at the final parameters.
	if err := bind(first); err != nil {
		return nil, st, fmt.Errorf("update: %w", err)
	}
	gr.DrawEps(noise(0))
	ev, err := gr.Run()
	if err != nil {
		return nil, st, fmt.Errorf("update: final evaluation: %w: %w", ErrRefused, err)
	}
	st.LossEnd, st.NLLEnd = ev.Loss, ev.NLL

	out := prev.Clone()
	if err := gr.WriteTo(out); err != nil {
		return nil, st, fmt.Errorf("update: %w: %w", ErrRefused, err)
	}
	return finish(prev, out, n, cfg, st, start)
}

// finish checks the new posterior out (valid, prev's body bit for bit), gives it its version and
// the records it stands for, and completes st with the update KL, the forgetting and the time.
func finish(prev, out *bnn.Model, n int, cfg Config, st Stats, start time.Time) (*bnn.Model, Stats, error) {
	if err := out.Validate(); err != nil {
		return nil, st, fmt.Errorf("update: %w: %w", ErrRefused, err)
	}
	if !bnn.SameBody(out, prev) {
		return nil, st, fmt.Errorf("update: %w: body changed (internal error)", ErrRefused)
	}
	kl, _, err := certify.KL(out, prev)
	if err != nil {
		return nil, st, fmt.Errorf("update: %w: %w", ErrRefused, err)
	}
	out.Version = prev.Version + 1
	out.Records = represented(prev, n, cfg)
	st.KL, st.Duration, st.Forgetting = kl, time.Since(start), forgetting(n, cfg.Memory)
	return out, st, nil
}

// represented is the number of records the update of prev on n records leaves the posterior
// standing for: cfg.Represented when given, else Represented(prev.Records, n, cfg.Memory).
func represented(prev *bnn.Model, n int, cfg Config) float64 {
	if cfg.Represented > 0 {
		return cfg.Represented
	}
	return Represented(prev.Records, n, cfg.Memory)
}

// Represented is N_t = lambda N_{t-1} + n, lambda = exp(-n / memory) (1 for memory 0): the
// records a posterior standing for prev records stands for after an update on n more.
func Represented(prev float64, n int, memory float64) float64 {
	return forgetting(n, memory)*prev + float64(n)
}

// lastLayerConverged is LastLayer's converged solver (see converge.go) on the standardised
// rows z.
func lastLayerConverged(ctx context.Context, start time.Time, prev *bnn.Model, z *mat.Dense, y []int, cfg Config) (*bnn.Model, Stats, error) {
	n, _ := z.Dims()
	rows := make([][]float64, n)
	for r := range rows {
		rows[r] = z.RawRowView(r)
	}
	st := Stats{Objective: cfg.Objective, Rows: n}
	c, err := newConverged(prev, rows, y, cfg)
	if err != nil {
		return nil, st, fmt.Errorf("update: %w", err)
	}
	x0 := make([]float64, 2*len(c.mu0))
	c.set(x0)
	st.LossStart = c.eval(nil)
	st.NLLStart = c.lastNLL
	x, iters, ok, err := c.minimize(ctx, cfg.Tolerance*c.klScale, cfg.MaxIterations)
	if err != nil {
		if ctx.Err() != nil {
			return nil, st, fmt.Errorf("update: %w", ctx.Err())
		}
		return nil, st, fmt.Errorf("update: %w: %w", ErrRefused, err)
	}
	c.set(x)
	st.LossEnd = c.eval(nil)
	st.NLLEnd, st.Iterations, st.Converged, st.Evaluations = c.lastNLL, iters, ok, c.evals
	out := prev.Clone()
	c.writeTo(out)
	return finish(prev, out, n, cfg, st, start)
}

// graphConfig is the objective of an update of prev on n rows (cfg with defaults applied): for
// vcl, the KL term's target is prev flattened by the memory (flattened), as in the converged
// solver.
func graphConfig(prev *bnn.Model, n int, cfg Config) bnn.GraphConfig {
	g := bnn.GraphConfig{Batch: min(cfg.BatchSize, n), Samples: cfg.Samples, LastOnly: true,
		KLScale: cfg.KLWeight / float64(n)}
	if cfg.Objective == ObjectiveVCL {
		g.Prev = flattened(prev, forgetting(n, cfg.Memory))
	} else if cfg.Represented > 0 {
		g.KLScale = cfg.KLWeight / cfg.Represented // as training divides by its rows
	}
	return g
}

// Interpolate returns a copy of next whose last layer is moved back towards prev's along the
// straight line in (mu, log_sigma):
//
//	mu_t = mu_prev + t (mu_next - mu_prev),   log_sigma_t = ls_prev + t (ls_next - ls_prev).
//
// t = 0 gives prev's last layer and t = 1 next's, both bit-for-bit. The body, scaler, names and
// Version are next's. prev and next must have the same last-layer shape (as LastLayer
// guarantees); Interpolate panics otherwise, a programmer error. Neither input is modified.
func Interpolate(prev, next *bnn.Model, t float64) *bnn.Model {
	out := next.Clone()
	a, b, o := prev.Last(), next.Last(), out.Last()
	if a.In != b.In || a.Out != b.Out {
		panic(fmt.Sprintf("update.Interpolate: last layers are %dx%d and %dx%d", a.Out, a.In, b.Out, b.In))
	}
	lerp := func(dst, p, q []float64) {
		for i := range dst {
			switch t {
			case 0:
				dst[i] = p[i]
			case 1:
				dst[i] = q[i]
			default:
				dst[i] = p[i] + t*(q[i]-p[i])
			}
		}
	}
	lerp(o.WeightMu, a.WeightMu, b.WeightMu)
	lerp(o.WeightLogSigma, a.WeightLogSigma, b.WeightLogSigma)
	lerp(o.BiasMu, a.BiasMu, b.BiasMu)
	lerp(o.BiasLogSigma, a.BiasLogSigma, b.BiasLogSigma)
	return out
}

// ClipToBudget scales the update from prev to next back, if needed, so that the result q_t =
// Interpolate(prev, next, t) satisfies KL(q_t || prev) <= budget, with the largest such t in
// [0, 1] (to within 1e-12, found by bisection). When next is already within budget it returns a
// copy of next and t = 1.
//
// Along this path the KL is monotone non-decreasing in t for any size of update, not only small
// ones: per parameter, with change (dm, dl),
//
//	KL_j(t) = (exp(2 t dl) - 1 - 2 t dl) / 2 + t^2 dm^2 / (2 s_prev^2),
//	dKL_j/dt = dl (exp(2 t dl) - 1) + t dm^2 / s_prev^2 >= 0  for t >= 0,
//
// since dl and exp(2 t dl) - 1 have the same sign. So the set {t : KL <= budget} is an interval
// [0, t*] and bisection finds t*. The bodies must be bit-identical (bnn.SameBody), so that the KL
// is the last layer's alone; budget must be finite and >= 0.
func ClipToBudget(prev, next *bnn.Model, budget float64) (*bnn.Model, float64, error) {
	if !(budget >= 0) || math.IsInf(budget, 0) {
		return nil, 0, fmt.Errorf("clip: budget %v, want finite and >= 0", budget)
	}
	if err := next.Validate(); err != nil {
		return nil, 0, fmt.Errorf("clip: next: %w", err)
	}
	if _, _, err := certify.KL(next, prev); err != nil {
		return nil, 0, fmt.Errorf("clip: %w", err)
	}
	if !bnn.SameBody(prev, next) {
		return nil, 0, errors.New("clip: the models' bodies differ; only last-layer updates can be clipped")
	}
	kl := func(t float64) float64 {
		k, _, err := certify.KL(Interpolate(prev, next, t), prev)
		if err != nil {
			return math.Inf(1)
		}
		return k
	}
	if kl(1) <= budget {
		return Interpolate(prev, next, 1), 1, nil
	}
	lo, hi := 0.0, 1.0 // kl(lo) <= budget < kl(hi)
	for hi-lo > 1e-12 {
		mid := lo + (hi-lo)/2
		if kl(mid) <= budget {
			lo = mid
		} else {
			hi = mid
		}
	}
	return Interpolate(prev, next, lo), lo, nil
}
