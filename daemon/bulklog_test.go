package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestBulkLogCountsExistingCEs: the log line of a bulk registration has the answer's counts: the
// lines whose CE is stored already as existing, not as refused; a line whose id holds another CE
// as refused.
func TestBulkLogCountsExistingCEs(t *testing.T) {
	logs := &tooltest.Output{}
	r := startDaemonWith(t, nil, func(o *Options) { o.Logger = slog.New(slog.NewTextHandler(logs, nil)) }, nil)
	waitfor.Cond(t, 20*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	var lines strings.Builder
	for k := range 3 {
		line, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("again-%d", k), "x": data.X[xs[k%len(xs)]], "x_cf": data.X[cfs[k%len(cfs)]], "target": "benign"})
		lines.Write(append(line, '\n'))
	}
	if resp, body := r.RawDo(t, "POST", "/v1/counterfactuals:bulk", lines.String(), nil); resp.StatusCode != 200 || !strings.Contains(string(body), `"stored":3`) {
		t.Fatalf("the first bulk: %d %s", resp.StatusCode, body)
	}
	other, _ := json.Marshal(map[string]any{"id": "again-0", "x": data.X[xs[1%len(xs)]], "x_cf": data.X[cfs[0]], "target": "benign"})
	resp, body := r.RawDo(t, "POST", "/v1/counterfactuals:bulk", lines.String()+string(other)+"\n", nil)
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"stored":0,"accepted":0,"exists":3,"refused":1`) {
		t.Fatalf("the same lines again, and another CE under a taken id: %d %s", resp.StatusCode, body)
	}
	if want := `msg="bulk registration answered" lines=4 stored=0 accepted=0 exists=3 refused=1`; !strings.Contains(logs.String(), want) {
		t.Errorf("the log does not say %q:\n%s", want, logs.String())
	}
	// A new id given twice in one write, with the same CE: the first line stores it and the
	// second finds it stored, by that write.
	twice, _ := json.Marshal(map[string]any{"id": "twice", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"})
	resp, body = r.RawDo(t, "POST", "/v1/counterfactuals:bulk", string(twice)+"\n"+string(twice)+"\n", nil)
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"stored":1,"accepted":0,"exists":1,"refused":0`) {
		t.Fatalf("one new CE on two lines: %d %s", resp.StatusCode, body)
	}
	if want := `msg="bulk registration answered" lines=2 stored=1 accepted=0 exists=1 refused=0`; !strings.Contains(logs.String(), want) {
		t.Errorf("the log does not say %q:\n%s", want, logs.String())
	}
}

