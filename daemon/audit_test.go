package daemon

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestIngestContinuesDuringAnAudit: an audit no longer holds the daemon's lock, so increments
// are applied while it runs (before, ingestion waited for the whole audit), and the audit still
// evaluates every stored CE. The figures (ingest rate during an audit of 10^5 CEs over the rate
// without) are BenchmarkIngestDuringAudit's.
func TestIngestContinuesDuringAnAudit(t *testing.T) {
	const n = 2000
	r := startDaemon(t, func(c *config.Config) { c.Certify.Samples = 1000 })
	data := bundled(t)
	storeCEs(t, r, data, n)
	type result struct {
		evaluated int
		err       error
	}
	done := make(chan result, 1)
	go func() {
		rep, err := r.d.runAudit(context.Background(), "test")
		done <- result{rep.Evaluated, err}
	}()
	waitfor.Cond(t, 10*time.Second, "the audit to start", func() bool { return r.d.auditStatus().Running })
	var vals [][]byte
	for i := 0; i < 64; i++ {
		vals = append(vals, record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.produce(t, vals...)
	waitfor.Cond(t, 60*time.Second, "64 records applied", func() bool { return r.metric(t, "cfguard_records_total", "result", "applied") == 64 })
	if !r.d.auditStatus().Running {
		t.Fatal("the audit had finished before two increments were applied: ingestion waited for it, or it was too short to show anything")
	}
	res := <-done
	if res.err != nil || res.evaluated != n {
		t.Fatalf("audit: evaluated %d of %d CEs, err %v", res.evaluated, n, res.err)
	}
}
