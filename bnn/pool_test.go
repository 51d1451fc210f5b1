package bnn

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
)

// predictor is what the ledger accepts for its Monte-Carlo estimates; a *Pool must be one.
type predictor interface {
	Version() uint64
	Predict(ctx context.Context, X [][]float64) (*Predictive, error)
}

var _ predictor = (*Pool)(nil)

// TestPoolEqualsFreshDraws: a Pool's networks are the draws PredictWith makes with the same seed,
// so their predictives agree: bit for bit in the default build (and whatever the number of
// goroutines the pool splits a batch over), to 1e-12 (float64) with OpenBLAS.
func TestPoolEqualsFreshDraws(t *testing.T) {
	for _, act := range []Activation{ReLU, Tanh} {
		m, X := paperModel(21, act, 4*chunkRows+3)
		m.Version = 17
		for _, prec := range []Precision{Float64, Float32} {
			pool, err := NewPool(m, 9, 33, prec)
			if err != nil {
				t.Fatal(err)
			}
			if pool.Version() != 17 || pool.Samples() != 9 || pool.Seed() != 33 || pool.Precision() != prec {
				t.Fatalf("pool reports version %d samples %d seed %d precision %v", pool.Version(), pool.Samples(), pool.Seed(), pool.Precision())
			}
			perNet := map[Precision]int{Float64: 8, Float32: 4}[prec] * m.NumParams()
			if pool.Bytes() != 9*perNet {
				t.Fatalf("Bytes = %d, want 9 networks x %d", pool.Bytes(), perNet)
			}
			for _, n := range []int{1, 5, len(X)} {
				got, err := pool.Predict(context.Background(), X[:n])
				if err != nil {
					t.Fatal(err)
				}
				want, err := m.PredictWith(context.Background(), X[:n], 9, 33, prec)
				if err != nil {
					t.Fatal(err)
				}
				if got.S != 9 || got.N != n || got.Precision != prec {
					t.Fatalf("pool predictive has S %d N %d precision %v", got.S, got.N, got.Precision)
				}
				for i := range want.Mean {
					dm, dv := math.Abs(got.Mean[i]-want.Mean[i]), math.Abs(got.Var[i]-want.Var[i])
					if (Backend == "gonum" && (dm != 0 || dv != 0)) || dm > 1e-12 || dv > 1e-12 {
						t.Fatalf("%s %s, %d inputs, entry %d: pool (%v, %v), fresh draws (%v, %v)", act, prec, n, i, got.Mean[i], got.Var[i], want.Mean[i], want.Var[i])
					}
				}
			}
		}
	}
}

// TestPoolIsIndependentOfTheModel: a pool keeps the draws of the posterior it was built from;
// later changes to that Model do not reach it.
func TestPoolIsIndependentOfTheModel(t *testing.T) {
	m, X := paperModel(2, ReLU, 3)
	pool, err := NewPool(m, 5, 1, Float64)
	if err != nil {
		t.Fatal(err)
	}
	before, _ := pool.Predict(context.Background(), X)
	m.Last().BiasMu[0] += 5
	m.Scaler.Mean[0] += 3
	after, _ := pool.Predict(context.Background(), X)
	for i := range before.Mean {
		if before.Mean[i] != after.Mean[i] {
			t.Fatal("changing the model changed the pool's estimates")
		}
	}
}

// TestPoolConcurrentUse runs many predictives on one pool at once (run with -race): all give the
// single-caller result (exactly in the default build; with OpenBLAS, whose float32 sums differ
// between the one-input and chunked paths, within 1e-6, far inside the float32 bound).
func TestPoolConcurrentUse(t *testing.T) {
	m, X := paperModel(3, ReLU, 2*chunkRows)
	pool, err := NewPool(m, 6, 2, Float32)
	if err != nil {
		t.Fatal(err)
	}
	want, err := pool.Predict(context.Background(), X)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for g := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := 1 + g*len(X)/8
			got, err := pool.Predict(context.Background(), X[:n])
			if err != nil {
				errs[g] = err
				return
			}
			for i := range got.Mean {
				if d := math.Abs(got.Mean[i] - want.Mean[i]); (Backend == "gonum" && d != 0) || d > 1e-6 {
					errs[g] = fmt.Errorf("caller %d entry %d: %v, alone %v", g, i, got.Mean[i], want.Mean[i])
					return
				}
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

func TestPoolRejects(t *testing.T) {
	m, X := paperModel(4, ReLU, 40)
	if _, err := NewPool(m, 1, 1, Float64); err == nil || !strings.Contains(err.Error(), "at least 2 samples") {
		t.Errorf("one sample: %v", err)
	}
	if _, err := NewPool(m, 3, 1, Precision(5)); err == nil || !strings.Contains(err.Error(), "precision") {
		t.Errorf("unknown precision: %v", err)
	}
	bad := m.Clone()
	bad.Layers[0].WeightMu[0] = math.NaN()
	if _, err := NewPool(bad, 3, 1, Float64); !errors.Is(err, ErrInvalidModel) {
		t.Errorf("invalid model: %v", err)
	}
	pool, err := NewPool(m, 3, 1, Float64)
	if err != nil {
		t.Fatal(err)
	}
	for name, in := range map[string][][]float64{"empty": nil, "short": {{1, 2}}, "nan": {append(make([]float64, 29), math.NaN())}} {
		if _, err := pool.Predict(context.Background(), in); err == nil {
			t.Errorf("%s input: no error", name)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, n := range []int{1, len(X)} {
		if _, err := pool.Predict(ctx, X[:n]); !errors.Is(err, context.Canceled) {
			t.Errorf("%d inputs, cancelled: %v", n, err)
		}
	}
}
