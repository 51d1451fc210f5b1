package update

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/blas64"
	"gonum.org/v1/gonum/floats"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/vec"
)

// Engines accepted by Config.Engine.
const (
	// EngineGo evaluates the objective and its closed-form gradient in plain Go (goObjective).
	EngineGo = "go"
	// EngineGorgonia evaluates it with bnn.Graph (gorgonia autodiff), the reference.
	EngineGorgonia = "gorgonia"
)

// objective is what LastLayer's Adam loop drives: a minibatch objective over the last layer's
// parameters with explicit weight noise. *bnn.Graph (built with LastOnly) and *goObjective both
// implement it with the same semantics, the same parameter blocks (in the same layout:
// weights In x Out) and the same order of noise draws, so LastLayer's result does not depend on
// the engine beyond floating-point rounding.
type objective interface {
	Batch() int
	SetBatch(rows [][]float64, labels []int) error
	DrawEps(rng *rand.Rand)
	SetEps(f func(draw, layer int, bias bool, index int) float64)
	Run() (bnn.Eval, error)
	Params() []bnn.Param
	WriteTo(m *bnn.Model) error
	Close() error
}

// newObjective builds the update objective of prev on n rows with cfg's engine (cfg with
// defaults applied).
func newObjective(prev *bnn.Model, n int, cfg Config) (objective, error) {
	gc := graphConfig(prev, n, cfg)
	if cfg.Engine == EngineGorgonia {
		return bnn.NewGraph(prev, gc)
	}
	return newGoObjective(prev, gc)
}

// goObjective is the last-layer update objective of bnn.Graph (GraphConfig.LastOnly) in plain
// Go with a hand-derived gradient; its value and gradient equal the graph's up to rounding
// (see TestGoObjectiveMatchesGraph). For a minibatch of B rows x_r with labels y_r and S draws,
// every layer is sampled (the body's (mu, sigma) are constants, but still sampled):
//
//	W_k = mu_k + sigma_k * eps_{s,k},   sigma = exp(log_sigma),   eps ~ N(0, 1),
//	h_r = act(... act(x_r W_1 + b_1) ...)             (body, the model's activation; see forwardBody)
//	z_r = h_r W + b                                     (last layer, W of shape H x C)
//	loss = (1/(S B)) sum_{s,r} -log softmax(z_r)[y_r] + KLScale * KL(q_L || N(m0, s0^2)),
//	KL = sum_j [ (exp(2 d_j) - 1 - 2 d_j) / 2 + (mu_j - m0_j)^2 / (2 s0_j^2) ],   d_j = log_sigma_j - log s0_j,
//
// where the KL runs over the last layer's weights and biases, (m0, s0) = (0, PriorSigma) for the
// prior objective and the previous posterior's (mu, sigma) per parameter for vcl, and KLScale =
// KLWeight / N (N rows in the update). The gradient, per draw s (eps, sigma of the last layer):
//
//	dL/dz_r        = (softmax(z_r) - onehot(y_r)) / (S B)
//	dL/dW          = sum_r h_r^T dL/dz_r,            dL/db = sum_r dL/dz_r
//	dL/dmu         = dL/dW                          (W = mu + sigma eps)
//	dL/dlog_sigma  = dL/dW * sigma * eps            (dW/dlog_sigma = sigma eps)
//
// summed over draws (the body is constant, so the activation's derivative never enters: h_r is
// the same function of the draw for every activation, and only its value is needed), plus the KL
// term's
//
//	dKL/dmu_j = (mu_j - m0_j) / s0_j^2,   dKL/dlog_sigma_j = exp(2 d_j) - 1,
//
// times KLScale. (For the prior: mu/sp^2 and -1 + exp(2 ls)/sp^2; for vcl: (mu - m1) exp(-2 ls1)
// and -1 + exp(2 (ls - ls1)).) Noise is stored and drawn exactly as bnn.Graph does it: per draw,
// per layer, the weight's noise in In x Out order, then the bias's; so one rng gives both
// engines the same noise.
//
// A goObjective is not safe for concurrent use.
type goObjective struct {
	batch, samples   int
	inputs, hid, cls int
	klScale          float64
	act              bnn.Activation
	body             []frozenLayer

	// The last layer's parameters (params[0..3] = weight_mu, weight_log_sigma, bias_mu,
	// bias_log_sigma; weights H x C) and its KL target in the same layout.
	params             []bnn.Param
	m0W, ls0W, ivW     []float64 // ivW = exp(-2 ls0W) = 1/s0^2
	m0B, ls0B, ivB     []float64
	epsW, epsB         [][]float64 // per draw, the last layer's noise
	sigW, sigB, wT, bL []float64   // work: sigma, sampled weights (wT is C x H)
	gT, gB             []float64   // work: dL/dW (C x H), dL/db of one draw

	rows   int
	labels []int
	x      []float64   // the bound rows, Batch x inputs
	acts   [][]float64 // per body layer, its activations, Batch x out
}

