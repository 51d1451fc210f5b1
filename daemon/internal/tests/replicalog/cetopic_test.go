package replicalog

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestCETopicGoneAnswers503: when the CE topic cannot take a request (recreated with one
// partition, so the partitions of most CEs are gone), a registration and a deletion are
// answered 503 with Retry-After, naming the CE topic and that the request may or may not be
// applied, once cluster.SendTimeout has passed: not held open while the producer retries.
func TestCETopicGoneAnswers503(t *testing.T) {
	t.Parallel() // mostly waits out two send deadlines of 10 s
	b := daemontest.StartCluster(t, 1)
	r := launch.Replica(t, b, "r1")
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 3, "")
	parts := r.Config.Replication.CEPartitions
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
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	kafkatest.RecreateTopic(t, b.Addrs(), r.Config.Replication.CETopic, 1)

	// A request held open while the producer retries would hang here: go test's timeout then
	// names this call in its goroutine dump.
	call := func(method, path string, body any) (*http.Response, string) {
		t.Helper()
		raw := ""
		if body != nil {
			b, _ := json.Marshal(body)
			raw = string(b)
		}
		resp, b := r.RawDo(t, method, path, raw, map[string]string{"Content-Type": "application/json"})
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

// TestCETopicRecreatedKeepsTheCEs deletes the CE topic under a replica that owns every CE
// partition and creates it again, empty, with the same partitions: the replica finds each
// partition ending before what it read, reads it again from 0 and sends its CEs again
// (cfguard_counterfactuals_repaired_total), keeps serving them, and takes new registrations
// and deletions. A second replica then joins and takes partitions: it stores their CEs from the
// new topic with the states r1 left, so every CE still stored reads the same from either replica
// (its creation time, certificate and status included), and the deleted one from neither.
func TestCETopicRecreatedKeepsTheCEs(t *testing.T) {
	t.Parallel() // replicas mostly wait for their group and for each other
	b := daemontest.StartCluster(t, 1)
	r1 := launch.Replica(t, b, "r1")
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r1, data, 6, "")
	topic := r1.Config.Replication.CETopic
	kafkatest.RecreateTopic(t, b.Addrs(), topic, r1.Config.Replication.CEPartitions)
	waitfor.Cond(t, 60*time.Second, "the replica sends its 6 CEs again", func() bool {
		return r1.Metric(t, "cfguard_counterfactuals_repaired_total") == 6
	})
	if !strings.Contains(r1.Logs.String(), "the topic was deleted and created again") {
		t.Errorf("no ERROR line names the reset:\n%s", r1.Logs.String())
	}
	more := daemontest.RegisterCEs(t, r1, data, 2, "after-")
	if code, body := r1.Do(t, "DELETE", "/v1/counterfactuals/"+ids[0], "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE %s after the reset: %d %s", ids[0], code, body)
	}
	type view struct {
		X             []float64 `json:"x"`
		Target        string    `json:"target"`
		CreatedAt     string    `json:"created_at"`
		AnchorVersion uint64    `json:"anchor_version"`
		P1            float64   `json:"p1"`
		Status        string    `json:"status"`
	}
	read := func(r *launch.Running, id string) (int, string) {
		code, body := r.Get(t, "/v1/counterfactuals/"+id)
		var ce view
		json.Unmarshal(body, &ce)
		return code, fmt.Sprint(ce.X, ce.Target, ce.CreatedAt, ce.AnchorVersion, ce.P1, ce.Status)
	}
	before := map[string]string{} // each CE as r1, owning every partition, reads it
	for _, id := range append(ids[1:], more...) {
		_, before[id] = read(r1, id)
	}
	r2 := launch.Replica(t, b, "r2")
	waitfor.Cond(t, 90*time.Second, "r2 owns CE partitions, every one ready", func() bool {
		return daemontest.ShareReady(r2) && len(r1.D.Share().Member().Owned())+len(r2.D.Share().Member().Owned()) == r1.Config.Replication.CEPartitions
	})
	for _, id := range append(ids, more...) {
		want := http.StatusOK
		if id == ids[0] {
			want = http.StatusNotFound
		}
		for _, r := range []*launch.Running{r1, r2} {
			code, got := read(r, id)
			if code != want {
				t.Errorf("GET %s at %s: %d; want %d", id, r.Config.Replication.ReplicaID, code, want)
			}
			if want == http.StatusOK && got != before[id] {
				t.Errorf("%s reads %s at %s, %s before r2 joined", id, got, r.Config.Replication.ReplicaID, before[id])
			}
		}
	}
	moved := 0
	for _, id := range ids[1:] {
		if slices.Contains(r2.D.Share().Member().Owned(), ceshare.Partition(id, r1.Config.Replication.CEPartitions)) {
			moved++
		}
	}
	if moved == 0 {
		t.Errorf("no CE registered before the reset moved to r2: the test does not show that a new owner stores them")
	}
	if n := r2.Metric(t, "cfguard_counterfactuals_states_total", "result", "not_used"); n != 0 {
		t.Errorf("r2 did not use %v states of the CEs that moved to it:\n%s", n, r2.Logs.String())
	}
}
