package daemon

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
)

// TestMergePages holds the merge of owners' pages to the first limit CEs of their union in id
// order, whatever an owner left out of its own page.
func TestMergePages(t *testing.T) {
	ces := func(ids ...string) []*ledger.CE {
		var out []*ledger.CE
		for _, id := range ids {
			out = append(out, &ledger.CE{ID: id})
		}
		return out
	}
	for _, c := range []struct {
		name  string
		pages []listPage
		limit int
		want  []string
		next  string
	}{
		{"every owner done", []listPage{newListPage("a", ces("b", "d"), 3), newListPage("b", ces("a", "c"), 3)}, 3, []string{"a", "b", "c"}, "c"},
		{"fewer than a page, nobody has more", []listPage{newListPage("a", ces("b"), 3), newListPage("b", ces("a"), 3)}, 3, []string{"a", "b"}, ""},
		{"an owner with more bounds the page", []listPage{newListPage("a", ces("a", "b", "c"), 3), newListPage("b", ces("d"), 3)}, 3, []string{"a", "b", "c"}, "c"},
		{"the bound leaves another owner's later CEs for the next page",
			[]listPage{newListPage("a", ces("a", "e"), 2), newListPage("b", ces("b"), 2)}, 2, []string{"a", "b"}, "b"},
		{"an owner's page emptied by ownership: the cursor still moves past it",
			[]listPage{{replica: "a", more: true, lastID: "m"}, newListPage("b", ces("z"), 2)}, 2, nil, "m"},
		{"nothing stored", []listPage{newListPage("a", nil, 5)}, 5, nil, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, next, err := mergePages(c.pages, c.limit)
			var ids []string
			for _, ce := range got {
				ids = append(ids, ce.ID)
			}
			if err != nil || !slices.Equal(ids, c.want) || next != c.next {
				t.Errorf("mergePages = %v, next %q, %v; want %v, next %q", ids, next, err, c.want, c.next)
			}
		})
	}
}

// TestListsCoverTheCluster: GET /v1/counterfactuals at any replica lists every CE the cluster
// stores, each once, in id order, page by page (a small limit, so that pages cut across owners),
// with the status filter; a request another replica forwards lists that replica's ledger only.
func TestListsCoverTheCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("three replicas: not with -short")
	}
	_, reps := startThreeReplicas(t)
	data := bundled(t)
	var all []string
	for i, r := range reps {
		all = append(all, registerCEsPrefixed(t, r, data, 7, fmt.Sprintf("r%d-", i+1))...)
	}
	slices.Sort(all)
	local := map[string][]string{}
	for i, r := range reps {
		ces, err := r.d.ledger.List(0, 1000, "")
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
			resp, body := r.rawDo(t, "GET", "/v1/counterfactuals?limit=4"+query+after, "", header)
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
			code, body := r.get(t, "/v1/counterfactuals/"+id)
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
		if got := walk(r, "", map[string]string{headerForwarded: "r9"}); !slices.Equal(got, local[name]) {
			t.Errorf("%s lists %v for another replica, its ledger holds %v", name, got, local[name])
		}
	}
	if t.Failed() {
		t.Logf("stored at: %v", local)
	}
}
