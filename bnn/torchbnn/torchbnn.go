// Package torchbnn imports a posterior trained in PyTorch with torchbnn's BayesLinear layers:
// the model's state_dict, saved with safetensors, becomes a *bnn.Model that bnn.Save writes as a
// cfguard model directory.
//
// A BayesLinear layer with prefix P stores its mean-field Gaussian posterior as
//
//	P.weight_mu, P.weight_log_sigma   shape (out, in)   w = mu + exp(log_sigma) * e, e ~ N(0, 1)
//	P.bias_mu,   P.bias_log_sigma     shape (out)
//
// exactly the parameters of a bnn.Layer. torchbnn may also store, and Import accepts and checks
// but does not import:
//
//	P.weight_eps, P.bias_eps          the noise buffers of BayesLinear.freeze(), shaped like
//	                                  their parameters (a frozen draw, not part of the posterior)
//	P.prior_mu, P.prior_sigma,        scalar prior buffers (some torchbnn versions register the
//	P.prior_log_sigma                 prior so); prior_mu must be 0 and the sigma must equal
//	                                  Options.PriorSigma, since bnn's prior is N(0, sigma^2)
//
// Any other tensor (a plain nn.Linear's P.weight, a BatchNorm's running_mean, another library's
// weight_rho) is refused by name: cfguard would otherwise serve a different network than the one
// trained. Tensors may be float32 (torch's default; widened exactly) or float64.
//
// # Layer order
//
// safetensors stores tensors by name, not in module order, so the order is recovered:
//
//  1. Options.Layers, when given, is the order (every layer listed once).
//  2. nn.Sequential keys ("0.weight_mu", "2.weight_mu", or "net.0...", "net.2..." under one
//     parent) are ordered by their integer index, as Sequential runs them.
//  3. Otherwise (named layers such as fc1, fc2, out) the order is inferred from the chain of
//     shapes: layer k+1's input size is layer k's output size, the first layer's input size is the
//     scaler's dimension when a scaler is given, and the last layer's output size is the number of
//     classes. Exactly one ordering must satisfy this; when several do (e.g. two 32 x 32 hidden
//     layers), Import refuses with both orderings in the error and asks for Options.Layers.
//
// In every case the resulting order must chain; the error names the two layers that do not.
package torchbnn

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/safetensors"
)

// Options are what the weights file does not say.
type Options struct {
	// Classes names the outputs, one per logit of the last layer (required).
	Classes []string
	// Scaler standardises raw features before the first layer, as in training; nil means the
	// identity (the model takes raw features).
	Scaler *bnn.Scaler
	// Features optionally names the input features (len = input size).
	Features []string
	// PriorSigma is the standard deviation of the N(0, sigma^2) prior the posterior was trained
	// against [bnn.DefaultPriorSigma, torchbnn's customary 0.1].
	PriorSigma float64
	// Activation between layers: relu (or ""), tanh or sigmoid (bnn.ParseActivation); it is
	// written to model.json and used by every forward pass.
	Activation string
	// Layers optionally gives the layer order by prefix (e.g. "fc1", "fc2", "out").
	Layers []string
}

// ErrStateDict is wrapped by every error about the weights file's content.
var ErrStateDict = errors.New("torchbnn state_dict")

// OptionError reports an Options field that does not fit the weights or is unsupported. Option
// is the field's name (Classes, Scaler, Features, PriorSigma, Activation, Layers), so that a
// command line can name its flag.
type OptionError struct {
	Option string
	Err    error
}

func (e *OptionError) Error() string { return "torchbnn: " + e.Err.Error() }
func (e *OptionError) Unwrap() error { return e.Err }

func optionErr(option, format string, args ...any) error {
	return &OptionError{Option: option, Err: fmt.Errorf(format, args...)}
}

func dictErr(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrStateDict}, args...)...)
}

// Parameter and buffer names of a torchbnn BayesLinear.
const (
	weightMu       = "weight_mu"
	weightLogSigma = "weight_log_sigma"
	biasMu         = "bias_mu"
	biasLogSigma   = "bias_log_sigma"
	weightEps      = "weight_eps"
	biasEps        = "bias_eps"
	priorMu        = "prior_mu"
	priorSigma     = "prior_sigma"
	priorLogSigma  = "prior_log_sigma"
)

var knownSuffixes = []string{weightMu, weightLogSigma, biasMu, biasLogSigma, weightEps, biasEps, priorMu, priorSigma, priorLogSigma}

// layer is one BayesLinear found in the file: its prefix and tensors by suffix.
type layer struct {
	prefix  string
	tensors map[string]safetensors.Tensor
	in, out int
}

