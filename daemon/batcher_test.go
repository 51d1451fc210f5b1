package daemon

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
)

// testPool is the bundled breast-cancer model, briefly trained, with a pool of 1000 draws.
func testPool(t testing.TB) (*bnn.Model, *pools, [][]float64) {
	t.Helper()
	set, ds, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	m, _, err := bnn.Fit(context.Background(), set, ds.Classes, bnn.TrainConfig{Seed: 1, Epochs: 5})
	if err != nil {
		t.Fatal(err)
	}
	return m, &pools{samples: 1000, prec: bnn.Float64}, set.X
}

// testPoolDrawn is testPool with its pool drawn for the model.
func testPoolDrawn(t testing.TB) (*bnn.Model, *bnn.Pool, [][]float64) {
	t.Helper()
	m, ps, X := testPool(t)
	pool, err := ps.get(m)
	if err != nil {
		t.Fatal(err)
	}
	return m, pool, X
}

// Concurrent requests through the batcher get exactly the answers each would get alone (the
// pool's draws are shared, each input's estimate depends on its own row), and they share engine
// calls: 64 concurrent requests make far fewer than 64 calls.
func TestBatcherSharesEngineCallsAndChangesNoAnswer(t *testing.T) {
	m, pool, X := testPoolDrawn(t)
	var calls atomic.Int64
	release := make(chan struct{})
	b := newBatcher(1, func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
		if calls.Add(1) == 1 {
			<-release // the first call waits, so that the others queue behind it
		}
		return pool.Predict(ctx, xs)
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { b.run(ctx); close(done) }()
	defer func() { cancel(); <-done }()

	const clients = 64
	results := make([]*bnn.Predictive, clients)
	errs := make([]error, clients)
	var wg sync.WaitGroup
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			xs := [][]float64{X[i], X[i+clients]} // two inputs each
			results[i], errs[i] = b.do(context.Background(), m, xs)
		}()
	}
	for calls.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // let the others queue (more or fewer changes only the number of batches)
	close(release)
	wg.Wait()
	for i := range clients {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		alone, err := pool.Predict(context.Background(), [][]float64{X[i], X[i+clients]})
		if err != nil {
			t.Fatal(err)
		}
		if !sameSums(results[i].Mean, alone.Mean) || !sameSums(results[i].Var, alone.Var) || results[i].N != 2 {
			t.Fatalf("client %d: batched %+v, alone %+v", i, results[i], alone)
		}
	}
	if n := calls.Load(); n >= clients/4 {
		t.Fatalf("%d engine calls for %d concurrent requests, want far fewer", n, clients)
	}
	t.Logf("%d concurrent requests served by %d engine calls", clients, calls.Load())
}

