package daemon

import (
	"context"
	"fmt"

	"github.com/cfguard/cfguard/bnn"
)

// backgroundBatch is how many CEs one audit or confirmation batch samples and then writes in one
// transaction under the ledger's writer lock (ledger.Options.MCBatch, the max of Confirm). An
// increment's commit waits for at most one such write: with 4096 (ledger.DefaultMCBatch), ingest
// during an audit of 10^5 CEs ran at 0.70-0.79 of its rate without; with 1024 at 0.80-1.2
// (BenchmarkIngestDuringAudit, 2 shared cores, noisy).
const backgroundBatch = 1024

// backgroundRows is the number of inputs one background Predict call evaluates. bnn splits a
// call into chunks of 192 inputs and runs min(GOMAXPROCS, chunks/2) goroutines, so a call of 384
// inputs runs on one goroutine: audits and confirmations then take at most one core, and
// ingestion keeps the others (with 2 cores, an audit on both halved ingest; see
// BenchmarkIngestDuringAudit). Should bnn split differently, only the speed changes.
const backgroundRows = 384

// backgroundPredictor is a ledger.Predictor over a bnn.Pool for work that must not take every
// core: it predicts in calls of backgroundRows inputs, one after the other. A Pool's result for
// an input does not depend on the other inputs of the call, so the results are those of one call.
type backgroundPredictor struct{ pool *bnn.Pool }

func (p backgroundPredictor) Version() uint64 { return p.pool.Version() }

func (p backgroundPredictor) Predict(ctx context.Context, X [][]float64) (*bnn.Predictive, error) {
	if len(X) <= backgroundRows {
		return p.pool.Predict(ctx, X)
	}
	var out *bnn.Predictive
	for lo := 0; lo < len(X); lo += backgroundRows {
		pr, err := p.pool.Predict(ctx, X[lo:min(lo+backgroundRows, len(X))])
		if err != nil {
			return nil, err
		}
		if out == nil {
			out = &bnn.Predictive{N: len(X), C: pr.C, S: pr.S, Precision: pr.Precision,
				Mean: make([]float64, 0, len(X)*pr.C), Var: make([]float64, 0, len(X)*pr.C)}
		}
		if pr.C != out.C || pr.S != out.S {
			return nil, fmt.Errorf("pool returned %d classes x %d draws, then %d x %d", out.C, out.S, pr.C, pr.S)
		}
		out.Mean = append(out.Mean, pr.Mean...)
		out.Var = append(out.Var, pr.Var...)
	}
	return out, nil
}
