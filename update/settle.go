package update

import (
	"cmp"
	"context"
	"fmt"

	"github.com/cfguard/cfguard/bnn"
)

// settleSeed is mixed into the training seed for Settle's body draws, so that they are not the
// draws of a stream's first update.
const settleSeed = 0x5e771e

// Settle returns m with its last layer moved to the optimum of the objective bnn.Fit trains it
// on, the body kept bit for bit: over the n training rows (X, y),
//
//	J(q) = (1/n) sum_r E_q[-log p(y_r | x_r, w)] + klWeight KL(q_L || N(0, prior_sigma^2)) / n
//
// (the prior objective, minimised by the converged solver with its fixed body draws). bnn.Fit's
// epochs of Adam on sampled gradients stop short of this optimum, with the sigmas of the
// parameters the data inform larger than it wants, and a stream started from such a fit moves
// towards the optimum as well as to where its records hold it. The daemon does not settle the
// model it trains (docs/MATHS.md, "Why the daemon does not settle": a settled posterior follows
// a drift more slowly); cfguard-lab stream --settle measures what settling changes. Version and
// Records stay m's. klWeight 0 is bnn.DefaultKLWeight, as in training; seed is the training
// seed.
//
// m is never modified; errors are LastLayer's.
func Settle(ctx context.Context, m *bnn.Model, X [][]float64, y []int, klWeight float64, seed uint64) (*bnn.Model, Stats, error) {
	return settle(ctx, m, X, y, klWeight, seed, false)
}

// SettleMeans is Settle over the last layer's means only, its log sigmas kept at m's, bit for
// bit: the fit's means reach the optimum of its objective for the fit's sigmas, while the
// sigmas, which size a stream's steps and how fast it follows a drift, stay as training left
// them (cfguard-lab stream --settle-means; docs/MATHS.md, "Why the daemon does not settle").
func SettleMeans(ctx context.Context, m *bnn.Model, X [][]float64, y []int, klWeight float64, seed uint64) (*bnn.Model, Stats, error) {
	return settle(ctx, m, X, y, klWeight, seed, true)
}

// settle is Settle, or SettleMeans with freezeSigma.
func settle(ctx context.Context, m *bnn.Model, X [][]float64, y []int, klWeight float64, seed uint64, freezeSigma bool) (*bnn.Model, Stats, error) {
	out, st, err := LastLayer(ctx, m, X, y, Config{Objective: ObjectivePrior, Solver: SolverConverge, FreezeSigma: freezeSigma,
		KLWeight: cmp.Or(klWeight, bnn.DefaultKLWeight), Represented: float64(len(X)), Seed: seed ^ settleSeed})
	if err != nil {
		what := "the last layer"
		if freezeSigma {
			what = "the last layer's means"
		}
		return nil, st, fmt.Errorf("settling %s: %w", what, err)
	}
	out.Version, out.Records = m.Version, m.Records
	return out, st, nil
}
