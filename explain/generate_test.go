package explain

import (
	"cmp"
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/dataset"
)

// blobs is a two-class data set in d dimensions: class 0 around -1.5, class 1 around +1.5 in
// every feature, unit variance, raw features shifted and scaled so that standardisation matters.
func blobs(n, d int, seed uint64) *dataset.Set {
	rng := rand.New(rand.NewPCG(seed, 3))
	s := &dataset.Set{NumClasses: 2}
	for i := 0; i < n; i++ {
		y := i % 2
		x := make([]float64, d)
		for j := range x {
			x[j] = 10 + 3*float64(j) + 2*(float64(2*y-1)*1.5+rng.NormFloat64())
		}
		s.X = append(s.X, x)
		s.Y = append(s.Y, y)
	}
	return s
}

var (
	blobOnce  sync.Once
	blobModel *bnn.Model
	blobVAE   *VAE
	blobSet   *dataset.Set
	blobErr   error
)

// blobFixture trains (once per test binary) a BNN and a VAE on blobs.
func blobFixture(t *testing.T) (*bnn.Model, *VAE, *dataset.Set) {
	t.Helper()
	blobOnce.Do(func() {
		blobSet = blobs(300, 4, 1)
		blobModel, _, blobErr = bnn.Fit(context.Background(), blobSet, []string{"neg", "pos"}, bnn.TrainConfig{Seed: 1, Epochs: 40, Hidden: []int{16, 8}})
		if blobErr != nil {
			return
		}
		blobVAE, _, blobErr = TrainVAE(context.Background(), blobModel, blobSet.X, TrainConfig{Seed: 1, Epochs: 30, Hidden: 16, Latent: 2})
	})
	if blobErr != nil {
		t.Fatal(blobErr)
	}
	return blobModel, blobVAE, blobSet
}

func TestGenerateBadRequests(t *testing.T) {
	m, v, set := blobFixture(t)
	g := NewGenerator(m, v, Config{Seed: 1})
	x := set.X[0] // class 0
	nan := append([]float64(nil), x...)
	nan[2] = math.NaN()
	inf := append([]float64(nil), x...)
	inf[1] = math.Inf(-1)
	for _, tc := range []struct {
		name   string
		x      []float64
		target int
		want   string
	}{
		{"short", x[:3], 1, "x has 3 features, model expects 4"},
		{"long", append(append([]float64(nil), x...), 1), 1, "x has 5 features"},
		{"empty", nil, 1, "x has 0 features"},
		{"nan", nan, 1, "feature 2 is NaN"},
		{"inf", inf, 1, "feature 1 is -Inf"},
		{"target too big", x, 2, "target class 2, want -1 (any other class) or 0..1"},
		{"target negative", x, -2, "target class -2"},
		{"already target", x, 0, "x is already classified as the target: class 0 (neg)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := g.Generate(context.Background(), tc.x, tc.target)
			if r != nil || !errors.Is(err, ErrInvalidInput) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got (%v, %v), want ErrInvalidInput containing %q", r, err, tc.want)
			}
			if errors.Is(err, ErrAlreadyTarget) != (tc.name == "already target") {
				t.Fatalf("%v: ErrAlreadyTarget %v", err, errors.Is(err, ErrAlreadyTarget))
			}
		})
	}
}

