package bnn

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/cfguard/cfguard/internal/vec"
)

// DefaultPriorSigma is torchbnn's customary prior standard deviation, N(0, 0.1^2).
const DefaultPriorSigma = 0.1

// DefaultHidden is the paper's tabular architecture: D -> 64 -> 32 -> C.
var DefaultHidden = []int{64, 32}

// Layer is one Bayesian linear layer (torchbnn BayesLinear). Weights are row-major with shape
// (Out, In), as in PyTorch: WeightMu[o*In+i] is the weight from input i to output o.
type Layer struct {
	Name           string
	In, Out        int
	WeightMu       []float64
	WeightLogSigma []float64
	BiasMu         []float64
	BiasLogSigma   []float64
}

// NumParams is the number of stochastic parameters of the layer (weights and biases).
func (l *Layer) NumParams() int { return l.In*l.Out + l.Out }

// Scaler standardises raw features: z = (x - Mean) / Std.
type Scaler struct {
	Mean []float64 `json:"mean"`
	Std  []float64 `json:"std"`
}

// FitScaler computes per-feature mean and standard deviation of the rows of X. A constant
// feature gets Std = 1 so that it maps to 0 instead of NaN.
func FitScaler(X [][]float64) Scaler {
	d := len(X[0])
	s := Scaler{Mean: make([]float64, d), Std: make([]float64, d)}
	for _, x := range X {
		for j, v := range x {
			s.Mean[j] += v
		}
	}
	n := float64(len(X))
	for j := range s.Mean {
		s.Mean[j] /= n
	}
	for _, x := range X {
		for j, v := range x {
			dv := v - s.Mean[j]
			s.Std[j] += dv * dv
		}
	}
	for j := range s.Std {
		s.Std[j] = math.Sqrt(s.Std[j] / n)
		if s.Std[j] < 1e-12 {
			s.Std[j] = 1
		}
	}
	return s
}

// Apply writes the standardised x into dst (len(dst) == len(x)).
func (s *Scaler) Apply(dst, x []float64) {
	for j, v := range x {
		dst[j] = (v - s.Mean[j]) / s.Std[j]
	}
}

// Model is a posterior over the weights of a Bayesian MLP, plus what is needed to use it on raw
// records: the activation between layers, the feature scaler, the feature and class names.
// Layers[len-1] is the last layer, the only one cfguard's online updates change; its outputs are
// logits, turned into class probabilities by a softmax.
type Model struct {
	Layers []Layer
	// Activation follows every layer but the last (ReLU, the zero value, unless the model file
	// says otherwise); every evaluation of the network honours it.
	Activation Activation
	Scaler     Scaler
	Features   []string // optional feature names, len == input dimension when set
	Classes    []string // class names; label i is Classes[i]
	PriorSigma float64
	// Version counts accepted posterior updates; training gives version 0.
	Version uint64
	// Records is the number of labelled records the posterior stands for: the training rows,
	// then N_t = lambda_t N_{t-1} + n_t after each streaming update of n_t records with
	// forgetting factor lambda_t (docs/MATHS.md, "The streaming update"). It is fractional once
	// records are forgotten. 0 means unknown (a model file that does not record it).
	Records float64
	// Dropout is 0 for a mean-field Gaussian BNN. In (0, 1) the model is an MC Dropout network
	// (Gal and Ghahramani 2016) instead: its weights are WeightMu and BiasMu, the log sigmas are
	// ignored, and a draw (Sample, Pool, Predict) keeps each input of every layer but the first
	// with probability 1 - Dropout and scales it by 1 / (1 - Dropout) (inverted dropout after
	// every hidden layer), so that a predictive over S draws is MC Dropout's over S stochastic
	// forward passes. Such a model has no posterior over weights: KL, updates and model files do
	// not apply to it (Encode refuses it). FitDropout trains one.
	Dropout float64
}

// New returns a freshly initialised ReLU model with torchbnn's initialisation:
// mu ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) and log_sigma = log(priorSigma), for weights and biases.
// Set Activation on the result for another non-linearity.
func New(inputs int, hidden []int, classes []string, priorSigma float64, rng *rand.Rand) *Model {
	if priorSigma <= 0 {
		priorSigma = DefaultPriorSigma
	}
	sizes := append(append([]int{inputs}, hidden...), len(classes))
	m := &Model{Classes: append([]string(nil), classes...), PriorSigma: priorSigma}
	ls := math.Log(priorSigma)
	for k := 0; k+1 < len(sizes); k++ {
		in, out := sizes[k], sizes[k+1]
		bound := 1 / math.Sqrt(float64(in))
		l := Layer{Name: fmt.Sprintf("fc%d", k+1), In: in, Out: out,
			WeightMu: make([]float64, in*out), WeightLogSigma: make([]float64, in*out),
			BiasMu: make([]float64, out), BiasLogSigma: make([]float64, out)}
		for i := range l.WeightMu {
			l.WeightMu[i] = (2*rng.Float64() - 1) * bound
			l.WeightLogSigma[i] = ls
		}
		for i := range l.BiasMu {
			l.BiasMu[i] = (2*rng.Float64() - 1) * bound
			l.BiasLogSigma[i] = ls
		}
		m.Layers = append(m.Layers, l)
	}
	m.Scaler = Scaler{Mean: make([]float64, inputs), Std: make([]float64, inputs)}
	for j := range m.Scaler.Std {
		m.Scaler.Std[j] = 1
	}
	return m
}

