package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestListsAndAuditsCoverTheCluster: GET /v1/counterfactuals at any replica lists every CE the
// cluster stores, each once, in id order, page by page (a small limit, so that pages cut across
// owners), with the status filter; POST /v1/audit at any replica audits every CE once, each at
// its owner, and GET /v1/audit reports each replica's audit; a request another replica forwards
// is answered from the receiving replica's ledger only.
func TestListsAndAuditsCoverTheCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("three replicas: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	_, reps := daemontest.StartThreeReplicas(t, startNoWait)
	data := daemontest.Bundled(t)
	var all []string
	for i, r := range reps {
		all = append(all, daemontest.RegisterCEs(t, r, data, 7, fmt.Sprintf("r%d-", i+1))...)
	}
	slices.Sort(all)
	local := map[string][]string{}
	for i, r := range reps {
		ces, err := r.D.ledger.List(0, 1000, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, ce := range ces {
			local[fmt.Sprintf("r%d", i+1)] = append(local[fmt.Sprintf("r%d", i+1)], ce.ID)
		}
	}
	spread := 0
	for _, ids := range local {
		if len(ids) > 0 {
			spread++
		}
	}
	if spread < 2 {
		t.Fatalf("the 21 CEs are stored at %d replica: the test needs them spread (%v)", spread, local)
	}
	walk := func(r *running, query string, header map[string]string) []string {
		t.Helper()
		var ids []string
		after := ""
		for range 100 {
			resp, body := r.RawDo(t, "GET", "/v1/counterfactuals?limit=4"+query+after, "", header)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("GET /v1/counterfactuals: %d %s", resp.StatusCode, body)
			}
			var page struct {
				CEs  []ledger.CE `json:"counterfactuals"`
				Next string      `json:"next"`
			}
			if err := json.Unmarshal(body, &page); err != nil {
				t.Fatal(err)
			}
			if len(page.CEs) > 4 {
				t.Fatalf("a page of %d CEs at limit 4", len(page.CEs))
			}
			for _, ce := range page.CEs {
				ids = append(ids, ce.ID)
			}
			if page.Next == "" {
				return ids
			}
			after = "&after=" + page.Next
		}
		t.Fatal("more than 100 pages")
		return nil
	}
	for i, r := range reps {
		if got := walk(r, "", nil); !slices.Equal(got, all) {
			t.Errorf("r%d lists %v, the cluster stores %v", i+1, got, all)
		}
		var certified []string
		for _, id := range all {
			code, body := r.Get(t, "/v1/counterfactuals/"+id)
			var ce ledger.CE
			if code != http.StatusOK || json.Unmarshal(body, &ce) != nil {
				t.Fatalf("GET %s at r%d: %d %s", id, i+1, code, body)
			}
			if ce.Status == certify.Certified {
				certified = append(certified, id)
			}
		}
		if got := walk(r, "&status=certified", nil); !slices.Equal(got, certified) {
			t.Errorf("r%d lists certified %v, the CEs say %v", i+1, got, certified)
		}
		name := fmt.Sprintf("r%d", i+1)
		if got := walk(r, "", map[string]string{cluster.HeaderForwarded: "r9"}); !slices.Equal(got, local[name]) {
			t.Errorf("%s lists %v for another replica, its ledger holds %v", name, got, local[name])
		}
	}
	if t.Failed() {
		t.Logf("stored at: %v", local)
	}

	// The web UI's list at a replica is the cluster's too.
	if code, body := reps[2].Get(t, "/ui/counterfactuals"); code != http.StatusOK {
		t.Errorf("GET /ui/counterfactuals at r3: %d", code)
	} else {
		for _, id := range all {
			if !strings.Contains(string(body), `href="/ui/counterfactuals/`+id+`"`) {
				t.Errorf("the UI's list at r3 does not link %s", id)
			}
		}
	}

	// POST /v1/audit at any replica audits every replica's CEs, each by its owner: the sum
	// evaluates every CE once; GET /v1/audit at another reports each replica's last audit.
	code, body := reps[1].Do(t, "POST", "/v1/audit", "", map[string]any{})
	var rep cluster.AuditAnswer
	if code != http.StatusOK || json.Unmarshal(body, &rep) != nil {
		t.Fatalf("POST /v1/audit at r2: %d %s", code, body)
	}
	if rep.Evaluated != len(all) || len(rep.Replicas) != len(reps) {
		t.Errorf("the cluster's audit evaluated %d CEs at %d replicas; the cluster stores %d at %d", rep.Evaluated, len(rep.Replicas), len(all), len(reps))
	}
	for name, ids := range local {
		if r := rep.Replicas[name]; r.Evaluated != len(ids) {
			t.Errorf("%s's audit evaluated %d CEs, its ledger holds %d", name, r.Evaluated, len(ids))
		}
	}
	code, body = reps[2].Get(t, "/v1/audit")
	var st auditStatus
	if code != http.StatusOK || json.Unmarshal(body, &st) != nil {
		t.Fatalf("GET /v1/audit at r3: %d %s", code, body)
	}
	for name, ids := range local {
		if r := st.Replicas[name]; r.Last == nil || r.Last.Evaluated != len(ids) || r.Running {
			t.Errorf("GET /v1/audit at r3: %s's status %+v, want its last audit of %d CEs", name, r, len(ids))
		}
	}
	// Forwarded by another replica, an audit is this replica's only.
	resp, body := reps[0].RawDo(t, "POST", "/v1/audit", "{}", map[string]string{cluster.HeaderForwarded: "r9"})
	var one cluster.AuditAnswer
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &one) != nil || one.Evaluated != len(local["r1"]) || one.Replicas != nil {
		t.Errorf("a forwarded audit at r1: %d %s; want r1's %d CEs only", resp.StatusCode, body, len(local["r1"]))
	}
}

