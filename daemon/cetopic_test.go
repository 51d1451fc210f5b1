package daemon

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/ceshare"
)

// TestCETopicGoneAnswers503: when the CE topic cannot take a request (recreated with one
// partition, so the partitions of most CEs are gone), a registration and a deletion are
// answered 503 with Retry-After, naming the CE topic and that the request may or may not be
// applied, once sendTimeout has passed: not held open while the producer retries.
func TestCETopicGoneAnswers503(t *testing.T) {
	b := startCluster(t, 1)
	r := startReplica(t, b, "r1")
	data := bundled(t)
	ids := registerCEs(t, r, data, 3)
	parts := r.d.cfg.Replication.CEPartitions
	stored := ""
	for _, id := range ids {
		if ceshare.Partition(id, parts) != 0 {
			stored = id
		}
	}
	fresh := ""
	for k := 0; fresh == ""; k++ {
		if id := fmt.Sprintf("gone-%d", k); ceshare.Partition(id, parts) != 0 {
			fresh = id
		}
	}
	if stored == "" {
		t.Fatalf("the CEs %v all hash to partition 0 of %d", ids, parts)
	}
	_, xs, cfs := candidatePairs(t, r.d.current(), data, 400, 1)
	recreate(t, b.Addrs(), r.d.cfg.Replication.CETopic)

	// A request held open while the producer retries would hang here: go test's timeout then
	// names this call in its goroutine dump.
	call := func(method, path string, body any) (*http.Response, string) {
		t.Helper()
		raw := ""
		if body != nil {
			b, _ := json.Marshal(body)
			raw = string(b)
		}
		resp, b := r.rawDo(t, method, path, raw, map[string]string{"Content-Type": "application/json"})
		var e struct {
			Error string `json:"error"`
		}
		json.Unmarshal(b, &e)
		return resp, e.Error
	}
	for _, tc := range []struct {
		method, path string
		body         any
		what         string
	}{
		{"POST", "/v1/counterfactuals", map[string]any{"id": fresh, "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}, "registration"},
		{"DELETE", "/v1/counterfactuals/" + stored, nil, "deletion"},
	} {
		resp, msg := call(tc.method, tc.path, tc.body)
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
			!strings.Contains(msg, "could not be sent to the CE topic within") || !strings.Contains(msg, "may or may not be applied") {
			t.Errorf("%s while the CE topic lacks its partition: %d (Retry-After %q) %q; want 503 with Retry-After naming the CE topic",
				tc.what, resp.StatusCode, resp.Header.Get("Retry-After"), msg)
		}
	}
}
