package daemon

import (
	"context"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
)

// backgroundPredictor runs on one goroutine; the estimates must be those of a Pool call on all of
// them, bit for bit, for sizes around bnn's chunks and its split over goroutines.
func TestBackgroundPredictorEqualsOneCall(t *testing.T) {
	data := daemontest.Bundled(t)
	m, _, err := bnn.Fit(context.Background(), data, []string{"malignant", "benign"}, bnn.TrainConfig{Seed: 1, Epochs: 1})
	if err != nil {
		t.Fatal(err)
	}
	pool, err := bnn.NewPool(m, 50, 9, bnn.Float64)
	if err != nil {
		t.Fatal(err)
	}
	var X [][]float64
	for len(X) < 3*384+17 {
		X = append(X, data.X[len(X)%len(data.X)])
	}
	for _, n := range []int{1, 383, 384, 385, 768, len(X)} {
		want, err := pool.Predict(context.Background(), X[:n])
		if err != nil {
			t.Fatal(err)
		}
		got, err := backgroundPredictor{pool: pool}.Predict(context.Background(), X[:n])
		if err != nil {
			t.Fatal(err)
		}
		if got.N != n || got.C != want.C || got.S != want.S || len(got.Mean) != len(want.Mean) || len(got.Var) != len(want.Var) {
			t.Fatalf("n=%d: shape %d x %d x %d (%d means), want %d x %d x %d (%d)", n, got.N, got.C, got.S, len(got.Mean), want.N, want.C, want.S, len(want.Mean))
		}
		for i := range want.Mean {
			if got.Mean[i] != want.Mean[i] || got.Var[i] != want.Var[i] {
				t.Fatalf("n=%d: element %d: mean %v var %v, want %v %v", n, i, got.Mean[i], got.Var[i], want.Mean[i], want.Var[i])
			}
		}
	}
}

// TestAuditWorkers: audit.workers sets the audit's goroutines; 0 (or less) means every core but
// one, and at least one on a single core.
func TestAuditWorkers(t *testing.T) {
	for _, tc := range []struct {
		procs, n, want int
	}{
		{4, 0, 3},
		{4, -1, 3},
		{4, 1, 1},
		{4, 6, 6},
		{1, 0, 1},
		{1, 2, 2},
	} {
		if got := workersOn(tc.n, tc.procs); got != tc.want {
			t.Errorf("audit.workers %d on %d cores: %d goroutines, want %d", tc.n, tc.procs, got, tc.want)
		}
	}
	if got, want := auditWorkers(0), max(1, runtime.GOMAXPROCS(0)-1); got != want {
		t.Errorf("audit.workers 0 on this machine's %d cores: %d goroutines, want %d", runtime.GOMAXPROCS(0), got, want)
	}
}

// TestBackgroundPredictorsGiveTheirPoolsPosterior: a confirmation's and an audit's predictors
// give the posterior their pool was drawn from, not the newest one, so that they measure under
// it after ingestion replaced it.
func TestBackgroundPredictorsGiveTheirPoolsPosterior(t *testing.T) {
	m := bnn.New(3, []int{4}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	pool, err := bnn.NewPool(m, 4, 1, bnn.Float64)
	if err != nil {
		t.Fatal(err)
	}
	for name, p := range map[string]interface {
		Posterior() *bnn.Model
		Version() uint64
	}{
		"confirmation": backgroundPredictor{pool: pool, model: m},
		"audit":        auditPredictor{pool: pool, model: m, workers: 1},
	} {
		if p.Posterior() != m || p.Version() != pool.Version() {
			t.Errorf("%s: posterior %p version %d, want the pool's %p version %d", name, p.Posterior(), p.Version(), m, pool.Version())
		}
	}
}
