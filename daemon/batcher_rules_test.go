package daemon

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
)

// engineCall is one engine call a test batcher made: its inputs' first features, and whether the
// first batch had been let go when it began.
type engineCall struct {
	firsts   []float64
	released bool
}

// rowEngine is an engine whose first call waits for release, and whose answer for an input is
// its first feature in each of two classes (mean) and that feature plus one (variance), so that
// each request can tell its own rows. Every call is sent on calls.
func rowEngine(release <-chan struct{}, calls chan<- engineCall) func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
	first := true
	return func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
		c := engineCall{}
		select {
		case <-release:
			c.released = true
		default:
		}
		for _, x := range xs {
			c.firsts = append(c.firsts, x[0])
		}
		wait := first
		first = false // before the call is seen, so that no later call reads it unordered
		calls <- c
		if wait {
			<-release
		}
		p := &bnn.Predictive{N: len(xs), C: 2, S: 1}
		for _, x := range xs {
			p.Mean = append(p.Mean, x[0], x[0])
			p.Var = append(p.Var, x[0]+1, x[0]+1)
		}
		return p, nil
	}
}

// startBatcher runs b until the test ends, when it first lets the engine's first call go (run
// returns once its batches have). free lets it go earlier.
func startBatcher(t *testing.T, b *batcher, release chan struct{}) (free func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { b.run(ctx); close(done) }()
	var once sync.Once
	free = func() { once.Do(func() { close(release) }) }
	t.Cleanup(func() { free(); cancel(); <-done })
	return free
}

// queueCalls hands the batcher one call per input count in sizes, in order, each taken by run
// before the next is offered; a call's inputs' first features are base, base+1, ...
func queueCalls(t *testing.T, b *batcher, m *bnn.Model, base float64, sizes ...int) []*predictCall {
	t.Helper()
	var out []*predictCall
	for _, n := range sizes {
		c := &predictCall{ctx: context.Background(), m: m, reply: make(chan predictReply, 1)}
		for range n {
			c.xs = append(c.xs, []float64{base})
			base++
		}
		select {
		case b.calls <- c:
		case <-time.After(time.Minute):
			t.Fatal("the batcher took no call for a minute")
		}
		out = append(out, c)
	}
	return out
}

func nextEngineCall(t *testing.T, calls <-chan engineCall) engineCall {
	t.Helper()
	select {
	case c := <-calls:
		return c
	case <-time.After(time.Minute):
		t.Fatal("no engine call for a minute")
		return engineCall{}
	}
}

// replyOf waits for the call's answer.
func replyOf(t *testing.T, c *predictCall) predictReply {
	t.Helper()
	select {
	case r := <-c.reply:
		return r
	case <-time.After(time.Minute):
		t.Fatal("a queued prediction got no answer for a minute")
		return predictReply{}
	}
}

// While a batch runs on every lane, the requests queued behind it start no batch, however many
// inputs they hold: they wait for a lane, then run as one batch. With a lane free beside a
// running batch, a batch starts at once when the queue holds minLaneInputs inputs, and waits for
// the running one when it holds fewer.
func TestBatcherStartsABatchOnlyOnAFreeLane(t *testing.T) {
	for _, c := range []struct {
		name         string
		lanes        int
		queued       int  // one-input requests queued while the first batch runs
		startsAtOnce bool // their batch starts before the first one ends
	}{
		{"every lane busy", 1, 2 * minLaneInputs, false},
		{"a free lane, minLaneInputs inputs", 2, minLaneInputs, true},
		{"a free lane, fewer inputs", 2, minLaneInputs - 1, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			release, calls := make(chan struct{}), make(chan engineCall, 8)
			b := newBatcher(c.lanes, rowEngine(release, calls))
			free := startBatcher(t, b, release)
			m := &bnn.Model{Version: 3}
			first := queueCalls(t, b, m, 1000, 1)
			if got := nextEngineCall(t, calls); len(got.firsts) != 1 || got.released {
				t.Fatalf("the first engine call %+v, want the lone request's input", got)
			}
			sizes := make([]int, c.queued)
			for i := range sizes {
				sizes[i] = 1
			}
			queued := queueCalls(t, b, m, 0, sizes...)
			if c.startsAtOnce {
				if got := nextEngineCall(t, calls); len(got.firsts) != c.queued || got.released {
					t.Fatalf("the second engine call had %d inputs (after the first ended: %v), want %d while the first runs",
						len(got.firsts), got.released, c.queued)
				}
				free()
			} else {
				free()
				if got := nextEngineCall(t, calls); len(got.firsts) != c.queued || !got.released {
					t.Fatalf("the second engine call had %d inputs (after the first ended: %v), want all %d, after the first ended",
						len(got.firsts), got.released, c.queued)
				}
			}
			for i, q := range append(first, queued...) {
				if r := replyOf(t, q); r.err != nil || r.p.N != 1 {
					t.Fatalf("request %d: %+v", i, r)
				}
			}
			if len(calls) != 0 {
				t.Fatalf("%d more engine calls, want 2", len(calls))
			}
		})
	}
}

