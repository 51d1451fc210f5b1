package bnn

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	G "gorgonia.org/gorgonia"

	"github.com/cfguard/cfguard/internal/vec"
	"gorgonia.org/tensor"
)

// ErrNonFinite is wrapped by every error about a loss, gradient or parameter that became NaN or
// infinite; training and updates refuse such results.
var ErrNonFinite = errors.New("non-finite value")

// GraphConfig says what a Graph computes.
type GraphConfig struct {
	// Batch is the number of rows of the graph's input; shorter minibatches are padded with
	// rows of weight 0. Required (>= 1).
	Batch int
	// Samples is the number of Monte-Carlo weight draws per iteration; the NLL is their mean.
	// Default 1 (torchbnn's single draw per forward pass).
	Samples int
	// LastOnly makes only the last layer trainable. The body's weights are still sampled in
	// every forward pass (w = mu + sigma*eps), but their (mu, log_sigma) are constants.
	LastOnly bool
	// KLScale multiplies the KL term of the loss (kl_weight / N in Train). 0 leaves the KL out of
	// the loss; it is still computed and reported.
	KLScale float64
	// Prev, the previous posterior q_prev, when set, replaces the N(0, PriorSigma^2) prior in the
	// KL term by q_prev's own (mu, sigma) for the trainable layers (variational continual
	// learning: KL(q || q_prev)). It must have the model's shape and activation.
	Prev *Model
}

// Param is one trainable block of parameters in a Graph, e.g. "fc3.weight_mu". Value aliases the
// graph's storage: an optimiser updates it in place and the next Run sees the change. Weights are
// stored transposed relative to Layer (In x Out, row-major); the layout is irrelevant to an
// element-wise optimiser, and Graph.WriteTo converts back. Grad holds d loss / d Value after Run.
type Param struct {
	Name  string
	Value []float64
	Grad  []float64
}

// Eval is what one Run computed on the current minibatch and noise.
type Eval struct {
	Loss    float64 // NLL + KLScale * KL
	NLL     float64 // mean over the batch's rows and the Samples draws of -log p(y | x, w)
	KL      float64 // KL(q || target) summed over the trainable layers' parameters
	Correct int     // rows whose first draw's argmax equals the label
	Rows    int     // rows in the minibatch
}

// Graph is the Bayes-by-backprop objective of a Model as a gorgonia expression graph. It is
// built once and run for every minibatch: the inputs (rows, labels, noise) are rebound with
// gorgonia.Let and the parameters are updated in place, so no graph is rebuilt per iteration.
//
// For every layer k and draw s the forward pass samples (reparameterisation trick)
//
//	W_k = mu_k + exp(log_sigma_k) * eps_{s,k},   eps ~ N(0, 1) fed by DrawEps or SetEps,
//
// applies the model's activation between layers and log-softmax at the end, and the loss is
//
//	loss = (1/S) sum_s (1/B) sum_i -log p(y_i | x_i, W_s) + KLScale * KL(q || target),
//	KL(q || N(m0, s0^2)) = sum_j [ log s0_j - log_sigma_j + (sigma_j^2 + (mu_j - m0_j)^2) / (2 s0_j^2) - 1/2 ],
//
// summed over the trainable layers' weights and biases, with target N(0, PriorSigma^2) or, when
// GraphConfig.Prev is set, the previous posterior's (mu, sigma) per parameter.
//
// A Graph is not safe for concurrent use. Close releases it.
type Graph struct {
	cfg     GraphConfig
	vm      G.VM
	layers  []graphLayer
	x, t    *G.Node
	xv, tv  *tensor.Dense
	eps     [][]*G.Node // eps[s][2k] weight noise, eps[s][2k+1] bias noise of layer k
	epsv    [][]*tensor.Dense
	bound   Inputs // every input tensor, checked when a run fails
	params  []Param
	read    []G.Value // loss, nll, klVar, logp0, then one gradient per param
	klConst float64
	targets []klTarget // one per (mu, log_sigma) pair of the trainable layers
	rows    int
	labels  []int
	classes int
}

// klTarget is the Gaussian N(m0, exp(ls0)^2) that one block of parameters is pulled towards,
// in graph layout; m0 == nil means 0.
type klTarget struct {
	mu, ls  []float64 // the parameters (aliases of graph storage)
	m0, ls0 []float64
	lsPrior float64 // used when ls0 == nil
}