// frozenLayer is a body layer: its (mu, sigma) in graph layout (weights In x Out) and, per draw,
// the sampled weights and biases (drawn by DrawEps/SetEps; the body does not change).
type frozenLayer struct {
	in, out   int
	muW, sigW []float64
	muB, sigB []float64
	w         [][]float64 // per draw, In x Out
	b         [][]float64 // per draw
}

func newGoObjective(m *bnn.Model, cfg bnn.GraphConfig) (*goObjective, error) {
	cfg, err := cfg.Check(m)
	if err != nil {
		return nil, fmt.Errorf("go engine: %w", err)
	}
	last := m.Last()
	h, c := last.In, last.Out
	o := &goObjective{batch: cfg.Batch, samples: cfg.Samples, inputs: m.Inputs(), hid: h, cls: c,
		klScale: cfg.KLScale, act: m.Activation, x: make([]float64, cfg.Batch*m.Inputs())}
	for k := 0; k+1 < len(m.Layers); k++ {
		l := &m.Layers[k]
		fl := frozenLayer{in: l.In, out: l.Out, muW: vec.Transpose(l.WeightMu, l.Out, l.In),
			sigW: vec.ExpInPlace(vec.Transpose(l.WeightLogSigma, l.Out, l.In)), muB: vec.Clone(l.BiasMu), sigB: vec.ExpInPlace(vec.Clone(l.BiasLogSigma))}
		for s := 0; s < cfg.Samples; s++ {
			fl.w = append(fl.w, make([]float64, l.In*l.Out))
			fl.b = append(fl.b, make([]float64, l.Out))
		}
		o.body = append(o.body, fl)
		o.acts = append(o.acts, make([]float64, cfg.Batch*l.Out))
	}
	for _, p := range []struct {
		name string
		v    []float64
	}{{"weight_mu", vec.Transpose(last.WeightMu, c, h)}, {"weight_log_sigma", vec.Transpose(last.WeightLogSigma, c, h)},
		{"bias_mu", vec.Clone(last.BiasMu)}, {"bias_log_sigma", vec.Clone(last.BiasLogSigma)}} {
		o.params = append(o.params, bnn.Param{Name: last.Name + "." + p.name, Value: p.v, Grad: make([]float64, len(p.v))})
	}
	if a := cfg.Prev; a != nil {
		al := a.Last()
		o.m0W, o.ls0W = vec.Transpose(al.WeightMu, c, h), vec.Transpose(al.WeightLogSigma, c, h)
		o.m0B, o.ls0B = vec.Clone(al.BiasMu), vec.Clone(al.BiasLogSigma)
	} else {
		lp := math.Log(m.PriorSigma)
		o.m0W, o.ls0W = make([]float64, h*c), fill(make([]float64, h*c), lp)
		o.m0B, o.ls0B = make([]float64, c), fill(make([]float64, c), lp)
	}
	o.ivW, o.ivB = invVar(o.ls0W), invVar(o.ls0B)
	for s := 0; s < cfg.Samples; s++ {
		o.epsW, o.epsB = append(o.epsW, make([]float64, h*c)), append(o.epsB, make([]float64, c))
	}
	o.sigW, o.sigB, o.wT, o.bL = make([]float64, h*c), make([]float64, c), make([]float64, h*c), make([]float64, c)
	o.gT, o.gB = make([]float64, h*c), make([]float64, c)
	return o, nil
}