// Import builds a model from the bytes of a safetensors file holding a torchbnn state_dict. See
// the package documentation for what is accepted and how the layer order is found. The model
// has posterior version 0 and passes bnn.Model.Validate.
func Import(weights []byte, opts Options) (*bnn.Model, error) {
	if err := checkOptions(opts); err != nil {
		return nil, err
	}
	tensors, _, err := safetensors.Decode(weights)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrStateDict, err)
	}
	layers, err := group(tensors)
	if err != nil {
		return nil, err
	}
	sigma := opts.PriorSigma
	sigma = cmp.Or(sigma, bnn.DefaultPriorSigma)
	for _, l := range layers {
		if err := l.check(sigma); err != nil {
			return nil, err
		}
	}
	inputs := 0
	if opts.Scaler != nil {
		inputs = len(opts.Scaler.Mean)
	}
	ordered, err := order(layers, opts.Layers, inputs, len(opts.Classes))
	if err != nil {
		return nil, err
	}
	return build(ordered, opts, sigma)
}

func checkOptions(opts Options) error {
	if _, err := activation(opts.Activation); err != nil {
		return optionErr("Activation", "%v", err)
	}
	if len(opts.Classes) < 2 {
		return optionErr("Classes", "%d class names, want one per output logit (at least 2)", len(opts.Classes))
	}
	seen := map[string]bool{}
	for _, c := range opts.Classes {
		if c == "" || seen[c] {
			return optionErr("Classes", "class names %q must be non-empty and distinct", opts.Classes)
		}
		seen[c] = true
	}
	if s := opts.PriorSigma; s != 0 && (!(s > 0) || math.IsInf(s, 0)) {
		return optionErr("PriorSigma", "prior sigma %v, want a finite number > 0", s)
	}
	if opts.Scaler != nil && len(opts.Scaler.Mean) != len(opts.Scaler.Std) {
		return optionErr("Scaler", "scaler has %d means and %d standard deviations", len(opts.Scaler.Mean), len(opts.Scaler.Std))
	}
	return nil
}

// group sorts the tensors into layers by prefix, refusing names that are not a BayesLinear's.
func group(tensors map[string]safetensors.Tensor) ([]*layer, error) {
	byPrefix := map[string]*layer{}
	names := make([]string, 0, len(tensors))
	for name := range tensors {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		dot := strings.LastIndexByte(name, '.')
		prefix, suffix := "", name
		if dot >= 0 {
			prefix, suffix = name[:dot], name[dot+1:]
		}
		if prefix == "" || !known(suffix) {
			hint := ""
			if suffix == "weight" || suffix == "bias" {
				hint = " (a deterministic nn.Linear or other layer: cfguard imports Bayesian layers only)"
			}
			return nil, dictErr("tensor %q is not a torchbnn BayesLinear tensor%s; want PREFIX.{%s}", name, hint, strings.Join(knownSuffixes, ","))
		}
		l := byPrefix[prefix]
		if l == nil {
			l = &layer{prefix: prefix, tensors: map[string]safetensors.Tensor{}}
			byPrefix[prefix] = l
		}
		l.tensors[suffix] = tensors[name]
	}
	if len(byPrefix) == 0 {
		return nil, dictErr("no tensors")
	}
	out := make([]*layer, 0, len(byPrefix))
	for _, l := range byPrefix {
		out = append(out, l)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].prefix < out[j].prefix })
	return out, nil
}

func known(suffix string) bool {
	for _, k := range knownSuffixes {
		if suffix == k {
			return true
		}
	}
	return false
}

// check validates one layer's tensors: the four parameters present with consistent shapes, the
// eps buffers shaped like their parameters, and the prior buffers equal to N(0, sigma^2).
func (l *layer) check(sigma float64) error {
	name := func(suffix string) string { return l.prefix + "." + suffix }
	for _, s := range []string{weightMu, weightLogSigma, biasMu, biasLogSigma} {
		if _, ok := l.tensors[s]; !ok {
			why := ""
			if s == biasMu || s == biasLogSigma {
				why = " (a BayesLinear with bias=False: cfguard's layers have biases)"
			}
			return dictErr("layer %q has no tensor %q%s", l.prefix, name(s), why)
		}
	}
	w := l.tensors[weightMu]
	if len(w.Shape) != 2 || w.Shape[0] < 1 || w.Shape[1] < 1 {
		return dictErr("tensor %q has shape %v, want (out, in)", name(weightMu), w.Shape)
	}
	l.out, l.in = w.Shape[0], w.Shape[1]
	for s, want := range map[string][]int{weightLogSigma: {l.out, l.in}, weightEps: {l.out, l.in},
		biasMu: {l.out}, biasLogSigma: {l.out}, biasEps: {l.out}} {
		if t, ok := l.tensors[s]; ok && fmt.Sprint(t.Shape) != fmt.Sprint(want) {
			return dictErr("tensor %q has shape %v, want %v (from %q %v)", name(s), t.Shape, want, name(weightMu), w.Shape)
		}
	}
	for _, s := range []string{priorMu, priorSigma, priorLogSigma} {
		t, ok := l.tensors[s]
		if !ok {
			continue
		}
		if len(t.Data) != 1 {
			return dictErr("tensor %q has shape %v, want a scalar", name(s), t.Shape)
		}
		v := t.Data[0]
		switch s {
		case priorMu:
			if v != 0 {
				return dictErr("tensor %q = %v: cfguard's prior is N(0, sigma^2), a non-zero prior mean cannot be imported", name(s), v)
			}
		case priorSigma, priorLogSigma:
			if s == priorLogSigma {
				v = math.Exp(v)
			}
			if !float32Equal(v, sigma) {
				return optionErr("PriorSigma", "tensor %q says the prior sigma is %v, but it is %v: set the prior sigma the model was trained with", name(s), v, sigma)
			}
		}
	}
	return nil
}

