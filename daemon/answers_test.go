package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// startThreeReplicas starts replicas r1, r2, r3 on one broker and waits until the CE topic's
// partitions are shared out among them, each owner caught up with its partitions.
func startThreeReplicas(t *testing.T) (*broker.Broker, []*running) {
	t.Helper()
	b := startCluster(t, 1)
	reps := []*running{startReplica(t, b, "r1"), startReplica(t, b, "r2"), startReplica(t, b, "r3")}
	parts := reps[0].d.rep.share.partitions
	waitfor.Cond(t, 90*time.Second, "every CE partition owned by one ready replica, each replica owning some", func() bool {
		owned := 0
		for _, r := range reps {
			m := r.d.rep.share.member
			own := m.Owned()
			if len(own) == 0 {
				return false
			}
			for _, p := range own {
				if !m.Ready(p) {
					return false
				}
			}
			owned += len(own)
		}
		return owned == parts
	})
	return b, reps
}

// settled waits until the owner of id's CE partition has applied every request the partition
// holds, and returns what that owner stores under id (nil when nothing).
func settled(t *testing.T, b *broker.Broker, reps []*running, id string) *ledger.CE {
	t.Helper()
	s := reps[0].d.rep.share
	p := ceshare.Partition(id, s.partitions)
	cl := &kafka.Client{Addr: kafka.TCP(b.Addrs()...)}
	var owner *running
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d applied to its end by its owner", p), func() bool {
		res, err := cl.ListOffsets(context.Background(), &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
			reps[0].d.cfg.Replication.CETopic: {kafka.LastOffsetOf(p)}}})
		if err != nil {
			return false
		}
		var end int64 = -1
		for _, po := range res.Topics[reps[0].d.cfg.Replication.CETopic] {
			if po.Partition == p && po.Error == nil {
				end = po.LastOffset
			}
		}
		for _, r := range reps {
			m := r.d.rep.share.member
			if next, ok := m.Next(p); ok && m.Ready(p) && next >= end && end >= 0 {
				owner = r
				return true
			}
		}
		return false
	})
	ce, err := owner.d.ledger.Get(id)
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
	b, reps := startThreeReplicas(t)
	data := bundled(t)
	_, xs, cfs := candidatePairs(t, reps[0].d.current(), data, 400, 1)
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
		if code, body := reps[0].do(t, "POST", "/v1/counterfactuals", "", with(ceA, id)); code != http.StatusCreated {
			t.Fatalf("trial %d: POST A at r1: %d %s", i, code, body)
		}
		deleted := i%5 != 4 // every fifth trial keeps A: B's answer must then be 409
		if deleted {
			if code, body := reps[1].do(t, "DELETE", "/v1/counterfactuals/"+id, "", nil); code != http.StatusNoContent {
				t.Fatalf("trial %d: DELETE at r2: %d %s", i, code, body)
			}
		}
		code, body := reps[2].do(t, "POST", "/v1/counterfactuals", "", with(ceB, id))
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
			code, got := r.get(t, "/v1/counterfactuals/"+id)
			if (code == http.StatusOK) != (stored != nil) {
				t.Errorf("trial %d: GET at %s: %d %s; the owner stores %v", i, r.d.rep.share.id, code, got, describe(stored))
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
	resp, got := r.rawDo(t, "POST", path, body, map[string]string{"Idempotency-Key": key})
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
	data := bundled(t)
	_, xs, cfs := candidatePairs(t, r.d.current(), data, 400, 1)
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
	if code, body := r.do(t, "DELETE", "/v1/counterfactuals/"+first.ID, "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE: %d %s", code, body)
	}
	retryAfterDelete := func(r *running, when string) {
		t.Helper()
		code, body := keyedDo(t, r, "/v1/counterfactuals", "key-1", ceA)
		if code != http.StatusConflict || !strings.Contains(string(body), "deleted since") {
			t.Errorf("%s: the request again after its CE's deletion: %d %s; want 409 deleted since", when, code, body)
		}
		if code, body := r.get(t, "/v1/counterfactuals/"+first.ID); code != http.StatusNotFound {
			t.Errorf("%s: the retry registered %s again: %d %s", when, first.ID, code, body)
		}
	}
	retryAfterDelete(r, "running")
	// Without a key, the same body registers a new CE.
	if code, body := r.do(t, "POST", "/v1/counterfactuals", "", ceA); code != http.StatusCreated {
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
	if code, body := r.do(t, "DELETE", "/v1/counterfactuals/"+res.Results[0].ID, "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE: %d %s", code, body)
	}
	code, body = keyedDo(t, r, "/v1/counterfactuals:bulk", "bulk-1", bulk)
	var res2 bulkResponse
	if code != http.StatusOK || json.Unmarshal(body, &res2) != nil || res2.Results[0].Code != http.StatusConflict ||
		res2.Results[1].ID != res.Results[1].ID || res2.Results[1].Code != 0 {
		t.Errorf("bulk again after a line's deletion: %d %s; want line 1 409, line 2 as before", code, body)
	}
	if code, _ := r.get(t, "/v1/counterfactuals/"+res.Results[0].ID); code != http.StatusNotFound {
		t.Errorf("the bulk retry registered %s again", res.Results[0].ID)
	}
	if code, body := keyedDo(t, r, "/v1/counterfactuals:bulk", "bulk-1", lines(ceB, ceA)); code != http.StatusUnprocessableEntity {
		t.Errorf("bulk key with another body: %d %s; want 422", code, body)
	}
	// The outcomes are the ledger's: a restart keeps them.
	r.stop(t)
	r = startDaemonClient(t, state, nil)
	retryAfterDelete(r, "after a restart")
}