func fill(v []float64, x float64) []float64 {
	for i := range v {
		v[i] = x
	}
	return v
}

func invVar(ls []float64) []float64 {
	iv := make([]float64, len(ls))
	for i, v := range ls {
		iv[i] = math.Exp(-2 * v)
	}
	return iv
}

// Batch is the objective's row capacity.
func (o *goObjective) Batch() int { return o.batch }

// Params returns the last layer's four blocks (weights H x C); the slices alias the objective.
func (o *goObjective) Params() []bnn.Param { return o.params }

// SetBatch copies a minibatch of standardised rows (1..Batch of them) and their labels.
func (o *goObjective) SetBatch(rows [][]float64, labels []int) error {
	n, d := len(rows), o.inputs
	if n == 0 || n > o.batch || len(labels) != n {
		return fmt.Errorf("go engine: batch of %d rows and %d labels, want 1..%d of each", n, len(labels), o.batch)
	}
	for i, r := range rows {
		if len(r) != d {
			return fmt.Errorf("go engine: row %d has %d features, want %d", i, len(r), d)
		}
		if labels[i] < 0 || labels[i] >= o.cls {
			return fmt.Errorf("go engine: label %d of row %d out of range [0, %d)", labels[i], i, o.cls)
		}
	}
	for i, r := range rows {
		copy(o.x[i*d:], r)
	}
	o.rows, o.labels = n, append(o.labels[:0], labels...)
	return nil
}

// DrawEps draws the noise of every draw, layer, weight (In x Out order) and bias, in
// bnn.Graph.DrawEps's order, from rng. The body's weights are sampled right away.
func (o *goObjective) DrawEps(rng *rand.Rand) {
	for s := 0; s < o.samples; s++ {
		for _, fl := range o.body {
			w := fl.w[s]
			for i, mu := range fl.muW {
				w[i] = mu + fl.sigW[i]*rng.NormFloat64()
			}
			for i, mu := range fl.muB {
				fl.b[s][i] = mu + fl.sigB[i]*rng.NormFloat64()
			}
		}
		for i := range o.epsW[s] {
			o.epsW[s][i] = rng.NormFloat64()
		}
		for i := range o.epsB[s] {
			o.epsB[s][i] = rng.NormFloat64()
		}
	}
}

// SetEps sets every noise value to f(draw, layer, isBias, index), index in the model's layout
// (Out x In for weights), as bnn.Graph.SetEps.
func (o *goObjective) SetEps(f func(draw, layer int, bias bool, index int) float64) {
	for s := 0; s < o.samples; s++ {
		for k, fl := range o.body {
			w := fl.w[s]
			for i := 0; i < fl.in; i++ {
				for j := 0; j < fl.out; j++ {
					g := i*fl.out + j
					w[g] = fl.muW[g] + fl.sigW[g]*f(s, k, false, j*fl.in+i)
				}
			}
			for j, mu := range fl.muB {
				fl.b[s][j] = mu + fl.sigB[j]*f(s, k, true, j)
			}
		}
		k := len(o.body)
		for i := 0; i < o.hid; i++ {
			for j := 0; j < o.cls; j++ {
				o.epsW[s][i*o.cls+j] = f(s, k, false, j*o.hid+i)
			}
		}
		for j := range o.epsB[s] {
			o.epsB[s][j] = f(s, k, true, j)
		}
	}
}