// float32Equal reports whether a and b agree to float32 precision (buffers are often float32).
func float32Equal(a, b float64) bool {
	return math.Abs(a-b) <= 1e-6*math.Max(math.Abs(a), math.Abs(b))
}

// order returns the layers in network order; see the package documentation. inputs is the
// expected input size (0: unknown), outputs the number of classes.
func order(layers []*layer, explicit []string, inputs, outputs int) ([]*layer, error) {
	byPrefix := map[string]*layer{}
	for _, l := range layers {
		byPrefix[l.prefix] = l
	}
	var out []*layer
	switch {
	case len(explicit) > 0:
		seen := map[string]bool{}
		for _, p := range explicit {
			l, ok := byPrefix[p]
			if !ok || seen[p] {
				return nil, optionErr("Layers", "layer order %q: %q is not a layer of the file, or is listed twice (layers: %s)", explicit, p, describe(layers))
			}
			seen[p] = true
			out = append(out, l)
		}
		if len(out) != len(layers) {
			return nil, optionErr("Layers", "layer order %q lists %d of the file's %d layers (%s)", explicit, len(out), len(layers), describe(layers))
		}
	case sequential(layers):
		out = append(out, layers...)
		sort.Slice(out, func(i, j int) bool { return seqIndex(out[i].prefix) < seqIndex(out[j].prefix) })
	default:
		chains, complete := chainsOf(layers, inputs, outputs, 2)
		switch {
		case !complete:
			return nil, optionErr("Layers", "too many candidate orders of the layers %s to search; give the order explicitly", describe(layers))
		case len(chains) == 0:
			// The shapes may chain with another input or output size: then the checks below
			// name the option that does not fit (classes, scaler) rather than the tensors.
			if loose, _ := chainsOf(layers, 0, 0, 1); len(loose) == 1 {
				out = loose[0]
				break
			}
			return nil, dictErr("the layers %s form no chain from %s inputs to %d outputs (one per class)", describe(layers), sizeOrAny(inputs), outputs)
		case len(chains) == 1:
			out = chains[0]
		default:
			return nil, optionErr("Layers", "the layer order is ambiguous: both %s and %s chain; give the order explicitly", prefixes(chains[0]), prefixes(chains[1]))
		}
	}
	for k := 1; k < len(out); k++ {
		if out[k].in != out[k-1].out {
			return nil, dictErr("layer %q (%d -> %d) follows layer %q (%d -> %d) but takes %d inputs, not %d",
				out[k].prefix, out[k].in, out[k].out, out[k-1].prefix, out[k-1].in, out[k-1].out, out[k].in, out[k-1].out)
		}
	}
	last := out[len(out)-1]
	if last.out != outputs {
		return nil, optionErr("Classes", "%d class names, but the last layer %q has %d outputs (tensor %q has shape %v)",
			outputs, last.prefix, last.out, last.prefix+"."+weightMu, last.tensors[weightMu].Shape)
	}
	if inputs != 0 && out[0].in != inputs {
		return nil, optionErr("Scaler", "the scaler has %d features, but the first layer %q takes %d inputs", inputs, out[0].prefix, out[0].in)
	}
	return out, nil
}

// sequential reports whether every prefix is an nn.Sequential index under one parent: "3" or
// "parent.3".
func sequential(layers []*layer) bool {
	parent := ""
	for i, l := range layers {
		p, idx := splitLast(l.prefix)
		if _, err := strconv.ParseUint(idx, 10, 31); err != nil {
			return false
		}
		if i > 0 && p != parent {
			return false
		}
		parent = p
	}
	return true
}

func splitLast(prefix string) (parent, last string) {
	if dot := strings.LastIndexByte(prefix, '.'); dot >= 0 {
		return prefix[:dot], prefix[dot+1:]
	}
	return "", prefix
}

func seqIndex(prefix string) int {
	_, idx := splitLast(prefix)
	n, _ := strconv.Atoi(idx)
	return n
}

