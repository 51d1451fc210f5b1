package daemon

import (
	"context"
	"errors"

	"github.com/cfguard/cfguard/bnn"
)

// maxBatchInputs bounds the inputs of one batched engine call (the largest single request,
// maxPredictBatch, always fits alone).
const maxBatchInputs = 4 * maxPredictBatch

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
// Server's and TF Serving's dynamic batchers do: while one batch runs, the requests that arrive
// queue; the next batch takes all of them (same posterior version, up to maxBatchInputs inputs).
// There is no timer: a lone request runs at once, and batches grow only with the load. One pass
// over the version's shared pool of S networks then serves every request of the batch, which
// matters because a pass is bound by reading the pool (34 MB at the default S = 1000), not by
// the inputs. Results do not depend on the batch: the pool's draws are shared by every input and
// each input's estimate depends on its own row only (bnn.Pool).
type batcher struct {
	predict func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error)
	calls   chan *predictCall
	held    *predictCall // the first call of the next batch (another version, or too large)
}

func newBatcher(predict func(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error)) *batcher {
	return &batcher{predict: predict, calls: make(chan *predictCall)}
}

// do queues one prediction and waits for its result, or for ctx to end.
func (b *batcher) do(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
	c := &predictCall{ctx: ctx, m: m, xs: xs, reply: make(chan predictReply, 1)}
	select {
	case b.calls <- c:
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

// run serves batches until ctx ends.
func (b *batcher) run(ctx context.Context) error {
	for {
		first := b.held
		b.held = nil
		if first == nil {
			select {
			case first = <-b.calls:
			case <-ctx.Done():
				return nil
			}
		}
		batch, n := []*predictCall{first}, len(first.xs)
	gather:
		for n < maxBatchInputs {
			select {
			case c := <-b.calls:
				if c.m.Version != first.m.Version || n+len(c.xs) > maxBatchInputs {
					b.held = c
					break gather
				}
				batch, n = append(batch, c), n+len(c.xs)
			default:
				break gather
			}
		}
		b.serve(ctx, batch, n)
	}
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
