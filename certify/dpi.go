package certify

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/cfguard/cfguard/bnn"
)

// ConditionalKLAlpha is the miss probability of the upper confidence bound ConditionalKL returns.
const ConditionalKLAlpha = 0.01

// ConditionalKLEstimate is a Monte-Carlo estimate, for one input x, of the KL divergence between
// the laws of (h, z) under two posteriors that share their body (see EstimateConditionalKL).
type ConditionalKLEstimate struct {
	// Mean is (1/S) sum_s KL(q_new(z | h_s) || q_old(z | h_s)) over S body draws h_s.
	Mean float64
	// Var is the unbiased sample variance of the S terms (0 when S = 1).
	Var float64
	// Draws is S.
	Draws int
	// ParamKL is the KL between the last layers' parameter posteriors, KL(q_new(W, b) || q_old(W, b)):
	// every term lies in [0, ParamKL], and so does the quantity estimated.
	ParamKL float64
}

// Hoeffding is an upper confidence bound on E_h[KL(q_new(z|h) || q_old(z|h))]: with probability
// at least 1 - alpha over the body draws,
//
//	KL_joint <= min(Mean + ParamKL sqrt(ln(1/alpha) / (2 S)), ParamKL)
//
// (Hoeffding's inequality for S independent terms in [0, ParamKL]; the clip is the
// data-processing inequality, which holds without any sampling). It is ParamKL for alpha outside
// (0, 1).
func (e ConditionalKLEstimate) Hoeffding(alpha float64) float64 {
	if !(alpha > 0 && alpha < 1) || e.Draws < 1 {
		return e.ParamKL
	}
	return min(e.Mean+e.ParamKL*math.Sqrt(math.Log(1/alpha)/(2*float64(e.Draws))), e.ParamKL)
}

// Bernstein is the empirical Bernstein upper confidence bound (BernsteinMargin, scaled to the
// range [0, ParamKL]): with probability at least 1 - alpha,
//
//	KL_joint <= min(Mean + sqrt(2 Var ln(2/alpha) / S) + 7 ParamKL ln(2/alpha) / (3 (S - 1)), ParamKL).
//
// It shrinks with the terms' spread, where Hoeffding's bound pays for the whole range. It is
// ParamKL for S < 2 or alpha outside (0, 1).
func (e ConditionalKLEstimate) Bernstein(alpha float64) float64 {
	if e.ParamKL == 0 {
		return 0
	}
	r := e.ParamKL
	return min(e.Mean+r*BernsteinMargin(e.Var/(r*r), e.Draws, alpha), r)
}

// ConditionalKL returns, for the raw input x, the estimate Mean of EstimateConditionalKL with
// draws body draws, and its Hoeffding upper confidence bound at ConditionalKLAlpha.
func ConditionalKL(qNew, qOld *bnn.Model, x []float64, draws int, seed uint64) (mean, upper float64, err error) {
	e, err := EstimateConditionalKL(qNew, qOld, x, draws, seed)
	if err != nil {
		return 0, 0, err
	}
	return e.Mean, e.Hoeffding(ConditionalKLAlpha), nil
}