type graphLayer struct {
	in, out   int
	trainable bool
	// Storage in graph layout. For trainable layers these are the parameters; for constant
	// layers ls holds sigma = exp(log_sigma) precomputed.
	muW, lsW, muB, lsB []float64
}

// Check validates cfg for model m and returns it with defaults applied (Samples 0 -> 1). Every
// engine that computes this objective (the gorgonia graph here, update's plain-Go engine) checks
// its configuration with it.
func (cfg GraphConfig) Check(m *Model) (GraphConfig, error) {
	if err := m.Validate(); err != nil {
		return cfg, err
	}
	if cfg.Batch < 1 {
		return cfg, fmt.Errorf("batch size %d, want >= 1", cfg.Batch)
	}
	cfg.Samples = cmp.Or(cfg.Samples, 1)
	if cfg.Samples < 1 {
		return cfg, fmt.Errorf("samples %d, want >= 1", cfg.Samples)
	}
	if math.IsNaN(cfg.KLScale) || math.IsInf(cfg.KLScale, 0) || cfg.KLScale < 0 {
		return cfg, fmt.Errorf("KL scale %v, want finite and >= 0", cfg.KLScale)
	}
	if cfg.Prev != nil {
		if err := sameShape(m, cfg.Prev); err != nil {
			return cfg, fmt.Errorf("previous posterior: %w", err)
		}
		if cfg.Prev.Activation != m.Activation {
			return cfg, fmt.Errorf("previous posterior: activation %v, model %v", cfg.Prev.Activation, m.Activation)
		}
	}
	return cfg, nil
}

// NewGraph builds the objective for m; m itself is not referenced afterwards (its parameters
// are copied into the graph). See GraphConfig for the options. The graph is built in the phases
// of the objective (see Graph): inputs, parameters, forward, kl, loss and gradient.
func NewGraph(m *Model, cfg GraphConfig) (*Graph, error) {
	return newGraph(m, cfg, NewGraphBuilder("graph"))
}

// newGraph is NewGraph on the builder b.
func newGraph(m *Model, cfg GraphConfig, b *GraphBuilder) (*Graph, error) {
	cfg, err := cfg.Check(m)
	if err != nil {
		return nil, fmt.Errorf("graph: %w", err)
	}
	gr := &Graph{cfg: cfg, classes: m.NumClasses()}
	gr.inputs(b, m)
	ln, wrt := gr.parameters(b, m)
	nll, logp0 := gr.forward(b, m, ln)
	klVar := gr.klTerm(b, m, ln)
	b.Phase("loss")
	loss := nll
	if cfg.KLScale != 0 {
		loss = b.Add(nll, b.Mul(klVar, G.NewConstant(cfg.KLScale)))
	}
	b.Phase("gradient")
	reads := append(G.Nodes{loss, nll, klVar, logp0}, b.Grad(loss, wrt...)...)
	gr.read = make([]G.Value, len(reads))
	for i, n := range reads {
		b.Read(n, &gr.read[i])
	}
	if gr.vm, err = b.Compile(); err != nil {
		return nil, err
	}
	gr.bound = b.Inputs()
	return gr, nil
}

func sameShape(a, b *Model) error {
	if len(a.Layers) != len(b.Layers) {
		return fmt.Errorf("%d layers, want %d", len(b.Layers), len(a.Layers))
	}
	for k := range a.Layers {
		if a.Layers[k].In != b.Layers[k].In || a.Layers[k].Out != b.Layers[k].Out {
			return fmt.Errorf("layer %d is %dx%d, want %dx%d", k, b.Layers[k].Out, b.Layers[k].In, a.Layers[k].Out, a.Layers[k].In)
		}
	}
	return nil
}

// layerNodes are one layer's parameter nodes: (mu, sigma) of its weights and biases, and for a
// trainable layer the log_sigma that sigma is computed from.
type layerNodes struct{ muW, sW, muB, sB, lsW, lsB *G.Node }

// inputs adds the minibatch: the rows x (Batch x D) and the target weights t (Batch x C),
// t_ic = 1/(rows*S) if row i has label c and 0 otherwise (0 for padding rows).
func (gr *Graph) inputs(b *GraphBuilder, m *Model) {
	b.Phase("inputs")
	d, c := m.Inputs(), m.NumClasses()
	gr.x, gr.xv = b.Input("x", make([]float64, gr.cfg.Batch*d), gr.cfg.Batch, d)
	gr.t, gr.tv = b.Input("target_weights", make([]float64, gr.cfg.Batch*c), gr.cfg.Batch, c)
}

