package update

import (
	"context"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// Settle moves a fit to the optimum of its training objective over the last layer: the
// objective falls, the solver converges, and settling the settled model again (same rows, same
// seed, so the same body draws) barely moves it, since it is already there. The body, Version
// and Records stay the fit's, and the fit is not modified. A first streamed increment of rows
// the model was trained on steps less from the settled model than from the fit, which also
// moves towards that optimum.
func TestSettleReachesTheTrainingOptimum(t *testing.T) {
	fit, _ := trained(t)
	train := fixture.train
	before := fit.Clone()
	settled, st, err := Settle(context.Background(), fit, train.X, train.Y, 0, 3)
	if err != nil {
		t.Fatal(err)
	}
	if !equalModels(fit, before) {
		t.Fatal("Settle modified the fit")
	}
	if !st.Converged || !(st.LossEnd < st.LossStart) || !(st.KL > 0) {
		t.Fatalf("settle: converged %v, objective %v -> %v, KL %v; want converged, lower, a move", st.Converged, st.LossStart, st.LossEnd, st.KL)
	}
	if settled.Version != fit.Version || settled.Records != fit.Records {
		t.Errorf("settled version %d records %v, want the fit's %d %v", settled.Version, settled.Records, fit.Version, fit.Records)
	}
	last := len(fit.Layers) - 1
	for k := range last {
		if !equalLayers(&settled.Layers[k], &fit.Layers[k]) {
			t.Errorf("layer %d (body) changed", k)
		}
	}
	again, st2, err := Settle(context.Background(), settled, train.X, train.Y, 0, 3)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("settle: KL %.3f, objective %.5f -> %.5f in %d iterations; again: KL %.2g in %d", st.KL, st.LossStart, st.LossEnd, st.Iterations, st2.KL, st2.Iterations)
	if !(st2.KL < 1e-4*st.KL) {
		t.Errorf("settling the settled model moved it by KL %g (the first settle %g): it was not at the optimum", st2.KL, st.KL)
	}
	if k, _, err := certify.KL(again, settled); err != nil || k != st2.KL {
		t.Errorf("Stats.KL %g, certify.KL %g (%v)", st2.KL, k, err)
	}

	// The default streaming update over 256 of the training rows, from each.
	cfg := Config{Objective: ObjectiveVCL, Solver: SolverConverge, KLWeight: 8, Memory: 50000, Seed: 7}
	rows, labels := train.X[:256], train.Y[:256]
	_, fromFit, err := LastLayer(context.Background(), fit, rows, labels, cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, fromSettled, err := LastLayer(context.Background(), settled, rows, labels, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("first increment of 256 training rows: KL %.4f from the fit, %.4f from the settled fit", fromFit.KL, fromSettled.KL)
	if !(fromSettled.KL < fromFit.KL/2) {
		t.Errorf("first step KL %.4f from the settled fit, %.4f from the fit; want under half", fromSettled.KL, fromFit.KL)
	}
}

// SettleMeans moves the last layer's means to the optimum of the training objective for the
// fit's sigmas: the sigmas stay bit for bit, the objective falls, but less than Settle's (which
// may move the sigmas too), and settling the means again moves nothing. The Adam solver
// refuses FreezeSigma.
func TestSettleMeansKeepsTheSigmas(t *testing.T) {
	fit, _ := trained(t)
	train := fixture.train
	means, st, err := SettleMeans(context.Background(), fit, train.X, train.Y, 0, 3)
	if err != nil {
		t.Fatal(err)
	}
	_, full, err := Settle(context.Background(), fit, train.X, train.Y, 0, 3)
	if err != nil {
		t.Fatal(err)
	}
	l, f := means.Last(), fit.Last()
	if !slices.Equal(l.WeightLogSigma, f.WeightLogSigma) || !slices.Equal(l.BiasLogSigma, f.BiasLogSigma) {
		t.Error("SettleMeans moved a log sigma")
	}
	if slices.Equal(l.WeightMu, f.WeightMu) || slices.Equal(l.BiasMu, f.BiasMu) {
		t.Error("SettleMeans left the weight or bias means where they were")
	}
	t.Logf("means only: objective %.5f -> %.5f, KL %.3f in %d iterations; with the sigmas: -> %.5f, KL %.3f",
		st.LossStart, st.LossEnd, st.KL, st.Iterations, full.LossEnd, full.KL)
	if !st.Converged || !(st.LossEnd < st.LossStart) || !(full.LossEnd <= st.LossEnd) {
		t.Errorf("means only: converged %v, objective %v -> %v; with the sigmas %v: want converged, lower, and no lower than Settle's",
			st.Converged, st.LossStart, st.LossEnd, full.LossEnd)
	}
	_, again, err := SettleMeans(context.Background(), means, train.X, train.Y, 0, 3)
	if err != nil || !(again.KL < 1e-4*st.KL) {
		t.Errorf("settling the settled means moved them by KL %g (the first %g; %v): they were not at the optimum", again.KL, st.KL, err)
	}
	// The objective reported is the returned model's (same rows and seed, so the same draws).
	if math.Abs(again.LossStart-st.LossEnd) > 1e-12*st.LossEnd {
		t.Errorf("the settled means' objective is %.15g, SettleMeans reported %.15g: it optimised another model than it returned", again.LossStart, st.LossEnd)
	}
	if _, _, err := LastLayer(context.Background(), fit, train.X[:10], train.Y[:10], Config{FreezeSigma: true}); err == nil || !strings.Contains(err.Error(), "freeze sigma") {
		t.Errorf("FreezeSigma with the Adam solver: %v, want it refused", err)
	}
}

func equalLayers(a, b *bnn.Layer) bool {
	return slices.Equal(a.WeightMu, b.WeightMu) && slices.Equal(a.WeightLogSigma, b.WeightLogSigma) &&
		slices.Equal(a.BiasMu, b.BiasMu) && slices.Equal(a.BiasLogSigma, b.BiasLogSigma)
}

func equalModels(a, b *bnn.Model) bool {
	if len(a.Layers) != len(b.Layers) || a.Version != b.Version || a.Records != b.Records {
		return false
	}
	for k := range a.Layers {
		if !equalLayers(&a.Layers[k], &b.Layers[k]) {
			return false
		}
	}
	return true
}