// A batch holds the requests at the head of the queue while they are of the first one's
// posterior version and fit in maxBatchInputs together; the first request after them starts the
// next batch. Each request of a batch gets the rows of its own inputs, in order.
func TestBatcherCutsBatchesAtAVersionOrTheInputBound(t *testing.T) {
	v1, v2 := &bnn.Model{Version: 1}, &bnn.Model{Version: 2}
	for _, c := range []struct {
		name    string
		models  []*bnn.Model
		sizes   []int
		batches []int // inputs of each engine call after the first request's
	}{
		{"one version", []*bnn.Model{v1, v1, v1}, []int{2, 3, 1}, []int{6}},
		{"a newer version", []*bnn.Model{v1, v1, v2, v2}, []int{2, 3, 1, 4}, []int{5, 5}},
		{"an older version", []*bnn.Model{v2, v1, v2}, []int{1, 1, 1}, []int{1, 1, 1}},
		{"exactly the bound", []*bnn.Model{v1, v1}, []int{maxBatchInputs - 1, 1}, []int{maxBatchInputs}},
		{"one input over the bound", []*bnn.Model{v1, v1, v1}, []int{maxBatchInputs - 1, 2, 1}, []int{maxBatchInputs - 1, 3}},
	} {
		t.Run(c.name, func(t *testing.T) {
			release, calls := make(chan struct{}), make(chan engineCall, 8)
			b := newBatcher(1, rowEngine(release, calls))
			free := startBatcher(t, b, release)
			first := queueCalls(t, b, v1, -1, 1)
			nextEngineCall(t, calls)
			var queued []*predictCall
			base := 0.0
			for i, m := range c.models {
				queued = append(queued, queueCalls(t, b, m, base, c.sizes[i])...)
				base += float64(c.sizes[i])
			}
			free()
			next := 0.0
			for i, want := range c.batches {
				got := nextEngineCall(t, calls)
				if len(got.firsts) != want {
					t.Fatalf("engine call %d had %d inputs, want %d", i+2, len(got.firsts), want)
				}
				for j, f := range got.firsts {
					if f != next {
						t.Fatalf("engine call %d: input %d is the queue's %v, want %v", i+2, j, f, next)
					}
					next++
				}
			}
			if r := replyOf(t, first[0]); r.err != nil || r.p.N != 1 || r.p.Mean[0] != -1 {
				t.Fatalf("the first request: %+v", r)
			}
			next = 0
			for i, q := range queued {
				r := replyOf(t, q)
				if r.err != nil || r.p.N != len(q.xs) || len(r.p.Mean) != 2*len(q.xs) || len(r.p.Var) != 2*len(q.xs) {
					t.Fatalf("request %d: %+v, want %d rows", i, r, len(q.xs))
				}
				for j := range q.xs {
					if r.p.P(j, 1) != next || r.p.V(j, 0) != next+1 {
						t.Fatalf("request %d, input %d: mean %v, variance %v; want its own row's %v, %v", i, j, r.p.P(j, 1), r.p.V(j, 0), next, next+1)
					}
					next++
				}
			}
		})
	}
}

