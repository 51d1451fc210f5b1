package explain

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// Method names a counterfactual generator.
type Method string

// The generators: the paper's PSCE and the two baselines.
const (
	// MethodPSCE is the paper's objective (package documentation), stopping in the
	// <delta,eps>-set.
	MethodPSCE Method = "psce"
	// MethodWachter is Wachter et al. (2017) on the Bayesian model: Adam on
	// Class * (-E_w[log p(y'|x',w)]) + Prox * ||x' - x||^2 (standardised units), stopping as soon
	// as the posterior predictive puts y' first, as CARLA's implementation does.
	MethodWachter Method = "wachter"
	// MethodSchut is the greedy search of Schut et al. (2021, Algorithm 1 "greedy"): repeatedly
	// move the one feature with the largest |d E_w[log p(y'|x',w)] / dx'_j| by Step (standardised
	// units) in the direction that raises the target, each feature at most MaxChanges times, until
	// the posterior predictive reaches Confidence.
	MethodSchut Method = "schut"
)

// ParseMethod accepts "psce", "wachter" and "schut".
func ParseMethod(s string) (Method, error) {
	switch m := Method(s); m {
	case MethodPSCE, MethodWachter, MethodSchut:
		return m, nil
	}
	return "", fmt.Errorf("unknown counterfactual method %q (want psce, wachter or schut)", s)
}

// Config configures a Generator. Zero fields take the defaults in brackets, which are the paper's
// settings for the Wisconsin Breast Cancer data where it gives them.
type Config struct {
	Method Method // [psce]

	LR      float64 // Adam learning rate for x' (standardised units) [0.1]
	MaxIter int     // iteration cap: Adam steps, or Schut's feature moves [2000]

	// Samples is S, the networks per iteration over which the loss's expectations are averaged
	// [32]. They are a fresh minibatch each iteration from a fixed pool of PoolSize posterior
	// draws [256], reshuffled whenever it is used up: fresh enough that x' cannot overfit a few
	// networks, without drawing S x (number of parameters) normals every iteration. Neither the
	// pool nor the minibatches decide success; see CheckSamples and FinalSamples.
	Samples, PoolSize int
	// CheckSamples independent draws [500], disjoint from the pool, confirm that an iterate meets
	// the stopping rule; FinalSamples [1000] fresh draws (bnn.Model.Predict with the Result's
	// Seed) then give the reported P1 and Var1, which must meet the rule again.
	CheckSamples, FinalSamples int

	Delta float64 // the <delta,eps>-set's delta: p >= 1 - delta [0.05]
	Eps   float64 // the <delta,eps>-set's eps: Var <= eps [0.01]

	// Weights of the gradient methods; nil means DefaultWeights for PSCE and WachterWeights for
	// Wachter. Set a non-nil value (e.g. &PaperWeights) to choose others or to ablate terms;
	// zeros are then taken as given.
	Weights *Weights

	Step       float64 // Schut: move per change, standardised units [0.1]
	MaxChanges int     // Schut: changes per feature [10]
	Confidence float64 // Schut: stop when p(y'|x') >= Confidence [0.95]

	// Alpha is the Hoeffding level of Result.P1Lower [0.01].
	Alpha float64
	// Seed makes Generate deterministic: same model, VAE, config, x and target give the same result.
	Seed uint64
}

// DefaultConfig returns the defaults for method.
func DefaultConfig(method Method) Config {
	return Config{Method: method}.withDefaults()
}