// countStored is how many CEs r lists.
func countStored(t *testing.T, r *running) int {
	t.Helper()
	code, body := r.get(t, "/v1/counterfactuals?limit=1000")
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
	b, reps := startThreeReplicas(t)
	data := bundled(t)
	_, xs, cfs := candidatePairs(t, reps[0].d.current(), data, 400, 1)
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
	if code, body := reps[1].do(t, "DELETE", "/v1/counterfactuals/"+first.ID, "", nil); code != http.StatusNoContent {
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
	s := reps[0].d.rep.share
	raw, err := json.Marshal(measured{X: first.X, XCF: first.XCF, Target: first.Target, AnchorVersion: first.AnchorVersion,
		P1: first.P1, Var1: first.Var1, Samples: first.Samples, Delta: first.Delta, Epsilon: first.Epsilon})
	if err != nil {
		t.Fatal(err)
	}
	id := "twice"
	req := ceshare.Request{Kind: ceshare.KindRegister, ID: id, CE: raw, Replica: "r1", At: time.Now().UTC(), RID: "rid-twice"}
	ctx := context.Background()
	if _, _, err := s.prod.Send(ctx, req); err != nil {
		t.Fatal(err)
	}
	if ce := settled(t, b, reps, id); ce == nil {
		t.Fatal("the registration request was not applied")
	}
	if _, _, err := s.prod.Send(ctx, ceshare.Request{Kind: ceshare.KindDelete, ID: id, Replica: "r1", At: time.Now().UTC(), RID: "rid-delete"}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.prod.Send(ctx, req); err != nil { // the producer's retry, landing after the deletion
		t.Fatal(err)
	}
	if ce := settled(t, b, reps, id); ce != nil {
		t.Errorf("a registration request delivered again after the deletion registered %s again", id)
	}
	req.RID = "rid-new"
	if _, _, err := s.prod.Send(ctx, req); err != nil {
		t.Fatal(err)
	}
	if ce := settled(t, b, reps, id); ce == nil {
		t.Errorf("a registration with a new request id after the deletion was not applied")
	}
}