// EstimateConditionalKL estimates, for one raw input x (standardised with the models' scaler),
// the KL divergence between the laws of (h, z) under qNew and qOld, where h is the last hidden
// layer's activation and z = W h + b the logits:
//
//	KL_joint(x) = KL(q_new(h, z) || q_old(h, z)) = E_{h ~ q(h)} [ KL(q_new(z | h) || q_old(z | h)) ]
//
// The two models must share their body (every layer but the last bit for bit, the scaler and the
// activation), as after cfguard's last-layer updates; otherwise it returns an error. Then h has
// the same law q(h) under both, KL(q_new(h) || q_old(h)) = 0, and the chain rule of KL gives the
// expectation above. Given h, with the last layer mean-field Gaussian (W_cj ~ N(mu_cj, s_cj^2),
// b_c ~ N(mu_c, s_c^2), s = exp(log_sigma)), the logits are independent Gaussians
//
//	z_c | h ~ N(m_c, v_c),   m_c = sum_j mu_cj h_j + mu_c,   v_c = sum_j s_cj^2 h_j^2 + s_c^2,
//
// so the inner KL is a sum over classes of univariate Gaussian KLs,
//
//	KL(q_new(z|h) || q_old(z|h)) = sum_c [ (r_c - 1 - ln r_c) / 2 + (m'_c - m_c)^2 / (2 v_c) ],  r_c = v'_c / v_c
//
// (primes for qNew). The outer expectation is a Monte-Carlo mean over draws independent draws of
// h. Each draw samples the body layer by layer with the local reparameterisation: given the
// previous layer's output a, the pre-activations are independent Gaussians with the mean and
// variance above, which gives h exactly the law it has under weight draws, for one input, with
// one normal per hidden unit instead of one per weight.
//
// Why it matters: p(target | x) = E[softmax(z)_target] and its variance over the posterior are
// functionals of the law of (h, z), a function of the weights, so Theorems 1 and 2 (and tight
// mode) hold per input with KL_joint(x) in place of the parameter KL. And by the
// data-processing inequality (z is the same function of (W, b) under both posteriors, for each
// h), every term lies in [0, ParamKL]: KL_joint(x) <= KL(q_new || q_old). See docs/MATHS.md for
// how much smaller it is and what an upper confidence bound on it costs.
//
// draws must be >= 1; x must have the models' input dimension and finite features. The result
// is a deterministic function of (qNew, qOld, x, draws, seed).
func EstimateConditionalKL(qNew, qOld *bnn.Model, x []float64, draws int, seed uint64) (ConditionalKLEstimate, error) {
	if err := checkSameBody(qNew, qOld); err != nil {
		return ConditionalKLEstimate{}, err
	}
	if draws < 1 {
		return ConditionalKLEstimate{}, fmt.Errorf("conditional kl: draws %d, want >= 1", draws)
	}
	if len(x) != qNew.Inputs() {
		return ConditionalKLEstimate{}, fmt.Errorf("conditional kl: input has %d features, model expects %d", len(x), qNew.Inputs())
	}
	for j, v := range x {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return ConditionalKLEstimate{}, fmt.Errorf("conditional kl: feature %d is %v", j, v)
		}
	}
	ln, lo := qNew.Last(), qOld.Last()
	e := ConditionalKLEstimate{Draws: draws,
		ParamKL: KLDiag(ln.WeightMu, ln.WeightLogSigma, lo.WeightMu, lo.WeightLogSigma) +
			KLDiag(ln.BiasMu, ln.BiasLogSigma, lo.BiasMu, lo.BiasLogSigma)}
	b := newBodySampler(qNew, x)
	headNew, headOld := newGaussianHead(ln), newGaussianHead(lo)
	rng := rand.New(rand.NewPCG(seed, 0x6a09e667f3bcc908))
	// Welford's running mean and variance of the terms.
	var m2 float64
	for s := 1; s <= draws; s++ {
		h := b.draw(rng)
		t := headNew.kl(headOld, h)
		d := t - e.Mean
		e.Mean += d / float64(s)
		m2 += d * (t - e.Mean)
	}
	if draws > 1 {
		e.Var = m2 / float64(draws-1)
	}
	if math.IsNaN(e.Mean) || math.IsInf(e.Mean, 0) {
		return ConditionalKLEstimate{}, fmt.Errorf("conditional kl: not finite (%v)", e.Mean)
	}
	return e, nil
}

// checkSameBody refuses two models whose law of h could differ: another body, scaler or
// activation, or last layers of different shapes. Both must be valid models.
func checkSameBody(a, b *bnn.Model) error {
	for _, m := range []*bnn.Model{a, b} {
		if err := m.Validate(); err != nil {
			return fmt.Errorf("conditional kl: %w", err)
		}
	}
	if !bnn.SameBody(a, b) {
		return fmt.Errorf("conditional kl: the models' bodies differ (every layer but the last must be bit-for-bit equal)")
	}
	la, lb := a.Last(), b.Last()
	if la.In != lb.In || la.Out != lb.Out {
		return fmt.Errorf("conditional kl: last layers have shapes %dx%d and %dx%d", la.Out, la.In, lb.Out, lb.In)
	}
	if a.Activation != b.Activation {
		return fmt.Errorf("conditional kl: activations differ (%v and %v)", a.Activation, b.Activation)
	}
	if !bnn.BitsEqual(a.Scaler.Mean, b.Scaler.Mean) || !bnn.BitsEqual(a.Scaler.Std, b.Scaler.Std) {
		return fmt.Errorf("conditional kl: the models' feature scalers differ")
	}
	return nil
}

