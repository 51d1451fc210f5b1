package owners

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
)

// A read of a CE in a partition its owner is still rebuilding is answered 503 with Retry-After,
// not 404: the CE may be among the registrations still to replay; so is a list. Here the rebuild
// waits on a registration measured under a posterior version the log does not have yet (its
// owner waits for that version up to cluster.AwaitOwner, then measures it again); a CE registered
// before it in the partition, and a CE of another partition, are then read as stored. Another
// replica's question for that registration's outcome is held by the owner until it applied it
// (cluster.HeaderAppliedAfter): a few questions over the wait, not one every cluster.OutcomeGap. An audit asked
// for meanwhile waits for the rebuild and measures every CE.
func TestReadDuringARebuildIsNotANotFound(t *testing.T) {
	b, key, r1 := daemontest.FirstOfTwoReplicas(t, launch.NoWait, "two replicas and a rebuild that waits")
	ids := daemontest.RegisterCEs(t, r1, daemontest.Bundled(t), 6, "")
	parts := r1.Config.Replication.CEPartitions
	stuck := ceshare.Partition(ids[0], parts)
	var other string // a CE of another partition
	for _, id := range ids[1:] {
		if ceshare.Partition(id, parts) != stuck {
			other = id
		}
	}
	later := ""
	for k := 0; later == ""; k++ {
		if id := fmt.Sprintf("later-%d", k); ceshare.Partition(id, parts) == stuck {
			later = id
		}
	}
	ce, err := r1.D.Ledger().Get(ids[0])
	if err != nil {
		t.Fatal(err)
	}
	raw, err := json.Marshal(cluster.Measured{X: ce.X, XCF: ce.XCF, Target: ce.Target, AnchorVersion: r1.D.Posterior().Version + 100,
		P1: ce.P1, Var1: ce.Var1, Samples: ce.Samples, Delta: ce.Delta, Epsilon: ce.Epsilon})
	if err != nil {
		t.Fatal(err)
	}
	conn, keys, topic := stream.ConnConfig{Brokers: r1.D.BrokerAddrs()}, r1.D.Replica().Keys(), r1.Config.Replication.CETopic
	r1.Stop(t)
	ctx := context.Background()
	prod, err := ceshare.NewProducer(ctx, conn, topic, keys, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close()
	const rid = "rid-later"
	_, landed, err := prod.Send(ctx, ceshare.Request{Kind: ceshare.KindRegister, ID: later, CE: raw, Replica: "r1", At: time.Now().UTC(), RID: rid})
	if err != nil {
		t.Fatal(err)
	}

	r2 := launch.With(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r2", key) }, nil, nil)
	start := time.Now()
	// A replica that accepted the registration asks r2, its owner, for the outcome.
	answered := askOutcome(r2, later, rid, landed)
	// While the partition is rebuilt, ids[0] reads 503 (never 404), and so does a list, which
	// would miss the CEs still to replay.
	waitfor.Cond(t, 60*time.Second, "r2 answering "+ids[0]+" 503, being rebuilt", func() bool {
		resp, body := r2.RawDo(t, "GET", "/v1/counterfactuals/"+ids[0], "", nil)
		switch resp.StatusCode {
		case http.StatusNotFound:
			t.Fatalf("GET %s while its partition is rebuilt: 404", ids[0])
		case http.StatusOK:
			t.Fatalf("GET %s answered 200 before its partition was rebuilt: the test shows nothing", ids[0])
		}
		return resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") != "" &&
			strings.Contains(string(body), "being rebuilt")
	})
	if resp, body := r2.RawDo(t, "GET", "/v1/counterfactuals?limit=1000", "", nil); resp.StatusCode != http.StatusServiceUnavailable ||
		resp.Header.Get("Retry-After") == "" || !strings.Contains(string(body), "being rebuilt") {
		t.Errorf("a list while a partition is rebuilt: %d (Retry-After %q) %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if code, _ := r2.Get(t, "/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz answers %d while a partition is rebuilt", code)
	}
	// The gauge counts the partitions r2's member holds or was assigned: from when it takes up
	// the group's assignment (the 503 above may come before), for the whole wait.
	waitfor.Cond(t, 30*time.Second, alerts.NameCERebuilding+" counting partition "+strconv.Itoa(stuck), func() bool {
		return r2.Metric(t, alerts.NameCERebuilding) >= 1
	})
	if resp, body := r2.RawDo(t, "GET", "/ui/counterfactuals/"+ids[0], "", nil); resp.StatusCode != http.StatusServiceUnavailable ||
		!strings.Contains(string(body), "being rebuilt") {
		t.Errorf("the UI's page of %s while its partition is rebuilt: %d\n%s", ids[0], resp.StatusCode, body)
	}
	// An audit asked for now waits for the rebuild, then measures every CE.
	audited := make(chan cluster.AuditAnswer, 1)
	go func() {
		var got cluster.AuditAnswer
		defer func() { audited <- got }()
		resp, err := r2.Client.Post(r2.Base+"/v1/audit", "application/json", strings.NewReader("{}"))
		if err != nil {
			return
		}
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			json.NewDecoder(resp.Body).Decode(&got)
		}
	}()
	// A partition rebuilt reads as stored meanwhile.
	waitfor.Cond(t, 60*time.Second, other+", of a partition rebuilt, read", func() bool {
		code, _ := r2.Get(t, "/v1/counterfactuals/"+other)
		return code == http.StatusOK
	})
	if code, _ := r2.Get(t, "/v1/counterfactuals/"+ids[0]); code == http.StatusNotFound {
		t.Errorf("GET %s: 404", ids[0])
	}
	// Once the wait ends, the partition caught up: every CE reads as stored, the one that waited too.
	waitfor.Cond(t, 60*time.Second, "r2 ready", func() bool { code, _ := r2.Get(t, "/readyz"); return code == 200 })
	if n := r2.Metric(t, alerts.NameCERebuilding); n != 0 {
		t.Errorf("%s = %v once r2 is ready", alerts.NameCERebuilding, n)
	}
	for _, id := range append(ids, later) {
		if code, body := r2.Get(t, "/v1/counterfactuals/"+id); code != http.StatusOK {
			t.Errorf("GET %s after the rebuild: %d %s", id, code, body)
		}
	}
	if code, body, n := r2.Listed(t); code != http.StatusOK || n != len(ids)+1 {
		t.Errorf("a list after the rebuild: %d, %d CEs (%s); want all %d", code, n, body, len(ids)+1)
	}
	if got := <-audited; got.Evaluated != len(ids)+1 {
		t.Errorf("an audit asked for during the rebuild evaluated %d CEs (%+v); want all %d, once the partition was rebuilt", got.Evaluated, got, len(ids)+1)
	}
	if waited := time.Since(start); waited < cluster.AwaitOwner/2 {
		t.Errorf("the rebuild took %s: the registration did not make it wait (cluster.AwaitOwner %s)", waited, cluster.AwaitOwner)
	}
	a := <-answered
	if a.code != http.StatusOK || a.ro.Outcome.ID != later || a.ro.Applied <= landed {
		t.Errorf("after %d questions: %d %+v; want the outcome of %s, applied past offset %d", a.asks, a.code, a.ro, later, landed)
	}
	// Each question but the last was held cluster.OutcomeHold (before r2 joined, and over the wait).
	if most := int(time.Since(start)/cluster.OutcomeHold) + 3; a.asks > most {
		t.Errorf("%d questions for one outcome over %s: the owner did not hold them (at most %d)", a.asks, time.Since(start), most)
	}
	t.Logf("%d questions for one outcome over a rebuild of %s", a.asks, time.Since(start).Round(time.Millisecond))
}

// outcomeAnswer is the last answer to a question for a request's outcome, after asks questions.
type outcomeAnswer struct {
	asks, code int
	ro         cluster.RequestOutcome
}

// askOutcome asks r, as a replica that accepted request rid for id would (cluster.Share.AwaitOutcome), for
// the request's outcome, again each time it gets none, until it gets it, 1000 questions or two
// minutes; the channel gets the last answer.
func askOutcome(r *launch.Running, id, rid string, landed int64) <-chan outcomeAnswer {
	answered := make(chan outcomeAnswer, 1)
	start := time.Now()
	go func() {
		var a outcomeAnswer
		for a.code != http.StatusOK && a.asks < 1000 && time.Since(start) < 2*time.Minute {
			a.asks++
			req, _ := http.NewRequest(http.MethodGet, r.Base+"/v1/counterfactuals/"+id, nil)
			req.Header.Set(cluster.HeaderForwarded, "r3")
			req.Header.Set(cluster.HeaderRequestID, rid)
			req.Header.Set(cluster.HeaderAppliedAfter, strconv.FormatInt(landed, 10))
			resp, err := r.Client.Do(req)
			if err != nil {
				break
			}
			a.code = resp.StatusCode
			json.NewDecoder(resp.Body).Decode(&a.ro)
			resp.Body.Close()
		}
		answered <- a
	}()
	return answered
}

// Registrations and their states anchored to posteriors this replica's posterior log does not
// have (here a log begun by a genesis at a later version: a cluster whose posterior topic was
// recreated from a replica's head) are not refused: each state is not used (counted not_used,
// with a WARN line), and each registration is measured again under the current posterior, with
// a WARN line; the partition goes on.
func TestStateAnchoredOutsideTheLogIsDropped(t *testing.T) {
	b, key, r1 := daemontest.FirstOfTwoReplicas(t, launch.NoWait, "two replicas")
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r1, data, 3, "")
	registered, err := r1.D.Ledger().Get(ids[0])
	if err != nil {
		t.Fatal(err)
	}
	// Records after the registrations move the posterior on: the next log begins after the
	// registrations' anchor.
	daemontest.ProduceRows(t, r1, data, 0, 64)
	waitfor.Cond(t, 30*time.Second, "the records applied", func() bool {
		return r1.Metric(t, "cfguard_records_total", "result", "applied") == 64
	})
	head := r1.D.Posterior()
	if head.Version == registered.AnchorVersion {
		t.Fatalf("64 records left the posterior at version %d, the registration's: the test shows nothing", head.Version)
	}
	waitfor.Cond(t, 30*time.Second, "r1's states of its registrations written", func() bool {
		return r1.Metric(t, "cfguard_events_pending") == 0 && r1.Metric(t, alerts.NameCEStates, "result", alerts.StateWritten) >= float64(len(ids))
	})
	r1.Stop(t)

	// r2 begins another posterior log from r1's posterior, at its version.
	model := filepath.Join(t.TempDir(), "model")
	if err := bnn.Save(model, head); err != nil {
		t.Fatal(err)
	}
	r2 := launch.With(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r2", key)
		c.Model.Path = model
		c.Replication.PosteriorTopic = "cfguard.posterior.next"
	}, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r2 ready, holding every CE", func() bool {
		held := r2.HeldCEs(t)
		code, _ := r2.Get(t, "/readyz")
		return held == len(ids) && code == 200
	})
	// r2's updater reads the input topic again from its start for the new log: the CEs are
	// measured under the new log's genesis or a later posterior.
	for _, id := range ids {
		got, err := r2.D.Ledger().Get(id)
		if err != nil {
			t.Fatal(err)
		}
		if got.AnchorVersion < head.Version {
			t.Errorf("%s at r2: anchored to version %d, before the log's genesis at %d", id, got.AnchorVersion, head.Version)
		}
	}
	if n := r2.Metric(t, alerts.NameCEStates, "result", alerts.StateNotUsed); n != float64(len(ids)) {
		t.Errorf("r2 counted %v states not used, want %d", n, len(ids))
	}
	if n := r2.Metric(t, alerts.NameCEStates, "result", alerts.StateRestored); n != 0 {
		t.Errorf("r2 restored %v states, want none", n)
	}
	notUsed, measuredAgain := loggedIDs(r2, "CE stored from its registration"), loggedIDs(r2, "CE measured again under the current posterior")
	for _, id := range ids {
		if !notUsed[id] {
			t.Errorf("r2 logged no WARN line for the state of %s, which it did not use", id)
		}
		if !measuredAgain[id] {
			t.Errorf("r2 logged no WARN line for %s, measured again", id)
		}
	}
}

