package daemon

import (
	"context"
	"errors"

	"github.com/cfguard/cfguard/bnn"
)

// maxBatchInputs bounds the inputs of one batched engine call (the largest single request,
// maxPredictBatch, always fits alone).
const maxBatchInputs = 4 * maxPredictBatch

// minLaneInputs is the fewest inputs for which a batch starts on a core of its own while another
// batch runs. Each batch pays one pass over the pool from memory (about 1.35 ms of a core at
// 1000 float64 networks, against 0.58 ms per input: the cost of ~2.3 inputs), and under load a
// lane's batches are about as large as the inputs it starts with: at 16 the pass is 13% of a
// batch's cost, at 8 it would be 22%. Fewer inputs wait for a running batch to end and join the
// next.
const minLaneInputs = 16

// errPredictStopping answers the predictions still queued when the daemon stops.
var errPredictStopping = errors.New("predict: the daemon is stopping; retry once it runs again")

// predictCall is one POST /v1/predict waiting for the batcher.
type predictCall struct {
	ctx   context.Context
	m     *bnn.Model
	xs    [][]float64
	reply chan predictReply // buffered, 1
}

type predictReply struct {
	p   *bnn.Predictive
	err error
}

// batcher serves concurrent predictions with one engine call per batch, as Triton Inference
// Server's and TF Serving's dynamic batchers do. Requests queue while batches run; a batch takes
// the requests at the head of the queue (same posterior version, up to maxBatchInputs inputs).
// Up to lanes batches run at once (the daemon runs one per core): when none runs, a batch
// starts at once, however small; while others run, it starts only with minLaneInputs inputs
// or more, else it waits for a running batch to end. There is no timer: a lone request runs at
// once, and batches grow only with the load.
//
// One pass over the version's shared pool of S networks then serves every request of the batch,
// which matters because a pass is bound by reading the pool (34 MB at the default S = 1000),
// not by the inputs: an input costs a lone call about 1.9 ms of a core at the defaults, and
// about 0.6 ms in a batch of tens (BenchmarkPredictBatchSizes). Lanes, because an engine call of
// fewer than a few hundred inputs runs on one core (bnn.Pool.Predict spreads only large calls):
// with one batch at a time the other cores idled while it ran. Results do not depend on the
// batch: the pool's draws are shared by every input and each input's estimate depends on its
// own row only (bnn.Pool).
type batcher struct {
	predict func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error)
	lanes   int
	calls   chan *predictCall
	stopped chan struct{} // closed when run returns: no call is taken after
}

// newBatcher serves batches on up to lanes cores at once (at least 1).
func newBatcher(lanes int, predict func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error)) *batcher {
	return &batcher{predict: predict, lanes: max(1, lanes), calls: make(chan *predictCall), stopped: make(chan struct{})}
}

// do queues one prediction and waits for its result, or for ctx to end. Once run has returned
// (the daemon stops) it answers errPredictStopping at once. A call run took is always answered
// (served, or errPredictStopping from its queue), so the wait for the reply needs no such case.
func (b *batcher) do(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
	c := &predictCall{ctx: ctx, m: m, xs: xs, reply: make(chan predictReply, 1)}
	select {
	case b.calls <- c:
	case <-b.stopped:
		return nil, errPredictStopping
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case r := <-c.reply:
		return r.p, r.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// run queues the calls and starts their batches until ctx ends; then it answers the calls still
// queued with errPredictStopping and returns once every running batch has.
func (b *batcher) run(ctx context.Context) error {
	defer close(b.stopped)
	// A batch runs to its end when the daemon stops (milliseconds; the HTTP server drains the
	// requests it answers, and run waits for it): the stop does not cut it into 500s.
	batchCtx := context.WithoutCancel(ctx)
	var (
		queue   []*predictCall
		running int
		ended   = make(chan struct{}, b.lanes)
	)
	for {
		for len(queue) > 0 && running < b.lanes {
			k, n := nextBatch(queue)
			if running > 0 && n < minLaneInputs {
				break
			}
			batch := queue[:k:k]
			queue = queue[k:]
			running++
			go func() {
				b.serve(batchCtx, batch, n)
				ended <- struct{}{}
			}()
		}
		select {
		case c := <-b.calls:
			queue = append(queue, c)
		waiting: // and every call waiting with it
			for {
				select {
				case c := <-b.calls:
					queue = append(queue, c)
				default:
					break waiting
				}
			}
		case <-ended:
			running--
		case <-ctx.Done():
			for _, c := range queue {
				c.reply <- predictReply{err: errPredictStopping}
			}
			for ; running > 0; running-- {
				<-ended
			}
			return nil
		}
	}
}

// nextBatch is the batch at the head of queue: its first k calls, n inputs, all of the first's
// posterior version and at most maxBatchInputs inputs (the first call always fits).
func nextBatch(queue []*predictCall) (k, n int) {
	for k < len(queue) {
		c := queue[k]
		if k > 0 && (c.m.Version != queue[0].m.Version || n+len(c.xs) > maxBatchInputs) {
			break
		}
		k, n = k+1, n+len(c.xs)
	}
	return k, n
}

// serve runs one engine call for the batch's live calls and hands each its rows.
func (b *batcher) serve(ctx context.Context, batch []*predictCall, n int) {
	xs := make([][]float64, 0, n)
	live := batch[:0]
	for _, c := range batch {
		if c.ctx.Err() != nil {
			c.reply <- predictReply{err: c.ctx.Err()}
			continue
		}
		live = append(live, c)
		xs = append(xs, c.xs...)
	}
	if len(live) == 0 {
		return
	}
	p, err := b.predict(ctx, live[0].m, xs)
	if err == nil && p.N != len(xs) {
		err = errors.New("predict: the engine returned a result of another size")
	}
	lo := 0
	for _, c := range live {
		if err != nil {
			c.reply <- predictReply{err: err}
			continue
		}
		hi := lo + len(c.xs)
		c.reply <- predictReply{p: &bnn.Predictive{N: len(c.xs), C: p.C, S: p.S, Precision: p.Precision,
			Mean: p.Mean[lo*p.C : hi*p.C], Var: p.Var[lo*p.C : hi*p.C]}}
		lo = hi
	}
}