func (c Config) withDefaults() Config {
	if c.Method == "" {
		c.Method = MethodPSCE
	}
	def := func(p *float64, v float64) {
		if *p == 0 {
			*p = v
		}
	}
	defi := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	def(&c.LR, 0.1)
	defi(&c.MaxIter, 2000)
	defi(&c.Samples, 32)
	defi(&c.PoolSize, 256)
	defi(&c.CheckSamples, 500)
	defi(&c.FinalSamples, 1000)
	def(&c.Delta, 0.05)
	def(&c.Eps, 0.01)
	def(&c.Step, 0.1)
	defi(&c.MaxChanges, 10)
	def(&c.Confidence, 0.95)
	def(&c.Alpha, 0.01)
	if c.Weights == nil {
		w := DefaultWeights
		if c.Method != MethodPSCE {
			w = WachterWeights
		}
		c.Weights = &w
	}
	return c
}

func (c Config) validate() error {
	if _, err := ParseMethod(string(c.Method)); err != nil {
		return err
	}
	switch {
	case !(c.LR > 0) || math.IsInf(c.LR, 0):
		return fmt.Errorf("lr %v, want finite and > 0", c.LR)
	case c.MaxIter < 0:
		return fmt.Errorf("max_iter %d, want >= 0", c.MaxIter)
	case c.Samples < 2:
		return fmt.Errorf("samples %d, want >= 2", c.Samples)
	case c.PoolSize < c.Samples:
		return fmt.Errorf("pool_size %d, want >= samples (%d)", c.PoolSize, c.Samples)
	case c.CheckSamples < 2 || c.FinalSamples < 2:
		return fmt.Errorf("check_samples %d / final_samples %d, want >= 2", c.CheckSamples, c.FinalSamples)
	case !(c.Delta > 0 && c.Delta < 0.5):
		return fmt.Errorf("delta %v, want in (0, 0.5)", c.Delta)
	case !(c.Eps > 0 && c.Eps <= 0.25):
		return fmt.Errorf("eps %v, want in (0, 0.25]", c.Eps)
	case !(c.Step > 0) || math.IsInf(c.Step, 0):
		return fmt.Errorf("step %v, want finite and > 0", c.Step)
	case c.MaxChanges < 1:
		return fmt.Errorf("max_changes %d, want >= 1", c.MaxChanges)
	case !(c.Confidence > 0 && c.Confidence < 1):
		return fmt.Errorf("confidence %v, want in (0, 1)", c.Confidence)
	case !(c.Alpha > 0 && c.Alpha < 1):
		return fmt.Errorf("alpha %v, want in (0, 1)", c.Alpha)
	}
	return c.Weights.validate()
}

// Result is a counterfactual. Every Result returned with a nil error is valid: the fresh
// FinalSamples-draw estimate of the posterior predictive puts Target first.
type Result struct {
	Method Method    `json:"method"`
	XCF    []float64 `json:"x_cf"` // the counterfactual, raw feature units
	// Original is the class the posterior predictive gives the query x; Target the class sought.
	Original int `json:"original"`
	Target   int `json:"target"`
	// P1 and Var1 estimate E_q[p(Target|x',w)] and Var_q[p(Target|x',w)] with Samples fresh
	// draws: bnn.Model.Predict([XCF], Samples, Seed) reproduces them.
	P1      float64 `json:"p1"`
	Var1    float64 `json:"var1"`
	Samples int     `json:"samples"`
	Seed    uint64  `json:"seed"`
	// P1Lower is Hoeffding's lower confidence bound on P1 at level Alpha:
	//	P1Lower = P1 - sqrt(ln(1/alpha) / (2 Samples)).
	P1Lower float64 `json:"p1_lower"`
	// Iterations is the number of steps taken (Adam steps or Schut's feature moves).
	Iterations int `json:"iterations"`
	// InSet: P1 >= 1 - delta and Var1 <= eps. Valid: Target is the argmax of the estimate.
	InSet bool `json:"in_set"`
	Valid bool `json:"valid"`
	// Certified: valid, and P1Lower > 1/2, so that Theorem 1 leaves it a positive KL budget
	// (P1Lower - 1/2)^2 / 2 under the posterior it was generated with (its anchor).
	Certified bool `json:"certified"`
	// Distance is ||z' - z||_2 in standardised units.
	Distance float64 `json:"distance"`
	// Reason says why the search stopped short of its goal ("" when it reached it).
	Reason       string        `json:"reason,omitempty"`
	ModelVersion uint64        `json:"model_version"`
	Duration     time.Duration `json:"duration_ns"`
}

