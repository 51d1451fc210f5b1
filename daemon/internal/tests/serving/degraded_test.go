package serving

import (
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
)

// Answers of a daemon whose ledger cannot be written name its file by its name only, as every
// 5xx does: a bulk line refused with 503, and the last audit's error in GET /v1/audit (the log
// keeps the paths).
func TestAnswersOfAFailingLedgerNameNoPath(t *testing.T) {
	var failing atomic.Bool
	dir := t.TempDir()
	r := launch.With(t, func(c *config.Config) { c.StateDir = dir }, func(o *daemon.Options) {
		o.Hooks.LedgerAfterCommit = func() error {
			if failing.Load() {
				return errors.New("injected: fdatasync: input/output error")
			}
			return nil
		}
	}, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	daemontest.RegisterCEs(t, r, data, 2, "") // for the audit to write
	failing.Store(true)
	line, _ := json.Marshal(map[string]any{"id": "bulk-0", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"})
	resp, body := r.RawDo(t, "POST", "/v1/counterfactuals:bulk", string(line)+"\n", map[string]string{"Content-Type": "application/x-ndjson"})
	if code := resp.StatusCode; code < 500 && !strings.Contains(string(body), `"code":503`) {
		t.Fatalf("a bulk registration while the ledger fails: %d %s, want its line refused with 503", code, body)
	}
	if strings.Contains(string(body), dir) {
		t.Errorf("the bulk answer names the state directory %s: %s", dir, body)
	}
	if code, body := r.Do(t, "POST", "/v1/audit", "", nil); code < 500 {
		t.Fatalf("an audit while the ledger fails: %d %s, want a 5xx", code, body)
	}
	_, body = r.Get(t, "/v1/audit")
	var st struct {
		LastError string `json:"last_error"`
	}
	if err := json.Unmarshal(body, &st); err != nil || !strings.Contains(st.LastError, "cfguard.db") || strings.Contains(st.LastError, dir) {
		t.Errorf("GET /v1/audit's last_error %q (%v): want the ledger named cfguard.db, without %s", st.LastError, err, dir)
	}
}