func TestGeneratorConfigErrors(t *testing.T) {
	m, v, set := blobFixture(t)
	other := m.Clone()
	other.Scaler.Mean[0] += 1
	bad := m.Clone()
	bad.Layers[0].WeightMu[0] = math.NaN()
	for _, tc := range []struct {
		name string
		g    *Generator
		want string
	}{
		{"nil model", NewGenerator(nil, v, Config{}), "nil model"},
		{"invalid model", NewGenerator(bad, v, Config{}), "weight_mu[0] = NaN"},
		{"psce without vae", NewGenerator(m, nil, Config{}), "psce needs a VAE"},
		{"vae for another scaler", NewGenerator(other, v, Config{}), "scaler differs at feature 0"},
		{"delta", NewGenerator(m, v, Config{Delta: 0.7}), "delta = 0.7"},
		{"method", NewGenerator(m, v, Config{Method: "dice"}), `unknown counterfactual method "dice"`},
		{"negative weight", NewGenerator(m, v, Config{Weights: &Weights{Class: -1}}), "weight class = -1"},
		{"pool", NewGenerator(m, v, Config{Samples: 64, PoolSize: 10}), "pool_size 10"},
		{"precision", NewGenerator(m, v, Config{Precision: 7}), "precision Precision(7)"},
		{"epsilon", NewGenerator(m, v, Config{Epsilon: 0.3}), "epsilon = 0.3"},
		{"move size", NewGenerator(m, v, Config{MoveSize: -1}), "move_size -1"},
		{"a final pool of another version", NewGenerator(m, v, Config{FinalPool: otherVersionPool(t, m)}), "drawn from posterior version 7, the model is version"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tc.g.Generate(context.Background(), set.X[0], 1)
			if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrConfig containing %q", err, tc.want)
			}
		})
	}
	// The baselines do not need a VAE, nor PSCE without its plausibility terms.
	if _, err := NewGenerator(m, nil, Config{Method: MethodWachter}).Generate(context.Background(), set.X[0], 1); err != nil {
		t.Fatalf("wachter without vae: %v", err)
	}
	res, err := NewGenerator(m, nil, Config{WithoutVAE: true}).Generate(context.Background(), set.X[0], 1)
	if err != nil {
		t.Fatalf("psce WithoutVAE: %v", err)
	}
	if len(res.XCF) != len(set.X[0]) || res.Method != MethodPSCE {
		t.Errorf("psce WithoutVAE: %+v", res)
	}
	// WithoutVAE ignores a VAE given beside it.
	if res2, err := NewGenerator(m, v, Config{WithoutVAE: true}).Generate(context.Background(), set.X[0], 1); err != nil || !slices.Equal(res2.XCF, res.XCF) {
		t.Errorf("psce WithoutVAE with a VAE: %v, x_cf %v; want %v, as without one", err, res2.XCF, res.XCF)
	}
}

