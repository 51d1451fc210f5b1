package endtoend

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/update"
)

func TestEndToEndCleanStream(t *testing.T) {
	r := launch.Daemon(t, nil)
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 4, "")
	if got := r.Metric(t, "cfguard_counterfactuals", "status", "certified"); got != 4 {
		t.Fatalf("certified = %v, want 4", got)
	}
	// 96 good records in the data's own labels, and bad ones of several kinds.
	var vals [][]byte
	for i := 0; i < 96; i++ {
		vals = append(vals, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	vals = append(vals, []byte("not json"), daemontest.Record("short", []float64{1, 2}, 0), daemontest.Record("alien", data.X[0], "alien"),
		[]byte(`{"id":"nan","features":[`+strings.Repeat("1,", 29)+`"NaN"],"label":0}`))
	version0 := r.D.Posterior().Version
	snapshot := r.D.Posterior().Clone()
	r.Produce(t, vals...)
	waitfor.Cond(t, 30*time.Second, "96 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 96 })
	waitfor.Cond(t, 10*time.Second, "4 dead letters", func() bool { return r.Metric(t, "cfguard_records_total", "result", "dead_lettered") == 4 })
	if v := r.D.Posterior().Version; v != version0+3 {
		t.Fatalf("posterior version %d, want %d (three increments of 32)", v, version0+3)
	}
	if kl := r.Metric(t, "cfguard_posterior_kl"); !(kl > 0 && kl < certify.KLBudget(r.Config.Certify.Delta)) {
		t.Fatalf("step KL %v, want in (0, budget) at the default settings", kl)
	}
	if r.Metric(t, "cfguard_kl_over_budget") != 0 || r.Metric(t, "cfguard_kl_breach_last_timestamp_seconds") != 0 {
		t.Fatal("KL over budget on a clean stream")
	}
	if a := r.Metric(t, "cfguard_posterior_kl_max_anchor"); !(a > r.Metric(t, "cfguard_posterior_kl")) {
		t.Fatalf("anchor KL %v should exceed the last step's", a)
	}
	// The body of the network never changes; only the last layer does.
	if !bnn.SameBody(snapshot, r.D.Posterior()) {
		t.Fatal("an update changed the body of the network")
	}
	code, body := r.Get(t, "/v1/counterfactuals/"+ids[0])
	var ce ledger.CE
	if code != 200 || json.Unmarshal(body, &ce) != nil || ce.Status.String() != "certified" || ce.KLFromAnchor <= 0 || ce.Bound >= ce.P1 {
		t.Fatalf("get %s: %d %s", ids[0], code, body)
	}
	code, body = r.Get(t, "/v1/model")
	if code != 200 || !bytes.Contains(body, []byte(`"kl_history"`)) || !bytes.Contains(body, []byte(`"applied":96`)) {
		t.Fatalf("model: %d %s", code, body)
	}
	// Test, then train: each of the 96 good records was scored once, under the posterior before it.
	var model struct {
		Prequential struct {
			Records  int64   `json:"records"`
			Window   int     `json:"window_records"`
			LogLoss  float64 `json:"log_loss"`
			Accuracy float64 `json:"accuracy"`
		} `json:"prequential"`
		Records float64 `json:"records_represented"`
	}
	if err := json.Unmarshal(body, &model); err != nil {
		t.Fatal(err)
	}
	if p := model.Prequential; p.Records != 96 || p.Window != 96 || !(p.LogLoss > 0 && p.LogLoss < 0.5) || !(p.Accuracy > 0.8) {
		t.Fatalf("prequential %+v, want 96 records scored with a log loss in (0, 0.5) and accuracy > 0.8 (correct labels)", p)
	}
	if got := r.Metric(t, "cfguard_prequential_records_total"); got != 96 {
		t.Fatalf("cfguard_prequential_records_total %v, want 96", got)
	}
	if want := update.Represented(update.Represented(update.Represented(snapshot.Records, 32, r.Config.Update.MemoryRecords), 32,
		r.Config.Update.MemoryRecords), 32, r.Config.Update.MemoryRecords); model.Records != want || snapshot.Records != 569 {
		t.Fatalf("records represented %v, want %v (569 training rows, then three increments of 32)", model.Records, want)
	}
	// The metrics endpoint serves the same registry.
	code, body = r.Get(t, "/metrics")
	if code != 200 || !bytes.Contains(body, []byte("cfguard_kl_budget 0.10125")) {
		t.Fatalf("/metrics: %d", code)
	}
	if err := testutil.GatherAndCompare(r.Reg, strings.NewReader("# HELP cfguard_kl_budget KL budget (0.5 - delta)^2 / 2 of one update, under which Theorem 1 keeps a delta-safe counterfactual valid.\n# TYPE cfguard_kl_budget gauge\ncfguard_kl_budget 0.10125\n"), "cfguard_kl_budget"); err != nil {
		t.Fatal(err)
	}
}

func TestDriftFlagsCounterfactualsAndPublishesEvents(t *testing.T) {
	r := launch.Daemon(t, func(c *config.Config) { daemontest.PaperLearner(c, 1e-3) })
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 6, "")
	r.Produce(t, daemontest.Flipped(data, 96)...)
	waitfor.Cond(t, 30*time.Second, "96 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 96 })
	hist, err := r.D.Ledger().KLHistory(100)
	if err != nil {
		t.Fatal(err)
	}
	over := false
	for _, h := range hist {
		over = over || h.KL > certify.KLBudget(r.Config.Certify.Delta)
	}
	if !over {
		t.Fatalf("drift at lr 1e-3 should put an update's KL over budget: history %+v", hist)
	}
	// The certificates lapse at the commits; the confirmer judges them (none can be renewed
	// under this drift).
	var flagged float64
	waitfor.Cond(t, 60*time.Second, "every lapsed certificate judged", func() bool {
		flagged = r.Metric(t, "cfguard_counterfactuals", "status", "at_risk") + r.Metric(t, "cfguard_counterfactuals", "status", "invalidated")
		return r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 && flagged > 0
	})
	// Status changes went to the events topic.
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: r.D.BrokerAddrs(), Topic: r.Config.Kafka.EventsTopic, MaxWait: kafkatest.MaxWait})
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	changed, overBudget := map[string]bool{}, false
	var lastSeq, firstOver, firstChange uint64
	for len(changed) < int(flagged) || !overBudget {
		m, err := rd.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("events: saw %d status changes (want %v) and over-budget %v: %v", len(changed), flagged, overBudget, err)
		}
		var e daemon.Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		seq, err := strconv.ParseUint(kafkatest.Header(m, daemon.OutboxSeqHeader), 10, 64)
		if err != nil || seq <= lastSeq {
			t.Fatalf("event %s: %s header %q after %d: want increasing sequence numbers", m.Value, daemon.OutboxSeqHeader, kafkatest.Header(m, daemon.OutboxSeqHeader), lastSeq)
		}
		lastSeq = seq
		switch e.Type {
		case "status_changed":
			// certified -> at_risk or invalidated by the confirmer's verdict once the certificate
			// lapsed; a later verdict may follow (at_risk -> invalidated), never before.
			if string(m.Key) != e.ID || !(e.From == "certified" || e.From == "at_risk" && changed[e.ID]) {
				t.Fatalf("event %s", m.Value)
			}
			changed[e.ID] = true
			firstChange = cmp.Or(firstChange, seq)
		case "kl_over_budget":
			overBudget = e.KL != nil && *e.KL > e.Budget
			firstOver = cmp.Or(firstOver, seq)
			if e.ParentVersion == nil || *e.ParentVersion+1 != e.PosteriorVersion {
				t.Fatalf("kl_over_budget event %s: want the version it describes and its parent", m.Value)
			}
		}
	}
	if firstOver > firstChange {
		t.Fatalf("the first kl_over_budget event (seq %d) comes after the status changes it caused (first at seq %d)", firstOver, firstChange)
	}
	for id := range changed {
		code, body := r.Get(t, "/v1/counterfactuals/"+id)
		var ce ledger.CE
		json.Unmarshal(body, &ce)
		if code != 200 || ce.Status.String() == "certified" || len(ce.History) == 0 {
			t.Fatalf("%s after drift: %s", id, body)
		}
	}
	// Every status change a CE's history records is on the events topic (at least once),
	// intermediate ones included; renewals (certified to certified) publish none.
	waitfor.Cond(t, 30*time.Second, "the outbox drained", func() bool { return r.Metric(t, "cfguard_events_pending") == 0 })
	published := map[string]bool{}
	for _, m := range kafkatest.ReadPartition(t, r.D.BrokerAddrs(), r.Config.Kafka.EventsTopic, 0) {
		var e daemon.Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type == "status_changed" {
			published[fmt.Sprintf("%s %s->%s at %d", e.ID, e.From, e.To, e.PosteriorVersion)] = true
		}
	}
	recorded := 0
	for _, id := range ids {
		ce, err := r.D.Ledger().Get(id)
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range ce.History {
			if h.Renewal {
				continue
			}
			recorded++
			if change := fmt.Sprintf("%s %s->%s at %d", id, h.From, h.To, h.PosteriorVersion); !published[change] {
				t.Errorf("%s is in the CE's history and not on the events topic (%d status changes published)", change, len(published))
			}
		}
	}
	if recorded == 0 {
		t.Error("no status change recorded in the CEs' histories: the check shows nothing")
	}
}

