package certify_test

import (
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/update"
)

// TestMeasureConditionalKL measures, on the daemon's first-start model (breast_cancer trained with
// the default model.seed and epochs) and updates under the paper's protocol (update.LastLayer
// with the prior objective and the adam solver, seeded per version as the daemon seeds them; not
// the daemon's default learner), increments of 10
// correctly labelled rows in data order), how much smaller the conditional KL of the logits
// given the body is than the parameter KL, what an estimate costs, and how many updates a
// certificate with p1 = 0.99 lasts under each. Rows: the first 40 the first posterior puts in
// class benign with p > 0.95 (as a counterfactual's x' would be). It logs the figures quoted in
// docs/MATHS.md ("The conditional KL of the logits"); about a minute on two cores:
//
//	CFGUARD_BENCH_DPI=1 go test ./certify -run MeasureConditionalKL -count=1 -v
func TestMeasureConditionalKL(t *testing.T) {
	if os.Getenv("CFGUARD_BENCH_DPI") != "1" {
		t.Skip("a measurement of about a minute: set CFGUARD_BENCH_DPI=1 to run it")
	}
	ctx := context.Background()
	set, ds, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	m0, _, err := bnn.Fit(ctx, set, ds.Classes, bnn.TrainConfig{Seed: 1}) // model.seed 1, model.epochs 0 (the trainer's default)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("trained v0 in %v", time.Since(start).Round(time.Millisecond))
	rows := benignRows(t, m0, set.X, 40)

	const (
		p1         = 0.99
		maxVersion = 160
		report     = 32
		fewDraws   = 200
		manyDraws  = 1000
		refDraws   = 20000
	)
	modes := []certify.Mode{certify.Paper, certify.Tight}
	lapsed := func(kl float64, mode certify.Mode) bool { return certify.ProbLower(p1, kl, mode) < 0.5 }
	// lease[mode][estimator][row]: the first version whose KL from v0 makes the bound fail (0: not
	// yet); estimator 0 is the parameter KL.
	estimators := []string{"parameter KL", "conditional mean (1000 draws)", "Hoeffding upper (1000 draws)",
		"Bernstein upper (1000 draws)", "Hoeffding upper (200 draws)", "Bernstein upper (200 draws)"}
	lease := map[certify.Mode][][]int{}
	for _, mode := range modes {
		lease[mode] = make([][]int, len(estimators))
		for k := range estimators {
			lease[mode][k] = make([]int, len(rows))
		}
	}
	q := m0
	for v := 1; v <= maxVersion; v++ {
		X, y := increment(set.X, set.Y, v, 10)
		cfg := update.Config{Objective: update.ObjectivePrior, LR: update.DefaultLR, Iterations: update.DefaultIterations,
			Samples: update.DefaultSamples, Seed: 1 ^ uint64(v)*0x9e3779b97f4a7c15} // update.seed 1, as the daemon seeds version v
		if q, _, err = update.LastLayer(ctx, q, X, y, cfg); err != nil {
			t.Fatal(err)
		}
		kl, _, err := certify.KL(q, m0)
		if err != nil {
			t.Fatal(err)
		}
		var means []float64
		done := true
		for i, x := range rows {
			many, err := certify.EstimateConditionalKL(q, m0, x, manyDraws, uint64(v*1000+i))
			if err != nil {
				t.Fatal(err)
			}
			few, err := certify.EstimateConditionalKL(q, m0, x, fewDraws, uint64(v*1000+i+500))
			if err != nil {
				t.Fatal(err)
			}
			means = append(means, many.Mean)
			values := []float64{kl, many.Mean, many.Hoeffding(certify.ConditionalKLAlpha), many.Bernstein(certify.ConditionalKLAlpha),
				few.Hoeffding(certify.ConditionalKLAlpha), few.Bernstein(certify.ConditionalKLAlpha)}
			for _, mode := range modes {
				for k, val := range values {
					if lease[mode][k][i] == 0 && lapsed(val, mode) {
						lease[mode][k][i] = v
					}
					done = done && lease[mode][k][i] != 0
				}
			}
		}
		if v%4 == 0 || v == 1 {
			t.Logf("v%d: parameter KL from v0 %.4f, conditional KL (1000 draws) median %.4f, min %.4f, max %.4f",
				v, kl, median(means), slices.Min(means), slices.Max(means))
		}
		if v == report {
			reportAt(t, q, m0, rows, kl, refDraws, fewDraws, manyDraws)
		}
		if done && v >= report {
			break
		}
	}
	for _, mode := range modes {
		t.Logf("update at which a certificate with p1 = %.2f lapses (%s mode; the first whose bound falls below 0.5; over %d rows):", p1, mode, len(rows))
		for k, name := range estimators {
			t.Logf("  %-32s %s", name, leaseSummary(lease[mode][k]))
			for i, v := range lease[mode][k] {
				if v < lease[mode][0][i] {
					t.Errorf("%s mode, row %d: lapses at %d under %s, before the parameter KL's %d", mode, i, v, name, lease[mode][0][i])
				}
			}
		}
	}
}

