package update

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"

	"gonum.org/v1/gonum/integrate/quad"
	"gonum.org/v1/gonum/optimize"

	"github.com/cfguard/cfguard/bnn"
)

// The converged solver (Config.Solver "converge") minimises, over the last layer's mean-field
// Gaussian q = N(mu, diag sigma^2), the negative ELBO of the increment's n records under a prior
// that stands for everything seen before:
//
//	J(q) = (1/n) sum_r E_body E_q[-log p(y_r | x_r, w)] + KLWeight * KL(q || q~) / D
//
// with, for vcl, q~ the previous posterior flattened by stabilised forgetting (Kulhavy and
// Zarrop 1993) towards the training prior p0 = N(0, PriorSigma^2), per parameter j:
//
//	lambda = exp(-n / M)                            (M = Config.Memory records; M = 0: lambda = 1)
//	tau~_j = lambda tau_prev,j + (1 - lambda) tau_0,     tau = 1 / sigma^2
//	mu~_j  = (lambda tau_prev,j mu_prev,j + (1 - lambda) tau_0 * 0) / tau~_j
//
// and D = n; for prior, q~ = p0 and D = the records the new posterior stands for
// (Config.Represented). The objective is deterministic, so that a tolerance means something:
//
//   - the body is frozen, so its outputs h_{r,s} under S fixed draws (Config.Draws, seeded) are
//     computed once per increment (common random numbers);
//   - given h, the logits z = h W + b are Gaussian with independent classes,
//     z_c ~ N(m_c, v_c), m_c = h . mu_c + mu_b,c, v_c = sum_i h_i^2 sigma_c,i^2 + sigma_b,c^2
//     (the local reparameterisation of Kingma et al. 2015, exact for a linear layer);
//   - with two classes the NLL depends on d = z_y - z_o ~ N(m_y - m_o, v_y + v_o) alone, and
//     E[softplus(-d)] is computed by Gauss-Hermite quadrature (ghNodes nodes);
//     with more classes, by ghNodes fixed standard-normal draws of z per (row, draw).
//
// J is minimised by L-BFGS (gonum/optimize) in coordinates scaled by the previous posterior,
// a_j = (mu_j - mu_prev,j) / sigma_prev,j and b_j = log sigma_j - log sigma_prev,j, where the KL
// term's curvature is ~KLWeight / D for every coordinate; it stops when the largest gradient
// coordinate is below Tolerance * KLWeight / D, i.e. when the remaining step is about Tolerance
// previous-posterior standard deviations, or at MaxIterations (the safety net), or when the line
// search can make no more progress (Stats.Converged says whether the tolerance was met).
const ghNodes = 16

// gh holds the Gauss-Hermite rule for E[f(N(0, 1))] = sum_k w_k f(x_k): the nodes of
// int e^{-t^2} f(t) dt scaled by sqrt(2), the weights by 1 / sqrt(pi).
var gh = func() (r struct{ x, w [ghNodes]float64 }) {
	x, w := make([]float64, ghNodes), make([]float64, ghNodes)
	quad.Hermite{}.FixedLocations(x, w, math.Inf(-1), math.Inf(1))
	for k := range x {
		r.x[k], r.w[k] = x[k]*math.Sqrt2, w[k]/math.Sqrt(math.Pi)
	}
	return r
}()

// converged is the data of one converged update: the body's outputs, the targets of the KL
// term and the scaling of the coordinates.
type converged struct {
	n, draws, hid, cls int
	h                  [][]float64 // per draw, n x hid row-major
	y                  []int
	e                  [][]float64 // classes > 2: per draw, n x ghNodes x cls fixed normals

	// Parameters in model layout: weights (cls x hid) then biases (cls), as one vector of P.
	mu0, sig0  []float64 // previous posterior (the origin of the scaled coordinates)
	tmu, ttau  []float64 // KL target q~: mean and precision
	klScale    float64   // KLWeight / D
	mu, sig    []float64 // work: current parameters
	gmu, gls   []float64 // work: gradient in (mu, log sigma)
	evals      int
	lastNLL    float64 // the data term and the objective at the last evaluation
	lastObject float64
	freeze     bool // FreezeSigma: the log-sigma gradient is zeroed
}