// parameters adds every layer's (mu, log_sigma) in graph layout (weights In x Out) and
//
//	sigma = exp(log_sigma).
//
// A trainable layer's mu and log_sigma are Params (returned in wrt, in Params' order); a frozen
// layer's mu and sigma are inputs, with sigma precomputed, so nothing is differentiated for it.
func (gr *Graph) parameters(b *GraphBuilder, m *Model) ([]layerNodes, G.Nodes) {
	b.Phase("parameters")
	ln := make([]layerNodes, len(m.Layers))
	var wrt G.Nodes
	for k := range m.Layers {
		l := &m.Layers[k]
		gl := graphLayer{in: l.In, out: l.Out, trainable: !gr.cfg.LastOnly || k == len(m.Layers)-1,
			muW: vec.Transpose(l.WeightMu, l.Out, l.In), lsW: vec.Transpose(l.WeightLogSigma, l.Out, l.In),
			muB: vec.Clone(l.BiasMu), lsB: vec.Clone(l.BiasLogSigma)}
		n := &ln[k]
		n.muW, _ = b.Input(l.Name+".weight_mu", gl.muW, l.In, l.Out)
		n.muB, _ = b.Input(l.Name+".bias_mu", gl.muB, 1, l.Out)
		if gl.trainable {
			n.lsW, _ = b.Input(l.Name+".weight_log_sigma", gl.lsW, l.In, l.Out)
			n.lsB, _ = b.Input(l.Name+".bias_log_sigma", gl.lsB, 1, l.Out)
			n.sW, n.sB = b.Exp(n.lsW), b.Exp(n.lsB)
			for _, p := range []struct {
				node *G.Node
				v    []float64
			}{{n.muW, gl.muW}, {n.lsW, gl.lsW}, {n.muB, gl.muB}, {n.lsB, gl.lsB}} {
				if p.node != nil {
					gr.params = append(gr.params, Param{Name: p.node.Name(), Value: p.v, Grad: make([]float64, len(p.v))})
				}
				wrt = append(wrt, p.node)
			}
		} else {
			n.sW, _ = b.Input(l.Name+".weight_sigma", vec.ExpInPlace(gl.lsW), l.In, l.Out)
			n.sB, _ = b.Input(l.Name+".bias_sigma", vec.ExpInPlace(gl.lsB), 1, l.Out)
		}
		gr.layers = append(gr.layers, gl)
	}
	return ln, wrt
}

// forward adds one forward pass per Monte-Carlo draw s, with noise inputs eps (rebound by
// DrawEps or SetEps) and the reparameterised weights
//
//	W_k = mu_k + sigma_k * eps_{s,k},   b_k likewise,
//	h_0 = x,   h_k = act(h_{k-1} W_k + b_k),   logits = h_{L-1} W_L + b_L,
//
// and returns the NLL of the draws and the first draw's log-probabilities (for Eval.Correct):
//
//	nll = sum_s -sum_ic t_ic log softmax(logits_s)_ic   (t carries 1/(rows*S)).
func (gr *Graph) forward(b *GraphBuilder, m *Model, ln []layerNodes) (nll, logp0 *G.Node) {
	b.Phase("forward")
	last := len(m.Layers) - 1
	for s := 0; s < gr.cfg.Samples; s++ {
		var eps []*G.Node
		var epsv []*tensor.Dense
		h := gr.x
		for k := range m.Layers {
			l := &m.Layers[k]
			eW, eWv := b.Input(fmt.Sprintf("eps%d.%s.weight", s, l.Name), nil, l.In, l.Out)
			eB, eBv := b.Input(fmt.Sprintf("eps%d.%s.bias", s, l.Name), nil, 1, l.Out)
			eps, epsv = append(eps, eW, eB), append(epsv, eWv, eBv)
			w := b.Reparam(ln[k].muW, ln[k].sW, eW)
			bias := b.Reparam(ln[k].muB, ln[k].sB, eB)
			h = b.BroadcastAdd(b.Mul(h, w), bias, 0)
			if k != last {
				h = b.Activation(m.Activation, h)
			}
		}
		logp := b.LogSoftMax(h)
		if s == 0 {
			logp0 = logp
		}
		nll = b.Accum(nll, b.Neg(b.Sum(b.HadamardProd(gr.t, logp))))
		gr.eps, gr.epsv = append(gr.eps, eps), append(gr.epsv, epsv)
	}
	return nll, logp0
}