// Run evaluates the loss and its gradient (see goObjective) for the bound minibatch and noise,
// filling every Param.Grad. It fails with bnn.ErrNonFinite if the loss or a gradient is NaN or
// infinite.
func (o *goObjective) Run() (bnn.Eval, error) {
	if o.rows == 0 {
		return bnn.Eval{}, errors.New("go engine: no batch bound (call SetBatch)")
	}
	muW, lsW, muB, lsB := o.params[0].Value, o.params[1].Value, o.params[2].Value, o.params[3].Value
	gmW, glW, gmB, glB := o.params[0].Grad, o.params[1].Grad, o.params[2].Grad, o.params[3].Grad
	for j, v := range lsW {
		o.sigW[j] = math.Exp(v)
	}
	for j, v := range lsB {
		o.sigB[j] = math.Exp(v)
	}
	clear(gmW)
	clear(glW)
	clear(gmB)
	clear(glB)
	ev := bnn.Eval{Rows: o.rows}
	scale := 1 / float64(o.rows*o.samples)
	c := o.cls
	var zbuf [8]float64
	z := zbuf[:0]
	if c > len(zbuf) {
		z = make([]float64, c)
	}
	z = z[:c]
	for s := 0; s < o.samples; s++ {
		h := o.forwardBody(s)
		eW, eB := o.epsW[s], o.epsB[s]
		// The sampled last layer, transposed (C x H) so that logits and gradients are
		// length-H dot products and axpys on the rows of h.
		for i := 0; i < o.hid; i++ {
			for j := 0; j < c; j++ {
				g := i*c + j
				o.wT[j*o.hid+i] = muW[g] + o.sigW[g]*eW[g]
			}
		}
		for j, mu := range muB {
			o.bL[j] = mu + o.sigB[j]*eB[j]
		}
		clear(o.gT)
		clear(o.gB)
		for r := 0; r < o.rows; r++ {
			hr := h[r*o.hid : (r+1)*o.hid]
			for j := range z {
				z[j] = o.bL[j] + floats.Dot(hr, o.wT[j*o.hid:(j+1)*o.hid])
			}
			nll, best := softmaxNLL(z, o.labels[r], scale)
			ev.NLL += nll
			if s == 0 && best == o.labels[r] {
				ev.Correct++
			}
			for j, d := range z {
				o.gB[j] += d
				floats.AddScaled(o.gT[j*o.hid:(j+1)*o.hid], d, hr)
			}
		}
		for i := 0; i < o.hid; i++ {
			for j := 0; j < c; j++ {
				g, gt := i*c+j, o.gT[j*o.hid+i]
				gmW[g] += gt
				glW[g] += gt * o.sigW[g] * eW[g]
			}
		}
		for j, g := range o.gB {
			gmB[j] += g
			glB[j] += g * o.sigB[j] * eB[j]
		}
	}
	ev.KL = o.klTerm(muW, lsW, o.m0W, o.ls0W, o.ivW, gmW, glW) + o.klTerm(muB, lsB, o.m0B, o.ls0B, o.ivB, gmB, glB)
	ev.Loss = ev.NLL + o.klScale*ev.KL
	if !finite(ev.Loss) || !finite(ev.NLL) || !finite(ev.KL) {
		return ev, fmt.Errorf("go engine: loss %v (NLL %v, KL %v): %w", ev.Loss, ev.NLL, ev.KL, bnn.ErrNonFinite)
	}
	for _, p := range o.params {
		for j, v := range p.Grad {
			if !finite(v) {
				return ev, fmt.Errorf("go engine: gradient of %s[%d] is %v: %w", p.Name, j, v, bnn.ErrNonFinite)
			}
		}
	}
	return ev, nil
}

// softmaxNLL returns scale * -log softmax(z)[y] and argmax(z) (the first, on ties), and
// overwrites the logits z with the NLL term's gradient,
//
//	scale * (softmax(z) - onehot(y)),
//
// computed stably: -log softmax(z)[y] = log sum_j exp(z_j - max z) - (z_y - max z).
func softmaxNLL(z []float64, y int, scale float64) (nll float64, best int) {
	mx := z[0]
	for j, v := range z {
		if v > mx {
			mx, best = v, j
		}
	}
	zy, sum := z[y]-mx, 0.0
	for j, v := range z {
		z[j] = math.Exp(v - mx)
		sum += z[j]
	}
	for j := range z {
		z[j] = z[j] / sum * scale
	}
	z[y] -= scale
	return (math.Log(sum) - zy) * scale, best
}