// The group's directory shows a new generation's assignment as soon as the group completes it,
// before each member takes its share up. A list in that window must not pass off a replica's
// ledger as the whole of partitions it does not hold yet: here r2 joins and is held before it
// takes up its partitions; a list at r1 (which asks r2 for r2's partitions) and one at r2 answer
// a complete page or 503 naming the wait, never a page without r2's partitions' CEs; once r2
// goes on, both list every CE.
func TestListWhileAReplicaTakesUpItsPartitions(t *testing.T) {
	b, key, r1 := daemontest.FirstOfTwoReplicas(t, startNoWait, "two replicas")
	ids := daemontest.RegisterCEs(t, r1, daemontest.Bundled(t), 8, "")
	r2, mine, release := startHeldReplica(t, b, "r2", key)
	defer release()
	missing := 0 // CEs of the partitions r2 is held before
	for _, id := range ids {
		if slices.Contains(mine, ceshare.Partition(id, r1.D.share.Partitions())) {
			missing++
		}
	}
	if missing == 0 {
		t.Fatalf("none of the %d CEs is in r2's partitions %v: the test shows nothing", len(ids), mine)
	}
	// r1 sees the new assignment once its directory reads it; until then it lists its own
	// ledger, which still holds every CE.
	waitfor.Cond(t, 30*time.Second, "a list at r1 waiting for r2", func() bool {
		code, body, n := r1.Listed(t)
		switch {
		case code == http.StatusOK && n != len(ids):
			t.Fatalf("a list at r1 while r2 has not taken up %v: 200 with %d CEs of %d", mine, n, len(ids))
		case code == http.StatusServiceUnavailable && strings.Contains(string(body), "between two generations"):
			return true
		}
		return false
	})
	if code, body, n := r2.Listed(t); code != http.StatusServiceUnavailable || !strings.Contains(string(body), "between two generations") {
		t.Errorf("a list at r2 while it has not taken up %v: %d, %d CEs: %s", mine, code, n, body)
	}
	release()
	for _, r := range []*running{r1, r2} {
		waitfor.Cond(t, 60*time.Second, "every CE listed at "+r.D.cfg.Replication.ReplicaID, func() bool {
			code, _, n := r.Listed(t)
			return code == http.StatusOK && n == len(ids)
		})
	}
}

