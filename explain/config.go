package explain

import (
	"cmp"
	"fmt"
	"math"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// Method names a counterfactual generator.
type Method string

// The generators: the paper's PSCE and the two baselines.
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
)

// ParseMethod accepts "psce", "wachter" and "schut".
func ParseMethod(s string) (Method, error) {
	switch m := Method(s); m {
	case MethodPSCE, MethodWachter, MethodSchut:
		return m, nil
	}
	return "", fmt.Errorf("unknown counterfactual method %q (want psce, wachter or schut)", s)
}

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

	// Weights of the gradient methods; nil means DefaultWeights for PSCE and WachterWeights for
	// Wachter. Set a non-nil value (e.g. &PaperWeights) to choose others or to ablate terms;
	// zeros are then taken as given.
	Weights *Weights

	MoveSize   float64 // Schut: the size of one feature change, standardised units [0.1]
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
	c.Method = cmp.Or(c.Method, DefaultMethod)
	c.LR = cmp.Or(c.LR, DefaultLR)
	c.MaxIter = cmp.Or(c.MaxIter, DefaultMaxIterations)
	c.Samples = cmp.Or(c.Samples, DefaultSamples)
	c.PoolSize = cmp.Or(c.PoolSize, DefaultPoolSize)
	c.CheckSamples = cmp.Or(c.CheckSamples, DefaultCheckSamples)
	c.FinalSamples = cmp.Or(c.FinalSamples, DefaultFinalSamples)
	c.Delta = cmp.Or(c.Delta, DefaultDelta)
	c.Epsilon = cmp.Or(c.Epsilon, DefaultEpsilon)
	c.MoveSize = cmp.Or(c.MoveSize, DefaultMoveSize)
	c.MaxChanges = cmp.Or(c.MaxChanges, DefaultMaxChanges)
	c.Confidence = cmp.Or(c.Confidence, DefaultConfidence)
	c.Alpha = cmp.Or(c.Alpha, DefaultAlpha)
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
	}
	return c.Weights.validate()
}
