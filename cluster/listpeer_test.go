package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

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

// A question to a peer carries the client's Authorization, or this replica's token when the
// client sent none, is marked forwarded by this replica, and is JSON when it has a body; a 503 the
// peer marked HeaderBlocked is read as blocked.
func TestAskAPeer(t *testing.T) {
	type seen struct{ auth, forwarded, contentType string }
	var (
		mu  sync.Mutex
		got []seen
	)
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, seen{r.Header.Get("Authorization"), r.Header.Get(HeaderForwarded), r.Header.Get("Content-Type")})
		mu.Unlock()
		if r.URL.Path == "/blocked" {
			w.Header().Set(HeaderBlocked, "1")
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(peer.Close)
	s := &Share{id: "r1", token: "replica-token", client: peer.Client()}
	o := ceshare.Owner{Replica: "r2", URL: peer.URL}
	ctx := context.Background()
	for _, c := range []struct {
		name, path, authorization string
		body                      []byte
		want                      seen
		blocked                   bool
	}{
		{"the client's Authorization", "/x", "Bearer client", nil, seen{"Bearer client", "r1", ""}, false},
		{"none: this replica's token", "/x", "", nil, seen{"Bearer replica-token", "r1", ""}, false},
		{"a body", "/x", "", []byte("{}"), seen{"Bearer replica-token", "r1", "application/json"}, false},
		{"a blocked partition", "/blocked", "", nil, seen{"Bearer replica-token", "r1", ""}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			mu.Lock()
			got = nil
			mu.Unlock()
			a, err := s.ask(ctx, o, http.MethodGet, c.path, c.body, c.authorization)
			mu.Lock()
			defer mu.Unlock()
			if err != nil || len(got) != 1 || got[0] != c.want || a.blocked != c.blocked {
				t.Errorf("ask = %+v, %v, peer saw %+v; want %+v, blocked %v", a, err, got, c.want, c.blocked)
			}
		})
	}
}

// A peer's answer of exactly maxPeerAnswer bytes is read whole; one byte more is refused.
func TestReadPeerBodyBound(t *testing.T) {
	b, err := readPeerBody(bytes.NewReader(make([]byte, maxPeerAnswer)))
	if err != nil || len(b) != maxPeerAnswer {
		t.Errorf("readPeerBody of %d bytes: %d bytes, %v; want it whole", maxPeerAnswer, len(b), err)
	}
	if _, err := readPeerBody(bytes.NewReader(make([]byte, maxPeerAnswer+1))); !errors.Is(err, errAnswerTooLarge) {
		t.Errorf("readPeerBody of %d bytes: %v, want errAnswerTooLarge", maxPeerAnswer+1, err)
	}
}

// askOwners asks each replica once, whatever number of partitions it owns, and sorts answers
// from failures by replica.
func TestAskOwners(t *testing.T) {
	owners := map[int]ceshare.Owner{0: {Replica: "r1"}, 1: {Replica: "r2"}, 2: {Replica: "r1"}, 3: {Replica: "r3"}}
	var (
		mu    sync.Mutex
		asked []string
	)
	got, failed := askOwners(owners, func(o ceshare.Owner) (string, error) {
		mu.Lock()
		asked = append(asked, o.Replica)
		mu.Unlock()
		if o.Replica == "r2" {
			return "", ErrPeer
		}
		return "page of " + o.Replica, nil
	})
	sort.Strings(asked)
	if fmt.Sprint(asked) != "[r1 r2 r3]" || len(got) != 2 || got["r1"] != "page of r1" || got["r3"] != "page of r3" ||
		len(failed) != 1 || failed["r2"] != ErrPeer {
		t.Errorf("askOwners asked %v: got %v, failed %v", asked, got, failed)
	}
}