// An increment is fitted under Config.Draws body draws whatever its size. Every row of the
// increment shares them, so the objective's noise across draws (how the fitted last layer
// depends on the body's features under the draws it got) does not average out over rows: under
// one draw, an increment of 1,024 rows lands two seeds' posteriors KL 0.2 to 0.7 apart, more
// than the default KL budget, and under 16 about 0.02 apart (experiment's
// TestDefaultStepDoesNotDependOnItsDrawsAtAnySize).

// scoreRowDraws is the number of (row, body draw) pairs over which ScoringDraws scores an
// increment's records, at least.
const scoreRowDraws = 1024

// ScoringDraws is the number of body draws with which to score n records (Predictive):
// ceil(scoreRowDraws / n), at most most and at least 4. Scoring does not move the posterior: a
// record's score is its own predictive, whose noise across draws does average out over the
// records of a window.
func ScoringDraws(n, most int) int {
	return min(most, max(4, (scoreRowDraws+n-1)/n))
}

// forgetting returns lambda = exp(-n / memory), 1 for memory 0 (no forgetting).
func forgetting(n int, memory float64) float64 {
	if memory <= 0 {
		return 1
	}
	return math.Exp(-float64(n) / memory)
}

// flatten is stabilised forgetting of one parameter's Gaussian, mean mu and precision tau,
// towards the training prior N(0, 1 / tau0) with weight lambda (the geometric mixture
// N(mu, 1/tau)^lambda N(0, 1/tau0)^(1 - lambda), renormalised):
//
//	tau~ = lambda tau + (1 - lambda) tau0,   mu~ = lambda tau mu / tau~
func flatten(mu, tau, tau0, lambda float64) (tmu, ttau float64) {
	ttau = lambda*tau + (1-lambda)*tau0
	return lambda * tau * mu / ttau, ttau
}

// flattened is prev with its last layer flattened by stabilised forgetting with weight lambda
// (flatten, per weight and bias): the vcl objective's target q~. It is prev itself when lambda
// is 1 (no forgetting).
func flattened(prev *bnn.Model, lambda float64) *bnn.Model {
	if lambda == 1 {
		return prev
	}
	out := prev.Clone()
	tau0 := 1 / (prev.PriorSigma * prev.PriorSigma)
	l := out.Last()
	for _, p := range []struct{ mu, ls []float64 }{{l.WeightMu, l.WeightLogSigma}, {l.BiasMu, l.BiasLogSigma}} {
		for j := range p.mu {
			mu, ttau := flatten(p.mu[j], math.Exp(-2*p.ls[j]), tau0, lambda)
			p.mu[j], p.ls[j] = mu, -0.5*math.Log(ttau)
		}
	}
	return out
}

// lastVector returns the last layer's means and log sigmas as vectors of P: weights in model
// layout (Out x In), then biases.
func lastVector(m *bnn.Model) (mu, ls []float64) {
	l := m.Last()
	mu = append(append([]float64(nil), l.WeightMu...), l.BiasMu...)
	ls = append(append([]float64(nil), l.WeightLogSigma...), l.BiasLogSigma...)
	return mu, ls
}

// bodyOutputs returns the body's outputs for the standardised rows z under draws fixed draws of
// the body's weights, drawn from rng: out[s] is len(z) x H row-major.
func bodyOutputs(prev *bnn.Model, rows [][]float64, labels []int, draws int, rng *rand.Rand) ([][]float64, error) {
	o, err := newGoObjective(prev, bnn.GraphConfig{Batch: len(rows), Samples: draws, LastOnly: true})
	if err != nil {
		return nil, err
	}
	if err := o.SetBatch(rows, labels); err != nil {
		return nil, err
	}
	o.DrawEps(rng)
	out := make([][]float64, draws)
	for s := range out {
		out[s] = append([]float64(nil), o.forwardBody(s)...)
	}
	return out, nil
}

