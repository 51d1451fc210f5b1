package daemon

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestFailedUpdateKeepsThePosterior serves a model whose last-layer means are so large that
// the logits overflow: every update's loss is non-finite, update.LastLayer refuses it, and the
// daemon must keep the posterior bit for bit, count the failure, and still consume the records.
func TestFailedUpdateKeepsThePosterior(t *testing.T) {
	data := daemontest.Bundled(t)
	r := startDaemon(t, func(c *config.Config) { c.Model.Path = daemontest.OverflowingModel(t) })
	before := r.D.current()
	var vals [][]byte
	for i := 0; i < 32; i++ {
		vals = append(vals, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, vals...)
	waitfor.Cond(t, 30*time.Second, "32 failed records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "failed") == 32 })
	if r.Metric(t, "cfguard_updates_total", "outcome", "failed") != 1 || r.Metric(t, "cfguard_records_total", "result", "applied") != 0 {
		t.Fatal("the failure was not counted as one failed update")
	}
	now := r.D.current()
	if now != before || now.Version != before.Version || !bnn.LayersEqual(now.Last(), before.Last()) {
		t.Fatal("a failed update changed the posterior")
	}
	st, err := r.D.ledger.State()
	if err != nil {
		t.Fatal(err)
	}
	if st.PosteriorVersion != before.Version || st.Offsets[0] != 32 || st.Counters["failed"] != 32 {
		t.Fatalf("checkpoint after the failure: %+v", st)
	}
	// The KL history records the failed update as the candidate posterior it did not make.
	if hist, err := r.D.ledger.KLHistory(1); err != nil || len(hist) != 1 || hist[0].PosteriorVersion != before.Version+1 ||
		hist[0].Outcome != certify.OutcomeFailed || hist[0].KL != 0 {
		t.Fatalf("KL history after the failure: %+v (%v), want one failed entry for version %d with KL 0", hist, err, before.Version+1)
	}
	// Its update_failed event names the records and where they are in the input topic, for replay.
	waitfor.Cond(t, 30*time.Second, "the outbox drained", func() bool { return r.Metric(t, "cfguard_events_pending") == 0 })
	found := false
	for _, m := range kafkatest.ReadPartition(t, r.D.BrokerAddrs(), r.D.cfg.Kafka.EventsTopic, 0) {
		var e Event
		if err := json.Unmarshal(m.Value, &e); err != nil || e.Type != "update_failed" {
			continue
		}
		found = true
		if len(e.Records) != 32 || !slices.Equal(e.Offsets, []offsetRange{{Partition: 0, First: 0, Last: 31}}) {
			t.Errorf("update_failed names %d records at %+v, want 32 at offsets 0..31 of partition 0", len(e.Records), e.Offsets)
		}
	}
	if !found {
		t.Error("no update_failed event published")
	}
}
