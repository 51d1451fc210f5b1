package experiment

import (
	"context"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/update"
)

// At the daemon's default settings a step is what the records and the prior say it is, whatever
// the increment's size: one increment of correct records fitted under two seeds (two sets of
// body draws) lands on two posteriors a small KL apart, at 1,024 records (an increment of a
// backlog, kafka.max_records_backlog) as at 64. Every row of an increment shares its body
// draws, so their noise does not average out over rows: an increment fitted to fewer draws
// measures the draws it got, and its step KL (the KL the budget and the alerts watch) with it.
func TestDefaultStepDoesNotDependOnItsDrawsAtAnySize(t *testing.T) {
	for _, data := range []string{"breast_cancer", "german_credit"} {
		set, d, err := assets.Load(data)
		if err != nil {
			t.Fatal(err)
		}
		train, _ := set.Split(0.5, 1)
		m, _, err := bnn.Fit(context.Background(), train, d.Classes, bnn.TrainConfig{Seed: 1, Epochs: 10})
		if err != nil {
			t.Fatal(err)
		}
		m.Records = float64(len(train.X))
		for _, n := range []int{64, 1024} {
			X, y := make([][]float64, n), make([]int, n)
			for i := range n {
				X[i], y[i] = set.X[i%len(set.X)], set.Y[i%len(set.X)]
			}
			var fits [2]*bnn.Model
			for k := range fits {
				cfg := DefaultUpdate()
				cfg.Seed = uint64(11 + k)
				next, st, err := update.LastLayer(context.Background(), m, X, y, cfg)
				if err != nil {
					t.Fatal(err)
				}
				if !st.Converged {
					t.Fatalf("%s, %d records, seed %d: did not converge", data, n, cfg.Seed)
				}
				fits[k] = next
			}
			kl, _, err := certify.KL(fits[0], fits[1])
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s, %d records: the fits under two seeds are KL %.3g apart", data, n, kl)
			if most := certify.KLBudget(config.Default().Certify.Delta) / 2; !(kl < most) {
				t.Errorf("%s, %d correct records fitted under two seeds: KL %.3g apart, want < %.4g (half the default KL budget)",
					data, n, kl, most)
			}
		}
	}
}
