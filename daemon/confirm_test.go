package daemon

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestConfirmerDrawsNothingWithoutFailingCEs: the confirmer is woken after every commit, and its
// draws (certify.samples networks per posterior version) cost more than the commit itself (they
// were 64% of the daemon's CPU time while ingesting a backlog with no CE stored). With no CE
// whose bound fails, a round must not draw them; the drift tests show that it still confirms
// when one fails.
func TestConfirmerDrawsNothingWithoutFailingCEs(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	daemontest.StoreCEs(t, r, data, 20) // certified: their bounds hold
	ps := &pools{samples: r.D.cfg.Certify.Samples, prec: r.D.cfg.Certify.Precision}
	c := newConfirmer(r.D.ledger, r.D.current, ps, r.D.metrics, func([]ledger.StatusChange) {}, r.D.log)
	ctx := context.Background()
	for range 3 {
		var vals [][]byte
		for i := 0; i < 32; i++ {
			vals = append(vals, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
		}
		v := r.D.current().Version
		r.Produce(t, vals...)
		waitfor.Cond(t, 30*time.Second, "the increment applied", func() bool { return r.D.current().Version > v })
		if err := c.round(ctx); err != nil {
			t.Fatal(err)
		}
	}
	counts, err := r.D.ledger.Counts()
	if err != nil {
		t.Fatal(err)
	}
	if counts[certify.Certified] != 20 {
		t.Fatalf("statuses %v, want the 20 CEs certified", counts)
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.drawn != 0 {
		t.Fatalf("the confirmer drew %d pools for 3 posterior versions with no CE whose bound fails", ps.drawn)
	}
}

// TestConfirmerLanesShareTheWork: with audit.workers 2 the daemon runs two confirmer lanes, and
// after a drift that lapses every certificate each lane measures some of the CEs and, between
// them, every CE is left with a verdict or a renewal (none waits).
func TestConfirmerLanesShareTheWork(t *testing.T) {
	const n = 400
	r := startDaemon(t, func(c *config.Config) {
		daemontest.PaperLearner(c, 3e-3)
		c.Audit.Workers = 2
	})
	if len(r.D.confirm) != 2 {
		t.Fatalf("%d confirmer lanes with audit.workers 2, want 2", len(r.D.confirm))
	}
	data := daemontest.Bundled(t)
	daemontest.StoreCEs(t, r, data, n)
	var drift [][]byte
	for i := range data.X {
		if data.Y[i] == 1 && len(drift) < 96 {
			drift = append(drift, daemontest.Record(fmt.Sprintf("flip%d", i), data.X[i], "malignant"))
		}
	}
	r.Produce(t, drift...)
	waitfor.Cond(t, 60*time.Second, "the drift applied", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 96 })
	// A lane counts a batch just after the batch's write, which the gauges show at once: wait
	// for both.
	var measured []int64
	waitfor.Cond(t, 2*time.Minute, "every CE measured by both lanes", func() bool {
		measured = []int64{r.D.confirm[0].measured.Load(), r.D.confirm[1].measured.Load()}
		return r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0 && r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 &&
			measured[0] > 0 && measured[1] > 0 && measured[0]+measured[1] >= n
	})
}

// TestConfirmerCountsWhatBecameOfItsMeasurements: every measurement the confirmers write is
// counted in cfguard_counterfactuals_measured_total under what became of it. The confirmers are
// held until a drift is applied, so that no posterior comes while they measure: then none is
// discarded, and every measurement is kept (in force for the posterior current when it is
// written) but those made under an older version a CE became due at (measureDue, when the newest
// is near it), which are superseded when their verdict does not carry to the newest; kept and
// superseded add up to the lanes' measurements.
func TestConfirmerCountsWhatBecameOfItsMeasurements(t *testing.T) {
	held := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(held) }) }
	t.Cleanup(release)
	r := startDaemonWith(t, func(c *config.Config) { daemontest.PaperLearner(c, 3e-3) }, func(o *Options) {
		o.Hooks.ConfirmRound = func(ctx context.Context) {
			select {
			case <-held:
			case <-ctx.Done():
			}
		}
	}, nil).WaitReady(t, "readyz", 20*time.Second)
	data := daemontest.Bundled(t)
	daemontest.StoreCEs(t, r, data, 100)
	r.Produce(t, daemontest.Flipped(data, 96)...)
	waitfor.Cond(t, 60*time.Second, "the drift applied and certificates lapsed", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == 96 && r.Metric(t, "cfguard_counterfactuals_renewal_pending") > 0
	})
	release()
	// A lane counts a batch just after the batch's write, which the gauges show at once: wait
	// for both.
	var measured, due int64
	got := map[string]float64{}
	waitfor.Cond(t, 2*time.Minute, "every CE measured and its measurement counted", func() bool {
		if r.Metric(t, "cfguard_counterfactuals_unconfirmed") != 0 || r.Metric(t, "cfguard_counterfactuals_renewal_pending") != 0 {
			return false
		}
		measured, due = 0, 0
		for _, c := range r.D.confirm {
			measured += c.measured.Load()
			due += c.dueMeasured.Load()
		}
		for _, res := range alerts.MeasurementResults() {
			got[res] = r.Metric(t, "cfguard_counterfactuals_measured_total", "result", res)
		}
		return measured > 0 && got["kept"]+got["superseded"] == float64(measured)
	})
	t.Logf("%d measurements, %d of them under a due version: %v", measured, due, got)
	if got["discarded"] != 0 || got["superseded"] > float64(due) {
		t.Fatalf("measurements counted %v, want none discarded and none superseded but of the %d of %d the confirmers made under a due version",
			got, due, measured)
	}
}