// TestBulkLogOnAReplica: on a replica too the log line of a bulk registration has the answer's
// counts: a line refused as new (its x is classified as the target) whose CE is stored under its
// id is counted as existing, not refused.
func TestBulkLogOnAReplica(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	logs := &tooltest.Output{}
	r := startDaemonWith(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r1", key) },
		func(o *Options) { o.Logger = slog.New(slog.NewTextHandler(logs, nil)) }, nil)
	waitfor.Cond(t, 60*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	data := daemontest.Bundled(t)
	m := r.D.current()
	_, _, cfs := daemontest.CandidatePairs(t, m, data, 400, 1)
	// Stored at its owner (this replica owns every partition), as after a drift: its x is
	// classified as its target by the current posterior.
	ce := &ledger.CE{ID: "kept", X: data.X[cfs[0]], XCF: data.X[cfs[1]], Target: 1, AnchorVersion: m.Version, P1: 0.99, Var1: 0.001,
		Samples: 400, Delta: 0.05, Epsilon: 0.01}
	if err := r.D.ledger.Put(context.Background(), ce); err != nil {
		t.Fatal(err)
	}
	line, _ := json.Marshal(map[string]any{"id": "kept", "x": ce.X, "x_cf": ce.XCF, "target": "benign"})
	fresh, _ := json.Marshal(map[string]any{"id": "fresh", "x": ce.X, "x_cf": ce.XCF, "target": "benign"})
	resp, body := r.RawDo(t, "POST", "/v1/counterfactuals:bulk", string(line)+"\n"+string(fresh)+"\n", nil)
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"stored":0,"accepted":0,"exists":1,"refused":1`) {
		t.Fatalf("a stored CE sent again and the same CE under a free id: %d %s", resp.StatusCode, body)
	}
	if want := `msg="bulk registration answered" lines=2 stored=0 accepted=0 exists=1 refused=1`; !strings.Contains(logs.String(), want) {
		t.Errorf("the log does not say %q:\n%s", want, logs.String())
	}
}

// A registration stored in one batch with the lines of a bulk request (the registrar stores
// what is queued together) gets its own log line; the bulk's lines get none.
func TestRegistrationBesideABulkIsLogged(t *testing.T) {
	logs := &tooltest.Output{}
	r := startDaemonWith(t, nil, func(o *Options) { o.Logger = slog.New(slog.NewTextHandler(logs, nil)) }, nil)
	waitfor.Cond(t, 20*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	benign := target{set: true, name: "benign"}
	rs := []registration{
		{id: "alone", x: data.X[xs[0]], xcf: data.X[cfs[0]], target: benign},
		{id: "line", x: data.X[xs[1%len(xs)]], xcf: data.X[cfs[1%len(cfs)]], target: benign, inBulk: true},
	}
	for i, o := range r.D.storeRegistrations(context.Background(), rs, nil) {
		if o.err != nil {
			t.Fatalf("%s: %v", rs[i].id, o.err)
		}
	}
	if want := `msg="counterfactual registered" id=alone`; !strings.Contains(logs.String(), want) {
		t.Errorf("the log does not say %q:\n%s", want, logs.String())
	}
	if strings.Contains(logs.String(), "id=line") {
		t.Errorf("the bulk's line was logged alone:\n%s", logs.String())
	}
}

// TestBulkCutLogsWhatItStored: a bulk registration answered with an error after it stored lines
// logs what it stored, as an answered one does: its lines get no log line of their own. Here
// the key of an earlier one-line request is sent with a longer body: line 1 is the key reused
// (422), and line 2, stored in the same write, is in the log's counts.
func TestBulkCutLogsWhatItStored(t *testing.T) {
	logs := &tooltest.Output{}
	r := startDaemonWith(t, nil, func(o *Options) { o.Logger = slog.New(slog.NewTextHandler(logs, nil)) }, nil)
	waitfor.Cond(t, 20*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	var lines []string
	for k := range 2 {
		line, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("cut-%d", k), "x": data.X[xs[k%len(xs)]], "x_cf": data.X[cfs[k%len(cfs)]], "target": "benign"})
		lines = append(lines, string(line)+"\n")
	}
	key := map[string]string{"Idempotency-Key": "bulk-cut"}
	if resp, body := r.RawDo(t, "POST", "/v1/counterfactuals:bulk", lines[0], key); resp.StatusCode != 200 || !strings.Contains(string(body), `"stored":1`) {
		t.Fatalf("the first bulk: %d %s", resp.StatusCode, body)
	}
	resp, body := r.RawDo(t, "POST", "/v1/counterfactuals:bulk", lines[0]+lines[1], key)
	if resp.StatusCode != 422 {
		t.Fatalf("the key again with another body: %d %s; want 422", resp.StatusCode, body)
	}
	if code, body := r.Get(t, "/v1/counterfactuals/cut-1"); code != 200 {
		t.Fatalf("line 2 of the cut request is not stored (%d %s): the test needs it stored", code, body)
	}
	if want := `msg="bulk registration cut" lines=2 at_line=1 stored=1 accepted=0 exists=0 refused=1`; !strings.Contains(logs.String(), want) {
		t.Errorf("the log does not say %q:\n%s", want, logs.String())
	}
}
