package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// startThreeReplicas starts replicas r1, r2, r3 on one broker and waits until the CE topic's
// partitions are shared out among them, each owner caught up with its partitions.
func startThreeReplicas(t testing.TB) (*broker.Broker, []*running) {
	t.Helper()
	b := daemontest.StartCluster(t, 1)
	reps := []*running{startReplica(t, b, "r1"), startReplica(t, b, "r2"), startReplica(t, b, "r3")}
	parts := reps[0].D.share.Partitions()
	waitfor.Cond(t, 90*time.Second, "every CE partition owned by one ready replica, each replica owning some", func() bool {
		owned := 0
		for _, r := range reps {
			if !daemontest.ShareReady(r) {
				return false
			}
			owned += len(r.D.share.Member().Owned())
		}
		return owned == parts
	})
	return b, reps
}

// settled waits until the owner of id's CE partition has applied every request the partition
// holds, and returns what that owner stores under id (nil when nothing).
func settled(t *testing.T, b *broker.Broker, reps []*running, id string) *ledger.CE {
	t.Helper()
	s := reps[0].D.share
	p := ceshare.Partition(id, s.Partitions())
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()...)}
	var owner *running
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d applied to its end by its owner", p), func() bool {
		res, err := cl.ListOffsets(context.Background(), &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
			reps[0].D.cfg.Replication.CETopic: {kafka.LastOffsetOf(p)}}})
		if err != nil {
			return false
		}
		var end int64 = -1
		for _, po := range res.Topics[reps[0].D.cfg.Replication.CETopic] {
			if po.Partition == p && po.Error == nil {
				end = po.LastOffset
			}
		}
		for _, r := range reps {
			m := r.D.share.Member()
			if next, ok := m.Next(p); ok && m.Ready(p) && next >= end && end >= 0 {
				owner = r
				return true
			}
		}
		return false
	})
	ce, err := owner.D.ledger.Get(id)
	if err != nil {
		return nil
	}
	return ce
}

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
	b, reps := startThreeReplicas(t)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, reps[0].D.current(), data, 400, 1)
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
		stored := settled(t, b, reps, id)
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
				t.Errorf("trial %d: GET at %s: %d %s; the owner stores %v", i, r.D.share.ID(), code, got, describe(stored))
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

// keyedDo sends body (JSON of v, or raw when v is a string) with the Idempotency-Key key.
func keyedDo(t *testing.T, r *running, path, key string, v any) (int, []byte) {
	t.Helper()
	body, ok := v.(string)
	if !ok {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		body = string(b)
	}
	resp, got := r.RawDo(t, "POST", path, body, map[string]string{"Idempotency-Key": key})
	return resp.StatusCode, got
}