// reportAt logs the ratio conditional KL / parameter KL between q and m0 per row (reference
// estimate with ref draws), the bounds at few and many draws, and the cost per input.
func reportAt(t *testing.T, q, m0 *bnn.Model, rows [][]float64, kl float64, ref, few, many int) {
	var ratios, hFew, hMany, bFew, bMany []float64
	for i, x := range rows {
		e, err := certify.EstimateConditionalKL(q, m0, x, ref, uint64(7_000_000+i))
		if err != nil {
			t.Fatal(err)
		}
		ratios = append(ratios, e.Mean/kl)
		for _, c := range []struct {
			draws int
			h, b  *[]float64
		}{{few, &hFew, &bFew}, {many, &hMany, &bMany}} {
			e, err := certify.EstimateConditionalKL(q, m0, x, c.draws, uint64(8_000_000+i))
			if err != nil {
				t.Fatal(err)
			}
			*c.h = append(*c.h, e.Hoeffding(certify.ConditionalKLAlpha)/kl)
			*c.b = append(*c.b, e.Bernstein(certify.ConditionalKLAlpha)/kl)
		}
	}
	t.Logf("v32: parameter KL from v0 %.4f; conditional/parameter (%d draws) median %.3f, mean %.3f, min %.3f, max %.3f",
		kl, ref, median(ratios), mean(ratios), slices.Min(ratios), slices.Max(ratios))
	t.Logf("v32: upper bound / parameter KL at alpha %.2g, median (max): Hoeffding %d draws %.3f (%.3f), %d draws %.3f (%.3f); Bernstein %d draws %.3f (%.3f), %d draws %.3f (%.3f)",
		certify.ConditionalKLAlpha, few, median(hFew), slices.Max(hFew), many, median(hMany), slices.Max(hMany),
		few, median(bFew), slices.Max(bFew), many, median(bMany), slices.Max(bMany))
	for _, draws := range []int{few, many} {
		start := time.Now()
		for i, x := range rows {
			if _, _, err := certify.ConditionalKL(q, m0, x, draws, uint64(i)); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("cost: %v per input at %d body draws (one goroutine)", (time.Since(start) / time.Duration(len(rows))).Round(time.Microsecond), draws)
	}
	// What measuring p(target) itself costs, as a renewal or a verdict does: the version's shared
	// pool of networks (drawn once per version, not counted), one batch of the 40 rows, one worker.
	pool, err := bnn.NewPool(q, many, 3, bnn.Float64)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := pool.PredictWorkers(context.Background(), rows, 1); err != nil {
		t.Fatal(err)
	}
	batch := time.Since(start) / time.Duration(len(rows))
	start = time.Now()
	for _, x := range rows {
		if _, err := pool.PredictWorkers(context.Background(), [][]float64{x}, 1); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("cost of p(target) from a shared pool of %d networks: %v per input in one batch of %d, %v per input alone",
		many, batch.Round(time.Microsecond), len(rows), (time.Since(start) / time.Duration(len(rows))).Round(time.Microsecond))
	for i, r := range ratios {
		if !(r > 0 && r <= 1) {
			t.Errorf("row %d: conditional/parameter KL %v, outside (0, 1] (the data-processing inequality)", i, r)
		}
	}
}

// benignRows returns the first n rows that m puts in class benign with p > 0.95 (1000 draws).
func benignRows(t *testing.T, m *bnn.Model, X [][]float64, n int) [][]float64 {
	c := m.ClassIndex("benign")
	pred, err := m.Predict(X, 1000, 42)
	if err != nil {
		t.Fatal(err)
	}
	var rows [][]float64
	for i := range X {
		if pred.P(i, c) > 0.95 && len(rows) < n {
			rows = append(rows, X[i])
		}
	}
	if len(rows) < n {
		t.Fatalf("only %d rows with p(benign) > 0.95", len(rows))
	}
	return rows
}

// increment is the v-th increment of size records: rows (v-1)*size ... v*size-1 of the data in
// order, wrapping around, with their own (correct) labels.
func increment(X [][]float64, Y []int, v, size int) ([][]float64, []int) {
	var xs [][]float64
	var ys []int
	for k := 0; k < size; k++ {
		i := ((v-1)*size + k) % len(X)
		xs, ys = append(xs, X[i]), append(ys, Y[i])
	}
	return xs, ys
}

func leaseSummary(l []int) string {
	if slices.Contains(l, 0) {
		n := 0
		for _, v := range l {
			if v == 0 {
				n++
			}
		}
		return fmt.Sprintf("%d rows not lapsed by the last version measured", n)
	}
	f := make([]float64, len(l))
	for i, v := range l {
		f[i] = float64(v)
	}
	return fmt.Sprintf("median %.0f, min %.0f, max %.0f", median(f), slices.Min(f), slices.Max(f))
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func mean(v []float64) float64 {
	s := 0.0
	for _, x := range v {
		s += x
	}
	if len(v) == 0 {
		return math.NaN()
	}
	return s / float64(len(v))
}
