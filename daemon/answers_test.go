package daemon

import (
	"context"
	"encoding/json"
	"maps"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/ledger"
)

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
	b, reps := daemontest.StartThreeReplicas(t, startNoWait)
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
	if ce := daemontest.Settled(t, b, reps, "kept"); ce == nil {
		t.Fatal("the registration request was not applied")
	}
	if code, got := reps[2].KeyedDo(t, "/v1/counterfactuals", "first-key", string(body)); code != http.StatusCreated {
		t.Errorf("the keyed request's retry: %d %s; want 201, what its first attempt decided", code, got)
	}
	if got := reps[2].Metric(t, "cfguard_requests_replayed_total", "result", "stored"); got != 1 {
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
		if code, body := reps[1].KeyedDo(t, "/v1/counterfactuals", "kept-key", line); code != http.StatusUnprocessableEntity ||
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
	if ce := daemontest.Settled(t, b, reps, "new"); ce != nil {
		t.Errorf("a CE refused as new was stored: %+v", ce)
	}
}
