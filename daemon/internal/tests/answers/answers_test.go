package answers

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/stream"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/ledger"
)

// TestRegistrationAfterDeletionAnswersWhatIsStored registers A at one replica, deletes it at
// another and registers B under the same id at a third, many times (every fifth time without the
// deletion): each answer to B must say what the owner stores once every request of the
// partition is applied: 201 when it stores B, 409 only when it stores another CE under the id. The deletion's answer comes before its owner
// applies it, so the third replica's answer must come from the partition's order, not from
// what the owner happened to hold when it was asked.
func TestRegistrationAfterDeletionAnswersWhatIsStored(t *testing.T) {
	if testing.Short() {
		t.Skip("three replicas: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b, reps := daemontest.StartThreeReplicas(t, launch.NoWait)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, reps[0].D.Posterior(), data, 400, 1)
	if len(xs) < 2 || len(cfs) < 2 {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	ceA := map[string]any{"x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
	ceB := map[string]any{"x": data.X[xs[1]], "x_cf": data.X[cfs[1]], "target": "benign"}
	with := func(ce map[string]any, id string) map[string]any {
		out := map[string]any{"id": id}
		for k, v := range ce {
			out[k] = v
		}
		return out
	}
	const trials = 50
	answers := map[int]int{}
	for i := range trials {
		id := fmt.Sprintf("attack-%d", i)
		if code, body := reps[0].Do(t, "POST", "/v1/counterfactuals", "", with(ceA, id)); code != http.StatusCreated {
			t.Fatalf("trial %d: POST A at r1: %d %s", i, code, body)
		}
		deleted := i%5 != 4 // every fifth trial keeps A: B's answer must then be 409
		if deleted {
			if code, body := reps[1].Do(t, "DELETE", "/v1/counterfactuals/"+id, "", nil); code != http.StatusNoContent {
				t.Fatalf("trial %d: DELETE at r2: %d %s", i, code, body)
			}
		}
		code, body := reps[2].Do(t, "POST", "/v1/counterfactuals", "", with(ceB, id))
		answers[code]++
		stored := daemontest.Settled(t, b, reps, id)
		isB := stored != nil && slices.Equal(stored.X, data.X[xs[1]]) && slices.Equal(stored.XCF, data.X[cfs[1]])
		switch code {
		case http.StatusCreated:
			if !isB {
				t.Errorf("trial %d: POST B answered 201, and the owner stores %v", i, describe(stored))
			}
			var got ledger.CE
			if err := json.Unmarshal(body, &got); err != nil || got.ID != id || !slices.Equal(got.XCF, data.X[cfs[1]]) {
				t.Errorf("trial %d: POST B answered 201 with %s", i, body)
			}
		case http.StatusConflict:
			if isB || stored == nil {
				t.Errorf("trial %d: POST B answered 409 %s, and the owner stores %v", i, body, describe(stored))
			}
			if deleted {
				t.Errorf("trial %d: POST B after A's deletion answered 409 %s", i, body)
			}
		default:
			t.Errorf("trial %d: POST B answered %d %s", i, code, body)
		}
		// Every replica serves what the owner stores.
		for _, r := range reps {
			code, got := r.Get(t, "/v1/counterfactuals/"+id)
			if (code == http.StatusOK) != (stored != nil) {
				t.Errorf("trial %d: GET at %s: %d %s; the owner stores %v", i, r.D.Share().ID(), code, got, describe(stored))
			}
		}
	}
	t.Logf("answers to POST B over %d trials: %v", trials, answers)
}

// describe names a stored CE in a test message.
func describe(ce *ledger.CE) string {
	if ce == nil {
		return "nothing"
	}
	return fmt.Sprintf("%s (x_cf[0] = %v, %v)", ce.ID, ce.XCF[0], ce.Status)
}

// A registration sent with an Idempotency-Key is one request however often it is sent: a retry
// answers the same CE and stores nothing twice; the key with another body is refused 422; a
// retry after the CE's deletion registers nothing and answers 409, also after a restart (the
// outcome is in the ledger). A bulk import's lines are keyed likewise.
func TestIdempotencyKeySingleDaemon(t *testing.T) {
	dir := t.TempDir()
	state := func(c *config.Config) { c.StateDir = dir }
	r := launch.TLS(t, state, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	ceA := map[string]any{"x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
	ceB := map[string]any{"x": data.X[xs[1]], "x_cf": data.X[cfs[1]], "target": "benign"}
	code, body := r.KeyedDo(t, "/v1/counterfactuals", "key-1", ceA)
	if code != http.StatusCreated {
		t.Fatalf("POST with a key: %d %s", code, body)
	}
	var first ledger.CE
	if err := json.Unmarshal(body, &first); err != nil || first.ID == "" {
		t.Fatalf("POST with a key answered %s", body)
	}
	code, body = r.KeyedDo(t, "/v1/counterfactuals", "key-1", ceA)
	var again ledger.CE
	if code != http.StatusCreated || json.Unmarshal(body, &again) != nil || again.ID != first.ID {
		t.Errorf("the same request again: %d %s; want 201 with %s", code, body, first.ID)
	}
	if n := countStored(t, r); n != 1 {
		t.Errorf("%d CEs stored after a request sent twice, want 1", n)
	}
	if code, body = r.KeyedDo(t, "/v1/counterfactuals", "key-1", ceB); code != http.StatusUnprocessableEntity ||
		!strings.Contains(string(body), "Idempotency-Key") {
		t.Errorf("the key with another body: %d %s; want 422 naming the key", code, body)
	}
	// The retry's answer came from the first attempt's outcome; the key reused for another
	// request's did not.
	if got := r.Metric(t, "cfguard_requests_replayed_total", "result", "stored"); got != 1 {
		t.Errorf("replayed registrations after a retry and a key reused: %v, want 1", got)
	}
	if code, body := r.Do(t, "DELETE", "/v1/counterfactuals/"+first.ID, "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE: %d %s", code, body)
	}
	retryAfterDelete := func(r *launch.Running, when string) {
		t.Helper()
		code, body := r.KeyedDo(t, "/v1/counterfactuals", "key-1", ceA)
		if code != http.StatusConflict || !strings.Contains(string(body), "deleted since") {
			t.Errorf("%s: the request again after its CE's deletion: %d %s; want 409 deleted since", when, code, body)
		}
		if code, body := r.Get(t, "/v1/counterfactuals/"+first.ID); code != http.StatusNotFound {
			t.Errorf("%s: the retry registered %s again: %d %s", when, first.ID, code, body)
		}
	}
	retryAfterDelete(r, "running")
	// Without a key, the same body registers a new CE.
	if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", ceA); code != http.StatusCreated {
		t.Errorf("the same body without a key: %d %s", code, body)
	}
	// Bulk: two lines; the first deleted; the same body again.
	lines := func(ces ...map[string]any) string {
		var sb strings.Builder
		for _, ce := range ces {
			b, _ := json.Marshal(ce)
			sb.Write(b)
			sb.WriteByte('\n')
		}
		return sb.String()
	}
	bulk := lines(ceA, ceB)
	var res bulkAnswer
	code, body = r.KeyedDo(t, "/v1/counterfactuals:bulk", "bulk-1", bulk)
	if code != http.StatusOK || json.Unmarshal(body, &res) != nil || res.Stored != 2 {
		t.Fatalf("bulk with a key: %d %s", code, body)
	}
	if code, body := r.Do(t, "DELETE", "/v1/counterfactuals/"+res.Results[0].ID, "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE: %d %s", code, body)
	}
	code, body = r.KeyedDo(t, "/v1/counterfactuals:bulk", "bulk-1", bulk)
	var res2 bulkAnswer
	if code != http.StatusOK || json.Unmarshal(body, &res2) != nil || res2.Results[0].Code != http.StatusConflict ||
		res2.Results[1].ID != res.Results[1].ID || res2.Results[1].Code != 0 {
		t.Errorf("bulk again after a line's deletion: %d %s; want line 1 409, line 2 as before", code, body)
	}
	if code, _ := r.Get(t, "/v1/counterfactuals/"+res.Results[0].ID); code != http.StatusNotFound {
		t.Errorf("the bulk retry registered %s again", res.Results[0].ID)
	}
	if code, body := r.KeyedDo(t, "/v1/counterfactuals:bulk", "bulk-1", lines(ceB, ceA)); code != http.StatusUnprocessableEntity {
		t.Errorf("bulk key with another body: %d %s; want 422", code, body)
	}
	// The outcomes are the ledger's: a restart keeps them.
	r.Stop(t)
	r = launch.TLS(t, state, nil)
	retryAfterDelete(r, "after a restart")
}

// countStored is how many CEs r lists.
func countStored(t *testing.T, r *launch.Running) int {
	t.Helper()
	code, body := r.Get(t, "/v1/counterfactuals?limit=1000")
	if code != http.StatusOK {
		t.Fatalf("GET /v1/counterfactuals: %d %s", code, body)
	}
	var page struct {
		Items []json.RawMessage `json:"counterfactuals"`
	}
	if err := json.Unmarshal(body, &page); err != nil {
		t.Fatal(err)
	}
	return len(page.Items)
}

// On replicas, a client's retry with its Idempotency-Key at another replica answers the same CE,
// the key with another body 422, and a retry after the CE's deletion registers nothing and
// answers 409; a registration request the CE topic holds twice
// (a producer's retry) registers nothing when its second copy comes after the deletion, while a
// request with another request id does.
func TestRetriesAfterDeletionAcrossReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("three replicas: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b, reps := daemontest.StartThreeReplicas(t, launch.NoWait)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, reps[0].D.Posterior(), data, 400, 1)
	ceA := map[string]any{"x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
	code, body := reps[0].KeyedDo(t, "/v1/counterfactuals", "retry-1", ceA)
	var first ledger.CE
	if code != http.StatusCreated || json.Unmarshal(body, &first) != nil {
		t.Fatalf("POST with a key at r1: %d %s", code, body)
	}
	if code, body := reps[1].KeyedDo(t, "/v1/counterfactuals", "retry-1", ceA); code != http.StatusCreated {
		t.Errorf("the same request at r2: %d %s; want 201", code, body)
	}
	ceB := map[string]any{"x": data.X[xs[1]], "x_cf": data.X[cfs[1]], "target": "benign"}
	if code, body := reps[2].KeyedDo(t, "/v1/counterfactuals", "retry-1", ceB); code != http.StatusUnprocessableEntity {
		t.Errorf("the key with another body at r3: %d %s; want 422", code, body)
	}
	// r2's answer came from the first attempt's outcome; r3's, a key reused for another request, did not.
	for i, want := range []float64{0, 1, 0} {
		if got := reps[i].Metric(t, "cfguard_requests_replayed_total", "result", "stored"); got != want {
			t.Errorf("r%d: replayed registrations %v, want %v", i+1, got, want)
		}
	}
	if code, body := reps[1].Do(t, "DELETE", "/v1/counterfactuals/"+first.ID, "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE at r2: %d %s", code, body)
	}
	code, body = reps[2].KeyedDo(t, "/v1/counterfactuals", "retry-1", ceA)
	if code != http.StatusConflict || !strings.Contains(string(body), "deleted since") {
		t.Errorf("the request again at r3 after the deletion: %d %s; want 409 deleted since", code, body)
	}
	if ce := daemontest.Settled(t, b, reps, first.ID); ce != nil {
		t.Errorf("the keyed retry registered %s again", first.ID)
	}
	// A request on the CE topic twice, the deletion between: the second copy changes nothing.
	d0 := reps[0].D
	prod, err := ceshare.NewProducer(context.Background(), stream.ConnConfig{Brokers: d0.BrokerAddrs()}, reps[0].Config.Replication.CETopic, d0.Replica().Keys(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close()
	raw, err := json.Marshal(cluster.Measured{X: first.X, XCF: first.XCF, Target: first.Target, AnchorVersion: first.AnchorVersion,
		P1: first.P1, Var1: first.Var1, Samples: first.Samples, Delta: first.Delta, Epsilon: first.Epsilon})
	if err != nil {
		t.Fatal(err)
	}
	id := "twice"
	req := ceshare.Request{Kind: ceshare.KindRegister, ID: id, CE: raw, Replica: "r1", At: time.Now().UTC(), RID: "rid-twice"}
	ctx := context.Background()
	if _, _, err := prod.Send(ctx, req); err != nil {
		t.Fatal(err)
	}
	if ce := daemontest.Settled(t, b, reps, id); ce == nil {
		t.Fatal("the registration request was not applied")
	}
	if _, _, err := prod.Send(ctx, ceshare.Request{Kind: ceshare.KindDelete, ID: id, Replica: "r1", At: time.Now().UTC(), RID: "rid-delete"}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := prod.Send(ctx, req); err != nil { // the producer's retry, landing after the deletion
		t.Fatal(err)
	}
	if ce := daemontest.Settled(t, b, reps, id); ce != nil {
		t.Errorf("a registration request delivered again after the deletion registered %s again", id)
	}
	req.RID = "rid-new"
	if _, _, err := prod.Send(ctx, req); err != nil {
		t.Fatal(err)
	}
	if ce := daemontest.Settled(t, b, reps, id); ce == nil {
		t.Errorf("a registration with a new request id after the deletion was not applied")
	}
}

// keyedDelete sends DELETE /v1/counterfactuals/{id}, with the Idempotency-Key key when it is
// not empty.
func keyedDelete(t *testing.T, r *launch.Running, id, key string) (int, []byte) {
	t.Helper()
	h := map[string]string{}
	if key != "" {
		h["Idempotency-Key"] = key
	}
	resp, body := r.RawDo(t, "DELETE", "/v1/counterfactuals/"+id, "", h)
	return resp.StatusCode, body
}

// A single daemon's DELETE answers 204 when it deleted a CE and 404 when none was stored; with
// an Idempotency-Key it is one request: a retry after the id was registered anew answers 204
// again (what the first attempt decided) and leaves the new CE, also after a restart; the key
// of another request is 422. The retries are counted as skipped and replayed.
func TestKeyedDeletionSingleDaemon(t *testing.T) {
	dir := t.TempDir()
	state := func(c *config.Config) { c.StateDir = dir }
	r := launch.TLS(t, state, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	ceA := map[string]any{"id": "del-a", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
	ceB := map[string]any{"id": "del-a", "x": data.X[xs[1]], "x_cf": data.X[cfs[1]], "target": "benign"}
	if code, body := keyedDelete(t, r, "del-a", ""); code != http.StatusNotFound {
		t.Errorf("DELETE of an id never stored: %d %s; want 404", code, body)
	}
	if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", ceA); code != http.StatusCreated {
		t.Fatalf("POST A: %d %s", code, body)
	}
	if code, body := keyedDelete(t, r, "del-a", "del-key-1"); code != http.StatusNoContent {
		t.Fatalf("keyed DELETE: %d %s; want 204", code, body)
	}
	if code, body := r.Get(t, "/v1/counterfactuals/del-a"); code != http.StatusNotFound {
		t.Errorf("GET after the DELETE's 204: %d %s", code, body)
	}
	if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", ceB); code != http.StatusCreated {
		t.Fatalf("POST B under the deleted id: %d %s", code, body)
	}
	retry := func(when string) {
		t.Helper()
		if code, body := keyedDelete(t, r, "del-a", "del-key-1"); code != http.StatusNoContent {
			t.Errorf("%s: the keyed DELETE again: %d %s; want 204, its first answer", when, code, body)
		}
		code, body := r.Get(t, "/v1/counterfactuals/del-a")
		var got ledger.CE
		if code != http.StatusOK || json.Unmarshal(body, &got) != nil || !slices.Equal(got.XCF, data.X[cfs[1]]) {
			t.Errorf("%s: after the keyed DELETE's retry, GET answers %d %s; want B, registered after the first attempt", when, code, body)
		}
	}
	retry("running")
	if got := r.Metric(t, "cfguard_requests_skipped_total", "kind", "delete"); got != 1 {
		t.Errorf("skipped deletions: %v, want 1", got)
	}
	if got := r.Metric(t, "cfguard_requests_replayed_total", "result", "deleted"); got != 1 {
		t.Errorf("replayed deletions: %v, want 1", got)
	}
	if code, body := keyedDelete(t, r, "del-other", "del-key-1"); code != http.StatusUnprocessableEntity {
		t.Errorf("the deletion's key for another id: %d %s; want 422", code, body)
	}
	if got := r.Metric(t, "cfguard_requests_replayed_total", "result", "deleted"); got != 1 {
		t.Errorf("replayed deletions after a key reused for another id: %v, want 1 (a 422 replays nothing)", got)
	}
	// A keyed DELETE of an id holding nothing is 404, and stays 404 when retried after a registration.
	if code, body := keyedDelete(t, r, "del-b", "del-key-2"); code != http.StatusNotFound {
		t.Errorf("keyed DELETE of an id never stored: %d %s; want 404", code, body)
	}
	ceB["id"] = "del-b"
	if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", ceB); code != http.StatusCreated {
		t.Fatalf("POST del-b: %d %s", code, body)
	}
	if code, body := keyedDelete(t, r, "del-b", "del-key-2"); code != http.StatusNotFound {
		t.Errorf("the keyed DELETE of nothing, again after a registration: %d %s; want 404, its first answer", code, body)
	}
	if code, body := r.Get(t, "/v1/counterfactuals/del-b"); code != http.StatusOK {
		t.Errorf("the retry of a DELETE that found nothing deleted the CE registered since: %d %s", code, body)
	}
	// One key, one request: on another id, or first used by a registration, it is 422.
	if code, body := keyedDelete(t, r, "del-b", "del-key-1"); code != http.StatusUnprocessableEntity {
		t.Errorf("a DELETE's key on another id: %d %s; want 422", code, body)
	}
	if code, body := r.KeyedDo(t, "/v1/counterfactuals", "del-key-1", ceA); code != http.StatusUnprocessableEntity {
		t.Errorf("a DELETE's key on a POST: %d %s; want 422", code, body)
	}
	if code, body := r.Get(t, "/v1/counterfactuals/del-b"); code != http.StatusOK {
		t.Errorf("a DELETE with a reused key deleted del-b: %d %s", code, body)
	}
	r.Stop(t)
	r = launch.TLS(t, state, nil)
	retry("after a restart")
}

// On replicas a DELETE answers what its owner decided in partition order: with a registration
// and a deletion of a fresh id sent at once to two replicas, the DELETE's 204 means the owner
// deleted the CE (nothing is stored after), its 404 that the registration came after it (the CE
// is stored after). A keyed DELETE retried after the id was registered anew answers 204 again
// and leaves the new CE; the owner counts the retry as skipped, the replica that answered it as
// replayed.
func TestDeletionAnswersAcrossReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("three replicas: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b, reps := daemontest.StartThreeReplicas(t, launch.NoWait)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, reps[0].D.Posterior(), data, 400, 1)
	ceFor := func(id string, k int) map[string]any {
		return map[string]any{"id": id, "x": data.X[xs[k]], "x_cf": data.X[cfs[k]], "target": "benign"}
	}
	if code, body := keyedDelete(t, reps[0], "never", ""); code != http.StatusNotFound {
		t.Errorf("DELETE of an id never stored: %d %s; want 404", code, body)
	}
	// send is a request from a goroutine of its own: its status and body, or -1 when it was not
	// answered.
	type answer struct {
		code int
		body string
	}
	send := func(r *launch.Running, method, path string, v any) answer {
		var body io.Reader
		if v != nil {
			b, err := json.Marshal(v)
			if err != nil {
				t.Error(err)
				return answer{code: -1}
			}
			body = bytes.NewReader(b)
		}
		req, err := http.NewRequest(method, r.Base+path, body)
		if err != nil {
			t.Error(err)
			return answer{code: -1}
		}
		resp, err := r.Client.Do(req)
		if err != nil {
			t.Errorf("%s %s: %v", method, path, err)
			return answer{code: -1}
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Errorf("%s %s: %v", method, path, err)
		}
		return answer{resp.StatusCode, string(b)}
	}
	// Even trials send the registration and the deletion at once; odd trials the deletion once
	// the registration is answered (its 201 means the owner stored it: the deletion must delete it).
	const trials = 16
	answers := map[int]int{}
	for i := range trials {
		id := fmt.Sprintf("race-%d", i)
		var pc, dc answer
		if i%2 == 0 {
			post, del := make(chan answer, 1), make(chan answer, 1)
			go func() { post <- send(reps[i%3], "POST", "/v1/counterfactuals", ceFor(id, 0)) }()
			go func() { del <- send(reps[(i+1)%3], "DELETE", "/v1/counterfactuals/"+id, nil) }()
			pc, dc = <-post, <-del
		} else {
			pc = send(reps[i%3], "POST", "/v1/counterfactuals", ceFor(id, 0))
			dc = send(reps[(i+1)%3], "DELETE", "/v1/counterfactuals/"+id, nil)
			if dc.code != http.StatusNoContent {
				t.Errorf("trial %d: DELETE after the registration's %d answered %d %s; want 204", i, pc.code, dc.code, dc.body)
			}
		}
		answers[dc.code]++
		stored := daemontest.Settled(t, b, reps, id)
		switch dc.code {
		case http.StatusNoContent:
			if stored != nil {
				t.Errorf("trial %d: DELETE answered 204, and the owner stores %s", i, describe(stored))
			}
		case http.StatusNotFound:
			if stored == nil {
				t.Errorf("trial %d: DELETE answered 404, and the owner stores nothing: the registration came first", i)
			}
		default:
			t.Errorf("trial %d: DELETE answered %d %s", i, dc.code, dc.body)
		}
		// The registration stored its CE either way: 201, or 409 when the deletion came after
		// it and the CE is gone by the time it is answered (no 201 names a CE that is not there).
		if pc.code != http.StatusCreated && (pc.code != http.StatusConflict || !strings.Contains(pc.body, "deleted since") || stored != nil) {
			t.Errorf("trial %d: POST answered %d %s; the owner stores %s", i, pc.code, pc.body, describe(stored))
		}
	}
	t.Logf("answers to a DELETE sent with a registration of the same id, over %d trials: %v", trials, answers)

	id := "keyed-del"
	if code, body := reps[0].Do(t, "POST", "/v1/counterfactuals", "", ceFor(id, 0)); code != http.StatusCreated {
		t.Fatalf("POST A at r1: %d %s", code, body)
	}
	if code, body := keyedDelete(t, reps[1], id, "rdel-1"); code != http.StatusNoContent {
		t.Fatalf("keyed DELETE at r2: %d %s; want 204", code, body)
	}
	if code, body := reps[2].Do(t, "POST", "/v1/counterfactuals", "", ceFor(id, 1)); code != http.StatusCreated {
		t.Fatalf("POST B at r3 after the deletion: %d %s", code, body)
	}
	if code, body := keyedDelete(t, reps[0], id, "rdel-1"); code != http.StatusNoContent {
		t.Errorf("the keyed DELETE again at r1: %d %s; want 204, its first answer", code, body)
	}
	stored := daemontest.Settled(t, b, reps, id)
	if stored == nil || !slices.Equal(stored.XCF, data.X[cfs[1]]) {
		t.Errorf("after the keyed DELETE's retry the owner stores %s; want B, registered after the first attempt", describe(stored))
	}
	if got := reps[0].Metric(t, "cfguard_requests_replayed_total", "result", "deleted"); got != 1 {
		t.Errorf("r1 answered %v deletions from an earlier attempt's outcome, want 1", got)
	}
	skipped := 0.0
	for _, r := range reps {
		skipped += r.Metric(t, "cfguard_requests_skipped_total", "kind", "delete")
	}
	if skipped != 1 {
		t.Errorf("the owners skipped %v deletions applied before, want 1", skipped)
	}
	// The key on another id: 422 when that id's owner holds the key's outcome (the same
	// partition), else a request of its own that finds nothing.
	if code, body := keyedDelete(t, reps[2], "keyed-other", "rdel-1"); code != http.StatusUnprocessableEntity && code != http.StatusNotFound {
		t.Errorf("the key on another id: %d %s; want 422 or 404", code, body)
	}

	// A DELETE with If-Match deletes only the registration it names, wherever it is sent: A's
	// deletion sent again after A was registered anew (the same CE, another registration) is
	// 412 at its owner, and the new registration stays.
	id = "if-match"
	body, err := json.Marshal(ceFor(id, 2))
	if err != nil {
		t.Fatal(err)
	}
	register := func(r *launch.Running) string {
		t.Helper()
		resp, msg := r.RawDo(t, "POST", "/v1/counterfactuals", string(body), nil)
		if resp.StatusCode != http.StatusCreated || resp.Header.Get("ETag") == "" {
			t.Fatalf("POST %s at %s: %d %s, ETag %q", id, r.Base, resp.StatusCode, msg, resp.Header.Get("ETag"))
		}
		return resp.Header.Get("ETag")
	}
	conditional := func(r *launch.Running, tag string) (int, string) {
		resp, msg := r.RawDo(t, "DELETE", "/v1/counterfactuals/"+id, "", map[string]string{"If-Match": tag})
		return resp.StatusCode, string(msg)
	}
	first := register(reps[0])
	for _, r := range reps {
		if resp, msg := r.RawDo(t, "GET", "/v1/counterfactuals/"+id, "", nil); resp.StatusCode != http.StatusOK || resp.Header.Get("ETag") != first {
			t.Fatalf("GET at %s: %d %s, ETag %q; want the 201's %s", r.Base, resp.StatusCode, msg, resp.Header.Get("ETag"), first)
		}
		// A client polling the CE at any replica with its ETag gets the CE as that replica's
		// owner holds it now: the ETag names the registration, not the answer (its status and
		// bound change under it), so it is no 304.
		if resp, msg := r.RawDo(t, "GET", "/v1/counterfactuals/"+id, "", map[string]string{"If-None-Match": first}); resp.StatusCode != http.StatusOK ||
			!strings.Contains(string(msg), `"id":"`+id+`"`) || resp.Header.Get("ETag") != first {
			t.Fatalf("GET If-None-Match its ETag at %s: %d %q, ETag %q; want 200 with the CE and the ETag", r.Base, resp.StatusCode, msg, resp.Header.Get("ETag"))
		}
	}
	if code, msg := conditional(reps[1], first); code != http.StatusNoContent {
		t.Fatalf("DELETE If-Match the registration's ETag at r2: %d %s; want 204", code, msg)
	}
	again := register(reps[2])
	if again == first {
		t.Fatalf("the CE registered again has its first registration's ETag %s", first)
	}
	if code, msg := conditional(reps[0], first); code != http.StatusPreconditionFailed || !strings.Contains(msg, strings.Trim(again, `"`)) {
		t.Errorf("the first DELETE again at r1: %d %s; want 412 naming %s", code, msg, again)
	}
	if stored := daemontest.Settled(t, b, reps, id); stored == nil || stored.Tag() != strings.Trim(again, `"`) {
		t.Errorf("after the first DELETE again the owner stores %s; want the registration made since", describe(stored))
	}
	if code, msg := conditional(reps[1], again); code != http.StatusNoContent {
		t.Errorf("DELETE If-Match the new registration's ETag: %d %s; want 204", code, msg)
	}
}

// bulkAnswer is what POST /v1/counterfactuals:bulk answers, as these tests read it.
type bulkAnswer struct {
	Stored  int `json:"stored"`
	Results []struct {
		ID   string `json:"id"`
		Code int    `json:"code"`
	} `json:"results"`
}
