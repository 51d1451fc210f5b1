package explain

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/cfguard/cfguard/bnn"
)

// The search drivers: the gradient search of PSCE and Wachter (descend) and Schut's greedy search
// (schut), both run by run, which evaluates the objective at every iterate and applies the
// stopping rule.

// search is the state shared by both search loops: minibatches from the Generator's networks and
// the stopping machinery.
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
	// does not pay for the confirmation ensemble at every iteration.
	cooldown int
}

func (g *Generator) newSearch(o *objective, target int) *search {
	s := &search{g: g, o: o, target: target, rng: rand.New(rand.NewPCG(seedFor(g.cfg.Seed, tagIter), 0)),
		batch: make([]*bnn.Net, g.cfg.Samples)}
	if g.vae != nil {
		s.zeta = make([]float64, g.vae.Latent)
	}
	s.order = s.rng.Perm(len(g.nets))
	return s
}

// evalAt draws the next minibatch of networks and ELBO noise and evaluates the objective at z.
func (s *search) evalAt(z []float64) error {
	for i := range s.batch {
		if s.pos == len(s.order) {
			s.order, s.pos = s.rng.Perm(len(s.g.nets)), 0
		}
		s.batch[i] = s.g.nets[s.order[s.pos]]
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

// done applies the stopping rule at z after evalAt: minibatch gate, then the confirmation
// ensemble, then the final estimate. It returns the final result when all three agree.
func (s *search) done(ctx context.Context, z, z0 []float64, it int) (*Result, error) {
	if s.g.cfg.Stop == StopEstimate {
		return s.doneOnEstimate(ctx, z, z0, it)
	}
	if s.cooldown > 0 {
		s.cooldown--
		return nil, nil
	}
	if !s.g.gate(s.ev.Probs, s.o.C, s.target) {
		return nil, nil
	}
	e, err := s.g.estimate(ctx, s.g.checkPool, z)
	if err != nil {
		return nil, err
	}
	if !s.g.meets(e, s.target) {
		s.cooldown = 5
		return nil, nil
	}
	r, err := s.g.final(ctx, z, z0, s.target, it)
	if err != nil {
		return nil, err
	}
	if !s.g.meetsResult(r) {
		s.cooldown = 10
		return nil, nil
	}
	return r, nil
}

// doneOnEstimate is the paper protocol's stopping rule (StopEstimate): the method's rule on the
// mean and variance of the iteration's own S sampled probabilities. The final ensemble measures
// the iterate it stops at, whatever that says.
//
// The start x' = x is never accepted: the generator has already classified x (Result.Original)
// with its confirmation ensemble, and a noisy minibatch that disagrees there would hand back x
// itself, at distance 0, as a counterfactual.
func (s *search) doneOnEstimate(ctx context.Context, z, z0 []float64, it int) (*Result, error) {
	if it == 0 {
		return nil, nil
	}
	c := s.o.C
	n := len(s.ev.Probs) / c
	e := estimate{mean: make([]float64, c), vr: make([]float64, c), samples: len(s.ev.Probs) / c}
	for i := 0; i < n; i++ {
		for j := 0; j < c; j++ {
			e.mean[j] += s.ev.Probs[i*c+j] / float64(n)
		}
	}
	for i := 0; i < n; i++ {
		for j := 0; j < c; j++ {
			d := s.ev.Probs[i*c+j] - e.mean[j]
			e.vr[j] += d * d / float64(n-1)
		}
	}
	if !s.g.meets(e, s.target) {
		return nil, nil
	}
	r, err := s.g.final(ctx, z, z0, s.target, it)
	if err != nil {
		return nil, err
	}
	if !r.Valid {
		r.Reason = fmt.Sprintf("the optimiser's %d draws met the rule; the final %d draws put class %d below another (p = %.4f)",
			n, r.Samples, s.target, r.P1)
	}
	return r, nil
}

// run drives a search from z (modified in place): at each iteration it checks ctx, evaluates the
// objective at z, returns the result once the stopping rule is met, gives up at the iteration
// cap, and otherwise lets the method move z with move, which returns a non-empty reason when the
// method cannot go on.
func (g *Generator) run(ctx context.Context, s *search, z, z0 []float64, target int, move func(it int) string) (*Result, error) {
	for it := 0; ; it++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if err := s.evalAt(z); err != nil {
			return g.giveUp(ctx, z, z0, target, it, "objective failed ("+err.Error()+")")
		}
		r, err := s.done(ctx, z, z0, it)
		if err != nil || r != nil {
			return r, err
		}
		if it == g.cfg.MaxIter {
			return g.giveUp(ctx, z, z0, target, it, fmt.Sprintf("stopped at the iteration cap %d", g.cfg.MaxIter))
		}
		if why := move(it); why != "" {
			return g.giveUp(ctx, z, z0, target, it, why)
		}
	}
}

// giveUp builds the Result for a search that stopped without meeting its rule.
func (g *Generator) giveUp(ctx context.Context, z, z0 []float64, target, it int, why string) (*Result, error) {
	r, err := g.final(ctx, z, z0, target, it)
	if err != nil {
		return nil, err
	}
	goal := map[Method]string{MethodPSCE: fmt.Sprintf("the <%g, %g>-set", g.cfg.Delta, g.cfg.Epsilon),
		MethodSchut: fmt.Sprintf("confidence %g", g.cfg.Confidence)}[g.cfg.Method]
	if goal == "" {
		goal = "validity"
	}
	r.Reason = fmt.Sprintf("%s without reaching %s: p = %.4f, var = %.5f, valid = %v", why, goal, r.P1, r.Var1, r.Valid)
	return r, nil
}

// descend is the gradient search of PSCE and Wachter: Adam (bnn.Adam) on x' from x' = x.
func (g *Generator) descend(ctx context.Context, o *objective, z0 []float64, target int) (*Result, error) {
	var mu0 []float64
	if g.vae != nil {
		mu0, _ = g.vae.Encode(z0)
	}
	if err := o.setProblem(target, z0, mu0, *g.cfg.Weights, g.cfg.Delta, g.cfg.Epsilon); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	if err := o.setDeltaMax(g.cfg.DeltaMax); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	s := g.newSearch(o, target)
	z := append([]float64(nil), z0...)
	x := []bnn.Param{{Name: "x'", Value: z}}
	opt := bnn.NewAdam(x, g.cfg.LR)
	return g.run(ctx, s, z, z0, target, func(int) string {
		x[0].Grad = s.ev.Grad
		opt.Step(x)
		return ""
	})
}

// schut is Schut et al.'s greedy search (see MethodSchut).
func (g *Generator) schut(ctx context.Context, o *objective, z0 []float64, target int) (*Result, error) {
	if err := o.setProblem(target, z0, nil, Weights{Class: 1}, g.cfg.Delta, g.cfg.Epsilon); err != nil {
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
		z[best] -= g.cfg.MoveSize * math.Copysign(1, s.ev.Grad[best])
		changes[best]++
		return ""
	})
}
