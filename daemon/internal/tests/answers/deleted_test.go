package answers

import (
	"bytes"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestRegistrationDeletedBeforeItsAnswerIs409: a DELETE handled after a registration stored its
// CE and before the registration read it back for its answer (the hook stands at that point)
// makes the registration answer 409, saying the CE was stored and is not now, never 500 nor the
// 201 of a CE that is not there: also when another CE was registered under the id meanwhile.
// The same registration sent again stores it.
func TestRegistrationDeletedBeforeItsAnswerIs409(t *testing.T) {
	var (
		base     atomic.Pointer[string]
		between  sync.Map     // id -> the requests to send between the store and the answer
		answered atomic.Int32 // the last of them's status code
	)
	send := func(method, url string, body []byte) int {
		req, _ := http.NewRequest(method, url, bytes.NewReader(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return -1
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	r := launch.With(t, nil, func(o *daemon.Options) {
		o.Hooks.Registered = func(id string) {
			other, ok := between.LoadAndDelete(id) // once per id: the requests below register again
			if b := base.Load(); ok && b != nil {
				code := send(http.MethodDelete, *b+"/v1/counterfactuals/"+id, nil)
				if other != nil && other.([]byte) != nil && code == http.StatusNoContent {
					code = send(http.MethodPost, *b+"/v1/counterfactuals", other.([]byte))
				}
				answered.Store(int32(code))
			}
		}
	}, nil)
	waitfor.Cond(t, 20*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	base.Store(&r.Base)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	for _, c := range []struct {
		id      string
		replace bool // another CE registered under the id after the DELETE
	}{{"raced", false}, {"replaced", true}} {
		ce := map[string]any{"id": c.id, "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
		other := map[string]any{"id": c.id, "x": data.X[xs[1]], "x_cf": data.X[cfs[1]], "target": "benign"}
		var then []byte
		if c.replace {
			then, _ = json.Marshal(other)
		}
		between.Store(c.id, then)
		code, body := r.Do(t, "POST", "/v1/counterfactuals", "", ce)
		want := http.StatusNoContent
		if c.replace {
			want = http.StatusCreated
		}
		if got := answered.Load(); got != int32(want) {
			t.Fatalf("%s: the last request between the store and the answer: %d, want %d", c.id, got, want)
		}
		if code != http.StatusConflict || !strings.Contains(string(body), "was stored by this request and is not stored now") {
			t.Errorf("%s: POST whose CE was deleted before its answer: %d %s; want 409 saying it was stored and is not now", c.id, code, body)
		}
		code, body = r.Get(t, "/v1/counterfactuals/"+c.id)
		var got ledger.CE
		switch {
		case !c.replace && code != http.StatusNotFound:
			t.Errorf("%s: GET after the DELETE: %d %s; want 404", c.id, code, body)
		case c.replace && (code != http.StatusOK || json.Unmarshal(body, &got) != nil || !slices.Equal(got.XCF, data.X[cfs[1]])):
			t.Errorf("%s: GET after another CE took the id: %d %s; want that CE", c.id, code, body)
		}
	}
	ce := map[string]any{"id": "raced", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
	if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", ce); code != http.StatusCreated {
		t.Errorf("the same registration sent again: %d %s; want 201", code, body)
	}
}