// otherVersionPool is a pool of 300 draws of m as posterior version 7 (m is not).
func otherVersionPool(t *testing.T, m *bnn.Model) *bnn.Pool {
	t.Helper()
	o := m.Clone()
	o.Version = 7
	if m.Version == 7 {
		t.Fatal("the fixture is version 7")
	}
	p, err := bnn.NewPool(o, 300, 9, bnn.Float64)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// With Config.FinalPool the final estimate is the caller's pool's: its draws, its seed, its
// precision, and exactly the predictive the pool gives the counterfactual, so that a caller who
// admits a counterfactual by that pool's estimate reaches the verdict the search stopped on.
func TestGenerateWithTheCallersFinalPool(t *testing.T) {
	m, v, set := blobFixture(t)
	for _, prec := range []bnn.Precision{bnn.Float64, bnn.Float32} {
		pool, err := bnn.NewPool(m, 300, 0xfeed, prec)
		if err != nil {
			t.Fatal(err)
		}
		g := NewGenerator(m, v, Config{Seed: 1, FinalPool: pool})
		if g.Config().FinalSamples != 300 {
			t.Errorf("final samples %d, want the pool's 300", g.Config().FinalSamples)
		}
		r, err := g.Generate(context.Background(), set.X[0], 1)
		if err != nil {
			t.Fatal(err)
		}
		p, err := pool.Predict(context.Background(), [][]float64{r.XCF})
		if err != nil {
			t.Fatal(err)
		}
		if r.Samples != 300 || r.Seed != 0xfeed || r.Precision != prec || r.P1 != p.P(0, 1) || r.Var1 != p.V(0, 1) {
			t.Errorf("%v: result from %d draws, seed %#x, %v, p1 %v, var1 %v; want the pool's 300, %#x, %v, %v, %v", prec,
				r.Samples, r.Seed, r.Precision, r.P1, r.Var1, uint64(0xfeed), prec, p.P(0, 1), p.V(0, 1))
		}
	}
}

// TestGenerateBlobs checks each method's contract on an easy problem: the result is valid under
// an independent estimate, the reported P1/Var1 are reproducible with m.Predict and the Result's
// seed, PSCE's result is in the set, Schut's reaches its confidence or is handed back as a best
// attempt, and equal seeds give identical results.
func TestGenerateBlobs(t *testing.T) {
	m, v, set := blobFixture(t)
	for _, method := range Methods {
		t.Run(string(method), func(t *testing.T) {
			g := NewGenerator(m, v, Config{Method: method, Seed: 7})
			for i := 0; i < 4; i++ {
				x := set.X[i]
				r, err := g.Generate(context.Background(), x, -1)
				// Schut may run out of feature changes (4 features x 10 here) short of its
				// confidence: its attempt, valid, is then the best of a NotFoundError, which
				// says why.
				var nf *NotFoundError
				if method == MethodSchut && errors.As(err, &nf) && nf.Best.Valid {
					if nf.Best.P1 >= 0.95 || !strings.Contains(nf.Reason, "changed 10 times") {
						t.Errorf("row %d: schut gave up at p %v without saying it ran out of changes (%q)", i, nf.Best.P1, nf.Reason)
					}
					r, err = nf.Best, nil
				}
				if err != nil {
					t.Fatalf("row %d: %v", i, err)
				}
				if r.Target != 1-set.Y[i] || r.Original != set.Y[i] {
					t.Errorf("row %d: original %d target %d, label %d", i, r.Original, r.Target, set.Y[i])
				}
				p, err := m.Predict([][]float64{r.XCF}, r.Samples, r.Seed)
				if err != nil {
					t.Fatal(err)
				}
				if p.P(0, r.Target) != r.P1 || p.V(0, r.Target) != r.Var1 {
					t.Errorf("row %d: reported p1 %v var1 %v, m.Predict gives %v %v", i, r.P1, r.Var1, p.P(0, r.Target), p.V(0, r.Target))
				}
				// An independent estimate with other draws agrees on validity.
				q, _ := m.Predict([][]float64{r.XCF}, 2000, 12345)
				if q.Argmax(0) != r.Target || !r.Valid {
					t.Errorf("row %d: not valid (independent p %v)", i, q.P(0, r.Target))
				}
				if method == MethodPSCE && (!r.InSet || r.P1 < 0.95 || r.Var1 > 0.01 || !r.Confirmed) {
					t.Errorf("row %d: psce result not in the set: %+v", i, r)
				}
				if method == MethodSchut && r.P1 < 0.95 && nf == nil {
					t.Errorf("row %d: schut returned p %v < 0.95 as a Result", i, r.P1)
				}
				again, err := NewGenerator(m, v, Config{Method: method, Seed: 7}).Generate(context.Background(), x, -1)
				if errors.As(err, &nf) {
					again, err = nf.Best, nil
				}
				if err != nil || !equalFloats(again.XCF, r.XCF) || again.Iterations != r.Iterations {
					t.Errorf("row %d: same seed gave a different result (%v)", i, err)
				}
			}
		})
	}
}

// TestGenerateSharesEnsembles: the confirmation and final ensembles are drawn once per Generator
// (bnn.Pools of CheckSamples and FinalSamples networks) and every call uses all of them; in
// float32 a Result's P1 and Var1 are reproduced by PredictWith in float32 with its seed.
func TestGenerateSharesEnsembles(t *testing.T) {
	m, v, set := blobFixture(t)
	g := NewGenerator(m, v, Config{Seed: 5, Precision: bnn.Float32, CheckSamples: 300, FinalSamples: 700})
	var check, final *bnn.Pool
	for i := 0; i < 3; i++ {
		r, err := g.Generate(context.Background(), set.X[i], -1)
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			check, final = g.checkPool, g.finalPool
		}
		if g.checkPool != check || g.finalPool != final {
			t.Fatal("a Generate call drew new ensembles")
		}
		if check.Samples() != 300 || final.Samples() != 700 || r.Samples != 700 || r.Precision != bnn.Float32 || r.PosteriorVersion != m.Version {
			t.Fatalf("ensembles of %d and %d draws, result says %d draws in %v (version %d)", check.Samples(), final.Samples(), r.Samples, r.Precision, r.PosteriorVersion)
		}
		p, err := m.PredictWith(context.Background(), [][]float64{r.XCF}, r.Samples, r.Seed, r.Precision)
		if err != nil {
			t.Fatal(err)
		}
		if p.P(0, r.Target) != r.P1 || p.V(0, r.Target) != r.Var1 {
			t.Errorf("row %d: reported (%v, %v), PredictWith gives (%v, %v)", i, r.P1, r.Var1, p.P(0, r.Target), p.V(0, r.Target))
		}
	}
}