// Inputs is the input (feature) dimension.
func (m *Model) Inputs() int { return m.Layers[0].In }

// NumClasses is the output dimension.
func (m *Model) NumClasses() int { return m.Layers[len(m.Layers)-1].Out }

// Last returns the last layer, the one online updates change.
func (m *Model) Last() *Layer { return &m.Layers[len(m.Layers)-1] }

// NumParams is the number of stochastic parameters over all layers.
func (m *Model) NumParams() int {
	n := 0
	for i := range m.Layers {
		n += m.Layers[i].NumParams()
	}
	return n
}

// ClassIndex returns the index of a class name, or -1.
func (m *Model) ClassIndex(name string) int {
	for i, c := range m.Classes {
		if c == name {
			return i
		}
	}
	return -1
}

// Clone returns a deep copy.
func (m *Model) Clone() *Model {
	c := *m
	c.Layers = make([]Layer, len(m.Layers))
	for i, l := range m.Layers {
		c.Layers[i] = Layer{Name: l.Name, In: l.In, Out: l.Out,
			WeightMu: vec.Clone(l.WeightMu), WeightLogSigma: vec.Clone(l.WeightLogSigma),
			BiasMu: vec.Clone(l.BiasMu), BiasLogSigma: vec.Clone(l.BiasLogSigma)}
	}
	c.Scaler = Scaler{Mean: vec.Clone(m.Scaler.Mean), Std: vec.Clone(m.Scaler.Std)}
	c.Features = append([]string(nil), m.Features...)
	c.Classes = append([]string(nil), m.Classes...)
	return &c
}

// ErrInvalidModel is wrapped by every error Validate returns.
var ErrInvalidModel = errors.New("invalid model")

// MaxLogSigma bounds |log sigma| of every parameter. Within it sigma^2 = e^(2 log sigma), 1/sigma^2
// and the ratio sigma_a^2 / sigma_b^2 <= e^(4 MaxLogSigma) of any two valid posteriors are finite
// normal floats, so the variance terms of the closed-form KL between them and of the KL to the
// prior the learner minimises stay finite (at |log sigma| = 500, sigma^2 overflows and every
// update fails; the means' terms are bounded by the means themselves). Trained BNNs sit far
// inside it (torchbnn initialises log sigma near log 0.1).
const MaxLogSigma = 100

