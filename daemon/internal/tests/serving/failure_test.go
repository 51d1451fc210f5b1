package serving

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/stream"
)

// TestHugeFeatureIsDeadLettered: a record whose feature is finite but so far from the model's
// mean that its scaled square overflows would fail the update of its whole increment, and one
// twice MaxScaledFeature out would dominate it; both are dead-lettered as out_of_range and the
// other records of the increment are applied.
func TestHugeFeatureIsDeadLettered(t *testing.T) {
	data := daemontest.Bundled(t)
	r := launch.Daemon(t, nil)
	var vals [][]byte
	for i := range 31 {
		vals = append(vals, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	huge := slices.Clone(data.X[31])
	huge[0] = 1e300 // its scaled square overflows the update
	vals = append(vals, daemontest.Record("huge", huge, data.Y[31]))
	far := slices.Clone(data.X[32]) // 2e5 standard deviations out: it would dominate the update
	sc := r.D.Posterior().Scaler
	far[0] = sc.Mean[0] + 2*stream.MaxScaledFeature*sc.Std[0]
	vals = append(vals, daemontest.Record("far", far, data.Y[32]))
	r.Produce(t, vals...)
	waitfor.Cond(t, 30*time.Second, "31 records applied and two dead-lettered", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == 31 &&
			r.Metric(t, "cfguard_records_total", "result", "dead_lettered") == 2
	})
	if n := r.Metric(t, "cfguard_records_total", "result", "failed"); n != 0 {
		t.Errorf("%v records failed, want none", n)
	}
	// The ledger counts them too, in the checkpoint of their increment.
	if st, err := r.D.Ledger().State(); err != nil || st.Counters["dead_lettered"] != 2 {
		t.Errorf("the ledger's dead_lettered counter: %v (%v), want 2", st.Counters["dead_lettered"], err)
	}
}