// A registration sent with an Idempotency-Key is one request however often it is sent: a retry
// answers the same CE and stores nothing twice; the key with another body is refused 422; a
// retry after the CE's deletion registers nothing and answers 409, also after a restart (the
// outcome is in the ledger). A bulk import's lines are keyed likewise.
func TestIdempotencyKeySingleDaemon(t *testing.T) {
	dir := t.TempDir()
	state := func(c *config.Config) { c.StateDir = dir }
	r := startDaemonClient(t, state, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	ceA := map[string]any{"x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
	ceB := map[string]any{"x": data.X[xs[1]], "x_cf": data.X[cfs[1]], "target": "benign"}
	code, body := keyedDo(t, r, "/v1/counterfactuals", "key-1", ceA)
	if code != http.StatusCreated {
		t.Fatalf("POST with a key: %d %s", code, body)
	}
	var first ledger.CE
	if err := json.Unmarshal(body, &first); err != nil || first.ID == "" {
		t.Fatalf("POST with a key answered %s", body)
	}
	code, body = keyedDo(t, r, "/v1/counterfactuals", "key-1", ceA)
	var again ledger.CE
	if code != http.StatusCreated || json.Unmarshal(body, &again) != nil || again.ID != first.ID {
		t.Errorf("the same request again: %d %s; want 201 with %s", code, body, first.ID)
	}
	if n := countStored(t, r); n != 1 {
		t.Errorf("%d CEs stored after a request sent twice, want 1", n)
	}
	if code, body = keyedDo(t, r, "/v1/counterfactuals", "key-1", ceB); code != http.StatusUnprocessableEntity ||
		!strings.Contains(string(body), "Idempotency-Key") {
		t.Errorf("the key with another body: %d %s; want 422 naming the key", code, body)
	}
	// The retry's answer came from the first attempt's outcome; the key reused for another
	// request's did not.
	if got := counter(t, r, "cfguard_requests_replayed_total", "result", "stored"); got != 1 {
		t.Errorf("replayed registrations after a retry and a key reused: %v, want 1", got)
	}
	if code, body := r.Do(t, "DELETE", "/v1/counterfactuals/"+first.ID, "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE: %d %s", code, body)
	}
	retryAfterDelete := func(r *running, when string) {
		t.Helper()
		code, body := keyedDo(t, r, "/v1/counterfactuals", "key-1", ceA)
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
	var res bulkResponse
	code, body = keyedDo(t, r, "/v1/counterfactuals:bulk", "bulk-1", bulk)
	if code != http.StatusOK || json.Unmarshal(body, &res) != nil || res.Stored != 2 {
		t.Fatalf("bulk with a key: %d %s", code, body)
	}
	if code, body := r.Do(t, "DELETE", "/v1/counterfactuals/"+res.Results[0].ID, "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE: %d %s", code, body)
	}
	code, body = keyedDo(t, r, "/v1/counterfactuals:bulk", "bulk-1", bulk)
	var res2 bulkResponse
	if code != http.StatusOK || json.Unmarshal(body, &res2) != nil || res2.Results[0].Code != http.StatusConflict ||
		res2.Results[1].ID != res.Results[1].ID || res2.Results[1].Code != 0 {
		t.Errorf("bulk again after a line's deletion: %d %s; want line 1 409, line 2 as before", code, body)
	}
	if code, _ := r.Get(t, "/v1/counterfactuals/"+res.Results[0].ID); code != http.StatusNotFound {
		t.Errorf("the bulk retry registered %s again", res.Results[0].ID)
	}
	if code, body := keyedDo(t, r, "/v1/counterfactuals:bulk", "bulk-1", lines(ceB, ceA)); code != http.StatusUnprocessableEntity {
		t.Errorf("bulk key with another body: %d %s; want 422", code, body)
	}
	// The outcomes are the ledger's: a restart keeps them.
	r.Stop(t)
	r = startDaemonClient(t, state, nil)
	retryAfterDelete(r, "after a restart")
}

// countStored is how many CEs r lists.
func countStored(t *testing.T, r *running) int {
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
	b, reps := startThreeReplicas(t)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, reps[0].D.current(), data, 400, 1)
	ceA := map[string]any{"x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
	code, body := keyedDo(t, reps[0], "/v1/counterfactuals", "retry-1", ceA)
	var first ledger.CE
	if code != http.StatusCreated || json.Unmarshal(body, &first) != nil {
		t.Fatalf("POST with a key at r1: %d %s", code, body)
	}
	if code, body := keyedDo(t, reps[1], "/v1/counterfactuals", "retry-1", ceA); code != http.StatusCreated {
		t.Errorf("the same request at r2: %d %s; want 201", code, body)
	}
	ceB := map[string]any{"x": data.X[xs[1]], "x_cf": data.X[cfs[1]], "target": "benign"}
	if code, body := keyedDo(t, reps[2], "/v1/counterfactuals", "retry-1", ceB); code != http.StatusUnprocessableEntity {
		t.Errorf("the key with another body at r3: %d %s; want 422", code, body)
	}
	// r2's answer came from the first attempt's outcome; r3's, a key reused for another request, did not.
	for i, want := range []float64{0, 1, 0} {
		if got := counter(t, reps[i], "cfguard_requests_replayed_total", "result", "stored"); got != want {
			t.Errorf("r%d: replayed registrations %v, want %v", i+1, got, want)
		}
	}
	if code, body := reps[1].Do(t, "DELETE", "/v1/counterfactuals/"+first.ID, "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE at r2: %d %s", code, body)
	}
	code, body = keyedDo(t, reps[2], "/v1/counterfactuals", "retry-1", ceA)
	if code != http.StatusConflict || !strings.Contains(string(body), "deleted since") {
		t.Errorf("the request again at r3 after the deletion: %d %s; want 409 deleted since", code, body)
	}
	if ce := settled(t, b, reps, first.ID); ce != nil {
		t.Errorf("the keyed retry registered %s again", first.ID)
	}
	// A request on the CE topic twice, the deletion between: the second copy changes nothing.
	d0 := reps[0].D
	prod, err := ceshare.NewProducer(context.Background(), d0.conn, d0.cfg.Replication.CETopic, d0.rep.Keys(), nil)
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
	if ce := settled(t, b, reps, id); ce == nil {
		t.Fatal("the registration request was not applied")
	}
	if _, _, err := prod.Send(ctx, ceshare.Request{Kind: ceshare.KindDelete, ID: id, Replica: "r1", At: time.Now().UTC(), RID: "rid-delete"}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := prod.Send(ctx, req); err != nil { // the producer's retry, landing after the deletion
		t.Fatal(err)
	}
	if ce := settled(t, b, reps, id); ce != nil {
		t.Errorf("a registration request delivered again after the deletion registered %s again", id)
	}
	req.RID = "rid-new"
	if _, _, err := prod.Send(ctx, req); err != nil {
		t.Fatal(err)
	}
	if ce := settled(t, b, reps, id); ce == nil {
		t.Errorf("a registration with a new request id after the deletion was not applied")
	}
}

// keyedDelete sends DELETE /v1/counterfactuals/{id}, with the Idempotency-Key key when it is
// not empty.
func keyedDelete(t *testing.T, r *running, id, key string) (int, []byte) {
	t.Helper()
	h := map[string]string{}
	if key != "" {
		h["Idempotency-Key"] = key
	}
	resp, body := r.RawDo(t, "DELETE", "/v1/counterfactuals/"+id, "", h)
	return resp.StatusCode, body
}

// counter is the value of the series of counter name with label = value in r's registry.
func counter(t *testing.T, r *running, name, label, value string) float64 {
	t.Helper()
	mfs, err := r.D.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label && lp.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("no series %s{%s=%q}", name, label, value)
	return 0
}

// A single daemon's DELETE answers 204 when it deleted a CE and 404 when none was stored; with
// an Idempotency-Key it is one request: a retry after the id was registered anew answers 204
// again (what the first attempt decided) and leaves the new CE, also after a restart; the key
// of another request is 422. The retries are counted as skipped and replayed.
func TestKeyedDeletionSingleDaemon(t *testing.T) {
	dir := t.TempDir()
	state := func(c *config.Config) { c.StateDir = dir }
	r := startDaemonClient(t, state, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
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
	if got := counter(t, r, "cfguard_requests_skipped_total", "kind", "delete"); got != 1 {
		t.Errorf("skipped deletions: %v, want 1", got)
	}
	if got := counter(t, r, "cfguard_requests_replayed_total", "result", "deleted"); got != 1 {
		t.Errorf("replayed deletions: %v, want 1", got)
	}
	if code, body := keyedDelete(t, r, "del-other", "del-key-1"); code != http.StatusUnprocessableEntity {
		t.Errorf("the deletion's key for another id: %d %s; want 422", code, body)
	}
	if got := counter(t, r, "cfguard_requests_replayed_total", "result", "deleted"); got != 1 {
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
	if code, body := keyedDo(t, r, "/v1/counterfactuals", "del-key-1", ceA); code != http.StatusUnprocessableEntity {
		t.Errorf("a DELETE's key on a POST: %d %s; want 422", code, body)
	}
	if code, body := r.Get(t, "/v1/counterfactuals/del-b"); code != http.StatusOK {
		t.Errorf("a DELETE with a reused key deleted del-b: %d %s", code, body)
	}
	r.Stop(t)
	r = startDaemonClient(t, state, nil)
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
	b, reps := startThreeReplicas(t)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, reps[0].D.current(), data, 400, 1)
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
	send := func(r *running, method, path string, v any) answer {
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
		stored := settled(t, b, reps, id)
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
	stored := settled(t, b, reps, id)
	if stored == nil || !slices.Equal(stored.XCF, data.X[cfs[1]]) {
		t.Errorf("after the keyed DELETE's retry the owner stores %s; want B, registered after the first attempt", describe(stored))
	}
	if got := counter(t, reps[0], "cfguard_requests_replayed_total", "result", "deleted"); got != 1 {
		t.Errorf("r1 answered %v deletions from an earlier attempt's outcome, want 1", got)
	}
	skipped := 0.0
	for _, r := range reps {
		skipped += counter(t, r, "cfguard_requests_skipped_total", "kind", "delete")
	}
	if skipped != 1 {
		t.Errorf("the owners skipped %v deletions applied before, want 1", skipped)
	}
	// The key on another id: 422 when that id's owner holds the key's outcome (the same
	// partition), else a request of its own that finds nothing.
	if code, body := keyedDelete(t, reps[2], "keyed-other", "rdel-1"); code != http.StatusUnprocessableEntity && code != http.StatusNotFound {
		t.Errorf("the key on another id: %d %s; want 422 or 404", code, body)
	}
}

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
	r := startDaemonWith(t, nil, func(o *Options) {
		o.hooks.registered = func(id string) {
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
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
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

// TestStoredCESentAgainToReplicasIsAnsweredAsStored: on replicas too, a CE stored under an
// earlier posterior (here: sent to the CE topic as a replica measured it then) and sent again,
// which the current posterior would refuse as new, is answered as stored, from what the owner of
// its partition holds: 201 with the CE (a replica's answer to the same CE), exists in a bulk
// request; a keyed retry of the request that stored it answers from its outcome, a request with
// a new key is refused (its key records nothing). Another CE under its id is 409; the same CE
// under a free id is refused as before (422), at any replica.
func TestStoredCESentAgainToReplicasIsAnsweredAsStored(t *testing.T) {
	if testing.Short() {
		t.Skip("three replicas: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b, reps := startThreeReplicas(t)
	data := daemontest.Bundled(t)
	m := reps[0].D.current()
	_, _, cfs := daemontest.CandidatePairs(t, m, data, 400, 1)
	d0 := reps[0].D
	prod, err := ceshare.NewProducer(context.Background(), d0.conn, d0.cfg.Replication.CETopic, d0.rep.Keys(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close()
	raw, err := json.Marshal(cluster.Measured{X: data.X[cfs[0]], XCF: data.X[cfs[1]], Target: 1, AnchorVersion: m.Version,
		P1: 0.99, Var1: 0.001, Samples: 400, Delta: 0.05, Epsilon: 0.01})
	if err != nil {
		t.Fatal(err)
	}
	line := map[string]any{"id": "kept", "x": data.X[cfs[0]], "x_cf": data.X[cfs[1]], "target": "benign"}
	body, err := json.Marshal(line)
	if err != nil {
		t.Fatal(err)
	}
	// The first attempt of a request with an Idempotency-Key, as a replica sent it then.
	ref, _ := keyRequest("first-key", "", requestFingerprint("POST", "/v1/counterfactuals", body))
	req := ceshare.Request{Kind: ceshare.KindRegister, ID: "kept", CE: raw, Replica: "r1", At: time.Now().UTC(), RID: ref.RID,
		Fingerprint: ref.Fingerprint}
	if _, _, err := prod.Send(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	if ce := settled(t, b, reps, "kept"); ce == nil {
		t.Fatal("the registration request was not applied")
	}
	if code, got := keyedDo(t, reps[2], "/v1/counterfactuals", "first-key", string(body)); code != http.StatusCreated {
		t.Errorf("the keyed request's retry: %d %s; want 201, what its first attempt decided", code, got)
	}
	if got := counter(t, reps[2], "cfguard_requests_replayed_total", "result", "stored"); got != 1 {
		t.Errorf("the keyed retry was not answered from its first attempt's outcome: replayed %v, want 1", got)
	}
	for i, r := range reps {
		code, body := r.Do(t, "POST", "/v1/counterfactuals", "", line)
		var got ledger.CE
		if code != http.StatusCreated || json.Unmarshal(body, &got) != nil || got.ID != "kept" || got.P1 != 0.99 {
			t.Errorf("r%d: POST of the stored CE again: %d %s; want 201 with the CE as stored", i+1, code, body)
		}
	}
	// A new key's request decides nothing here, and its key records nothing: refused as new, as
	// every retry of it is until the posterior takes the CE for a counterfactual again.
	for range 2 {
		if code, body := keyedDo(t, reps[1], "/v1/counterfactuals", "kept-key", line); code != http.StatusUnprocessableEntity ||
			!strings.Contains(string(body), "already classified") {
			t.Errorf("POST of the stored CE again with a new Idempotency-Key: %d %s; want 422, refused as new", code, body)
		}
	}
	other := map[string]any{"id": "kept", "x": data.X[cfs[0]], "x_cf": data.X[cfs[2]], "target": "benign"}
	if code, body := reps[1].Do(t, "POST", "/v1/counterfactuals", "", other); code != http.StatusConflict ||
		!strings.Contains(string(body), "holds another counterfactual") {
		t.Errorf("POST of another CE, refused as new, under the stored id: %d %s; want 409", code, body)
	}
	b1, _ := json.Marshal(line)
	line["id"] = "new"
	b2, _ := json.Marshal(line)
	resp, body := reps[2].RawDo(t, "POST", "/v1/counterfactuals:bulk", string(b1)+"\n"+string(b2)+"\n", nil)
	var bulk struct {
		Exists, Refused, Accepted int
		Results                   []struct {
			Status string
			Code   int
			Error  string
		}
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &bulk) != nil || bulk.Exists != 1 || bulk.Refused != 1 || bulk.Accepted != 0 ||
		len(bulk.Results) != 2 || bulk.Results[1].Code != http.StatusUnprocessableEntity || !strings.Contains(bulk.Results[1].Error, "already classified") {
		t.Errorf("bulk of the stored CE again and of the same CE under a free id: %d %s; want exists 1, refused 1 (422)", resp.StatusCode, body)
	}
	// A second batch is looked up as the first is: 256 lines refused as new, then the stored CE.
	// The 256 name no id, so that nothing is asked for them (a line without an id holds no CE to
	// look up): asking for 256 ids would spend the request's 5 s of questions on a busy core, and
	// the stored CE's line would then be refused unasked, as documented.
	var many strings.Builder
	anon := maps.Clone(line)
	delete(anon, "id")
	for range maxRegisterBatch {
		b, _ := json.Marshal(anon)
		many.Write(append(b, '\n'))
	}
	many.Write(append(b1, '\n'))
	line["id"] = "new"
	resp, body = reps[0].RawDo(t, "POST", "/v1/counterfactuals:bulk", many.String(), nil)
	if err := json.Unmarshal(body, &bulk); resp.StatusCode != http.StatusOK || err != nil || bulk.Exists != 1 || bulk.Refused != maxRegisterBatch {
		t.Errorf("bulk of %d lines refused as new, then the stored CE: %d %.300s; want exists 1, refused %d", maxRegisterBatch, resp.StatusCode, body, maxRegisterBatch)
	}
	for i, r := range reps {
		if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", line); code != http.StatusUnprocessableEntity ||
			!strings.Contains(string(body), "already classified") {
			t.Errorf("r%d: POST of the same CE under a free id: %d %s; want 422, x is classified as the target", i+1, code, body)
		}
	}
	if ce := settled(t, b, reps, "new"); ce != nil {
		t.Errorf("a CE refused as new was stored: %+v", ce)
	}
}

// TestStoredCESentAgainIsAnsweredAsStored: a CE stored under an earlier posterior that the
// current one no longer takes for a counterfactual (its x is classified as the target now, as
// after a drift) is answered as stored when sent again, by the single registration (409) and in
// a bulk (exists), so that an import runs again without refusals; the same CE under a free id is
// still refused (422).
func TestStoredCESentAgainIsAnsweredAsStored(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	m := r.D.current()
	_, _, cfs := daemontest.CandidatePairs(t, m, data, 400, 1)
	ce := &ledger.CE{ID: "kept", X: data.X[cfs[0]], XCF: data.X[cfs[1]], Target: 1, AnchorVersion: m.Version, P1: 0.99, Var1: 0.001,
		Samples: 400, Delta: 0.05, Epsilon: 0.01}
	if err := r.D.ledger.Put(context.Background(), ce); err != nil {
		t.Fatal(err)
	}
	line := map[string]any{"id": "kept", "x": ce.X, "x_cf": ce.XCF, "target": "benign"}
	if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", line); code != http.StatusConflict {
		t.Errorf("POST of the stored CE again: %d %s; want 409, the id holds it", code, body)
	}
	if code, body := keyedDo(t, r, "/v1/counterfactuals", "kept-key", line); code != http.StatusConflict {
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