// Validate checks shapes, chaining of layer sizes, that every parameter is finite with
// |log sigma| <= MaxLogSigma (a proper Gaussian N(mu, sigma^2) whose maths stays finite), the
// prior's sigma within the same bound, and that feature and class names are non-empty and
// distinct.
func (m *Model) Validate() error {
	if len(m.Layers) == 0 {
		return fmt.Errorf("%w: no layers", ErrInvalidModel)
	}
	if !m.Activation.valid() {
		return fmt.Errorf("%w: unknown activation %d", ErrInvalidModel, uint8(m.Activation))
	}
	if !(m.Records >= 0) || math.IsInf(m.Records, 0) {
		return fmt.Errorf("%w: records %v, want finite and >= 0", ErrInvalidModel, m.Records)
	}
	for k := range m.Layers {
		l := &m.Layers[k]
		if l.In <= 0 || l.Out <= 0 {
			return fmt.Errorf("%w: layer %q has shape %dx%d", ErrInvalidModel, l.Name, l.Out, l.In)
		}
		if k > 0 && m.Layers[k-1].Out != l.In {
			return fmt.Errorf("%w: layer %q takes %d inputs but layer %q gives %d",
				ErrInvalidModel, l.Name, l.In, m.Layers[k-1].Name, m.Layers[k-1].Out)
		}
		for _, a := range []struct {
			name string
			v    []float64
			n    int
		}{{"weight_mu", l.WeightMu, l.In * l.Out}, {"weight_log_sigma", l.WeightLogSigma, l.In * l.Out},
			{"bias_mu", l.BiasMu, l.Out}, {"bias_log_sigma", l.BiasLogSigma, l.Out}} {
			if len(a.v) != a.n {
				return fmt.Errorf("%w: %s.%s has %d values, want %d", ErrInvalidModel, l.Name, a.name, len(a.v), a.n)
			}
			for i, v := range a.v {
				if math.IsNaN(v) || math.IsInf(v, 0) {
					return fmt.Errorf("%w: %s.%s[%d] = %v", ErrInvalidModel, l.Name, a.name, i, v)
				}
			}
			if a.name == "weight_log_sigma" || a.name == "bias_log_sigma" {
				for i, v := range a.v {
					if v < -MaxLogSigma || v > MaxLogSigma {
						return fmt.Errorf("%w: %s.%s[%d] = %v, want |log sigma| <= %v (sigma in [e^-%v, e^%v])",
							ErrInvalidModel, l.Name, a.name, i, v, MaxLogSigma, MaxLogSigma, MaxLogSigma)
					}
				}
			}
		}
	}
	d := m.Inputs()
	if len(m.Scaler.Mean) != d || len(m.Scaler.Std) != d {
		return fmt.Errorf("%w: scaler has %d/%d entries, want %d", ErrInvalidModel, len(m.Scaler.Mean), len(m.Scaler.Std), d)
	}
	for j := 0; j < d; j++ {
		if !(m.Scaler.Std[j] > 0) || math.IsInf(m.Scaler.Std[j], 0) || math.IsNaN(m.Scaler.Mean[j]) || math.IsInf(m.Scaler.Mean[j], 0) {
			return fmt.Errorf("%w: scaler entry %d has mean %v std %v", ErrInvalidModel, j, m.Scaler.Mean[j], m.Scaler.Std[j])
		}
	}
	if len(m.Features) != 0 && len(m.Features) != d {
		return fmt.Errorf("%w: %d feature names for %d inputs", ErrInvalidModel, len(m.Features), d)
	}
	if err := distinctNames("feature", m.Features); err != nil {
		return err
	}
	if len(m.Classes) != m.NumClasses() {
		return fmt.Errorf("%w: %d class names for %d outputs", ErrInvalidModel, len(m.Classes), m.NumClasses())
	}
	if err := distinctNames("class", m.Classes); err != nil {
		return err
	}
	// The prior N(0, PriorSigma^2) enters the learner's objective as log PriorSigma and
	// 1/PriorSigma^2: both finite only for a sigma within the parameters' own bound.
	if !(m.PriorSigma > 0) || math.Abs(math.Log(m.PriorSigma)) > MaxLogSigma {
		return fmt.Errorf("%w: prior sigma %v, want finite and > 0 with |log sigma| <= %v", ErrInvalidModel, m.PriorSigma, MaxLogSigma)
	}
	if !(m.Dropout >= 0 && m.Dropout < 1) {
		return fmt.Errorf("%w: dropout %v, want in [0, 1)", ErrInvalidModel, m.Dropout)
	}
	return nil
}

// distinctNames checks that every name is non-empty and used once: records name their features
// and labels by these names, so an empty or a repeated one could not be told apart.
func distinctNames(what string, names []string) error {
	seen := make(map[string]int, len(names))
	for i, n := range names {
		if n == "" {
			return fmt.Errorf("%w: %s %d has an empty name", ErrInvalidModel, what, i)
		}
		if j, ok := seen[n]; ok {
			return fmt.Errorf("%w: %s names %d and %d are both %q", ErrInvalidModel, what, j, i, n)
		}
		seen[n] = i
	}
	return nil
}

// SameBody reports whether every layer but the last is bit-for-bit identical in a and b. Only
// then does KL(a || b) reduce to the last layer's terms.
func SameBody(a, b *Model) bool {
	if len(a.Layers) != len(b.Layers) {
		return false
	}
	for k := 0; k+1 < len(a.Layers); k++ {
		if !LayersEqual(&a.Layers[k], &b.Layers[k]) {
			return false
		}
	}
	return true
}

// LayersEqual reports whether two layers have the same shape and bit-for-bit equal parameters.
func LayersEqual(a, b *Layer) bool {
	return a.In == b.In && a.Out == b.Out && BitsEqual(a.WeightMu, b.WeightMu) &&
		BitsEqual(a.WeightLogSigma, b.WeightLogSigma) && BitsEqual(a.BiasMu, b.BiasMu) &&
		BitsEqual(a.BiasLogSigma, b.BiasLogSigma)
}

// BitsEqual reports whether a and b hold the same float64 bit patterns (NaN equals NaN, -0 does
// not equal 0): the equality of stored parameters, not of numbers.
func BitsEqual(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	if len(a) > 0 && &a[0] == &b[0] {
		return true // one array: posteriors that share a layer they did not change
	}
	for i := range a {
		if math.Float64bits(a[i]) != math.Float64bits(b[i]) {
			return false
		}
	}
	return true
}