// newConverged prepares the objective of an update of prev on the standardised rows (cfg with
// defaults applied; represented is the D of the prior objective).
func newConverged(prev *bnn.Model, rows [][]float64, y []int, cfg Config) (*converged, error) {
	n := len(rows)
	last := prev.Last()
	c := &converged{n: n, draws: cfg.Draws, hid: last.In, cls: last.Out, y: y, freeze: cfg.FreezeSigma}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0xc0fe))
	var err error
	if c.h, err = bodyOutputs(prev, rows, y, c.draws, rng); err != nil {
		return nil, err
	}
	if c.cls > 2 {
		c.e = make([][]float64, c.draws)
		for s := range c.e {
			c.e[s] = make([]float64, n*ghNodes*c.cls)
			for i := range c.e[s] {
				c.e[s][i] = rng.NormFloat64()
			}
		}
	}
	var ls0 []float64
	c.mu0, ls0 = lastVector(prev)
	p := len(c.mu0)
	c.sig0, c.tmu, c.ttau = make([]float64, p), make([]float64, p), make([]float64, p)
	tau0 := 1 / (prev.PriorSigma * prev.PriorSigma)
	lambda := forgetting(n, cfg.Memory)
	for j := range c.mu0 {
		c.sig0[j] = math.Exp(ls0[j])
		if cfg.Objective == ObjectivePrior {
			c.tmu[j], c.ttau[j] = 0, tau0
			continue
		}
		c.tmu[j], c.ttau[j] = flatten(c.mu0[j], math.Exp(-2*ls0[j]), tau0, lambda)
	}
	d := float64(n)
	if cfg.Objective == ObjectivePrior && cfg.Represented > 0 {
		d = cfg.Represented
	}
	c.klScale = cfg.KLWeight / d
	c.mu, c.sig = make([]float64, p), make([]float64, p)
	c.gmu, c.gls = make([]float64, p), make([]float64, p)
	return c, nil
}

// set moves the work parameters to the scaled coordinates x = (a, b).
func (c *converged) set(x []float64) {
	p := len(c.mu0)
	for j := 0; j < p; j++ {
		c.mu[j] = c.mu0[j] + c.sig0[j]*x[j]
		c.sig[j] = c.sig0[j] * math.Exp(x[p+j])
	}
}

// eval returns J at the work parameters and, when grad is not nil, its gradient in the scaled
// coordinates.
func (c *converged) eval(grad []float64) float64 {
	c.evals++
	clear(c.gmu)
	clear(c.gls)
	nll := 0.0
	if c.cls == 2 {
		nll = c.nllBinary()
	} else {
		nll = c.nllSampled()
	}
	// KL(q || q~) = sum_j [ (t - 1 - log t) / 2 + tau~ (mu - mu~)^2 / 2 ],  t = tau~ sigma^2.
	kl := 0.0
	for j, mu := range c.mu {
		lt := 2*math.Log(c.sig[j]) + math.Log(c.ttau[j])
		et := math.Expm1(lt)
		dm := mu - c.tmu[j]
		kl += 0.5*(et-lt) + 0.5*c.ttau[j]*dm*dm
		c.gmu[j] += c.klScale * c.ttau[j] * dm
		c.gls[j] += c.klScale * et
	}
	c.lastNLL = nll
	c.lastObject = nll + c.klScale*kl
	if grad != nil {
		p := len(c.mu0)
		for j := 0; j < p; j++ {
			grad[j] = c.gmu[j] * c.sig0[j]
			grad[p+j] = c.gls[j]
			if c.freeze {
				grad[p+j] = 0
			}
		}
	}
	return c.lastObject
}