// gaussianHead is a mean-field Gaussian layer prepared for the local reparameterisation: the
// weights' means and variances, row-major (Out x In), and the biases'.
type gaussianHead struct {
	in, out      int
	wMu, wVar    []float64
	bMu, bVar    []float64
	mean, vari   []float64 // scratch: the pre-activations' means and variances for one input
	activated    []float64 // scratch: the sampled, activated outputs (body layers)
	inputSquared []float64 // scratch: a_i^2
}

func newGaussianHead(l *bnn.Layer) *gaussianHead {
	g := &gaussianHead{in: l.In, out: l.Out, wMu: l.WeightMu, bMu: l.BiasMu,
		wVar: make([]float64, len(l.WeightLogSigma)), bVar: make([]float64, len(l.BiasLogSigma)),
		mean: make([]float64, l.Out), vari: make([]float64, l.Out), activated: make([]float64, l.Out),
		inputSquared: make([]float64, l.In)}
	for i, ls := range l.WeightLogSigma {
		g.wVar[i] = math.Exp(2 * ls)
	}
	for i, ls := range l.BiasLogSigma {
		g.bVar[i] = math.Exp(2 * ls)
	}
	return g
}

// moments sets g.mean and g.vari to the pre-activations' means and variances given the input a:
// mean_o = sum_i mu_oi a_i + mu_o, var_o = sum_i s_oi^2 a_i^2 + s_o^2.
func (g *gaussianHead) moments(a []float64) {
	for i, v := range a {
		g.inputSquared[i] = v * v
	}
	for o := 0; o < g.out; o++ {
		mu, va := g.wMu[o*g.in:(o+1)*g.in], g.wVar[o*g.in:(o+1)*g.in]
		m, v := g.bMu[o], g.bVar[o]
		for i, ai := range a {
			m += mu[i] * ai
			v += va[i] * g.inputSquared[i]
		}
		g.mean[o], g.vari[o] = m, v
	}
}

// kl is KL(g(z|h) || old(z|h)) for the logits of the two heads given h, a sum over classes of
// univariate Gaussian KLs computed without cancellation: with x = ln(v'/v),
// (r - 1 - ln r)/2 = expm1MinusX(x)/2.
func (g *gaussianHead) kl(old *gaussianHead, h []float64) float64 {
	g.moments(h)
	old.moments(h)
	s := 0.0
	for c := 0; c < g.out; c++ {
		v := old.vari[c]
		dm := g.mean[c] - old.mean[c]
		s += 0.5*expm1MinusX(math.Log1p((g.vari[c]-v)/v)) + 0.5*dm*dm/v
	}
	return s
}

// bodySampler draws the last hidden layer's activation h for one input, layer by layer.
type bodySampler struct {
	layers     []*gaussianHead
	activation bnn.Activation
	first      []float64 // the first layer's input, the standardised x
	firstDone  bool
}

func newBodySampler(m *bnn.Model, x []float64) *bodySampler {
	b := &bodySampler{activation: m.Activation, first: make([]float64, len(x))}
	m.Scaler.Apply(b.first, x)
	for k := 0; k+1 < len(m.Layers); k++ {
		b.layers = append(b.layers, newGaussianHead(&m.Layers[k]))
	}
	return b
}

// draw returns one draw of h (the standardised x itself for a model without hidden layers). The
// returned slice is overwritten by the next draw. The first layer's moments depend only on x and
// are computed once.
func (b *bodySampler) draw(rng *rand.Rand) []float64 {
	a := b.first
	for k, l := range b.layers {
		if k > 0 || !b.firstDone {
			l.moments(a)
			b.firstDone = true
		}
		for o := range l.activated {
			l.activated[o] = b.activation.Apply(l.mean[o] + math.Sqrt(l.vari[o])*rng.NormFloat64())
		}
		a = l.activated
	}
	return a
}
