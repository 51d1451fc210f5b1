package explain

import (
	"cmp"
	"fmt"
	"math"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/ident"
)

// Method names a counterfactual generator.
type Method string

// The generators: the paper's PSCE and the four baselines of its tables.
const (
	// MethodPSCE is the paper's objective (package documentation), stopping in the
	// <delta, epsilon>-set.
	MethodPSCE Method = "psce"
	// MethodWachter is Wachter et al. (2017) on the Bayesian model: Adam on
	// Class * (-E_w[log p(y'|x',w)]) + Prox * ||x' - x||^2 (standardised units), stopping as soon
	// as the posterior predictive puts y' first, as CARLA's implementation does.
	MethodWachter Method = "wachter"
	// MethodSchut is the greedy search of Schut et al. (2021, Algorithm 1 "greedy"): repeatedly
	// move the one feature with the largest |d E_w[log p(y'|x',w)] / dx'_j| by MoveSize
	// (standardised units) in the direction that raises the target, each feature at most
	// MaxChanges times, until the posterior predictive reaches Confidence.
	MethodSchut Method = "schut"
	// MethodBayesCF is the uncertainty-aware counterfactual of Batten et al. (2025) for a Bayesian
	// network: gradient descent on the posterior predictive itself, Adam on
	// Pred * (-log E_w[p(y'|x',w)]) + Prox * ||x' - x||^2 (standardised units), stopping as soon
	// as the posterior predictive puts y' first. Their paper defines a BNN's counterfactual on its
	// predictive distribution and finds it by projected gradient descent; this is a
	// reconstruction from that description, not a port of their code. The PSCE paper's
	// supplementary tables give Adam, lr 0.1, 2000 iterations and an L2 input-space lambda_prox.
	// It differs from Wachter on the same model only in the loss: the log of the mean
	// probability, not the mean log-probability, so networks that already agree with y' weigh
	// more than those that do not.
	MethodBayesCF Method = "bayescf"
	// MethodROAR is Robust Algorithmic Recourse (Upadhyay et al. 2021): Adam on the worst case,
	// over shifts of at most DeltaMax of every weight and bias of a local linear model, of the
	// logistic loss towards y', plus ROAR's L1 cost: Robust * L_roar + ProxL1 * ||x' - x||_1
	// (see Weights), stopping as soon as the (unshifted) posterior predictive puts y' first. ROAR
	// linearises the classifier with LIME; here each sampled network's own log-odds of y' is the
	// local model, so the worst case lowers it by DeltaMax (||x'||_1 + 1) in closed form.
	MethodROAR Method = "roar"
)

// Methods lists every generator, in the order of the paper's tables.
var Methods = []Method{MethodPSCE, MethodBayesCF, MethodSchut, MethodWachter, MethodROAR}

// ParseMethod accepts the names in Methods.
func ParseMethod(s string) (Method, error) {
	for _, m := range Methods {
		if Method(s) == m {
			return m, nil
		}
	}
	return "", fmt.Errorf("unknown counterfactual method %q (want one of %v)", ident.Clip(s, 64), Methods)
}

// Stop names when a search may stop.
type Stop string

const (
	// StopConfirmed (the default) accepts an iterate only when the confirmation ensemble and then
	// the final ensemble both say it meets the method's rule (see the package documentation): a
	// search either returns a counterfactual that meets the rule or ErrNotFound, whose best
	// attempt may be valid and still miss the rule (at the iteration cap). After a confirmation
	// fails, the next 5 iterations (10 after the final ensemble) move without being checked, so a
	// search that reaches the rule just after a failed check stops a few moves past it, farther
	// from the query than StopEstimate would (TestSchutStopsAtConfidence: 11 moves against 6).
	StopConfirmed Stop = "confirmed"
	// StopEstimate stops at the first iterate whose own minibatch estimate (the Samples networks
	// that gave the iteration's gradient, as a PyTorch implementation of these methods checks)
	// meets the method's rule, or at the iteration cap. The final ensemble then measures the
	// iterate, which may be invalid; it is returned as NotFoundError.Best. This is the paper's
	// protocol, which accepts every counterfactual a method generates.
	StopEstimate Stop = "estimate"
)

