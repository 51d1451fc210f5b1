package explain

import (
	"fmt"
	"math"

	"github.com/cfguard/cfguard/bnn"
	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

// Weights are the lambdas of the counterfactual objective (see the package documentation):
//
//	L = Class L_clf + Delta L_delta + Latent L_ldist + Var L_var - ELBO * ELBO(x') + Prox ||x' - x||^2
//	    + Pred L_pred + Robust L_roar + ProxL1 ||x' - x||_1
//	L_pred = -log E_w[ p(y' | x', w) ]                                  (BayesCF)
//	L_roar = E_w[ softplus( DeltaMax (||x'||_1 + 1) - logit_w(y' | x') ) ] (ROAR)
//	logit_w(y' | x') = log p(y' | x', w) - log( sum_{c != y'} p(c | x', w) + 1e-12 )
//
// Prox and ProxL1 are input-space proximities (standardised units); PSCE leaves them 0. L_pred
// is the negative log of the posterior predictive itself, where L_clf is the expected negative
// log-likelihood (Jensen: L_pred <= L_clf). L_roar is ROAR's worst case (Upadhyay et al. 2021):
// a linear model w.x' + b whose weights and bias may each move by at most DeltaMax loses at most
// DeltaMax (||x'||_1 + 1) of its logit, so the robust loss is the logistic loss at the logit
// lowered by that much; here the local model is each sampled network's own log-odds of y'
// (Config.DeltaMax sets DeltaMax).
type Weights struct {
	Class, Delta, Latent, Var, ELBO, Prox float64
	Pred, Robust, ProxL1                  float64
}

// PaperWeights are the paper's PSCE weights for the Wisconsin Breast Cancer data (supplementary
// Table "Hyperparameters ... Wisconsin Breast Cancer Dataset").
var PaperWeights = Weights{Class: 0.1, Delta: 0.2, Latent: 0.2, Var: 0.1, ELBO: 0.1}

// DefaultWeights are PSCE's defaults: the paper's breast-cancer regularisers (Latent 0.2, ELBO
// 0.1, Var 0.1) with Class and Delta raised to 1, the values the paper itself uses for
// lambda_class on Spambase/Credit and for lambda_delta on MNIST. The paper selected its weights
// "based on the validity of counterfactuals" for its own VAE, whose latent size and likelihood it
// does not state; with ours (Latent 8, ObsVar 1) the literal breast-cancer weights put the
// objective's minimum outside the <0.05,0.01>-set for most inputs. Measured on breast_cancer
// (seed 1, 20 test rows, 500-iteration cap): PaperWeights reach the set for 6/20 (valid 19/20),
// DefaultWeights for 20/20, with mean distance to the target class's training rows 6.70 against
// 7.08 for the paper's weights with per-dimension (mean) reductions and 7.34 for the paper's
// Spambase/Credit weights. Selected by the paper's criterion, re-applied to our VAE.
var DefaultWeights = Weights{Class: 1, Delta: 1, Latent: 0.2, Var: 0.1, ELBO: 0.1}

// WachterWeights are the baseline's: cross-entropy plus L2 proximity with the paper's BayesCF
// lambda_prox for breast cancer (0.1).
var WachterWeights = Weights{Class: 1, Prox: 0.1}

// BayesCFWeights are the BayesCF baseline's (Batten et al. 2025): the negative log posterior
// predictive plus L2 proximity, with the paper's breast-cancer lambda_prox (0.1).
var BayesCFWeights = Weights{Pred: 1, Prox: 0.1}

// ROARWeights are the ROAR baseline's (Upadhyay et al. 2021): the worst-case logistic loss plus
// ROAR's L1 cost with its paper's lambda (0.1). The PSCE paper's supplementary tables give no ROAR
// values.
var ROARWeights = Weights{Robust: 1, ProxL1: 0.1}

func (w Weights) validate() error {
	for _, f := range []struct {
		name string
		v    float64
	}{{"class", w.Class}, {"delta", w.Delta}, {"latent", w.Latent}, {"var", w.Var}, {"elbo", w.ELBO}, {"prox", w.Prox},
		{"pred", w.Pred}, {"robust", w.Robust}, {"prox_l1", w.ProxL1}} {
		if !(f.v >= 0) || math.IsInf(f.v, 0) {
			return fmt.Errorf("weight %s = %v, want finite and >= 0", f.name, f.v)
		}
	}
	return nil
}

// term indexes the objective's terms in objectiveEval.Terms.
type term int

// The objective's terms, in the order of objectiveEval.Terms.
const (
	termClf term = iota
	termDelta
	termLatent
	termVar
	termELBO
	termProx
	termPred
	termRobust
	termProxL1
	numTerms
)

func (t term) String() string {
	return [...]string{"L_clf", "L_delta", "L_ldist", "L_var", "ELBO", "L_prox", "L_pred", "L_roar", "L_prox1"}[t]
}

// objective is the counterfactual loss as one gorgonia graph over x' (standardised, length D):
//
//	probabilities of S sampled networks: layer 0 as one stacked matrix-vector product
//	(S*Out x In) x' and the later layers as batched products over the S draws, the model's
//	activation between layers, log-softmax at the end; then the terms of Weights and d L / d x'.
//
// The graph is built once; per evaluation only its inputs are rebound with gorgonia.Let: x', the
// S sampled networks, the ELBO noise, the anchors and the scalars. Only the nodes that the loss,
// the terms and the gradient depend on are compiled (gorgonia also builds gradient expressions
// for the weights, which we never need). An objective is not safe for concurrent use.
type objective struct {
	S, D, C int
	hasVAE  bool

	vm    G.VM
	bound bnn.Inputs // every input tensor, checked when a run fails

	x            *G.Node
	xv           *tensor.Dense
	wn, bn       []*G.Node
	wv, bv       []*tensor.Dense
	oh, noh, x0  *G.Node
	ohv, nohv    *tensor.Dense
	x0v          *tensor.Dense
	mu0          *G.Node
	mu0v         *tensor.Dense
	zeta         *G.Node
	zetav        *tensor.Dense
	lam          [numTerms]*G.Node
	thr, epsilon *G.Node // 1 - delta and epsilon
	deltaMax     *G.Node // ROAR's weight shift

	total, lp, grad G.Value
	terms           [numTerms]G.Value
	hasTerm         [numTerms]bool
}

// objectiveEval is one evaluation: the loss, its terms (unweighted), the S x C sampled
// probabilities and the gradient with respect to x'.
type objectiveEval struct {
	Total float64
	Terms [numTerms]float64
	Probs []float64 // S*C, row s is draw s
	Grad  []float64
}

// newObjective builds the graph for m's architecture, S draws per evaluation, and (if v is not
// nil) the VAE terms with v's weights bound as constants. It is built in phases: inputs, forward
// (the S sampled networks), terms (those of the classifier and of x' itself), vae (the VAE's
// terms), loss (the weighted sum) and gradient (d L / d x').
func newObjective(m *bnn.Model, v *VAE, S int) (*objective, error) {
	if S < 2 {
		return nil, fmt.Errorf("objective: %d samples, want >= 2", S)
	}
	o := &objective{S: S, D: m.Inputs(), C: m.NumClasses(), hasVAE: v != nil}
	b := bnn.NewGraphBuilder("objective")
	o.inputs(b)
	lp := o.forward(b, m)
	terms := o.classTerms(b, lp)
	if v != nil {
		o.vaeTerms(b, v, &terms)
	}
	total := o.weightedSum(b, terms)
	b.Phase("gradient")
	b.Read(total, &o.total)
	b.Read(lp, &o.lp)
	if grads := b.Grad(total, o.x); grads != nil {
		b.Read(grads[0], &o.grad)
	}
	var err error
	if o.vm, err = b.Compile(); err != nil {
		return nil, err
	}
	o.bound = b.Inputs()
	return o, nil
}

// inputs adds what is rebound per evaluation or per problem: x', the target's one-hot vector and
// its complement, the anchor x0, the lambdas, 1 - delta, epsilon and ROAR's DeltaMax.
func (o *objective) inputs(b *bnn.GraphBuilder) {
	b.Phase("inputs")
	o.x, o.xv = b.Input("x", nil, o.D)
	o.oh, o.ohv = b.Input("onehot", nil, o.C)
	o.noh, o.nohv = b.Input("not_onehot", nil, o.C)
	o.x0, o.x0v = b.Input("x0", nil, o.D)
	for t := range o.lam {
		o.lam[t] = b.Scalar("lambda_"+term(t).String(), 0)
	}
	o.thr = b.Scalar("one_minus_delta", 0.95)
	o.epsilon = b.Scalar("epsilon", 0.01)
	o.deltaMax = b.Scalar("delta_max", 0.1)
}

// forward adds the S sampled networks as inputs (rebound by setNets) and their log-probabilities
// at x', returned as an S x C node:
//
//	h_1 = act(W_1 x' + b_1)          all S draws at once: W_1 stacked as (S*Out x In),
//	h_k = act(h_{k-1} W_k^T + b_k)   batched over the S draws, W_k as (S, Out, In),
//	log p(c | x', w_s) = log softmax(h_L)_{s,c}   (no activation on the last layer).
func (o *objective) forward(b *bnn.GraphBuilder, m *bnn.Model) *G.Node {
	b.Phase("forward")
	S, nl := o.S, len(m.Layers)
	o.wn, o.bn = make([]*G.Node, nl), make([]*G.Node, nl)
	o.wv, o.bv = make([]*tensor.Dense, nl), make([]*tensor.Dense, nl)
	var h *G.Node
	for k, l := range m.Layers {
		if k == 0 {
			o.wn[0], o.wv[0] = b.Input("w0", nil, S*l.Out, l.In)
			o.bn[0], o.bv[0] = b.Input("b0", nil, S*l.Out)
			h = b.Add(b.Mul(o.wn[0], o.x), o.bn[0]) // (S*Out)
		} else {
			o.wn[k], o.wv[k] = b.Input(fmt.Sprintf("w%d", k), nil, S, l.Out, l.In)
			o.bn[k], o.bv[k] = b.Input(fmt.Sprintf("b%d", k), nil, S, 1, l.Out)
			h = b.Add(b.BatchedMatMul(h, o.wn[k], false, true), o.bn[k]) // (S,1,Out)
		}
		if k == nl-1 {
			h = b.Reshape(h, S, l.Out)
			break
		}
		h = b.Activation(m.Activation, h)
		if k == 0 {
			h = b.Reshape(h, S, 1, l.Out)
		}
	}
	return b.LogSoftMax(h, 1)
}

// classTerms adds the terms of the classifier's draws and of x' itself, from lp = log p(c | x',
// w_s) (S x C), with p_s = p(y' | x', w_s) and E, Var over the S draws (Var with 1/(S-1)):
//
//	L_clf   = -(1/S) sum_s log p_s
//	L_delta = max(1 - delta - E[p], 0)
//	L_var   = max(Var[p] - epsilon, 0)
//	L_pred  = -log(E[p] + 1e-300)   (the constant keeps it finite where E[p] underflows to 0, so
//	          that a weight of 0 gives 0, not 0 x Inf = NaN; it changes no E[p] above 1e-284)
//	L_roar  = (1/S) sum_s softplus(DeltaMax (||x'||_1 + 1) - logit_s),
//	          logit_s = log p_s - log(sum_{c != y'} p(c | x', w_s) + 1e-12)
//	L_prox  = ||x' - x0||^2,   L_prox1 = ||x' - x0||_1.
func (o *objective) classTerms(b *bnn.GraphBuilder, lp *G.Node) [numTerms]*G.Node {
	b.Phase("terms")
	lpt := b.Mul(lp, o.oh)              // (S): log p(y' | x', w_s)
	p := b.Exp(lpt)                     // (S)
	ep := b.Mean(p)                     // E_w[p]
	ss := b.Sum(b.Square(b.Sub(p, ep))) // sum of squared deviations from E_w[p]
	varp := b.Mul(ss, G.NewConstant(1/float64(o.S-1)))
	var terms [numTerms]*G.Node
	terms[termClf] = b.Neg(b.Mean(lpt))
	terms[termDelta] = b.Rectify(b.Sub(o.thr, ep))
	terms[termVar] = b.Rectify(b.Sub(varp, o.epsilon))
	terms[termProx] = b.Sum(b.Square(b.Sub(o.x, o.x0)))
	terms[termPred] = b.Neg(b.Log(b.Add(ep, G.NewConstant(1e-300))))
	terms[termProxL1] = b.Sum(b.Abs(b.Sub(o.x, o.x0)))
	others := b.Mul(b.Exp(lp), o.noh) // (S): sum_{c != y'} p(c | x', w_s)
	logit := b.Sub(lpt, b.Log(b.Add(others, G.NewConstant(1e-12))))
	shift := b.Mul(o.deltaMax, b.Add(b.Sum(b.Abs(o.x)), G.NewConstant(1.0)))
	terms[termRobust] = b.Mean(b.Softplus(b.Sub(shift, logit)))
	return terms
}

// vaeTerms adds the VAE's terms with its weights as constants, the anchor mu0 and the noise zeta
// (rebound by setProblem and setZeta) as inputs; (mu, log sigma^2) = encoder(x'), D inputs:
//
//	u      = mu + exp(logvar / 2) * zeta                         (reparameterised latent draw)
//	ELBO   = -||x' - decoder(u)||^2 / (2 ObsVar) - (D/2) log(2 pi ObsVar)
//	         - (1/2) sum_k (mu_k^2 + exp(logvar_k) - logvar_k - 1)
//	L_ldist = ||mu - mu0||^2.
func (o *objective) vaeTerms(b *bnn.GraphBuilder, v *VAE, terms *[numTerms]*G.Node) {
	b.Phase("vae")
	o.mu0, o.mu0v = b.Input("mu0", nil, v.Latent)
	o.zeta, o.zetav = b.Input("zeta", nil, v.Latent)
	aff := func(l *dense, name string, in *G.Node) *G.Node {
		w := b.Const(name+".weight", l.W, l.Out, l.In)
		bias := b.Const(name+".bias", l.B, l.Out)
		return b.Add(b.Mul(w, in), bias)
	}
	eh := b.Rectify(aff(&v.enc, "encoder.fc1", o.x))
	mu := aff(&v.mu, "encoder.mu", eh)
	lv := aff(&v.logvar, "encoder.logvar", eh)
	u := b.Reparam(mu, b.Exp(b.Mul(lv, G.NewConstant(0.5))), o.zeta)
	zh := aff(&v.out, "decoder.out", b.Rectify(aff(&v.dec, "decoder.fc1", u)))
	se := b.Sum(b.Square(b.Sub(o.x, zh)))
	logConst := float64(v.Inputs) / 2 * math.Log(2*math.Pi*v.ObsVar)
	rec := b.Sub(b.Mul(se, G.NewConstant(-1/(2*v.ObsVar))), G.NewConstant(logConst))
	klTerms := b.Sub(b.Add(b.Square(mu), b.Exp(lv)), b.Add(lv, G.NewConstant(1.0)))
	kl := b.Mul(b.Sum(klTerms), G.NewConstant(0.5))
	terms[termELBO] = b.Sub(rec, kl)
	terms[termLatent] = b.Sum(b.Square(b.Sub(mu, o.mu0)))
}

// weightedSum reads every term that is built and returns the loss
//
//	L = sum_t lambda_t L_t - lambda_ELBO ELBO.
func (o *objective) weightedSum(b *bnn.GraphBuilder, terms [numTerms]*G.Node) *G.Node {
	b.Phase("loss")
	var total *G.Node
	for t, n := range terms {
		if n == nil {
			continue
		}
		o.hasTerm[t] = true
		b.Read(n, &o.terms[t])
		weighted := b.Mul(n, o.lam[t])
		if term(t) == termELBO {
			weighted = b.Neg(weighted)
		}
		total = b.Accum(total, weighted)
	}
	return total
}

// setNets copies the S networks into the graph's weight inputs (layer 0 stacked, the others
// batched; both are the networks' own Out x In layouts laid end to end).
func (o *objective) setNets(nets []*bnn.Net) error {
	if len(nets) != o.S {
		return fmt.Errorf("objective: %d networks, want %d", len(nets), o.S)
	}
	for k := range o.wv {
		wd := o.wv[k].Data().([]float64)
		bd := o.bv[k].Data().([]float64)
		nw, nb := len(nets[0].W[k]), len(nets[0].B[k])
		for s, n := range nets {
			copy(wd[s*nw:(s+1)*nw], n.W[k])
			copy(bd[s*nb:(s+1)*nb], n.B[k])
		}
		if err := G.Let(o.wn[k], o.wv[k]); err != nil {
			return err
		}
		if err := G.Let(o.bn[k], o.bv[k]); err != nil {
			return err
		}
	}
	return nil
}

// setProblem binds the target class, the anchors (x0 for L_prox, mu0 for L_ldist), the weights
// and the thresholds.
func (o *objective) setProblem(target int, x0, mu0 []float64, w Weights, delta, epsilon float64) error {
	oh := o.ohv.Data().([]float64)
	for c := range oh {
		oh[c] = 0
	}
	oh[target] = 1
	noh := o.nohv.Data().([]float64)
	for c := range noh {
		noh[c] = 1 - oh[c]
	}
	copy(o.x0v.Data().([]float64), x0)
	if err := G.Let(o.oh, o.ohv); err != nil {
		return err
	}
	if err := G.Let(o.noh, o.nohv); err != nil {
		return err
	}
	if err := G.Let(o.x0, o.x0v); err != nil {
		return err
	}
	if o.hasVAE {
		copy(o.mu0v.Data().([]float64), mu0)
		if err := G.Let(o.mu0, o.mu0v); err != nil {
			return err
		}
	}
	ws := [numTerms]float64{w.Class, w.Delta, w.Latent, w.Var, w.ELBO, w.Prox, w.Pred, w.Robust, w.ProxL1}
	for t, v := range ws {
		if err := G.Let(o.lam[t], v); err != nil {
			return err
		}
	}
	if err := G.Let(o.thr, 1-delta); err != nil {
		return err
	}
	return G.Let(o.epsilon, epsilon)
}

// setDeltaMax binds ROAR's bound on the shift of every weight and bias of the local model.
func (o *objective) setDeltaMax(v float64) error { return G.Let(o.deltaMax, v) }

// setZeta binds the ELBO's reparameterisation noise (ignored without a VAE).
func (o *objective) setZeta(e []float64) error {
	if !o.hasVAE {
		return nil
	}
	copy(o.zetav.Data().([]float64), e)
	return G.Let(o.zeta, o.zetav)
}

// eval runs the graph at x' = z and fills out (reusing its slices).
func (o *objective) eval(z []float64, out *objectiveEval) error {
	copy(o.xv.Data().([]float64), z)
	if err := G.Let(o.x, o.xv); err != nil {
		return err
	}
	o.vm.Reset()
	if err := o.bound.Run(o.vm); err != nil {
		return fmt.Errorf("objective: %w", err)
	}
	out.Total = o.total.Data().(float64)
	for t := range o.terms {
		out.Terms[t] = 0
		if o.hasTerm[t] {
			out.Terms[t] = o.terms[t].Data().(float64)
		}
	}
	lp := o.lp.Data().([]float64)
	if cap(out.Probs) < len(lp) {
		out.Probs = make([]float64, len(lp))
	}
	out.Probs = out.Probs[:len(lp)]
	for i, v := range lp {
		out.Probs[i] = math.Exp(v)
	}
	gd := o.grad.Data().([]float64)
	if cap(out.Grad) < len(gd) {
		out.Grad = make([]float64, len(gd))
	}
	out.Grad = out.Grad[:len(gd)]
	copy(out.Grad, gd)
	return nil
}

func (o *objective) close() {
	if o.vm != nil {
		o.vm.Close()
	}
}