// ErrInvalidInput is wrapped by every error about a request: dimension, non-finite features,
// target class.
var ErrInvalidInput = errors.New("invalid counterfactual request")

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

	once        sync.Once
	pool, check []*bnn.Net

	mu   sync.Mutex
	free []*objective
}

// NewGenerator returns a generator for model (cloned; later changes to model are not seen). vae
// is required for PSCE and ignored by the baselines. Problems with the arguments are reported by
// every Generate call (errors wrapping ErrConfig).
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
		}
	}
	if g.err == nil && cfg.Method == MethodPSCE {
		switch {
		case vae == nil:
			g.err = fmt.Errorf("%w: psce needs a VAE", ErrConfig)
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

// ensembles draws the optimiser's pool and the independent check ensemble, once.
func (g *Generator) ensembles() {
	g.once.Do(func() {
		draw := func(n int, seed uint64) []*bnn.Net {
			nets := make([]*bnn.Net, n)
			for s := range nets {
				nets[s] = g.m.NewNet()
				g.m.Sample(bnn.SampleSeed(seed, s), nets[s])
			}
			return nets
		}
		g.pool = draw(g.cfg.PoolSize, seedFor(g.cfg.Seed, tagPool))
		g.check = draw(g.cfg.CheckSamples, seedFor(g.cfg.Seed, tagCheck))
	})
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

// ensembleEstimate is the posterior predictive of z over the given networks, computed in plain Go.
func ensembleEstimate(act bnn.Activation, nets []*bnn.Net, z []float64) estimate {
	nl := len(nets[0].W)
	c := len(nets[0].B[nl-1])
	bufs := make([][]float64, nl)
	for k := range bufs {
		bufs[k] = make([]float64, len(nets[0].B[k]))
	}
	e := estimate{mean: make([]float64, c), vr: make([]float64, c)}
	probs := make([]float64, c)
	for s, n := range nets {
		h := z
		for k := 0; k < nl; k++ {
			out := bufs[k]
			in := len(h)
			for o := range out {
				row := n.W[k][o*in : (o+1)*in]
				v := n.B[k][o]
				for i, hv := range h {
					v += row[i] * hv
				}
				if k < nl-1 {
					v = act.Apply(v)
				}
				out[o] = v
			}
			h = out
		}
		bnn.Softmax(probs, h)
		kf := float64(s + 1)
		for j, f := range probs { // Welford, as bnn.Predict
			d := f - e.mean[j]
			e.mean[j] += d / kf
			e.vr[j] += d * (f - e.mean[j])
		}
	}
	for j := range e.vr {
		e.vr[j] /= float64(len(nets) - 1)
	}
	return e
}

// meets is the method's stopping rule on an estimate.
func (g *Generator) meets(e estimate, target int) bool {
	if e.argmax() != target {
		return false
	}
	switch g.cfg.Method {
	case MethodPSCE:
		return e.mean[target] >= 1-g.cfg.Delta && e.vr[target] <= g.cfg.Eps
	case MethodSchut:
		return e.mean[target] >= g.cfg.Confidence
	}
	return true
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
	g.ensembles()
	z0 := make([]float64, d)
	g.m.Scaler.Apply(z0, x)
	e0 := ensembleEstimate(g.m.Activation, g.check, z0)
	orig := e0.argmax()
	if target == -1 {
		for k := 0; k < c; k++ {
			if k != orig && (target == -1 || e0.mean[k] > e0.mean[target]) {
				target = k
			}
		}
	}
	if target == orig {
		return nil, fmt.Errorf("%w: x is already classified as target class %d (%s) with p = %.4f; a counterfactual must change the class",
			ErrInvalidInput, target, g.m.Classes[target], e0.mean[target])
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
	if !res.Valid {
		return nil, &NotFoundError{Best: res, Reason: res.Reason}
	}
	return res, nil
}

// search is the state shared by both search loops: minibatches from the pool and the stopping
// machinery.
type search struct {
	g      *Generator
	o      *objective
	target int
	rng    *rand.Rand
	order  []int
	pos    int
	batch  []*bnn.Net
	zeta   []float64
	ev     objectiveEval
	// cooldown skips confirmations after one failed, so that an iterate hovering at the boundary
	// does not pay for the check ensemble at every step.
	cooldown int
}

func (g *Generator) newSearch(o *objective, target int) *search {
	s := &search{g: g, o: o, target: target, rng: rand.New(rand.NewPCG(seedFor(g.cfg.Seed, tagIter), 0)),
		batch: make([]*bnn.Net, g.cfg.Samples)}
	if g.vae != nil {
		s.zeta = make([]float64, g.vae.Latent)
	}
	s.order = s.rng.Perm(len(g.pool))
	return s
}

// evalAt draws the next minibatch and ELBO noise and evaluates the objective at z.
func (s *search) evalAt(z []float64) error {
	for i := range s.batch {
		if s.pos == len(s.order) {
			s.order, s.pos = s.rng.Perm(len(s.g.pool)), 0
		}
		s.batch[i] = s.g.pool[s.order[s.pos]]
		s.pos++
	}
	if err := s.o.setNets(s.batch); err != nil {
		return err
	}
	for k := range s.zeta {
		s.zeta[k] = s.rng.NormFloat64()
	}
	if err := s.o.setZeta(s.zeta); err != nil {
		return err
	}
	if err := s.o.eval(z, &s.ev); err != nil {
		return err
	}
	if !finite(s.ev.Total) {
		return fmt.Errorf("objective is %v", s.ev.Total)
	}
	for j, v := range s.ev.Grad {
		if !finite(v) {
			return fmt.Errorf("gradient[%d] is %v", j, v)
		}
	}
	return nil
}

// done applies the stopping rule at z after evalAt: minibatch gate, then the check ensemble,
// then the fresh final estimate. It returns the final result when all three agree.
func (s *search) done(z, z0 []float64, it int) *Result {
	if s.cooldown > 0 {
		s.cooldown--
		return nil
	}
	if !s.g.gate(s.ev.Probs, s.o.C, s.target) {
		return nil
	}
	if !s.g.meets(ensembleEstimate(s.g.m.Activation, s.g.check, z), s.target) {
		s.cooldown = 5
		return nil
	}
	r := s.g.final(z, z0, s.target, it)
	if !s.g.meetsResult(r) {
		s.cooldown = 10
		return nil
	}
	return r
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

// final estimates the posterior predictive at z with FinalSamples fresh draws (bnn.Model.Predict,
// seed derived from Config.Seed) and builds the Result.
func (g *Generator) final(z, z0 []float64, target, it int) *Result {
	d := len(z)
	xr := make([]float64, d)
	dist := 0.0
	for j := range z {
		xr[j] = z[j]*g.m.Scaler.Std[j] + g.m.Scaler.Mean[j]
		dist += (z[j] - z0[j]) * (z[j] - z0[j])
	}
	seed := seedFor(g.cfg.Seed, tagFinal)
	r := &Result{Method: g.cfg.Method, XCF: xr, Target: target, Samples: g.cfg.FinalSamples, Seed: seed,
		Iterations: it, Distance: math.Sqrt(dist), ModelVersion: g.m.Version}
	p, err := g.m.Predict([][]float64{xr}, g.cfg.FinalSamples, seed)
	if err != nil { // cannot happen for a finite x' of the right length; report it, never hide it
		r.Reason = "final estimate failed: " + err.Error()
		return r
	}
	r.P1, r.Var1 = p.P(0, target), p.V(0, target)
	r.P1Lower = certify.HoeffdingLower(r.P1, r.Samples, g.cfg.Alpha)
	r.Valid = p.Argmax(0) == target
	r.InSet = r.P1 >= 1-g.cfg.Delta && r.Var1 <= g.cfg.Eps
	r.Certified = r.Valid && r.P1Lower > 0.5
	return r
}

// giveUp builds the Result for a search that stopped without meeting its rule.
func (g *Generator) giveUp(z, z0 []float64, target, it int, why string) *Result {
	r := g.final(z, z0, target, it)
	if r.Reason != "" {
		return r
	}
	goal := map[Method]string{MethodPSCE: fmt.Sprintf("the <%g,%g>-set", g.cfg.Delta, g.cfg.Eps),
		MethodSchut: fmt.Sprintf("confidence %g", g.cfg.Confidence), MethodWachter: "validity"}[g.cfg.Method]
	r.Reason = fmt.Sprintf("%s without reaching %s: p = %.4f, var = %.5f, valid = %v", why, goal, r.P1, r.Var1, r.Valid)
	return r
}

// descend is the gradient search of PSCE and Wachter: Adam on x' from x' = x.
func (g *Generator) descend(ctx context.Context, o *objective, z0 []float64, target int) (*Result, error) {
	var mu0 []float64
	if g.vae != nil {
		mu0, _ = g.vae.Encode(z0)
	}
	if err := o.setProblem(target, z0, mu0, *g.cfg.Weights, g.cfg.Delta, g.cfg.Eps); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	s := g.newSearch(o, target)
	z := append([]float64(nil), z0...)
	opt := newAdam(len(z), g.cfg.LR)
	return g.run(ctx, s, z, z0, target, func(int) string {
		opt.step(z, s.ev.Grad)
		return ""
	})
}

// run drives a search from z (modified in place): at each iteration it checks ctx, evaluates the
// objective at z, returns the result once the stopping rule is met, gives up at the iteration
// cap, and otherwise lets the method move z with step, which returns a non-empty reason when the
// method cannot go on.
func (g *Generator) run(ctx context.Context, s *search, z, z0 []float64, target int, step func(it int) string) (*Result, error) {
	for it := 0; ; it++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if err := s.evalAt(z); err != nil {
			return g.giveUp(z, z0, target, it, "objective failed ("+err.Error()+")"), nil
		}
		if r := s.done(z, z0, it); r != nil {
			return r, nil
		}
		if it == g.cfg.MaxIter {
			return g.giveUp(z, z0, target, it, fmt.Sprintf("stopped at the iteration cap %d", g.cfg.MaxIter)), nil
		}
		if why := step(it); why != "" {
			return g.giveUp(z, z0, target, it, why), nil
		}
	}
}

// schut is Schut et al.'s greedy search (see MethodSchut).
func (g *Generator) schut(ctx context.Context, o *objective, z0 []float64, target int) (*Result, error) {
	if err := o.setProblem(target, z0, nil, Weights{Class: 1}, g.cfg.Delta, g.cfg.Eps); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	s := g.newSearch(o, target)
	z := append([]float64(nil), z0...)
	changes := make([]int, len(z))
	return g.run(ctx, s, z, z0, target, func(int) string {
		// The gradient is of L_clf = -E[log p(y'|x')]: moving against it raises the target.
		best := -1
		for j, gj := range s.ev.Grad {
			if changes[j] < g.cfg.MaxChanges && gj != 0 && (best < 0 || math.Abs(gj) > math.Abs(s.ev.Grad[best])) {
				best = j
			}
		}
		if best < 0 {
			return fmt.Sprintf("every feature was changed %d times", g.cfg.MaxChanges)
		}
		z[best] -= g.cfg.Step * math.Copysign(1, s.ev.Grad[best])
		changes[best]++
		return ""
	})
}