// klTerm adds KL(q || target) over the trainable layers' weights and biases without its constant,
// which it adds to gr.klConst, and records each block's target for KL:
//
//	KL = klVar + klConst,
//	klVar   = sum_j [ (sigma_j^2 + (mu_j - m0_j)^2) / (2 s0_j^2) - log_sigma_j ],
//	klConst = sum_j [ log s0_j - 1/2 ],
//
// with (m0, s0) = (0, PriorSigma), or GraphConfig.Prev's (mu, sigma) of the same parameter.
func (gr *Graph) klTerm(b *GraphBuilder, m *Model, ln []layerNodes) *G.Node {
	b.Phase("kl")
	var klVar *G.Node
	for k := range m.Layers {
		gl := &gr.layers[k]
		if !gl.trainable {
			continue
		}
		l, n := &m.Layers[k], ln[k]
		blocks := []klBlock{
			{name: "weight", mu: n.muW, ls: n.lsW, s: n.sW, muV: gl.muW, lsV: gl.lsW, shape: []int{l.In, l.Out}},
			{name: "bias", mu: n.muB, ls: n.lsB, s: n.sB, muV: gl.muB, lsV: gl.lsB, shape: []int{1, l.Out}},
		}
		if p := gr.cfg.Prev; p != nil {
			pl := &p.Layers[k]
			blocks[0].m0, blocks[0].ls0 = vec.Transpose(pl.WeightMu, l.Out, l.In), vec.Transpose(pl.WeightLogSigma, l.Out, l.In)
			blocks[1].m0, blocks[1].ls0 = pl.BiasMu, pl.BiasLogSigma
		}
		for _, kb := range blocks {
			klVar = b.Accum(klVar, b.Sub(gr.klQuad(b, m, l.Name, kb), b.Sum(kb.ls)))
		}
	}
	return klVar
}

// klBlock is one block of trainable parameters in klTerm: its nodes, its storage and shape in
// graph layout, and the previous posterior's (m0, log s0) in graph layout (nil for the prior).
type klBlock struct {
	name      string
	mu, ls, s *G.Node
	muV, lsV  []float64
	shape     []int
	m0, ls0   []float64
}

// klQuad is the block's sum_j (sigma_j^2 + (mu_j - m0_j)^2) / (2 s0_j^2), with the prior's
// 1/(2 PriorSigma^2) as a scalar or the previous posterior's m0 and 1/(2 s0^2) as constants; it
// adds the block's sum_j (log s0_j - 1/2) to gr.klConst and its target to gr.targets.
func (gr *Graph) klQuad(b *GraphBuilder, m *Model, layer string, kb klBlock) *G.Node {
	quad := b.Square(kb.s) // sigma^2 (+ (mu - m0)^2 below)
	if kb.ls0 == nil {
		lp := math.Log(m.PriorSigma)
		quad = b.Add(quad, b.Square(kb.mu))
		quad = b.Mul(b.Sum(quad), G.NewConstant(0.5/(m.PriorSigma*m.PriorSigma)))
		gr.klConst += float64(len(kb.muV)) * (lp - 0.5)
		gr.targets = append(gr.targets, klTarget{mu: kb.muV, ls: kb.lsV, lsPrior: lp})
		return quad
	}
	half := make([]float64, len(kb.ls0)) // 1 / (2 s0^2)
	for i, v := range kb.ls0 {
		half[i] = 0.5 * math.Exp(-2*v)
		gr.klConst += v - 0.5
	}
	m0n := b.Const(fmt.Sprintf("%s.%s_mu_prev", layer, kb.name), kb.m0, kb.shape...)
	hn := b.Const(fmt.Sprintf("%s.%s_half_inv_var_prev", layer, kb.name), half, kb.shape...)
	quad = b.Add(quad, b.Square(b.Sub(kb.mu, m0n)))
	gr.targets = append(gr.targets, klTarget{mu: kb.muV, ls: kb.lsV, m0: vec.Clone(kb.m0), ls0: vec.Clone(kb.ls0)})
	return b.Sum(b.HadamardProd(quad, hn))
}

// ActivationNode applies a to every element of n in a gorgonia graph: Rectify, Tanh or Sigmoid.
func ActivationNode(a Activation, n *G.Node) (*G.Node, error) {
	switch a {
	case ReLU:
		return rectify(n)
	case Tanh:
		return G.Tanh(n)
	case Sigmoid:
		return G.Sigmoid(n)
	}
	return nil, fmt.Errorf("unknown activation %d", uint8(a))
}

