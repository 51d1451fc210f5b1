package daemon

import (
	"context"
	"runtime"

	"github.com/cfguard/cfguard/bnn"
)

// backgroundBatch is how many CEs one audit batch samples and then writes in one transaction
// under the ledger's writer lock (ledger.Options.MCBatch; confirmations use the smaller
// confirmBatch, so that their verdicts are written while they carry). An
// increment's commit waits for at most one such write: with 4096 (ledger.DefaultMCBatch), ingest
// during an audit of 10^5 CEs ran at 0.70-0.79 of its rate without; with 1024 at 0.80-1.2
// (BenchmarkIngestDuringAudit, 2 shared cores, noisy).
const backgroundBatch = 1024

// backgroundPredictor is a ledger.Predictor over a bnn.Pool for work that must not take every
// core: it predicts on one goroutine, so that one confirmer lane takes at most one core; the
// lanes are audit.workers (confirmers), as many as an audit's cores, and ingestion keeps the
// others (with 2 cores, an audit on both halved ingest; see BenchmarkIngestDuringAudit).
//
// It also gives the posterior the pool was drawn from (ledger.PosteriorPredictor), so that a
// confirmation keeps using it after ingestion replaced that posterior.
type backgroundPredictor struct {
	pool  *bnn.Pool
	model *bnn.Model // the posterior pool was drawn from
}

func (p backgroundPredictor) Version() uint64 { return p.pool.Version() }

func (p backgroundPredictor) Posterior() *bnn.Model { return p.model }

func (p backgroundPredictor) Predict(ctx context.Context, X [][]float64) (*bnn.Predictive, error) {
	return p.pool.PredictWorkers(ctx, X, 1)
}

// auditPredictor is a ledger.Predictor over a bnn.Pool on a given number of goroutines: audits
// run on audit.workers cores (default every core but one), so that they scale with the machine
// and ingestion keeps a core. It gives the posterior the pool was drawn from
// (ledger.PosteriorPredictor), so that an audit measures under it after ingestion replaced it.
type auditPredictor struct {
	pool    *bnn.Pool
	model   *bnn.Model // the posterior pool was drawn from
	workers int
}

func (p auditPredictor) Version() uint64 { return p.pool.Version() }

func (p auditPredictor) Posterior() *bnn.Model { return p.model }

func (p auditPredictor) Predict(ctx context.Context, X [][]float64) (*bnn.Predictive, error) {
	return p.pool.PredictWorkers(ctx, X, p.workers)
}

// auditWorkers is audit.workers, 0 meaning every core but one (at least one).
func auditWorkers(n int) int { return workersOn(n, runtime.GOMAXPROCS(0)) }

// workersOn is audit.workers n on procs cores: n when it is positive, else procs - 1, at least 1.
func workersOn(n, procs int) int {
	if n > 0 {
		return n
	}
	return max(1, procs-1)
}