// forwardBody returns the body's output for the bound rows under draw s's weights,
// act(... act(x W_1 + b_1) ...), rows x H row-major; with no body layers it is x itself.
// One gonum Dgemm per layer on the whole batch, then bias and activation in one pass. (Measured
// against row-by-row axpys over only the nonzero inputs, which avoids Dgemm's unpredictable
// skip-a-zero branch after a ReLU: Dgemm was still 10-25% faster per layer, the saved branches
// costing less than the extra calls.)
func (o *goObjective) forwardBody(s int) []float64 {
	h, width := o.x, o.inputs
	for k := range o.body {
		fl := &o.body[k]
		out, b := o.acts[k], fl.b[s]
		blas64.Gemm(blas.NoTrans, blas.NoTrans, 1,
			blas64.General{Rows: o.rows, Cols: width, Stride: width, Data: h},
			blas64.General{Rows: fl.in, Cols: fl.out, Stride: fl.out, Data: fl.w[s]},
			0, blas64.General{Rows: o.rows, Cols: fl.out, Stride: fl.out, Data: out})
		for r := 0; r < o.rows; r++ {
			row := out[r*fl.out : (r+1)*fl.out]
			b := b[:len(row)]
			if o.act == bnn.ReLU {
				for j, v := range row {
					row[j] = max(v+b[j], 0) // NaN stays NaN
				}
				continue
			}
			for j, v := range row {
				row[j] = o.act.Apply(v + b[j])
			}
		}
		h, width = out, fl.out
	}
	return h
}

// klTerm returns KL(q || N(m0, s0^2)) of one block in the careful form of the goObjective
// comment and adds its gradient times klScale to (gm, gl).
func (o *goObjective) klTerm(mu, ls, m0, ls0, iv, gm, gl []float64) float64 {
	kl := 0.0
	for j := range mu {
		d, dm := ls[j]-ls0[j], mu[j]-m0[j]
		e := math.Expm1(2 * d)
		kl += 0.5*(e-2*d) + 0.5*dm*dm*iv[j]
		gm[j] += o.klScale * dm * iv[j]
		gl[j] += o.klScale * e
	}
	return kl
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// WriteTo copies the last layer's current (mu, log_sigma) into m's last layer (model layout).
// It fails with bnn.ErrNonFinite, leaving m unchanged, if a value is NaN or infinite or a
// log-sigma lies outside [-bnn.MaxLogSigma, bnn.MaxLogSigma] (a model Validate refuses), as
// bnn.Graph.WriteTo.
func (o *goObjective) WriteTo(m *bnn.Model) error {
	l := m.Last()
	if l.In != o.hid || l.Out != o.cls {
		return fmt.Errorf("go engine: last layer is %dx%d, objective has %dx%d", l.Out, l.In, o.cls, o.hid)
	}
	for bi, p := range o.params {
		for j, v := range p.Value {
			if !finite(v) || (bi%2 == 1 && (v < -bnn.MaxLogSigma || v > bnn.MaxLogSigma)) {
				return fmt.Errorf("go engine: %s[%d] = %v: %w", p.Name, j, v, bnn.ErrNonFinite)
			}
		}
	}
	copy(l.WeightMu, vec.Transpose(o.params[0].Value, o.hid, o.cls))
	copy(l.WeightLogSigma, vec.Transpose(o.params[1].Value, o.hid, o.cls))
	copy(l.BiasMu, o.params[2].Value)
	copy(l.BiasLogSigma, o.params[3].Value)
	return nil
}

// Close releases nothing; it exists for the objective interface.
func (o *goObjective) Close() error { return nil }