// nllBinary adds the gradient of the mean expected NLL (in mu and log sigma) to (gmu, gls) and
// returns it, by Gauss-Hermite quadrature over d = z_y - z_o ~ N(m, v):
//
//	E[softplus(-d)] = sum_k w_k softplus(-(m + sqrt(v) x_k)),
//	dE/dm = -sum_k w_k sigmoid(-d_k),   dE/dv = -sum_k w_k sigmoid(-d_k) x_k / (2 sqrt(v)),
//
// the exact derivatives of the quadrature sum; then dm/dmu = +-h, dv/dlog sigma = 2 h^2 sigma^2.
func (c *converged) nllBinary() float64 {
	hid := c.hid
	scale := 1 / float64(c.n*c.draws)
	total := 0.0
	w0, w1 := c.mu[:hid], c.mu[hid:2*hid]
	s0, s1 := c.sig[:hid], c.sig[hid:2*hid]
	b := 2 * hid
	v0b, v1b := c.sig[b]*c.sig[b], c.sig[b+1]*c.sig[b+1]
	for s := 0; s < c.draws; s++ {
		hs := c.h[s]
		for r := 0; r < c.n; r++ {
			h := hs[r*hid : (r+1)*hid]
			m0, m1, v0, v1 := c.mu[b], c.mu[b+1], v0b, v1b
			for i, hi := range h {
				if hi == 0 {
					continue
				}
				m0 += hi * w0[i]
				m1 += hi * w1[i]
				h2 := hi * hi
				v0 += h2 * s0[i] * s0[i]
				v1 += h2 * s1[i] * s1[i]
			}
			y := c.y[r]
			m := m1 - m0 // d = z_1 - z_0 for label 1
			if y == 0 {
				m = -m
			}
			v := v0 + v1
			sv := math.Sqrt(v)
			e, dm, dsv := 0.0, 0.0, 0.0
			for k, xk := range gh.x {
				dk := m + sv*xk
				sp, sg := softplusNeg(dk)
				e += gh.w[k] * sp
				dm -= gh.w[k] * sg
				dsv -= gh.w[k] * sg * xk
			}
			total += e
			dm *= scale
			dv := dsv * scale / (2 * sv)
			// d m / d mu: for label 1, +h on class 1, -h on class 0; flipped for label 0.
			g1, g0 := dm, -dm
			if y == 0 {
				g1, g0 = -dm, dm
			}
			for i, hi := range h {
				if hi == 0 {
					continue
				}
				c.gmu[i] += g0 * hi
				c.gmu[hid+i] += g1 * hi
				h2 := 2 * hi * hi * dv
				c.gls[i] += h2 * s0[i] * s0[i]
				c.gls[hid+i] += h2 * s1[i] * s1[i]
			}
			c.gmu[b] += g0
			c.gmu[b+1] += g1
			c.gls[b] += 2 * dv * v0b
			c.gls[b+1] += 2 * dv * v1b
		}
	}
	return total * scale
}

// softplusNeg returns softplus(-d) = log(1 + e^{-d}) and sigmoid(-d), both computed stably.
func softplusNeg(d float64) (sp, sg float64) {
	if d > 0 {
		e := math.Exp(-d)
		return math.Log1p(e), e / (1 + e)
	}
	e := math.Exp(d)
	return -d + math.Log1p(e), 1 / (1 + e)
}

