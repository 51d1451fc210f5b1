package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sort"
	"strconv"
	"sync"
	"testing"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// TestListAtAPeerWhosePageIsTooLarge: a peer's page of CEs with many features can be larger than
// a replica reads of an answer (1000 CEs of 784 features: about 17 MB). listAt asks it for
// smaller pages until one fits, and the page it returns is the peer's first CEs after the cursor
// with more to come, so that the merge and the cursor stay right; it never decodes a cut answer.
func TestListAtAPeerWhosePageIsTooLarge(t *testing.T) {
	const stored, features = 1200, 784
	ids := make([]string, stored)
	for i := range ids {
		ids[i] = fmt.Sprintf("ce-%05d", i)
	}
	sort.Strings(ids)
	x := make([]float64, features)
	for i := range x {
		x[i] = 0.123456789012345 * float64(i+1) // about 17 characters a number in JSON
	}
	var (
		mu    sync.Mutex
		asked []int
	)
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		limit, _ := strconv.Atoi(r.URL.Query().Get("limit"))
		mu.Lock()
		asked = append(asked, limit)
		mu.Unlock()
		after := r.URL.Query().Get("after")
		var page []*ledger.CE
		for _, id := range ids {
			if id > after && len(page) < limit {
				page = append(page, &ledger.CE{ID: id, X: x, XCF: x, Status: certify.Certified})
			}
		}
		next := ""
		if len(page) > 0 && page[len(page)-1].ID != ids[len(ids)-1] {
			next = page[len(page)-1].ID
		}
		json.NewEncoder(w).Encode(map[string]any{"counterfactuals": page, "next": next})
	}))
	t.Cleanup(peer.Close)

	s := &Share{id: "r1", client: peer.Client()}
	pg, err := s.listAt(context.Background(), ceshare.Owner{Replica: "r2", URL: peer.URL}, []int{0}, 0, 1000, "", "")
	mu.Lock()
	defer mu.Unlock()
	if err != nil {
		t.Fatalf("listAt: %v (asked for pages of %v)", err, asked)
	}
	if len(asked) < 2 || asked[0] != 1000 {
		t.Fatalf("asked for pages of %v: the first page of 1000 fits in an answer, the test shows nothing", asked)
	}
	n := len(pg.ces)
	if n == 0 || n >= 1000 || !pg.more || pg.lastID != ids[n-1] {
		t.Fatalf("a page of %d CEs (more %v, last %q), asked %v; want the first CEs with more to come", n, pg.more, pg.lastID, asked)
	}
	for i, ce := range pg.ces {
		if ce.ID != ids[i] || len(ce.X) != features {
			t.Fatalf("CE %d of the page is %s with %d features, want %s with %d", i, ce.ID, len(ce.X), ids[i], features)
		}
	}
	next, cursor := mergePages([]listPage{pg}, 1000)
	if len(next) != n || cursor != pg.lastID {
		t.Fatalf("merged: %d CEs, cursor %q; want the %d of the page and its last id", len(next), cursor, n)
	}
}
