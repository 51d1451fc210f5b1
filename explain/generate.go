package explain

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// Result is a counterfactual. Every Result returned with a nil error is valid: the final
// FinalSamples-draw estimate of the posterior predictive puts Target first.
type Result struct {
	Method Method    `json:"method"`
	XCF    []float64 `json:"x_cf"` // the counterfactual, raw feature units
	// Original is the class the posterior predictive gives the query x; Target the class sought.
	Original int `json:"original"`
	Target   int `json:"target"`
	// P1 and Var1 estimate E_q[p(Target|x',w)] and Var_q[p(Target|x',w)] with Samples draws:
	// bnn.Model.PredictWith([XCF], Samples, Seed, Precision) reproduces them.
	P1        float64       `json:"p1"`
	Var1      float64       `json:"var1"`
	Samples   int           `json:"samples"`
	Seed      uint64        `json:"seed"`
	Precision bnn.Precision `json:"precision"`
	// P1Lower is Hoeffding's lower confidence bound on P1 at level Alpha:
	//	P1Lower = P1 - sqrt(ln(1/alpha) / (2 Samples)).
	P1Lower float64 `json:"p1_lower"`
	// Iterations is the number of iterations taken (Adam iterations or Schut's feature moves).
	Iterations int `json:"iterations"`
	// InSet: P1 >= 1 - delta and Var1 <= epsilon (certify.InSet), or, with Config.TargetAlpha,
	// the lower confidence bound renewal uses >= 1 - delta (certify.Renewable). Valid: Target is the argmax
	// of the estimate.
	InSet bool `json:"in_set"`
	Valid bool `json:"valid"`
	// Confirmed: valid, and P1Lower > 1/2 (Hoeffding-confirmed p1 > 1/2), so that Theorem 1
	// leaves it a positive KL budget (P1Lower - 1/2)^2 / 2 under the posterior it was generated
	// with. This is the generator's own check, not a stored status (certify.Status): the ledger
	// certifies a CE when it registers it.
	Confirmed bool `json:"confirmed"`
	// Distance is ||z' - z||_2 in standardised units.
	Distance float64 `json:"distance"`
	// Reason says why the search stopped short of its goal ("" when it reached it).
	Reason string `json:"reason,omitempty"`
	// PosteriorVersion is the version of the posterior the Result was generated with.
	PosteriorVersion uint64        `json:"posterior_version"`
	Duration         time.Duration `json:"duration_ns"`
}

// ErrInvalidInput is wrapped by every error about a request: dimension, non-finite features,
// target class.
var ErrInvalidInput = errors.New("invalid counterfactual request")

// ErrAlreadyTarget is wrapped, beside ErrInvalidInput, by the error of a request whose x the
// model already puts in the target class: well formed, but no counterfactual can exist.
var ErrAlreadyTarget = errors.New("x is already classified as the target")

// ErrConfig is wrapped by errors about the Generator's configuration, model or VAE.
var ErrConfig = errors.New("invalid counterfactual generator")

// ErrNotFound is wrapped when a search ends without a valid counterfactual.
var ErrNotFound = errors.New("no valid counterfactual found")

// NotFoundError reports a search that ended without a valid counterfactual. Best is the last
// iterate with its estimates (Valid false); it is not a counterfactual.
type NotFoundError struct {
	Best   *Result
	Reason string
}

func (e *NotFoundError) Error() string { return fmt.Sprintf("%v: %s", ErrNotFound, e.Reason) }

// Unwrap makes errors.Is(err, ErrNotFound) true.
func (e *NotFoundError) Unwrap() error { return ErrNotFound }

// Generator generates counterfactuals for one model. It is safe for concurrent use; each call
// builds (or reuses a spare) objective graph of its own.
type Generator struct {
	m   *bnn.Model
	vae *VAE
	cfg Config
	err error

	// Drawn once (ensembles): the optimiser's PoolSize networks, the confirmation ensemble
	// (CheckSamples) and the final ensemble (FinalSamples).
	once      sync.Once
	nets      []*bnn.Net
	checkPool *bnn.Pool
	finalPool *bnn.Pool
	drawErr   error

	mu   sync.Mutex
	free []*objective
}

