package owners

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
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
	_, reps := daemontest.StartThreeReplicas(t, launch.NoWait)
	data := daemontest.Bundled(t)
	var all []string
	for i, r := range reps {
		all = append(all, daemontest.RegisterCEs(t, r, data, 7, fmt.Sprintf("r%d-", i+1))...)
	}
	slices.Sort(all)
	local := map[string][]string{}
	for i, r := range reps {
		ces, err := r.D.Ledger().List(0, 1000, "")
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
	walk := func(r *launch.Running, query string, header map[string]string) []string {
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
	var st struct {
		Replicas map[string]struct {
			Running bool
			Last    *ledger.AuditReport
		}
	}
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
