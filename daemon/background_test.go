package daemon

import (
	"context"
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
