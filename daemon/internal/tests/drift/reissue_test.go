package drift

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// With explain.reissue set, a drift that moves CEs into that status makes the daemon generate a
// replacement for each (PSCE for the same x under the current posterior), store it and publish
// counterfactual_reissued linking old to new, or counterfactual_reissue_failed with the reason:
// exactly one of them per CE. A replacement has the old CE's x and is measured under a posterior
// at least as new as the old CE's verdict. A mild drift (at_risk) leaves room for replacements; a
// strong one (invalidated, learning rate 1e-2) leaves none, and says so. There every generation
// runs to explain.max_iterations without reaching the set, so the case caps it at 200 instead of
// the paper's 2000: the failure and its event are the same, at a tenth of the work. A generation
// is bounded by explain.timeout as a request's is: at 1 ns, the mild drift's reissues fail, each
// naming the deadline.
func TestReissue(t *testing.T) {
	for _, c := range []struct {
		name, status  string
		lr            float64
		maxIterations int
		timeout       time.Duration
		failure       string // what every failure event says; "" when reissues must succeed
	}{
		{"at_risk", "at_risk", 1e-3, 2000, config.Default().Explain.Timeout, ""},
		{"invalidated", "invalidated", 1e-2, 200, config.Default().Explain.Timeout, "iteration cap 200"},
		{"at_risk past explain.timeout", "at_risk", 1e-3, 2000, time.Nanosecond, "no counterfactual within explain.timeout 1ns: " + context.DeadlineExceeded.Error()},
	} {
		t.Run(c.name, func(t *testing.T) { testReissue(t, c.status, c.lr, c.maxIterations, c.timeout, c.failure) })
	}
}

func testReissue(t *testing.T, status string, lr float64, maxIterations int, timeout time.Duration, failure string) {
	wantSuccess := failure == ""
	r := launch.Daemon(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		daemontest.PaperLearner(c, lr)
		c.Explain.MaxIterations = maxIterations
		c.Explain.Timeout = timeout
		c.Explain.Reissue = status
		c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog = 96, 96 // the drift is one increment
	}))
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 6, "")
	r.Produce(t, daemontest.Flipped(data, 96)...)
	trigger, _ := certify.ParseStatus(status)
	waitfor.Cond(t, 60*time.Second, "the drift applied and judged", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == 96 && r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 &&
			r.Metric(t, "cfguard_counterfactuals", "status", status) > 0
	})
	var invalidated []*ledger.CE // the CEs in the triggering status (or worse)
	for _, id := range ids {
		ce, err := r.D.Ledger().Get(id)
		if err != nil {
			t.Fatal(err)
		}
		if ce.Status == trigger || ce.Status == certify.Invalidated {
			invalidated = append(invalidated, ce)
		}
	}
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: r.D.BrokerAddrs(), Topic: r.Config.Kafka.EventsTopic, MaxWait: kafkatest.MaxWait})
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	outcome := map[string]daemon.Event{}
	for len(outcome) < len(invalidated) {
		m, err := rd.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("events: %d reissue events for %d invalidated CEs: %v", len(outcome), len(invalidated), err)
		}
		var e daemon.Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type != "counterfactual_reissued" && e.Type != "counterfactual_reissue_failed" {
			continue
		}
		if _, dup := outcome[e.ID]; dup {
			t.Fatalf("a second reissue event for %s: %s", e.ID, m.Value)
		}
		outcome[e.ID] = e
	}
	reissued := 0
	for _, old := range invalidated {
		e, ok := outcome[old.ID]
		if !ok {
			t.Fatalf("no reissue event for invalidated %s (events for %v)", old.ID, outcome)
		}
		if e.Type == "counterfactual_reissue_failed" {
			t.Logf("%s: %s", old.ID, e.Error)
			if e.Error == "" {
				t.Errorf("%s: a failure event without its error", old.ID)
			}
			if !wantSuccess && !strings.Contains(e.Error, failure) {
				t.Errorf("%s: failed with %q, want it to say %q", old.ID, e.Error, failure)
			}
			continue
		}
		reissued++
		if !wantSuccess {
			t.Errorf("%s reissued as %s; want every reissue to fail, saying %q", old.ID, e.NewID, failure)
		}
		ce, err := r.D.Ledger().Get(e.NewID)
		if err != nil {
			t.Fatalf("reissued %s as %s, which is not stored: %v", old.ID, e.NewID, err)
		}
		if !slices.Equal(ce.X, old.X) || ce.Target != old.Target || ce.AnchorVersion < *old.ConfirmedVersion || e.PosteriorVersion != ce.AnchorVersion {
			t.Errorf("%s reissued as %+v (event %+v)", old.ID, ce, e)
		}
		// The event says the move: the old CE's status and the new one's as stored, with its p1
		// (no record arrives after the drift, so neither status moves after the reissue).
		if e.From != old.Status.String() || e.To != ce.Status.String() || e.P2 == nil || *e.P2 != ce.P1 {
			t.Errorf("%s reissued as %s: event from %q to %q, p2 %v; the old CE is %v, the new %v with p1 %v",
				old.ID, e.NewID, e.From, e.To, e.P2, old.Status, ce.Status, ce.P1)
		}
		// The web UI links the two pages.
		link := func(id string) string { return `<a href="/ui/counterfactuals/` + id + `">` + id + `</a>` }
		if code, body := r.Get(t, "/ui/counterfactuals/"+old.ID); code != 200 || !strings.Contains(string(body), "Replaced by "+link(e.NewID)) {
			t.Errorf("the UI's page of %s does not link its replacement %s: %d", old.ID, e.NewID, code)
		}
		if code, body := r.Get(t, "/ui/counterfactuals/"+e.NewID); code != 200 || !strings.Contains(string(body), "This explanation replaces "+link(old.ID)) {
			t.Errorf("the UI's page of %s does not link the CE it replaces, %s: %d", e.NewID, old.ID, code)
		}
	}
	t.Logf("%d of %d CEs %s (or worse) after the drift: %d reissued, %d failures published", len(invalidated), len(ids), status, reissued, len(invalidated)-reissued)
	if wantSuccess && reissued == 0 {
		t.Fatal("no CE reissued after a mild drift")
	}
}