// rectify is max(x, 0), element-wise, built as gorgonia.Rectify builds it: x ⊙ [x ≥ 0], whose
// derivative is [x ≥ 0]. It leaves out gorgonia.Rectify's graph-drawing group, whose counter is
// a package variable that function increments unsynchronised: two graphs built at once (CEs
// generated concurrently) race on it.
func rectify(x *G.Node) (*G.Node, error) {
	var zero *G.Node
	switch dt := x.Dtype(); dt {
	case tensor.Float64:
		zero = G.NewConstant(float64(0))
	case tensor.Float32:
		zero = G.NewConstant(float32(0))
	default:
		return nil, fmt.Errorf("rectify: dtype %v, want float64 or float32", dt)
	}
	gte, err := G.Gte(x, zero, true)
	if err != nil {
		return nil, err
	}
	return G.HadamardProd(x, gte)
}

// KL is KL(q || target) of the current parameters, summed over the trainable layers, computed in
// plain Go in the numerically careful form (exact 0 when q equals the target)
//
//	sum_j [ (exp(2 d_j) - 1 - 2 d_j) / 2 + (mu_j - m0_j)^2 / (2 s0_j^2) ],   d_j = log_sigma_j - log s0_j.
//
// Run's Eval.KL is the same quantity evaluated inside the graph, before the optimiser's iteration.
func (gr *Graph) KL() float64 {
	s := 0.0
	for _, t := range gr.targets {
		for j, mu := range t.mu {
			m0, ls0 := 0.0, t.lsPrior
			if t.ls0 != nil {
				m0, ls0 = t.m0[j], t.ls0[j]
			}
			d, dm := t.ls[j]-ls0, mu-m0
			s += 0.5*(math.Expm1(2*d)-2*d) + 0.5*dm*dm*math.Exp(-2*ls0)
		}
	}
	return s
}

// Params returns the trainable parameter blocks, in layer order and (weight_mu,
// weight_log_sigma, bias_mu, bias_log_sigma) within a layer. The slices alias the graph.
func (gr *Graph) Params() []Param { return gr.params }

// Batch is the graph's row capacity.
func (gr *Graph) Batch() int { return gr.cfg.Batch }

// SetBatch binds a minibatch of standardised rows (at most Batch of them) and their labels.
// Missing rows are zero with weight 0, so they do not contribute to the loss.
func (gr *Graph) SetBatch(rows [][]float64, labels []int) error {
	n, d := len(rows), gr.layers[0].in
	if n == 0 || n > gr.cfg.Batch || len(labels) != n {
		return fmt.Errorf("graph: batch of %d rows and %d labels, want 1..%d of each", n, len(labels), gr.cfg.Batch)
	}
	xs, ts := gr.xv.Data().([]float64), gr.tv.Data().([]float64)
	clear(xs)
	clear(ts)
	w := 1 / float64(n*gr.cfg.Samples)
	for i, r := range rows {
		if len(r) != d {
			return fmt.Errorf("graph: row %d has %d features, want %d", i, len(r), d)
		}
		if labels[i] < 0 || labels[i] >= gr.classes {
			return fmt.Errorf("graph: label %d of row %d out of range [0, %d)", labels[i], i, gr.classes)
		}
		copy(xs[i*d:], r)
		ts[i*gr.classes+labels[i]] = w
	}
	gr.rows, gr.labels = n, append(gr.labels[:0], labels...)
	if err := G.Let(gr.x, gr.xv); err != nil {
		return fmt.Errorf("graph: %w", err)
	}
	return G.Let(gr.t, gr.tv)
}

// DrawEps draws fresh standard-normal noise for every draw, layer, weight and bias, in that
// order, from rng; the result is a deterministic function of rng's state.
func (gr *Graph) DrawEps(rng *rand.Rand) {
	for s := range gr.epsv {
		for _, t := range gr.epsv[s] {
			v := t.Data().([]float64)
			for i := range v {
				v[i] = rng.NormFloat64()
			}
		}
	}
}

// SetEps sets every noise value to f(draw, layer, isBias, index); index follows the model's
// layout (Out x In for weights). Used to evaluate the objective at a fixed noise, e.g. to
// check gradients against finite differences.
func (gr *Graph) SetEps(f func(draw, layer int, bias bool, index int) float64) {
	for s := range gr.epsv {
		for k, gl := range gr.layers {
			w := gr.epsv[s][2*k].Data().([]float64)
			for o := 0; o < gl.out; o++ {
				for i := 0; i < gl.in; i++ {
					w[i*gl.out+o] = f(s, k, false, o*gl.in+i)
				}
			}
			b := gr.epsv[s][2*k+1].Data().([]float64)
			for o := range b {
				b[o] = f(s, k, true, o)
			}
		}
	}
}