func equalFloats(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float64bits(a[i]) != math.Float64bits(b[i]) {
			return false
		}
	}
	return true
}

// TestGenerateNotFound: with one iteration allowed, PSCE cannot reach the set and must not return
// a Result; the error carries the best attempt.
func TestGenerateNotFound(t *testing.T) {
	m, v, set := blobFixture(t)
	g := NewGenerator(m, v, Config{MaxIter: 1, Seed: 1})
	r, err := g.Generate(context.Background(), set.X[0], 1)
	var nf *NotFoundError
	if r != nil || !errors.As(err, &nf) || !errors.Is(err, ErrNotFound) {
		t.Fatalf("got (%v, %v), want a *NotFoundError", r, err)
	}
	if nf.Best == nil || nf.Best.Valid || nf.Best.Iterations != 1 || !strings.Contains(nf.Reason, "iteration cap 1") {
		t.Errorf("best attempt %+v, reason %q", nf.Best, nf.Reason)
	}
}

// TestGenerateConfirmedReturnsOnlyWhatMetItsRule: under StopConfirmed a PSCE search that reaches
// its iteration cap with a valid iterate outside its <delta, epsilon>-set (epsilon 1e-6 is out of
// reach in 30 iterations) hands it back as the best attempt of a NotFoundError, never as a
// Result: every Result is in its set. Under StopEstimate the same attempt is a Result, as the
// paper's protocol accepts it.
func TestGenerateConfirmedReturnsOnlyWhatMetItsRule(t *testing.T) {
	m, v, set := blobFixture(t)
	for _, stop := range []Stop{StopConfirmed, StopEstimate} {
		g := NewGenerator(m, v, Config{Method: MethodPSCE, Delta: 0.45, Epsilon: 1e-6, MaxIter: 30, Seed: 3, Stop: stop})
		atCap := 0
		for i := 0; i < 40 && i < set.Len(); i++ {
			if set.Y[i] != 0 {
				continue
			}
			r, err := g.Generate(context.Background(), set.X[i], 1)
			var nf *NotFoundError
			switch {
			case errors.As(err, &nf):
				if nf.Best.Valid && !nf.Best.InSet && strings.Contains(nf.Reason, "iteration cap 30") {
					atCap++
				}
			case err != nil:
				t.Fatalf("%s row %d: %v", stop, i, err)
			case !r.Valid:
				t.Errorf("%s row %d: an invalid Result", stop, i)
			case stop == StopConfirmed && !r.InSet:
				t.Errorf("row %d: a Result outside its set (p1 %v, var1 %v, %d iterations, %q)", i, r.P1, r.Var1, r.Iterations, r.Reason)
			case stop == StopEstimate && !r.InSet && strings.Contains(r.Reason, "iteration cap 30"):
				atCap++
			}
		}
		if atCap == 0 {
			t.Errorf("%s: no search reached its cap with a valid iterate outside the set; the test does not exercise the cap", stop)
		}
	}
}