// NewGenerator returns a generator for model (cloned; later changes to model are not seen). vae
// is required for PSCE unless cfg.WithoutVAE, and ignored by the baselines. Problems with the
// arguments are reported by every Generate call (errors wrapping ErrConfig).
func NewGenerator(model *bnn.Model, vae *VAE, cfg Config) *Generator {
	cfg = cfg.withDefaults()
	g := &Generator{cfg: cfg}
	switch {
	case model == nil:
		g.err = fmt.Errorf("%w: nil model", ErrConfig)
	case model.Validate() != nil:
		g.err = fmt.Errorf("%w: %v", ErrConfig, model.Validate())
	default:
		g.m = model.Clone()
	}
	if g.err == nil {
		if err := cfg.validate(); err != nil {
			g.err = fmt.Errorf("%w: %v", ErrConfig, err)
		} else if cfg.FinalPool != nil && cfg.FinalPool.Version() != model.Version {
			g.err = fmt.Errorf("%w: the final pool was drawn from posterior version %d, the model is version %d", ErrConfig,
				cfg.FinalPool.Version(), model.Version)
		}
	}
	if g.err == nil && cfg.Method == MethodPSCE {
		switch {
		case cfg.WithoutVAE:
		case vae == nil:
			g.err = fmt.Errorf("%w: psce needs a VAE (or Config.WithoutVAE, without its plausibility terms)", ErrConfig)
		case vae.validate() != nil:
			g.err = fmt.Errorf("%w: vae: %v", ErrConfig, vae.validate())
		case vae.Compatible(g.m) != nil:
			g.err = fmt.Errorf("%w: %v", ErrConfig, vae.Compatible(g.m))
		default:
			g.vae = vae
		}
	}
	return g
}

// Config returns the generator's configuration with defaults applied.
func (g *Generator) Config() Config { return g.cfg }