// maxSearch bounds the work of chainsOf, counted as layers considered for a place: many layers
// of one square shape have factorially many orders, and each partial order considers every
// layer for its next place. A chain of L layers that the sizes decide takes about L^2 (a
// thousand layers: 2^20), so the bound refuses no model of a sane depth, and a file of many
// square layers costs at most 2^24 steps.
const maxSearch = 1 << 24

// chainsOf returns up to limit orderings of all layers in which sizes chain, the first layer
// takes inputs and the last gives outputs (either any, when 0). complete is false when the search gave
// up after maxSearch steps without finding limit of them.
func chainsOf(layers []*layer, inputs, outputs, limit int) (found [][]*layer, complete bool) {
	used := make([]bool, len(layers))
	path := make([]*layer, 0, len(layers))
	steps := 0
	var walk func()
	walk = func() {
		if len(found) >= limit || steps > maxSearch {
			return
		}
		if len(path) == len(layers) {
			if outputs == 0 || path[len(path)-1].out == outputs {
				found = append(found, append([]*layer(nil), path...))
			}
			return
		}
		for i, l := range layers {
			if steps++; steps > maxSearch {
				return
			}
			if used[i] {
				continue
			}
			if len(path) == 0 && inputs != 0 && l.in != inputs {
				continue
			}
			if len(path) > 0 && path[len(path)-1].out != l.in {
				continue
			}
			used[i] = true
			path = append(path, l)
			walk()
			path = path[:len(path)-1]
			used[i] = false
		}
	}
	walk()
	return found, len(found) >= limit || steps <= maxSearch
}

// describeAtMost is how many layers an error lists before it says how many more there are.
const describeAtMost = 16

// describe lists the layers with their sizes, the first describeAtMost of them.
func describe(layers []*layer) string {
	var parts []string
	for i, l := range layers {
		if i == describeAtMost {
			parts = append(parts, fmt.Sprintf("and %d more", len(layers)-i))
			break
		}
		parts = append(parts, fmt.Sprintf("%s (%d -> %d)", l.prefix, l.in, l.out))
	}
	return strings.Join(parts, ", ")
}

func prefixes(layers []*layer) string {
	parts := make([]string, len(layers))
	for i, l := range layers {
		parts[i] = l.prefix
	}
	return strings.Join(parts, ",")
}

func sizeOrAny(n int) string {
	if n == 0 {
		return "any number of"
	}
	return strconv.Itoa(n)
}

// build assembles and validates the model.
func build(layers []*layer, opts Options, sigma float64) (*bnn.Model, error) {
	act, err := activation(opts.Activation)
	if err != nil {
		return nil, optionErr("Activation", "%v", err)
	}
	m := &bnn.Model{Classes: append([]string(nil), opts.Classes...), PriorSigma: sigma,
		Features: append([]string(nil), opts.Features...), Activation: act}
	for _, l := range layers {
		m.Layers = append(m.Layers, bnn.Layer{Name: l.prefix, In: l.in, Out: l.out,
			WeightMu: l.tensors[weightMu].Data, WeightLogSigma: l.tensors[weightLogSigma].Data,
			BiasMu: l.tensors[biasMu].Data, BiasLogSigma: l.tensors[biasLogSigma].Data})
	}
	d := layers[0].in
	if opts.Scaler != nil {
		m.Scaler = bnn.Scaler{Mean: append([]float64(nil), opts.Scaler.Mean...), Std: append([]float64(nil), opts.Scaler.Std...)}
	} else {
		m.Scaler = bnn.Scaler{Mean: make([]float64, d), Std: make([]float64, d)}
		for j := range m.Scaler.Std {
			m.Scaler.Std[j] = 1
		}
	}
	if len(m.Features) != 0 && len(m.Features) != d {
		return nil, optionErr("Features", "%d feature names, but the first layer %q takes %d inputs", len(m.Features), layers[0].prefix, d)
	}
	for j := range m.Scaler.Mean {
		mu, sd := m.Scaler.Mean[j], m.Scaler.Std[j]
		if math.IsNaN(mu) || math.IsInf(mu, 0) || !(sd > 0) || math.IsInf(sd, 0) {
			return nil, optionErr("Scaler", "scaler feature %d has mean %v and standard deviation %v, want finite with std > 0", j, mu, sd)
		}
	}
	if err := m.Validate(); err != nil { // the options are checked: what remains is the tensors' values
		return nil, fmt.Errorf("%w: %w", ErrStateDict, err)
	}
	return m, nil
}

// activation parses Options.Activation; "" is ReLU, torchbnn's usual choice.
func activation(name string) (bnn.Activation, error) {
	if name == "" {
		return bnn.ReLU, nil
	}
	return bnn.ParseActivation(name)
}