// The cluster's audit report adds the replicas' counts, evaluated, re-anchored, changed, batches
// and behind, takes the oldest posterior version any started under and the longest duration, and
// keeps each replica's report.
func TestSumAudits(t *testing.T) {
	reports := map[string]ledger.AuditReport{
		"r1": {PosteriorVersion: 9, Counts: map[certify.Status]int{certify.Certified: 2}, Evaluated: 2, Reanchored: 1, Changed: 1, Batches: 1, Behind: 1, Duration: 3 * time.Second},
		"r2": {PosteriorVersion: 7, Counts: map[certify.Status]int{certify.Certified: 3}, Evaluated: 3, Reanchored: 2, Changed: 0, Batches: 2, Behind: 0, Duration: 5 * time.Second},
		"r3": {PosteriorVersion: 8, Counts: map[certify.Status]int{certify.Certified: 1}, Evaluated: 1, Reanchored: 0, Changed: 2, Batches: 1, Behind: 2, Duration: time.Second},
	}
	got := sumAudits(reports)
	want := ledger.AuditReport{PosteriorVersion: 7, Counts: map[certify.Status]int{certify.Certified: 6}, Evaluated: 6, Reanchored: 3, Changed: 3,
		Batches: 4, Behind: 3, Duration: 5 * time.Second}
	if fmt.Sprint(got.AuditReport) != fmt.Sprint(want) || len(got.Replicas) != 3 {
		t.Errorf("sumAudits = %+v, want %+v with 3 replicas", got.AuditReport, want)
	}
}

// A replica advertises replication.advertise_url when set, else the address its API is bound to
// (the host name when it listens on every interface), over https when the API serves TLS.
func TestAdvertiseURL(t *testing.T) {
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		configured, bound string
		tls               bool
		want              string
	}{
		{"http://r1.example:8080", "127.0.0.1:9000", false, "http://r1.example:8080"},
		{"", "127.0.0.1:9000", false, "http://127.0.0.1:9000"},
		{"", "127.0.0.1:9000", true, "https://127.0.0.1:9000"},
		{"", "0.0.0.0:9000", false, "http://" + net.JoinHostPort(host, "9000")},
	} {
		addr, err := net.ResolveTCPAddr("tcp", c.bound)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := AdvertiseURL(c.configured, addr, c.tls); err != nil || got != c.want {
			t.Errorf("AdvertiseURL(%q, %s, %v) = %q, %v; want %q", c.configured, c.bound, c.tls, got, err, c.want)
		}
	}
}

// listAt asks a peer for the partitions the group gives it and the status asked for (none when
// the list is of every status); a peer whose answer to a page of one CE is still too large fails
// the list, and is never asked for a page of none.
func TestListAtAsksForThePartitionsAndStatus(t *testing.T) {
	var (
		mu    sync.Mutex
		asked []string
	)
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		asked = append(asked, r.URL.RawQuery)
		mu.Unlock()
		if r.URL.Query().Get("after") == "huge" {
			w.Write(make([]byte, maxPeerAnswer+1))
			return
		}
		json.NewEncoder(w).Encode(map[string]any{"counterfactuals": []*ledger.CE{}, "next": ""})
	}))
	t.Cleanup(peer.Close)
	s := &Share{id: "r1", client: peer.Client()}
	o := ceshare.Owner{Replica: "r2", URL: peer.URL}
	ctx := context.Background()
	for _, c := range []struct {
		name  string
		st    certify.Status
		limit int
		after string
		fails bool
		want  []string
	}{
		{"every status", 0, 10, "", false, []string{"limit=10&partitions=1%2C3"}},
		{"one status", certify.Certified, 10, "a", false, []string{"after=a&limit=10&partitions=1%2C3&status=" + certify.Certified.String()}},
		{"a CE too large", 0, 1, "huge", true, []string{"after=huge&limit=1&partitions=1%2C3"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			mu.Lock()
			asked = nil
			mu.Unlock()
			_, err := s.listAt(ctx, o, []int{1, 3}, c.st, c.limit, c.after, "")
			mu.Lock()
			defer mu.Unlock()
			if (err != nil) != c.fails || fmt.Sprint(asked) != fmt.Sprint(c.want) {
				t.Errorf("listAt: %v, asked %q; want failing %v, asked %q", err, asked, c.fails, c.want)
			}
		})
	}
}