// Defaults of Config, applied to its zero fields; the paper's settings for the Wisconsin Breast
// Cancer data where it gives them.
const (
	DefaultMethod        = MethodPSCE
	DefaultLR            = 0.1  // Adam's learning rate for x', standardised units
	DefaultMaxIterations = 2000 // iteration cap
	DefaultSamples       = 32   // networks per iteration
	DefaultPoolSize      = 256  // posterior draws the iterations' networks are taken from
	DefaultCheckSamples  = 500  // draws of the confirmation ensemble
	DefaultFinalSamples  = 1000 // draws of the final estimate (P1, Var1)
	DefaultDelta         = 0.05 // the <delta, epsilon>-set: p >= 1 - delta
	DefaultEpsilon       = 0.01 // the <delta, epsilon>-set: Var <= epsilon
	DefaultMoveSize      = 0.1  // Schut: move per feature change, standardised units
	DefaultMaxChanges    = 10   // Schut: changes per feature
	DefaultConfidence    = 0.95 // Schut: stop when p(y'|x') >= Confidence
	DefaultAlpha         = 0.01 // Hoeffding level of Result.P1Lower
	DefaultDeltaMax      = 0.1  // ROAR: bound on the shift of each weight and bias (its paper's value)
)

// Config configures a Generator. Zero fields take the defaults above (in brackets).
type Config struct {
	Method Method // [psce]

	LR      float64 // Adam learning rate for x' (standardised units) [0.1]
	MaxIter int     // iteration cap: Adam iterations, or Schut's feature moves [2000]

	// Samples is S, the networks per iteration over which the loss's expectations are averaged
	// [32]. They are a fresh minibatch each iteration from a fixed pool of PoolSize posterior
	// draws [256], reshuffled whenever it is used up: fresh enough that x' cannot overfit a few
	// networks, without drawing S x (number of parameters) normals every iteration. Neither the
	// pool nor the minibatches decide success; see CheckSamples and FinalSamples.
	Samples, PoolSize int
	// CheckSamples draws [500], disjoint from the pool, confirm that an iterate meets the stopping
	// rule; FinalSamples draws [1000] then give the reported P1 and Var1, which must meet the rule
	// again. Both ensembles are bnn.Pools drawn once per Generator, in Precision.
	CheckSamples, FinalSamples int
	// Precision of the confirmation and final ensembles' forward passes [float64]. With float32
	// a Result's P1 is reproduced by bnn.Model.PredictWith(..., Float32), within bnn's float32
	// bound of the float64 value.
	Precision bnn.Precision

	Delta   float64 // the <delta, epsilon>-set's delta: p >= 1 - delta [0.05]
	Epsilon float64 // the <delta, epsilon>-set's epsilon: Var <= epsilon [0.01]

	// Weights of the gradient methods; nil means DefaultWeights for PSCE, BayesCFWeights for
	// BayesCF, ROARWeights for ROAR and WachterWeights for Wachter and Schut. Set a non-nil value (e.g. &PaperWeights) to choose others or to ablate terms;
	// zeros are then taken as given.
	Weights *Weights

	MoveSize   float64 // Schut: the size of one feature change, standardised units [0.1]
	MaxChanges int     // Schut: changes per feature [10]
	Confidence float64 // Schut: stop when p(y'|x') >= Confidence [0.95]

	// DeltaMax is ROAR's bound on the shift of every weight and bias of the local model [0.1].
	DeltaMax float64
	// Stop says when a search may stop [StopConfirmed].
	Stop Stop

	// Alpha is the Hoeffding level of Result.P1Lower [0.01].
	Alpha float64
	// TargetAlpha, when > 0, makes PSCE's <delta, epsilon>-set the one a certificate is renewed
	// by (certify.Renewable): the lower empirical-Bernstein bound of p at confidence
	// 1 - TargetAlpha, from the ensemble's own draws, must reach 1 - delta, and Var <= epsilon.
	// A CE found that way is admitted at registration by the same rule and can be renewed under
	// the posterior it was measured under. 0: the point estimates (the paper's rule) [0]. A
	// TargetAlpha under which an ensemble that decides has too few draws to reach the set at all
	// is refused (ErrConfig): see certify.MinRenewableSamples.
	TargetAlpha float64
	// WithoutVAE runs PSCE without its plausibility terms (the ELBO and the latent distance),
	// for a model no VAE can be trained for; NewGenerator then ignores its vae argument. Without
	// it, PSCE refuses a nil VAE [false].
	WithoutVAE bool
	// Seed makes Generate deterministic: same model, VAE, config, x and target give the same result.
	Seed uint64
	// FinalPool, when set, is the final ensemble: networks the caller drew from the generator's
	// model (its Version), shared rather than drawn per Generator. FinalSamples is then its
	// Samples, and the final estimate is in its precision. A caller that admits a counterfactual
	// by its own estimate on a pool passes that pool, so that a search stops only where the
	// caller's estimate will agree; NewGenerator refuses a pool of another version.
	FinalPool *bnn.Pool
}

// DefaultConfig returns the defaults for method.
func DefaultConfig(method Method) Config {
	return Config{Method: method}.withDefaults()
}

// Validate reports why NewGenerator would refuse c, its defaults applied (the reasons of
// ErrConfig that concern the configuration alone), nil when it would not.
func (c Config) Validate() error { return c.withDefaults().validate() }