// seedFor derives independent seeds for the generator's random streams (splitmix64 of seed^tag).
func seedFor(seed, tag uint64) uint64 {
	z := seed ^ tag
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

const (
	tagPool  = 0x706f6f6c
	tagCheck = 0x636865636b
	tagFinal = 0x66696e616c
	tagIter  = 0x69746572
)

// ensembles draws the optimiser's networks and the confirmation and final ensembles, once per
// Generator: every Generate call (every CE) shares them.
func (g *Generator) ensembles() error {
	g.once.Do(func() {
		seed := seedFor(g.cfg.Seed, tagPool)
		g.nets = make([]*bnn.Net, g.cfg.PoolSize)
		for s := range g.nets {
			g.nets[s] = g.m.NewNet()
			g.m.Sample(bnn.SampleSeed(seed, s), g.nets[s])
		}
		if g.checkPool, g.drawErr = bnn.NewPool(g.m, g.cfg.CheckSamples, seedFor(g.cfg.Seed, tagCheck), g.cfg.Precision); g.drawErr != nil {
			return
		}
		if g.cfg.FinalPool != nil {
			g.finalPool = g.cfg.FinalPool
			return
		}
		g.finalPool, g.drawErr = bnn.NewPool(g.m, g.cfg.FinalSamples, seedFor(g.cfg.Seed, tagFinal), g.cfg.Precision)
	})
	return g.drawErr
}

func (g *Generator) getObjective() (*objective, error) {
	g.mu.Lock()
	if n := len(g.free); n > 0 {
		o := g.free[n-1]
		g.free = g.free[:n-1]
		g.mu.Unlock()
		return o, nil
	}
	g.mu.Unlock()
	return newObjective(g.m, g.vae, g.cfg.Samples)
}

func (g *Generator) putObjective(o *objective) {
	g.mu.Lock()
	g.free = append(g.free, o)
	g.mu.Unlock()
}

// estimate is a Monte-Carlo posterior predictive for one input.
type estimate struct {
	mean, vr []float64 // per class
	samples  int       // the draws they were estimated from
}

func (e estimate) argmax() int {
	best := 0
	for c := range e.mean {
		if e.mean[c] > e.mean[best] {
			best = c
		}
	}
	return best
}

// raw maps a standardised z back to raw feature units.
func (g *Generator) raw(z []float64) []float64 {
	x := make([]float64, len(z))
	for j := range z {
		x[j] = z[j]*g.m.Scaler.Std[j] + g.m.Scaler.Mean[j]
	}
	return x
}

// estimate is the posterior predictive of the standardised z over the networks of pool.
func (g *Generator) estimate(ctx context.Context, pool *bnn.Pool, z []float64) (estimate, error) {
	p, err := pool.Predict(ctx, [][]float64{g.raw(z)})
	if err != nil {
		return estimate{}, err
	}
	return estimate{mean: p.Mean, vr: p.Var, samples: p.S}, nil
}

// meets is the method's stopping rule on an estimate.
func (g *Generator) meets(e estimate, target int) bool {
	if e.argmax() != target {
		return false
	}
	switch g.cfg.Method {
	case MethodPSCE:
		return g.inSet(e.mean[target], e.vr[target], e.samples)
	case MethodSchut:
		return e.mean[target] >= g.cfg.Confidence
	}
	return true
}

// inSet is PSCE's <delta, epsilon>-set: on the point estimates, or with Config.TargetAlpha on
// the lower confidence bound renewal uses.
func (g *Generator) inSet(p, v float64, samples int) bool {
	if g.cfg.TargetAlpha > 0 {
		return certify.Renewable(certify.Evidence{P: p, Var: v, Samples: samples}, g.cfg.Delta, g.cfg.Epsilon, g.cfg.TargetAlpha)
	}
	return certify.InSet(p, v, g.cfg.Delta, g.cfg.Epsilon)
}

// gate is a cheap pre-test on the minibatch probabilities (S x C) before the check ensemble is
// consulted: the minibatch mean puts the target first and, for PSCE and Schut, within 0.05 of the
// probability the rule asks for.
func (g *Generator) gate(probs []float64, c, target int) bool {
	mean := make([]float64, c)
	s := len(probs) / c
	for i := 0; i < s; i++ {
		for j := 0; j < c; j++ {
			mean[j] += probs[i*c+j] / float64(s)
		}
	}
	e := estimate{mean: mean}
	if e.argmax() != target {
		return false
	}
	switch g.cfg.Method {
	case MethodPSCE:
		return mean[target] >= 1-g.cfg.Delta-0.05
	case MethodSchut:
		return mean[target] >= g.cfg.Confidence-0.05
	}
	return true
}

// Generate searches a counterfactual for the raw input x towards class target (-1: the class,
// other than x's predicted class, with the highest predictive probability at x). Errors wrap
// ErrInvalidInput for bad requests (wrong dimension, non-finite feature, target out of range or
// equal to x's predicted class), ErrConfig for a bad generator, ErrNotFound (as *NotFoundError)
// when no valid counterfactual was found, and ctx.Err() when ctx ends first.
func (g *Generator) Generate(ctx context.Context, x []float64, target int) (*Result, error) {
	start := time.Now()
	if g.err != nil {
		return nil, g.err
	}
	d, c := g.m.Inputs(), g.m.NumClasses()
	if len(x) != d {
		return nil, fmt.Errorf("%w: x has %d features, model expects %d", ErrInvalidInput, len(x), d)
	}
	for j, v := range x {
		if !finite(v) {
			name := fmt.Sprintf("%d", j)
			if len(g.m.Features) == d {
				name = fmt.Sprintf("%d (%s)", j, g.m.Features[j])
			}
			return nil, fmt.Errorf("%w: feature %s is %v", ErrInvalidInput, name, v)
		}
	}
	if target < -1 || target >= c {
		return nil, fmt.Errorf("%w: target class %d, want -1 (any other class) or 0..%d", ErrInvalidInput, target, c-1)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := g.ensembles(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	z0 := make([]float64, d)
	g.m.Scaler.Apply(z0, x)
	e0, err := g.estimate(ctx, g.checkPool, z0)
	if err != nil {
		return nil, err
	}
	orig := e0.argmax()
	if target == -1 {
		for k := 0; k < c; k++ {
			if k != orig && (target == -1 || e0.mean[k] > e0.mean[target]) {
				target = k
			}
		}
	}
	if target == orig {
		return nil, fmt.Errorf("%w: %w: class %d (%s), with p = %.4f; a counterfactual must change the class",
			ErrInvalidInput, ErrAlreadyTarget, target, g.m.Classes[target], e0.mean[target])
	}
	o, err := g.getObjective()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	defer g.putObjective(o)
	var res *Result
	if g.cfg.Method == MethodSchut {
		res, err = g.schut(ctx, o, z0, target)
	} else {
		res, err = g.descend(ctx, o, z0, target)
	}
	if err != nil {
		return nil, err
	}
	res.Original = orig
	res.Duration = time.Since(start)
	// Under StopConfirmed a search returns only what met its rule (done); an attempt it gave up
	// on (the iteration cap, a failed objective) is no counterfactual of the method's kind, valid
	// or not. Under StopEstimate the paper's protocol accepts a valid attempt.
	if !res.Valid || g.cfg.Stop == StopConfirmed && !g.meetsResult(res) {
		return nil, &NotFoundError{Best: res, Reason: res.Reason}
	}
	return res, nil
}

// meetsResult applies the stopping rule to a final estimate.
func (g *Generator) meetsResult(r *Result) bool {
	if !r.Valid {
		return false
	}
	switch g.cfg.Method {
	case MethodPSCE:
		return r.InSet
	case MethodSchut:
		return r.P1 >= g.cfg.Confidence
	}
	return true
}

// final estimates the posterior predictive at z with the final ensemble (FinalSamples draws,
// seed derived from Config.Seed) and builds the Result.
func (g *Generator) final(ctx context.Context, z, z0 []float64, target, it int) (*Result, error) {
	dist := 0.0
	for j := range z {
		dist += (z[j] - z0[j]) * (z[j] - z0[j])
	}
	xr := g.raw(z)
	p, err := g.finalPool.Predict(ctx, [][]float64{xr})
	if err != nil {
		return nil, err
	}
	r := &Result{Method: g.cfg.Method, XCF: xr, Target: target, Samples: p.S, Seed: g.finalPool.Seed(), Precision: p.Precision,
		Iterations: it, Distance: math.Sqrt(dist), PosteriorVersion: g.m.Version}
	r.P1, r.Var1 = p.P(0, target), p.V(0, target)
	r.P1Lower = certify.HoeffdingLower(r.P1, r.Samples, g.cfg.Alpha)
	r.Valid = p.Argmax(0) == target
	r.InSet = g.inSet(r.P1, r.Var1, r.Samples)
	r.Confirmed = r.Valid && r.P1Lower > 0.5
	return r, nil
}