// loggedIDs are the ids named by r's log lines whose message begins with msg.
func loggedIDs(r *launch.Running, msg string) map[string]bool {
	ids := map[string]bool{}
	for _, line := range strings.Split(r.Logs.String(), "\n") {
		if strings.Contains(line, `msg="`+msg) {
			for _, f := range strings.Fields(line) {
				if id, ok := strings.CutPrefix(f, "id="); ok {
					ids[id] = true
				}
			}
		}
	}
	return ids
}

// An id registered, deleted and registered again leaves on the state topic the state of its
// second CE. A replica that takes the partition over replays both registrations: the first is
// stored from itself (the state is not its CE's, and it is no fault: nothing is counted), the
// second with the state.
func TestStateOfAReRegisteredIDGoesToItsCE(t *testing.T) {
	b, key, r1 := daemontest.FirstOfTwoReplicas(t, launch.NoWait, "two replicas")
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r1.D.Posterior(), data, 400, 1)
	if len(xs) < 2 || len(cfs) < 2 {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	for k, method := range []string{"POST", "DELETE", "POST"} {
		path, want := "/v1/counterfactuals", http.StatusCreated
		var body any = map[string]any{"id": "re-1", "x": data.X[xs[k/2]], "x_cf": data.X[cfs[k/2]], "target": "benign"}
		if method == "DELETE" {
			path, want, body = path+"/re-1", http.StatusNoContent, nil
		}
		if code, out := r1.Do(t, method, path, "", body); code != want {
			t.Fatalf("%s %s: %d %s, want %d", method, path, code, out, want)
		}
	}
	second, err := r1.D.Ledger().Get("re-1")
	if err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 30*time.Second, "r1's states written", func() bool {
		return r1.Metric(t, "cfguard_events_pending") == 0 && r1.Metric(t, alerts.NameCEStates, "result", alerts.StateWritten) >= 2
	})
	r1.Stop(t)

	r2 := launch.ReplicaKey(t, b, "r2", key)
	waitfor.Cond(t, 60*time.Second, "r2 holding the CE", func() bool { return r2.HeldCEs(t) == 1 })
	got, err := r2.D.Ledger().Get("re-1")
	if err != nil {
		t.Fatal(err)
	}
	if !ledger.SameCE(got, second) {
		t.Errorf("r2 holds re-1 created %v with x_cf %v, want the second registration's (created %v)", got.CreatedAt, got.XCF[:3], second.CreatedAt)
	}
	if n := r2.Metric(t, alerts.NameCEStates, "result", alerts.StateNotUsed); n != 0 {
		t.Errorf("r2 counted %v states not used, want none", n)
	}
	if n := r2.Metric(t, alerts.NameCEStates, "result", alerts.StateRestored); n != 1 {
		t.Errorf("r2 restored %v states, want the second registration's", n)
	}
}