// nllSampled is nllBinary for three or more classes: the expectation over the Gaussian logits
// is the mean over ghNodes fixed standard-normal vectors e, z_c = m_c + sqrt(v_c) e_c, with
//
//	d(-log softmax(z)_y)/dz_c = softmax(z)_c - [c = y],   dz_c/dv_c = e_c / (2 sqrt(v_c)).
func (c *converged) nllSampled() float64 {
	hid, cls := c.hid, c.cls
	scale := 1 / float64(c.n*c.draws*ghNodes)
	m, v, sv := make([]float64, cls), make([]float64, cls), make([]float64, cls)
	gm, gv, z := make([]float64, cls), make([]float64, cls), make([]float64, cls)
	b := cls * hid
	total := 0.0
	for s := 0; s < c.draws; s++ {
		hs := c.h[s]
		for r := 0; r < c.n; r++ {
			h := hs[r*hid : (r+1)*hid]
			for k := 0; k < cls; k++ {
				m[k], v[k] = c.mu[b+k], c.sig[b+k]*c.sig[b+k]
				w, sg := c.mu[k*hid:(k+1)*hid], c.sig[k*hid:(k+1)*hid]
				for i, hi := range h {
					m[k] += hi * w[i]
					v[k] += hi * hi * sg[i] * sg[i]
				}
				sv[k] = math.Sqrt(v[k])
				gm[k], gv[k] = 0, 0
			}
			y := c.y[r]
			e := c.e[s][r*ghNodes*cls:]
			for q := 0; q < ghNodes; q++ {
				eq := e[q*cls : (q+1)*cls]
				mx := math.Inf(-1)
				for k := range z {
					z[k] = m[k] + sv[k]*eq[k]
					mx = max(mx, z[k])
				}
				sum := 0.0
				for k := range z {
					z[k] = math.Exp(z[k] - mx)
					sum += z[k]
				}
				total += math.Log(sum) - math.Log(z[y])
				for k := range z {
					g := z[k] / sum
					if k == y {
						g--
					}
					gm[k] += g * scale
					gv[k] += g * eq[k] / (2 * sv[k]) * scale
				}
			}
			for k := 0; k < cls; k++ {
				sg := c.sig[k*hid : (k+1)*hid]
				for i, hi := range h {
					c.gmu[k*hid+i] += gm[k] * hi
					c.gls[k*hid+i] += gv[k] * 2 * hi * hi * sg[i] * sg[i]
				}
				c.gmu[b+k] += gm[k]
				c.gls[b+k] += gv[k] * 2 * c.sig[b+k] * c.sig[b+k]
			}
		}
	}
	return total * scale
}

// minimize runs L-BFGS from the previous posterior (x = 0) until the gradient's largest
// coordinate is below threshold or maxIter iterations; it returns the final coordinates, the
// iterations and whether the tolerance was met. ctx is checked at every evaluation.
func (c *converged) minimize(ctx context.Context, threshold float64, maxIter int) (x []float64, iters int, ok bool, err error) {
	p := len(c.mu0)
	prob := optimize.Problem{
		Func: func(x []float64) float64 {
			c.set(x)
			return c.eval(nil)
		},
		Grad: func(grad, x []float64) {
			c.set(x)
			c.eval(grad)
		},
		Status: func() (optimize.Status, error) {
			if err := ctx.Err(); err != nil {
				return optimize.Failure, err
			}
			return optimize.NotTerminated, nil
		},
	}
	settings := &optimize.Settings{
		GradientThreshold: threshold,
		MajorIterations:   maxIter,
		// Only the gradient decides convergence: a flat stretch of J must not end the search.
		Converger: optimize.NeverTerminate{},
	}
	res, err := optimize.Minimize(prob, make([]float64, 2*p), settings, &optimize.LBFGS{})
	if ctx.Err() != nil {
		return nil, 0, false, ctx.Err()
	}
	if res == nil {
		return nil, 0, false, fmt.Errorf("optimiser: %w", err)
	}
	// Minimize reports a line search that can make no more progress as an error; the location it
	// returns is still the best found, and the gradient test below judges it.
	x = res.X
	iters = res.Stats.MajorIterations
	c.set(x)
	g := make([]float64, 2*p)
	c.eval(g)
	worst := 0.0
	for _, v := range g {
		worst = max(worst, math.Abs(v))
	}
	if math.IsNaN(worst) || math.IsNaN(c.lastObject) || math.IsInf(c.lastObject, 0) {
		return nil, iters, false, fmt.Errorf("objective %v, gradient %v: %w", c.lastObject, worst, bnn.ErrNonFinite)
	}
	return x, iters, worst < threshold, nil
}