func TestCumulativeDriftCaughtThroughAnchorKL(t *testing.T) {
	// Every step stays under the budget, but the anchor KL does not: many small steps.
	r := launch.Daemon(t, func(c *config.Config) {
		daemontest.PaperLearner(c, 1e-4)
		c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog = 16, 16
	})
	data := daemontest.Bundled(t)
	daemontest.RegisterCEs(t, r, data, 4, "")
	r.Produce(t, daemontest.Flipped(data, 320)...)
	waitfor.Cond(t, 60*time.Second, "320 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 320 })
	hist, err := r.D.Ledger().KLHistory(100)
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, s := range hist {
		if s.KL > certify.KLBudget(r.Config.Certify.Delta) {
			t.Fatalf("step %d KL %v over budget: the scenario needs small steps", s.PosteriorVersion, s.KL)
		}
		sum += s.KL
	}
	anchor := 0.0
	for _, s := range hist {
		anchor = max(anchor, s.MaxAnchorKL)
	}
	if anchor <= certify.KLBudget(r.Config.Certify.Delta) {
		t.Fatalf("anchor KL %v not over budget %v after %d steps", anchor, certify.KLBudget(r.Config.Certify.Delta), len(hist))
	}
	// Every certificate lapsed through its anchor's KL, though no step was over budget: each CE
	// was renewed (re-anchored) or judged.
	waitfor.Cond(t, 60*time.Second, "lapsed certificates measured", func() bool { return r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 })
	renewed := r.Metric(t, "cfguard_counterfactuals_renewed_total")
	flagged := r.Metric(t, "cfguard_counterfactuals", "status", "at_risk") + r.Metric(t, "cfguard_counterfactuals", "status", "invalidated")
	if renewed+flagged < 4 {
		t.Fatalf("%v renewals and %v flagged CEs: the cumulative drift went unnoticed", renewed, flagged)
	}
	t.Logf("%d steps, max step KL under %.4f, sum of step KLs %.4f, KL from anchor %.4f", len(hist), certify.KLBudget(r.Config.Certify.Delta), sum, anchor)
}

func TestAPIRejectsBadRequests(t *testing.T) {
	r := launch.Daemon(t, func(c *config.Config) { c.HTTP.Token = "t0ken" })
	data := daemontest.Bundled(t)
	x := data.X[0]
	cases := []struct {
		name, method, path, token string
		body                      any
		want                      int
	}{
		{"no token", "POST", "/v1/counterfactuals", "", map[string]any{"x": x, "x_cf": x, "target": 1}, 401},
		{"wrong token", "POST", "/v1/audit", "nope", nil, 401},
		{"bad json", "POST", "/v1/counterfactuals", "t0ken", "{", 400},
		{"unknown field", "POST", "/v1/counterfactuals", "t0ken", map[string]any{"x": x, "x_cf": x, "target": 1, "extra": 1}, 400},
		{"wrong dimension", "POST", "/v1/counterfactuals", "t0ken", map[string]any{"x": x[:5], "x_cf": x, "target": 1}, 400},
		{"unknown target", "POST", "/v1/counterfactuals", "t0ken", map[string]any{"x": x, "x_cf": x, "target": "alien"}, 400},
		{"target out of range", "POST", "/v1/counterfactuals", "t0ken", map[string]any{"x": x, "x_cf": x, "target": 7}, 400},
		{"no target", "POST", "/v1/counterfactuals", "t0ken", map[string]any{"x": x, "x_cf": x}, 400},
		{"not a counterfactual", "POST", "/v1/counterfactuals", "t0ken", map[string]any{"x": x, "x_cf": x, "target": data.Y[0]}, 422},
		{"explain wrong dimension", "POST", "/v1/explain", "t0ken", map[string]any{"x": x[:3]}, 400},
		{"explain unknown target", "POST", "/v1/explain", "t0ken", map[string]any{"x": x, "target": "alien"}, 400},
		{"list bad status", "GET", "/v1/counterfactuals?status=nope", "t0ken", nil, 400},
		{"missing", "GET", "/v1/counterfactuals/none", "t0ken", nil, 404},
		// Ids follow one rule (ident.Check), checked before anything is measured; record ids
		// from Kafka follow it too (stream's bad_id).
		{"path id", "POST", "/v1/counterfactuals", "t0ken", map[string]any{"id": "../etc", "x": x, "x_cf": x, "target": 1}, 400},
		{"dot-dot id", "POST", "/v1/counterfactuals", "t0ken", map[string]any{"id": "..", "x": x, "x_cf": x, "target": 1}, 400},
		{"NUL in id", "POST", "/v1/counterfactuals", "t0ken", map[string]any{"id": "a\x00b", "x": x, "x_cf": x, "target": 1}, 400},
		{"explain path id", "POST", "/v1/explain", "t0ken", map[string]any{"id": "a/b", "x": x}, 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var code int
			var body []byte
			if s, ok := tc.body.(string); ok {
				req, _ := http.NewRequest(tc.method, r.Base+tc.path, strings.NewReader(s))
				req.Header.Set("Authorization", "Bearer "+tc.token)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				code = resp.StatusCode
				body, _ = io.ReadAll(resp.Body)
				resp.Body.Close()
			} else {
				code, body = r.Do(t, tc.method, tc.path, tc.token, tc.body)
			}
			if code != tc.want || !bytes.Contains(body, []byte(`"error"`)) {
				t.Fatalf("%s %s: %d %s, want %d with an error", tc.method, tc.path, code, body, tc.want)
			}
		})
	}
	// NaN cannot be written in JSON; a string in its place is a bad request, not a crash.
	code, _ := r.Do(t, "POST", "/v1/counterfactuals", "t0ken", map[string]any{"x": append([]any{"NaN"}, daemontest.AnySlice(x[1:])...), "x_cf": x, "target": 1})
	if code != 400 {
		t.Fatalf("NaN feature: %d", code)
	}
	if code, _ := r.Do(t, "POST", "/v1/audit", "t0ken", nil); code != 200 {
		t.Fatalf("audit with token: %d", code)
	}
}