// Run evaluates the loss and its gradient for the bound minibatch and noise, filling every
// Param.Grad. It fails with ErrNonFinite if the loss or any gradient is NaN or infinite.
func (gr *Graph) Run() (Eval, error) {
	if gr.rows == 0 {
		return Eval{}, errors.New("graph: no batch bound (call SetBatch)")
	}
	for s := range gr.eps {
		for i, n := range gr.eps[s] {
			if err := G.Let(n, gr.epsv[s][i]); err != nil {
				return Eval{}, fmt.Errorf("graph: %w", err)
			}
		}
	}
	defer gr.vm.Reset()
	if err := gr.bound.Run(gr.vm); err != nil {
		return Eval{}, fmt.Errorf("graph: run: %w", err)
	}
	scalar := func(v G.Value) float64 { return v.Data().(float64) }
	ev := Eval{Loss: scalar(gr.read[0]), NLL: scalar(gr.read[1]), KL: scalar(gr.read[2]) + gr.klConst, Rows: gr.rows}
	ev.Loss += gr.cfg.KLScale * gr.klConst
	logp := gr.read[3].Data().([]float64)
	for i := 0; i < gr.rows; i++ {
		row := logp[i*gr.classes : (i+1)*gr.classes]
		best := 0
		for c := range row {
			if row[c] > row[best] {
				best = c
			}
		}
		if best == gr.labels[i] {
			ev.Correct++
		}
	}
	if !finite(ev.Loss) || !finite(ev.NLL) || !finite(ev.KL) {
		return ev, fmt.Errorf("graph: loss %v (NLL %v, KL %v): %w", ev.Loss, ev.NLL, ev.KL, ErrNonFinite)
	}
	for i := range gr.params {
		g := gr.read[4+i].Data().([]float64)
		for j, v := range g {
			if !finite(v) {
				return ev, fmt.Errorf("graph: gradient of %s[%d] is %v: %w", gr.params[i].Name, j, v, ErrNonFinite)
			}
		}
		copy(gr.params[i].Grad, g)
	}
	return ev, nil
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// WriteTo copies the trainable layers' current (mu, log_sigma) into m, which must have the shape
// of the model the graph was built from. Layers that are not trainable are left untouched. It
// fails with ErrNonFinite, leaving m unchanged, if any value is NaN, infinite, or a log-sigma
// outside [-MaxLogSigma, MaxLogSigma] (a model Validate refuses).
func (gr *Graph) WriteTo(m *Model) error {
	if len(m.Layers) != len(gr.layers) {
		return fmt.Errorf("graph: model has %d layers, graph %d", len(m.Layers), len(gr.layers))
	}
	for k, gl := range gr.layers {
		l := &m.Layers[k]
		if l.In != gl.in || l.Out != gl.out {
			return fmt.Errorf("graph: layer %d is %dx%d, graph has %dx%d", k, l.Out, l.In, gl.out, gl.in)
		}
		if !gl.trainable {
			continue
		}
		for _, p := range []struct {
			name string
			v    []float64
			ls   bool
		}{{"weight_mu", gl.muW, false}, {"weight_log_sigma", gl.lsW, true}, {"bias_mu", gl.muB, false}, {"bias_log_sigma", gl.lsB, true}} {
			for i, v := range p.v {
				if !finite(v) || (p.ls && (v < -MaxLogSigma || v > MaxLogSigma)) {
					return fmt.Errorf("graph: %s.%s[%d] = %v: %w", l.Name, p.name, i, v, ErrNonFinite)
				}
			}
		}
	}
	for k, gl := range gr.layers {
		if !gl.trainable {
			continue
		}
		l := &m.Layers[k]
		copy(l.WeightMu, vec.Transpose(gl.muW, gl.in, gl.out))
		copy(l.WeightLogSigma, vec.Transpose(gl.lsW, gl.in, gl.out))
		copy(l.BiasMu, gl.muB)
		copy(l.BiasLogSigma, gl.lsB)
	}
	return nil
}

// Close releases the graph's machine.
func (gr *Graph) Close() error {
	if gr.vm == nil {
		return nil
	}
	return gr.vm.Close()
}
