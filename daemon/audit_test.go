package daemon

import (
	"context"
	"fmt"
	"sync"
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
	// The audit is held after its first batch (of 1024) until the records are applied, so that
	// they are applied while it runs however fast the machine: if ingestion waited for the
	// audit, they never would be.
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r.d.auditBatchDone = func(done, total int) {
		if done < total {
			once.Do(func() { close(held); <-release })
		}
	}
	done := make(chan result, 1)
	go func() {
		rep, err := r.d.runAudit(context.Background(), "test")
		done <- result{rep.Evaluated, err}
	}()
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	select {
	case <-held:
	case <-time.After(60 * time.Second):
		t.Fatal("the audit's first batch was not written within 60 s")
	}
	var vals [][]byte
	for i := 0; i < 64; i++ {
		vals = append(vals, record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.produce(t, vals...)
	waitfor.Cond(t, 60*time.Second, "64 records applied while the audit is held between its batches",
		func() bool { return r.metric(t, "cfguard_records_total", "result", "applied") == 64 })
	if !r.d.auditStatus().Running {
		t.Fatal("the audit is not running while held between its batches")
	}
	close(release)
	res := <-done
	if res.err != nil || res.evaluated != n {
		t.Fatalf("audit: evaluated %d of %d CEs, err %v", res.evaluated, n, res.err)
	}
}
