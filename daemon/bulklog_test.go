package daemon

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestBulkLogCountsExistingCEs: the log line of a bulk registration counts the lines whose CE is
// stored already as existing, as the answer does, not as refused; a line whose id holds another
// CE is refused.
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
	if want := `msg="counterfactuals registered" stored=0 existing=3 refused=1`; !strings.Contains(logs.String(), want) {
		t.Errorf("the log does not say %q:\n%s", want, logs.String())
	}
	// A new id given twice in one write, with the same CE: the first line stores it and the
	// second finds it stored, by that write.
	twice, _ := json.Marshal(map[string]any{"id": "twice", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"})
	resp, body = r.RawDo(t, "POST", "/v1/counterfactuals:bulk", string(twice)+"\n"+string(twice)+"\n", nil)
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"stored":1,"accepted":0,"exists":1,"refused":0`) {
		t.Fatalf("one new CE on two lines: %d %s", resp.StatusCode, body)
	}
	if want := `msg="counterfactuals registered" stored=1 existing=1 refused=0`; !strings.Contains(logs.String(), want) {
		t.Errorf("the log does not say %q:\n%s", want, logs.String())
	}
}