// writeTo copies the work parameters into m's last layer.
func (c *converged) writeTo(m *bnn.Model) {
	l := m.Last()
	nw := len(l.WeightMu)
	copy(l.WeightMu, c.mu[:nw])
	copy(l.BiasMu, c.mu[nw:])
	if c.freeze {
		return // the log sigmas stay prev's, bit for bit
	}
	for j, s := range c.sig {
		if j < nw {
			l.WeightLogSigma[j] = math.Log(s)
		} else {
			l.BiasLogSigma[j-nw] = math.Log(s)
		}
	}
}

// Predictive returns, for each raw row of X, the posterior predictive probabilities of every
// class under m, estimated as the converged objective sees the model: draws fixed body draws
// (from seed) and, given each, the Gaussian logits of the last layer integrated by Gauss-Hermite
// quadrature over z_1 - z_0 (two classes) or averaged over ghNodes fixed draws (more classes).
// It is deterministic in (m, X, draws, seed) and costs about one update's first evaluation, so
// that the daemon can score an increment's records before it learns from them.
func Predictive(m *bnn.Model, X [][]float64, draws int, seed uint64) ([][]float64, error) {
	if draws < 1 {
		return nil, fmt.Errorf("update: predictive: draws %d, want >= 1", draws)
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("update: predictive: %w", err)
	}
	z, err := m.Standardize(X)
	if err != nil {
		return nil, fmt.Errorf("update: predictive: %w", err)
	}
	n := len(X)
	rows := make([][]float64, n)
	for r := range rows {
		rows[r] = z.RawRowView(r)
	}
	rng := rand.New(rand.NewPCG(seed, 0x9e4d))
	h, err := bodyOutputs(m, rows, make([]int, n), draws, rng)
	if err != nil {
		return nil, fmt.Errorf("update: predictive: %w", err)
	}
	l := m.Last()
	hid, cls := l.In, l.Out
	varW, varB := make([]float64, len(l.WeightLogSigma)), make([]float64, cls)
	for j, v := range l.WeightLogSigma {
		varW[j] = math.Exp(2 * v)
	}
	for c, v := range l.BiasLogSigma {
		varB[c] = math.Exp(2 * v)
	}
	out := make([][]float64, n)
	m0, v0, z0 := make([]float64, cls), make([]float64, cls), make([]float64, cls)
	for r := range out {
		out[r] = make([]float64, cls)
	}
	e := make([]float64, ghNodes*cls)
	for s := 0; s < draws; s++ {
		if cls > 2 {
			for i := range e {
				e[i] = rng.NormFloat64()
			}
		}
		for r := 0; r < n; r++ {
			hr := h[s][r*hid : (r+1)*hid]
			for c := 0; c < cls; c++ {
				m0[c], v0[c] = l.BiasMu[c], varB[c]
				w, vw := l.WeightMu[c*hid:(c+1)*hid], varW[c*hid:(c+1)*hid]
				for i, hi := range hr {
					m0[c] += hi * w[i]
					v0[c] += hi * hi * vw[i]
				}
			}
			p := out[r]
			if cls == 2 {
				d, sv := m0[1]-m0[0], math.Sqrt(v0[0]+v0[1])
				p1 := 0.0
				for k, xk := range gh.x {
					p1 += gh.w[k] / (1 + math.Exp(-(d + sv*xk))) // sigmoid(d_k) = p(class 1)
				}
				p[1] += p1 / float64(draws)
				p[0] += (1 - p1) / float64(draws)
				continue
			}
			for q := 0; q < ghNodes; q++ {
				eq := e[q*cls : (q+1)*cls]
				for c := range z0 {
					z0[c] = m0[c] + math.Sqrt(v0[c])*eq[c]
				}
				bnn.Softmax(z0, z0)
				for c, v := range z0 {
					p[c] += v / float64(draws*ghNodes)
				}
			}
		}
	}
	for _, p := range out {
		for c, v := range p {
			p[c] = min(max(v, 0), 1)
		}
	}
	return out, nil
}
