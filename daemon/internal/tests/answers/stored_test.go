package answers

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"

	"github.com/cfguard/cfguard/ledger"
)

// TestStoredCESentAgainIsAnsweredAsStored: a CE stored under an earlier posterior that the
// current one no longer takes for a counterfactual (its x is classified as the target now, as
// after a drift) is answered as stored when sent again, by the single registration (409) and in
// a bulk (exists), so that an import runs again without refusals; the same CE under a free id is
// still refused (422).
func TestStoredCESentAgainIsAnsweredAsStored(t *testing.T) {
	r := launch.Daemon(t, nil)
	data := daemontest.Bundled(t)
	m := r.D.Posterior()
	_, _, cfs := daemontest.CandidatePairs(t, m, data, 400, 1)
	ce := &ledger.CE{ID: "kept", X: data.X[cfs[0]], XCF: data.X[cfs[1]], Target: 1, AnchorVersion: m.Version, P1: 0.99, Var1: 0.001,
		Samples: 400, Delta: 0.05, Epsilon: 0.01}
	if err := r.D.Ledger().Put(context.Background(), ce); err != nil {
		t.Fatal(err)
	}
	line := map[string]any{"id": "kept", "x": ce.X, "x_cf": ce.XCF, "target": "benign"}
	if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", line); code != http.StatusConflict {
		t.Errorf("POST of the stored CE again: %d %s; want 409, the id holds it", code, body)
	}
	if code, body := r.KeyedDo(t, "/v1/counterfactuals", "kept-key", line); code != http.StatusConflict {
		t.Errorf("POST of the stored CE again with a new Idempotency-Key: %d %s; want 409, the id holds it", code, body)
	}
	b, _ := json.Marshal(line)
	resp, body := r.RawDo(t, "POST", "/v1/counterfactuals:bulk", string(b)+"\n", nil)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"exists":1`) {
		t.Errorf("bulk of the stored CE again: %d %s; want 200 with exists 1", resp.StatusCode, body)
	}
	line["id"] = "new"
	if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", line); code != http.StatusUnprocessableEntity ||
		!strings.Contains(string(body), "already classified") {
		t.Errorf("POST of the same CE under a free id: %d %s; want 422, x is classified as the target", code, body)
	}
}