// An explanation asked for at a replica whose CE's owner does not store it within the wait is
// accepted, as a registration is: 202 with the CE's Location and the generated counterfactual,
// not a 500 for a CE that is on the CE topic. r2 is held before it takes up its partitions; the
// CE is then stored once r2 goes on.
func TestExplainWhoseOwnerIsSlowIsAccepted(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := startDaemonWith(t, daemontest.WithSharedVAE(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r1", key) }), nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r1.Get(t, "/readyz"); return code == 200 })
	r2, mine, release := startHeldReplica(t, b, "r2", key)
	defer release()
	id := ""
	for i := 0; id == ""; i++ {
		if c := fmt.Sprintf("slow-%d", i); slices.Contains(mine, ceshare.Partition(c, r1.D.share.Partitions())) {
			id = c
		}
	}
	data := daemontest.Bundled(t)
	p, _ := r1.D.current().Predict(data.X[:40], 200, 1)
	var x []float64
	for i := range 40 {
		if p.Argmax(i) == 0 && p.P(i, 0) > 0.9 {
			x = data.X[i]
			break
		}
	}
	body, _ := json.Marshal(map[string]any{"id": id, "x": x, "target": "benign"})
	resp, err := r1.Client.Post(r1.Base+"/v1/explain", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var answer struct {
		ID, Status string
		Partition  *int
		Offset     *int64
		Generation *struct {
			XCF []float64 `json:"x_cf"`
		}
	}
	if err := json.Unmarshal(got, &answer); err != nil || resp.StatusCode != http.StatusAccepted || answer.ID != id || answer.Status != "pending" ||
		answer.Generation == nil || len(answer.Generation.XCF) != len(x) || resp.Header.Get("Location") != "/v1/counterfactuals/"+id {
		t.Fatalf("POST /v1/explain at r1 for %s, of r2's held partitions %v: %d (Location %q) %s; want 202 pending with the generation",
			id, mine, resp.StatusCode, resp.Header.Get("Location"), got)
	}
	// The 202 names where the request landed: the id's partition, at an offset it holds.
	topic, parts := r1.D.cfg.Replication.CETopic, r1.D.cfg.Replication.CEPartitions
	if answer.Partition == nil || *answer.Partition != ceshare.Partition(id, parts) || answer.Offset == nil ||
		*answer.Offset < 0 || *answer.Offset >= b.HighWatermarks(topic)[*answer.Partition] {
		t.Errorf("the 202 for %s names partition %v offset %v; want partition %d and an offset of it (its end %d)", id,
			answer.Partition, answer.Offset, ceshare.Partition(id, parts), b.HighWatermarks(topic)[ceshare.Partition(id, parts)])
	}
	release()
	for _, r := range []*running{r1, r2} {
		waitfor.Cond(t, 60*time.Second, id+" stored, read at "+r.D.cfg.Replication.ReplicaID, func() bool {
			code, _ := r.Get(t, "/v1/counterfactuals/"+id)
			return code == http.StatusOK
		})
	}
}

// startHeldReplica starts replica id on cluster b and holds it in its first CE group generation
// that assigns it partitions, before it takes them up, until release is called (release may be
// called more than once). It returns the partitions it was given.
func startHeldReplica(t *testing.T, b *broker.Broker, id, key string) (r *running, assigned []int, release func()) {
	t.Helper()
	held, released := make(chan []int, 1), make(chan struct{})
	var hold, free sync.Once
	r = startDaemonWith(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), id, key) }, func(o *Options) {
		o.hooks.ceGeneration = func(ctx context.Context, _ int32, assigned []int) {
			if len(assigned) == 0 {
				return
			}
			hold.Do(func() {
				held <- assigned
				select {
				case <-released:
				case <-ctx.Done():
				}
			})
		}
	}, nil)
	release = func() { free.Do(func() { close(released) }) }
	select {
	case assigned = <-held:
	case <-time.After(60 * time.Second):
		release()
		t.Fatalf("%s was given no CE partition within 60 s", id)
	}
	return r, assigned, release
}