// TestGenerateStopEstimate: under the paper's protocol a search stops where the optimiser's own
// draws meet the method's rule, so it takes no more iterations than the confirmed search with the
// same seed and stops short of it for PSCE at the set's edge; the iterate it stops at is measured
// by the final ensemble and handed back (as NotFoundError.Best when that says invalid).
func TestGenerateStopEstimate(t *testing.T) {
	m, v, set := blobFixture(t)
	fewer := 0
	for _, method := range []Method{MethodPSCE, MethodBayesCF, MethodROAR} {
		est := NewGenerator(m, v, Config{Method: method, Seed: 3, Stop: StopEstimate})
		conf := NewGenerator(m, v, Config{Method: method, Seed: 3})
		for i := 0; i < 4; i++ {
			r, err := est.Generate(context.Background(), set.X[i], -1)
			var nf *NotFoundError
			if errors.As(err, &nf) {
				r, err = nf.Best, nil
				if !strings.Contains(nf.Reason, "the optimiser's 32 draws met the rule") && !strings.Contains(nf.Reason, "iteration cap") {
					t.Errorf("%s row %d: reason %q", method, i, nf.Reason)
				}
			}
			if err != nil {
				t.Fatalf("%s row %d: %v", method, i, err)
			}
			c, err := conf.Generate(context.Background(), set.X[i], -1)
			if err != nil {
				t.Fatalf("%s row %d confirmed: %v", method, i, err)
			}
			if r.Iterations > c.Iterations {
				t.Errorf("%s row %d: estimate stop after %d iterations, confirmed after %d", method, i, r.Iterations, c.Iterations)
			}
			if r.Iterations < c.Iterations {
				fewer++
			}
			p, err := m.Predict([][]float64{r.XCF}, r.Samples, r.Seed)
			if err != nil {
				t.Fatal(err)
			}
			if p.P(0, r.Target) != r.P1 || (p.Argmax(0) == r.Target) != r.Valid {
				t.Errorf("%s row %d: result p1 %v valid %v, final ensemble says %v", method, i, r.P1, r.Valid, p.P(0, r.Target))
			}
		}
	}
	if fewer == 0 {
		t.Error("the estimate rule never stopped earlier than the confirmed one; it is not in use")
	}
}

func TestGenerateContext(t *testing.T) {
	m, v, set := blobFixture(t)
	g := NewGenerator(m, v, Config{Seed: 1, Weights: &Weights{Class: 0, ELBO: 1}}) // never reaches the set
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := g.Generate(ctx, set.X[0], 1); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
	// A deadline that passes mid-search, at the sixth check of the context (Generate's own check,
	// then one per iteration): Generate returns DeadlineExceeded at the first check after it,
	// running no iteration past its deadline.
	dl := &countdown{Context: context.Background(), left: 5}
	if _, err := g.Generate(dl, set.X[0], 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("deadline: %v", err)
	}
	if dl.checks != 6 {
		t.Errorf("Generate checked its context %d times; the deadline passed after 5 checks, so want 6", dl.checks)
	}
}

// countdown is a context whose deadline passes after left checks of Err: a deadline counted in
// the callee's steps, not in wall time, so a busy machine cannot move it.
type countdown struct {
	context.Context
	left, checks int
}

func (c *countdown) Err() error {
	c.checks++
	if c.checks > c.left {
		return context.DeadlineExceeded
	}
	return nil
}

