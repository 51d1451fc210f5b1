package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
)

// poolCore is fakeCore with the daemon's predictive: the version's shared draws (pools).
type poolCore struct {
	fakeCore
	pools *pools
}

func (p *poolCore) predict(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
	pool, err := p.pools.get(m)
	if err != nil {
		return nil, err
	}
	return pool.Predict(ctx, xs)
}

// BenchmarkPredictEndpoint answers POST /v1/predict for a batch of 10^3 inputs of the bundled
// breast-cancer model (30 -> 64 -> 32 -> 2) with certify.samples = 1000 draws, through the
// API's handler (JSON in and out), the pool already drawn for the version. It reports the
// latency of one request next to the same predictive called directly (ratio = overhead of the
// API), for float64 and float32:
//
//	go test -run '^$' -bench PredictEndpoint -benchtime 10x ./daemon
func BenchmarkPredictEndpoint(b *testing.B) {
	set, ds, err := assets.Load("breast_cancer")
	if err != nil {
		b.Fatal(err)
	}
	m, _, err := bnn.Fit(context.Background(), set, ds.Classes, bnn.TrainConfig{Seed: 1, Epochs: 5})
	if err != nil {
		b.Fatal(err)
	}
	xs := make([][]float64, 1000)
	for i := range xs {
		xs[i] = set.X[i%set.Len()]
	}
	body, _ := json.Marshal(map[string]any{"xs": xs})
	for _, prec := range []bnn.Precision{bnn.Float64, bnn.Float32} {
		core := &poolCore{fakeCore: fakeCore{m: m}, pools: &pools{samples: 1000, prec: prec}}
		pool, err := core.pools.get(m)
		if err != nil {
			b.Fatal(err)
		}
		b.Run("direct/"+prec.String(), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := pool.Predict(context.Background(), xs); err != nil {
					b.Fatal(err)
				}
			}
		})
		a := &api{cfg: apiConfig{maxBodyBytes: 1 << 24}, metrics: http.NotFoundHandler(), core: core, predict: newInputBudget(0, maxPredictBatch)}
		h := a.routes()
		b.Run("api/"+prec.String(), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest("POST", "/v1/predict", bytes.NewReader(body)))
				if rec.Code != http.StatusOK {
					b.Fatalf("%d %s", rec.Code, rec.Body)
				}
			}
		})
	}
}