func (c Config) withDefaults() Config {
	c.Method = cmp.Or(c.Method, DefaultMethod)
	c.LR = cmp.Or(c.LR, DefaultLR)
	c.MaxIter = cmp.Or(c.MaxIter, DefaultMaxIterations)
	c.Samples = cmp.Or(c.Samples, DefaultSamples)
	c.PoolSize = cmp.Or(c.PoolSize, DefaultPoolSize)
	c.CheckSamples = cmp.Or(c.CheckSamples, DefaultCheckSamples)
	c.FinalSamples = cmp.Or(c.FinalSamples, DefaultFinalSamples)
	if c.FinalPool != nil {
		c.FinalSamples = c.FinalPool.Samples()
	}
	c.Delta = cmp.Or(c.Delta, DefaultDelta)
	c.Epsilon = cmp.Or(c.Epsilon, DefaultEpsilon)
	c.MoveSize = cmp.Or(c.MoveSize, DefaultMoveSize)
	c.MaxChanges = cmp.Or(c.MaxChanges, DefaultMaxChanges)
	c.Confidence = cmp.Or(c.Confidence, DefaultConfidence)
	c.Alpha = cmp.Or(c.Alpha, DefaultAlpha)
	c.DeltaMax = cmp.Or(c.DeltaMax, DefaultDeltaMax)
	c.Stop = cmp.Or(c.Stop, StopConfirmed)
	if c.Weights == nil {
		w := map[Method]Weights{MethodPSCE: DefaultWeights, MethodBayesCF: BayesCFWeights, MethodROAR: ROARWeights}[c.Method]
		if w == (Weights{}) {
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
	case c.Precision != bnn.Float64 && c.Precision != bnn.Float32:
		return fmt.Errorf("precision %v, want float64 or float32", c.Precision)
	case certify.CheckDelta(c.Delta) != nil:
		return certify.CheckDelta(c.Delta)
	case certify.CheckEpsilon(c.Epsilon) != nil:
		return certify.CheckEpsilon(c.Epsilon)
	case !(c.MoveSize > 0) || math.IsInf(c.MoveSize, 0):
		return fmt.Errorf("move_size %v, want finite and > 0", c.MoveSize)
	case c.MaxChanges < 1:
		return fmt.Errorf("max_changes %d, want >= 1", c.MaxChanges)
	case !(c.Confidence > 0 && c.Confidence < 1):
		return fmt.Errorf("confidence %v, want in (0, 1)", c.Confidence)
	case !(c.Alpha > 0 && c.Alpha < 1):
		return fmt.Errorf("alpha %v, want in (0, 1)", c.Alpha)
	case !(c.DeltaMax >= 0) || math.IsInf(c.DeltaMax, 0):
		return fmt.Errorf("delta_max %v, want finite and >= 0", c.DeltaMax)
	case c.Stop != StopConfirmed && c.Stop != StopEstimate:
		return fmt.Errorf("stop %q, want %q or %q", c.Stop, StopConfirmed, StopEstimate)
	case !(c.TargetAlpha >= 0 && c.TargetAlpha < 1):
		return fmt.Errorf("target_alpha %v, want in [0, 1)", c.TargetAlpha)
	}
	if err := c.targetReachable(); err != nil {
		return err
	}
	return c.Weights.validate()
}

// targetReachable refuses a TargetAlpha under which an ensemble that decides could never show
// a CE in the <delta, epsilon>-set: its estimate's empirical Bernstein margin, at least
// 7 ln(2/TargetAlpha) / (3 (n - 1)) for n draws, passes Delta even at p = 1 and Var = 0. The
// final ensemble decides Result.InSet; for PSCE the confirmation ensemble (StopConfirmed), or
// the iteration's minibatch of Samples (StopEstimate), decides when the search stops.
func (c Config) targetReachable() error {
	if c.TargetAlpha == 0 {
		return nil
	}
	least := certify.MinRenewableSamples(c.Delta, c.TargetAlpha)
	type ensemble struct {
		key string
		n   int
	}
	decide := []ensemble{{"final_samples", c.FinalSamples}}
	switch {
	case c.Method != MethodPSCE:
	case c.Stop == StopConfirmed:
		decide = append(decide, ensemble{"check_samples", c.CheckSamples})
	default:
		decide = append(decide, ensemble{"samples", c.Samples})
	}
	for _, d := range decide {
		if d.n < least {
			return fmt.Errorf("%s %d: with target_alpha %v no estimate of %d draws can show p >= 1 - delta (%v), its confidence margin alone being %.3f; want >= %d draws",
				d.key, d.n, c.TargetAlpha, d.n, 1-c.Delta, certify.BernsteinMargin(0, d.n, c.TargetAlpha), least)
		}
	}
	return nil
}