// TestBreastCancerPSCEvsWachter is the CI-sized comparison on the paper's data: PSCE's
// counterfactuals are valid and in the <delta, epsilon>-set far more often than Wachter's (which stops
// as soon as the class flips), and every returned Result is valid.
func TestBreastCancerPSCEvsWachter(t *testing.T) {
	set, ds, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	train, test := set.Split(0.8, 1)
	ctx := context.Background()
	m, _, err := bnn.Fit(ctx, train, ds.Classes, bnn.TrainConfig{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	epochs := 100
	n := 10
	if testing.Short() {
		epochs, n = 40, 5
	}
	v, _, err := TrainVAE(ctx, m, train.X, TrainConfig{Seed: 1, Epochs: epochs})
	if err != nil {
		t.Fatal(err)
	}
	count := func(method Method) (valid, inSet int) {
		g := NewGenerator(m, v, Config{Method: method, Seed: 1})
		for i := 0; i < n; i++ {
			r, err := g.Generate(ctx, test.X[i], -1)
			if errors.Is(err, ErrNotFound) {
				continue
			}
			if err != nil {
				t.Fatalf("%s row %d: %v", method, i, err)
			}
			if !r.Valid {
				t.Errorf("%s row %d: invalid result returned without error", method, i)
			}
			valid++
			if r.InSet {
				inSet++
			}
		}
		return valid, inSet
	}
	pv, ps := count(MethodPSCE)
	wv, ws := count(MethodWachter)
	t.Logf("of %d: psce valid %d in-set %d; wachter valid %d in-set %d", n, pv, ps, wv, ws)
	if pv < n*9/10 || ps < n*9/10 {
		t.Errorf("psce: valid %d, in set %d of %d; want >= 90%%", pv, ps, n)
	}
	if ps < ws+n/2 {
		t.Errorf("psce in set %d, wachter %d of %d: want psce ahead by half the instances", ps, ws, n)
	}
}

// TestGenerateConcurrent: one Generator serves concurrent calls (the daemon's HTTP handler) and
// each gets the result a lone call would.
func TestGenerateConcurrent(t *testing.T) {
	m, v, set := blobFixture(t)
	g := NewGenerator(m, v, Config{Seed: 3})
	want := make([]*Result, 4)
	for i := range want {
		r, err := g.Generate(context.Background(), set.X[i], -1)
		if err != nil {
			t.Fatal(err)
		}
		want[i] = r
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for k := 0; k < 8; k++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			r, err := g.Generate(context.Background(), set.X[i], -1)
			if err != nil {
				errs <- err
				return
			}
			if !equalFloats(r.XCF, want[i].XCF) {
				errs <- errors.New("concurrent call gave a different counterfactual")
			}
		}(k % 4)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestStopEstimateNeverAcceptsTheStart: at an x on the decision boundary (the confirmation
// ensemble puts it in class 0 by a hair), the optimiser's first minibatch often says class 1;
// the paper's stopping rule must still move before it stops, never handing back x itself.
func TestStopEstimateNeverAcceptsTheStart(t *testing.T) {
	m, v, set := blobFixture(t)
	a, b := set.X[0], set.X[1] // classes 0 and 1
	trapped := 0
	for seed := uint64(1); seed <= 12; seed++ {
		g := NewGenerator(m, v, Config{Method: MethodWachter, Seed: seed, Stop: StopEstimate})
		if err := g.ensembles(); err != nil {
			t.Fatal(err)
		}
		// Bisect a + l (b - a) to the check ensemble's boundary, staying on class 0's side.
		lo, hi := 0.0, 1.0
		var x []float64
		for i := 0; i < 40; i++ {
			l := (lo + hi) / 2
			x = make([]float64, len(a))
			for j := range a {
				x[j] = a[j] + l*(b[j]-a[j])
			}
			z := make([]float64, len(x))
			m.Scaler.Apply(z, x)
			e, err := g.estimate(context.Background(), g.checkPool, z)
			if err != nil {
				t.Fatal(err)
			}
			if e.argmax() == 0 {
				lo = l
			} else {
				hi = l
			}
		}
		for j := range a {
			x[j] = a[j] + lo*(b[j]-a[j])
		}
		z0 := make([]float64, len(x))
		m.Scaler.Apply(z0, x)
		o, err := g.getObjective()
		if err != nil {
			t.Fatal(err)
		}
		if err := o.setProblem(1, z0, nil, *g.cfg.Weights, g.cfg.Delta, g.cfg.Epsilon); err != nil {
			t.Fatal(err)
		}
		s := g.newSearch(o, 1)
		if err := s.evalAt(z0); err != nil {
			t.Fatal(err)
		}
		mean := make([]float64, 2)
		for i := 0; i < len(s.ev.Probs)/2; i++ {
			mean[0] += s.ev.Probs[2*i]
			mean[1] += s.ev.Probs[2*i+1]
		}
		g.putObjective(o)
		if mean[1] > mean[0] {
			trapped++
		}
		r, err := g.Generate(context.Background(), x, 1)
		var nf *NotFoundError
		if errors.As(err, &nf) {
			r, err = nf.Best, nil
		}
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if r.Iterations == 0 || r.Distance == 0 {
			t.Errorf("seed %d: stopped after %d iterations at distance %v: x itself handed back", seed, r.Iterations, r.Distance)
		}
	}
	if trapped == 0 {
		t.Fatal("no seed's first minibatch disagreed with the confirmation ensemble at x; the test does not exercise the start")
	}
}

// TestResultFlagsFollowTheirDefinitions holds a result's flags to their definitions, computed
// here from its P1, Var1 and Samples: InSet is p1 >= 1 - delta and Var1 <= epsilon (with a tiny
// epsilon, a result whose p1 alone would pass is out of the set); Confirmed is valid with
// Hoeffding's lower bound P1 - sqrt(ln(1/alpha) / (2 Samples)) above 1/2 (Wachter stops as soon
// as the target comes first, so some of its results are valid with p1 > 1/2 and not confirmed).
func TestResultFlagsFollowTheirDefinitions(t *testing.T) {
	m, v, set := blobFixture(t)
	var passP1, validNotConfirmed int
	for _, cfg := range []Config{
		{Method: MethodPSCE, Delta: 0.45, Epsilon: 1e-6, MaxIter: 30, Seed: 3},
		{Method: MethodWachter, Seed: 3},
	} {
		g := NewGenerator(m, v, cfg)
		for i := 0; i < 40 && i < set.Len(); i++ {
			if set.Y[i] != 0 {
				continue
			}
			r, err := g.Generate(context.Background(), set.X[i], 1)
			var nf *NotFoundError
			if errors.As(err, &nf) && nf.Best.Valid { // PSCE at its cap: valid, outside the set
				r, err = nf.Best, nil
			}
			if err != nil {
				t.Fatal(err)
			}
			alpha := cmp.Or(cfg.Alpha, DefaultAlpha)
			lower := r.P1 - math.Sqrt(math.Log(1/alpha)/(2*float64(r.Samples)))
			if r.Confirmed != (r.Valid && lower > 0.5) {
				t.Errorf("%s row %d: confirmed %v, valid %v, p1 %.4f over %d samples (lower bound %.4f)", cfg.Method, i, r.Confirmed, r.Valid, r.P1, r.Samples, lower)
			}
			if r.Valid && r.P1 > 0.5 && !r.Confirmed {
				validNotConfirmed++
			}
			if cfg.Method != MethodPSCE {
				continue
			}
			if want := r.P1 >= 1-cfg.Delta && r.Var1 <= cfg.Epsilon; r.InSet != want {
				t.Errorf("psce row %d: in set %v with p1 %.4f, var1 %.3g (delta %v, epsilon %v)", i, r.InSet, r.P1, r.Var1, cfg.Delta, cfg.Epsilon)
			}
			if r.P1 >= 1-cfg.Delta {
				passP1++
			}
		}
	}
	if passP1 == 0 || validNotConfirmed == 0 {
		t.Fatalf("results with p1 >= 1 - delta: %d, valid and not confirmed: %d; the test needs some of each", passP1, validNotConfirmed)
	}
	t.Logf("results with p1 >= 1 - delta: %d; valid, p1 > 1/2 and not confirmed: %d", passP1, validNotConfirmed)
}