// A request whose context ends while it waits is answered with that error and its batch-mates
// are not affected.
func TestBatcherCancelledWhileQueued(t *testing.T) {
	m, pool, X := testPoolDrawn(t)
	release, started := make(chan struct{}), make(chan struct{})
	var once sync.Once
	b := newBatcher(1, func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
		once.Do(func() { close(started); <-release })
		return pool.Predict(ctx, xs)
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { b.run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	first := make(chan error, 1)
	go func() { _, err := b.do(context.Background(), m, X[:1]); first <- err }()
	<-started // the first request's batch runs (and holds the only lane) until release
	qctx, qcancel := context.WithCancel(context.Background())
	queued := make(chan error, 1)
	go func() { _, err := b.do(qctx, m, X[1:2]); queued <- err }()
	qcancel()
	if err := <-queued; err != context.Canceled {
		t.Fatalf("a cancelled queued request: %v, want context.Canceled", err)
	}
	close(release)
	if err := <-first; err != nil {
		t.Fatalf("the running request: %v", err)
	}
}

// With two lanes, a batch starts while another runs, but only with minLaneInputs inputs or more:
// fewer wait for the running batch. Its answers are the ones each request gets alone.
func TestBatcherSecondLaneWaitsForAFullBatch(t *testing.T) {
	m, pool, X := testPoolDrawn(t)
	release := make(chan struct{})
	sizes := make(chan int, 64)
	var calls atomic.Int64
	b := newBatcher(2, func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
		sizes <- len(xs)
		if calls.Add(1) == 1 {
			<-release // the first batch runs until the second has started
		}
		return pool.Predict(ctx, xs)
	})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { b.run(ctx); close(done) }()
	defer func() { free(); cancel(); <-done }() // run returns once its batches have

	const n = 2 * minLaneInputs
	results := make([]*bnn.Predictive, n+1)
	errs := make([]error, n+1)
	var wg sync.WaitGroup
	ask := func(i int) {
		defer wg.Done()
		results[i], errs[i] = b.do(context.Background(), m, X[i:i+1])
	}
	wg.Add(1)
	go ask(0)
	if got := <-sizes; got != 1 {
		t.Fatalf("the first batch has %d inputs, want the lone request's 1", got)
	}
	for i := 1; i <= n; i++ {
		wg.Add(1)
		go ask(i) // one input each: the second lane must wait for minLaneInputs of them
	}
	if got := <-sizes; got < minLaneInputs {
		t.Fatalf("a batch of %d inputs started while another ran, want >= %d", got, minLaneInputs)
	}
	free()
	wg.Wait()
	for i := range n + 1 {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		alone, err := pool.Predict(context.Background(), X[i:i+1])
		if err != nil {
			t.Fatal(err)
		}
		if !sameSums(results[i].Mean, alone.Mean) || !sameSums(results[i].Var, alone.Var) {
			t.Fatalf("request %d: batched %+v, alone %+v", i, results[i], alone)
		}
	}
}

// BenchmarkPredictConcurrent: 50 clients, one input each, against the version's pool of 1000
// draws, each request one engine call (direct) or through the batcher with a lane per core as
// the daemon runs it (batched), in one run: requests/s, the p50 and p99 latency and the CPU
// time per request of each, the mean inputs per batched engine call, and the batched/direct
// throughput ratio. Where both keep every core busy, the throughput ratio is the inverse ratio
// of their CPU per request; on a machine shared with other work it is not.
//
//	go test -run '^$' -bench PredictConcurrent -benchtime 2000x ./daemon
func BenchmarkPredictConcurrent(b *testing.B) {
	m, ps, X := testPool(b)
	pool, err := ps.get(m)
	if err != nil {
		b.Fatal(err)
	}
	const clients = 50
	run := func(b *testing.B, predict func(ctx context.Context, xs [][]float64) error) (rps, p50, p99 float64) {
		lat := make([]time.Duration, b.N)
		cpu0 := processCPU(b)
		defer func() { b.ReportMetric(float64(processCPU(b)-cpu0)/1e6/float64(b.N), "cpu-ms/req") }()
		var next atomic.Int64
		var wg sync.WaitGroup
		b.ResetTimer()
		start := time.Now()
		for range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := next.Add(1) - 1
					if i >= int64(b.N) {
						return
					}
					t0 := time.Now()
					if err := predict(context.Background(), X[i%int64(len(X)):i%int64(len(X))+1]); err != nil {
						b.Error(err)
						return
					}
					lat[i] = time.Since(t0)
				}
			}()
		}
		wg.Wait()
		took := time.Since(start)
		b.StopTimer()
		sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
		ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
		return float64(b.N) / took.Seconds(), ms(lat[len(lat)/2]), ms(lat[len(lat)*99/100])
	}
	var direct, batched float64
	b.Run("direct", func(b *testing.B) {
		rps, p50, p99 := run(b, func(ctx context.Context, xs [][]float64) error { _, err := pool.Predict(ctx, xs); return err })
		direct = rps
		b.ReportMetric(rps, "req/s")
		b.ReportMetric(p50, "p50-ms")
		b.ReportMetric(p99, "p99-ms")
	})
	b.Run("batched", func(b *testing.B) {
		var calls atomic.Int64
		bt := newBatcher(runtime.GOMAXPROCS(0), func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
			calls.Add(1)
			return pool.Predict(ctx, xs) // as the daemon's batches (predictNow)
		})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { bt.run(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		rps, p50, p99 := run(b, func(ctx context.Context, xs [][]float64) error { _, err := bt.do(ctx, m, xs); return err })
		batched = rps
		b.ReportMetric(float64(b.N)/float64(calls.Load()), "inputs/call")
		b.ReportMetric(rps, "req/s")
		b.ReportMetric(p50, "p50-ms")
		b.ReportMetric(p99, "p99-ms")
		if direct > 0 {
			b.ReportMetric(batched/direct, "x-direct")
		}
	})
}

// BenchmarkPredictBatchSizes is the cost of one engine call on one core (Pool.PredictWorkers
// with 1 worker, as a lane of the batcher runs it) against its number of inputs, on the pool
// of BenchmarkPredictConcurrent: per input, a lone call against calls of more inputs, which
// share the call's pass over the pool.
//
//	go test -run '^$' -bench PredictBatchSizes -benchtime 40x ./daemon
func BenchmarkPredictBatchSizes(b *testing.B) {
	m, ps, X := testPool(b)
	pool, err := ps.get(m)
	if err != nil {
		b.Fatal(err)
	}
	for _, n := range []int{1, 2, 4, 8, 16, 25, 50, 100} {
		b.Run(fmt.Sprintf("inputs=%d", n), func(b *testing.B) {
			for range b.N {
				if _, err := pool.PredictWorkers(context.Background(), X[:n], 1); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/1e3/float64(b.N*n), "ms/input")
		})
	}
}

// A prediction that reaches the batcher after it stopped (the daemon stops; the HTTP server
// still drains requests under way) is answered errPredictStopping at once, without waiting for
// its own deadline.
func TestBatcherStoppedAnswersAtOnce(t *testing.T) {
	m, _, X := testPool(t)
	b := newBatcher(1, func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
		t.Error("a stopped batcher ran a prediction")
		return nil, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := b.run(ctx); err != nil {
		t.Fatal(err)
	}
	// A batcher that waits for the call to be taken answers only at the call's deadline.
	dctx, dcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer dcancel()
	if _, err := b.do(dctx, m, X[:1]); !errors.Is(err, errPredictStopping) {
		t.Fatalf("a prediction after the stop: %v, want errPredictStopping", err)
	}
}

// A batch that runs when the daemon stops runs to its end: its calls get their predictions, not
// the stop's cancellation (the engine, like predictNow, gives up on a context that ended).
func TestBatcherRunningBatchFinishesAtTheStop(t *testing.T) {
	m, pool, X := testPoolDrawn(t)
	entered, release := make(chan struct{}), make(chan struct{})
	b := newBatcher(1, func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
		close(entered)
		<-release
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		return pool.Predict(ctx, xs)
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.run(ctx) }()
	got := make(chan error, 1)
	go func() { _, err := b.do(context.Background(), m, X[:1]); got <- err }()
	<-entered
	cancel()
	close(release)
	if err := <-got; err != nil {
		t.Fatalf("a prediction running when the batcher stopped: %v, want its result", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