// When the daemon stops, the requests still queued are answered errPredictStopping at once, and
// run returns only after the batch that was running has answered its requests.
func TestBatcherStopAnswersTheQueueAndWaitsForTheRunningBatch(t *testing.T) {
	release, calls := make(chan struct{}), make(chan engineCall, 8)
	b := newBatcher(1, rowEngine(release, calls))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { b.run(ctx); close(done) }()
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	defer func() { free(); cancel(); <-done }()
	m := &bnn.Model{Version: 1}
	first := queueCalls(t, b, m, 0, 1)
	nextEngineCall(t, calls)
	queued := queueCalls(t, b, m, 1, 1, 2, 3)
	cancel()
	for i, q := range queued {
		if r := replyOf(t, q); !errors.Is(r.err, errPredictStopping) || r.p != nil {
			t.Fatalf("queued request %d at the stop: %+v, want errPredictStopping", i, r)
		}
	}
	select {
	case <-done:
		t.Fatal("the batcher stopped while a batch ran")
	default:
	}
	free()
	<-done
	select {
	case r := <-first[0].reply:
		if r.err != nil || r.p.N != 1 {
			t.Fatalf("the running request: %+v", r)
		}
	default:
		t.Fatal("the batcher stopped before its running batch answered")
	}
	if len(calls) != 0 {
		t.Fatalf("%d engine calls after the stop, want none", len(calls))
	}
}

// A request whose context ended while it waited in the queue is answered with its context's
// error without an engine call, and the rest of its batch is served without its inputs; a batch
// whose every request ended makes no engine call. An engine answer of another size than the
// batch's inputs is an error for every request of the batch.
func TestBatcherServesOnlyLiveRequests(t *testing.T) {
	m := &bnn.Model{Version: 1}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	call := func(ctx context.Context, firsts ...float64) *predictCall {
		c := &predictCall{ctx: ctx, m: m, reply: make(chan predictReply, 1)}
		for _, f := range firsts {
			c.xs = append(c.xs, []float64{f})
		}
		return c
	}
	t.Run("some ended", func(t *testing.T) {
		calls := make(chan engineCall, 4)
		release := make(chan struct{})
		close(release)
		b := newBatcher(1, rowEngine(release, calls))
		batch := []*predictCall{call(ended, 7), call(context.Background(), 1, 2), call(ended, 8, 9), call(context.Background(), 3)}
		b.serve(context.Background(), slices.Clone(batch), 6) // serve reuses its slice
		if got := nextEngineCall(t, calls); len(got.firsts) != 3 || got.firsts[0] != 1 || got.firsts[1] != 2 || got.firsts[2] != 3 {
			t.Fatalf("the engine call's inputs %v, want the live requests' [1 2 3]", got.firsts)
		}
		for i, want := range []float64{-1, 1, -1, 3} {
			r := replyOf(t, batch[i])
			if want < 0 {
				if !errors.Is(r.err, context.Canceled) || r.p != nil {
					t.Fatalf("ended request %d: %+v, want context.Canceled", i, r)
				}
				continue
			}
			if r.err != nil || r.p.P(0, 0) != want {
				t.Fatalf("live request %d: %+v, want its row %v", i, r, want)
			}
		}
	})
	t.Run("all ended", func(t *testing.T) {
		b := newBatcher(1, func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
			t.Error("an engine call for a batch with no live request")
			return nil, nil
		})
		batch := []*predictCall{call(ended, 1), call(ended, 2)}
		b.serve(context.Background(), slices.Clone(batch), 2) // serve reuses its slice
		for i, q := range batch {
			if r := replyOf(t, q); !errors.Is(r.err, context.Canceled) {
				t.Fatalf("request %d: %+v, want context.Canceled", i, r)
			}
		}
	})
	t.Run("engine answers another size", func(t *testing.T) {
		b := newBatcher(1, func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
			return &bnn.Predictive{N: len(xs) - 1, C: 2, Mean: make([]float64, 2*len(xs)), Var: make([]float64, 2*len(xs))}, nil
		})
		batch := []*predictCall{call(context.Background(), 1), call(context.Background(), 2, 3)}
		b.serve(context.Background(), slices.Clone(batch), 3) // serve reuses its slice
		for i, q := range batch {
			if r := replyOf(t, q); r.err == nil || r.p != nil {
				t.Fatalf("request %d: %+v, want an error", i, r)
			}
		}
	})
}
