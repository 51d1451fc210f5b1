package ui_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/ui"
)

// smallLedger is a ledger, closed when the test ends, holding a first posterior of two inputs
// and the classes malignant and benign, which it returns.
func smallLedger(t *testing.T) (*ledger.Ledger, *bnn.Model) {
	t.Helper()
	l, err := ledger.Open(t.TempDir(), ledger.Options{Policy: certify.DefaultPolicy(), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	m := bnn.New(2, []int{4}, []string{"malignant", "benign"}, 0.1, rand.New(rand.NewPCG(3, 4)))
	if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
		t.Fatal(err)
	}
	return l, m
}

// A filtered list whose matches lie past what one page reads says so, rather than "No
// counterfactual matches": 1,200 CEs of target benign come first, then 3 of target malignant, and
// a page reads at most ten pages' worth (500 at the default 50). The walk by the "Next page" links
// finds the 3, and only the last page says that nothing matches. On a narrow screen, where the
// list's header row is hidden, every cell names its column (data-label, in the header's order).
func TestFilteredListSaysWhatItRead(t *testing.T) {
	l, m := smallLedger(t)
	var ces []*ledger.CE
	for i := range 1203 {
		target := 1
		if i >= 1200 {
			target = 0
		}
		ces = append(ces, &ledger.CE{ID: fmt.Sprintf("ce-%05d", i), X: []float64{0, 0}, XCF: []float64{1, 1}, Target: target,
			AnchorVersion: m.Version, P1: 0.99, Var1: 0.001, Samples: 1000, Delta: 0.05, Epsilon: 0.01})
	}
	if err := l.Put(context.Background(), ces...); err != nil {
		t.Fatal(err)
	}
	u := ui.New(ui.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, ledgerSource{l})
	page := func(path string) string {
		rec := httptest.NewRecorder()
		u.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		if rec.Code != 200 {
			t.Fatalf("GET %s: %d %s", path, rec.Code, rec.Body)
		}
		return rec.Body.String()
	}
	next := regexp.MustCompile(`rel="next" href="([^"]+)"`)
	row := regexp.MustCompile(`<tr><td data-label="Id">`)
	var found, empty, pages int
	for path := "/ui/counterfactuals?target=malignant"; path != ""; pages++ {
		body := page(path)
		n := len(row.FindAllString(body, -1))
		found += n
		more := next.FindStringSubmatch(body)
		switch {
		case n == 0 && more != nil:
			empty++
			if !strings.Contains(body, "This page read 500 counterfactuals and none matches. Counterfactuals remain unread") {
				t.Errorf("page %d (%s) is empty with a next page, and does not say what it read", pages, path)
			}
		case strings.Contains(body, "No counterfactual matches") && more != nil:
			t.Errorf("page %d (%s) says nothing matches and links a next page", pages, path)
		}
		path = ""
		if more != nil {
			path = strings.ReplaceAll(more[1], "&amp;", "&")
		}
	}
	if found != 3 || empty != 2 {
		t.Errorf("walking target=malignant: %d CEs on %d pages, %d of them empty with a next page; want 3, with 2 empty", found, pages, empty)
	}

	labelled(t, page("/ui/counterfactuals"), "ces")
	labelled(t, page("/ui/"), "counts")
	labelled(t, page("/ui/counterfactuals/ce-00001"), "features")
	if body := page("/ui/counterfactuals"); !strings.Contains(body, "50 counterfactuals on this page of 1,203 stored") {
		t.Error("the list's caption does not say how many CEs it holds in all")
	}
}

// A list of one CE says "1 counterfactual", not "1 counterfactuals".
func TestListOfOneSaysOne(t *testing.T) {
	l, m := smallLedger(t)
	ce := &ledger.CE{ID: "ce-1", X: []float64{0, 0}, XCF: []float64{1, 1}, Target: 1,
		AnchorVersion: m.Version, P1: 0.99, Var1: 0.001, Samples: 1000, Delta: 0.05, Epsilon: 0.01}
	if err := l.Put(context.Background(), ce); err != nil {
		t.Fatal(err)
	}
	u := ui.New(ui.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, ledgerSource{l})
	rec := httptest.NewRecorder()
	u.ServeHTTP(rec, httptest.NewRequest("GET", "/ui/counterfactuals", nil))
	if body := rec.Body.String(); rec.Code != 200 || !strings.Contains(body, "1 counterfactual on this page of 1 stored") {
		t.Errorf("GET /ui/counterfactuals with one CE: %d; the caption does not say \"1 counterfactual on this page of 1 stored\":\n%s", rec.Code, body)
	}
}

// A filtered page that read one CE (a replica's page may be short: its owners fill their part
// of it) and found no match says "1 counterfactual", not "1 counterfactuals".
func TestFilteredPageThatReadOneSaysOne(t *testing.T) {
	l, m := smallLedger(t)
	ce := &ledger.CE{ID: "ce-1", X: []float64{0, 0}, XCF: []float64{1, 1}, Target: 1,
		AnchorVersion: m.Version, P1: 0.99, Var1: 0.001, Samples: 1000, Delta: 0.05, Epsilon: 0.01}
	if err := l.Put(context.Background(), ce); err != nil {
		t.Fatal(err)
	}
	u := ui.New(ui.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, shortPages{ledgerSource{l}})
	rec := httptest.NewRecorder()
	u.ServeHTTP(rec, httptest.NewRequest("GET", "/ui/counterfactuals?target=malignant", nil))
	if body := rec.Body.String(); rec.Code != 200 || !strings.Contains(body, "This page read 1 counterfactual and none matches") {
		t.Errorf("GET a filtered page that read one CE: %d; it does not say \"This page read 1 counterfactual and none matches\":\n%s", rec.Code, body)
	}
}

// shortPages is a source whose first page holds the first CE only and whose later pages are
// empty, each with a cursor to go on from, as a replica's pages can be.
type shortPages struct{ ledgerSource }

func (s shortPages) List(ctx context.Context, st certify.Status, limit int, after string) ([]*ledger.CE, string, error) {
	if after != "" {
		return nil, after, nil
	}
	ces, _, err := s.ledgerSource.List(ctx, st, 1, after)
	if err != nil || len(ces) == 0 {
		return nil, "", err
	}
	return ces, ces[0].ID, nil
}

// labelled checks that the first row of body's table of class class labels each data cell with
// its column's header (data-label, in the header's order), a row header (th scope="row") aside:
// on a narrow screen the header row is hidden and each cell shows its label.
func labelled(t *testing.T, body, class string) {
	t.Helper()
	i := strings.Index(body, `<table class="`+class+`">`)
	if i < 0 {
		t.Fatalf("no table of class %s", class)
	}
	table := body[i:]
	table = table[:strings.Index(table, "</table>")]
	var heads []string
	for _, m := range regexp.MustCompile(`<th scope="col">([^<]+)</th>`).FindAllStringSubmatch(table, -1) {
		heads = append(heads, m[1])
	}
	first := table[strings.Index(table, "<tbody>"):]
	first = first[:strings.Index(first, "</tr>")]
	heads = heads[min(len(heads), strings.Count(first, `<th scope="row"`)):]
	var labels []string
	for _, m := range regexp.MustCompile(`<td[^>]* data-label="([^"]+)"`).FindAllStringSubmatch(first, -1) {
		labels = append(labels, m[1])
	}
	if cells := strings.Count(first, "<td"); len(heads) == 0 || strings.Join(labels, "|") != strings.Join(heads, "|") || cells != len(heads) {
		t.Errorf("the %s table's first row labels its %d cells %q, want the header's %q", class, cells, labels, heads)
	}
}

// brokerDownSource is a ledger's Snapshot as a daemon whose broker does not answer, with
// records held by on_breach: reject, would give it.
type brokerDownSource struct{ ledgerSource }

func (s brokerDownSource) Snapshot(ctx context.Context) (ui.Snapshot, error) {
	snap, err := s.ledgerSource.Snapshot(ctx)
	snap.NotReady = "consumer not ready: the broker has not answered yet: dial tcp 127.0.0.1:9: connect: connection refused"
	snap.Gauges = map[string]float64{`cfguard_records_total{result="held"}`: 633, `cfguard_records_total{result="applied"}`: 0}
	return snap, err
}

// The overview says whether the daemon is ready, and why not, as /readyz does, and counts the
// records held (not learned) by on_breach: reject, which no other figure shows.
func TestOverviewSaysWhyNotReadyAndWhatIsHeld(t *testing.T) {
	l, _ := smallLedger(t)
	for _, tc := range []struct {
		src   ui.Source
		ready string
		held  bool
	}{
		{ledgerSource{l}, `<dd id="ready">yes</dd>`, false},
		{brokerDownSource{ledgerSource{l}}, `<dd id="ready">no: consumer not ready: the broker has not answered yet: dial tcp 127.0.0.1:9: connect: connection refused</dd>`, true},
	} {
		u := ui.New(ui.Config{Logger: slog.New(slog.DiscardHandler)}, tc.src)
		rec := httptest.NewRecorder()
		u.ServeHTTP(rec, httptest.NewRequest("GET", "/ui/", nil))
		body := rec.Body.String()
		if rec.Code != 200 || !strings.Contains(body, tc.ready) {
			t.Errorf("%T: overview %d, want %q", tc.src, rec.Code, tc.ready)
		}
		if held := strings.Contains(body, `<dd id="held">633, in updates over the KL budget`); held != tc.held {
			t.Errorf("%T: the overview shows the records held: %t, want %t", tc.src, held, tc.held)
		}
	}
}

// deadLetterSource is a ledger's Snapshot as a daemon that dead-lettered records would give it.
type deadLetterSource struct{ ledgerSource }

func (s deadLetterSource) Snapshot(ctx context.Context) (ui.Snapshot, error) {
	snap, err := s.ledgerSource.Snapshot(ctx)
	snap.Gauges = map[string]float64{`cfguard_records_total{result="dead_lettered"}`: 41, `cfguard_records_total{result="applied"}`: 7}
	return snap, err
}

// CfguardDeadLetterRateHigh's ui_path is a page that shows what the alert counts: the records
// dead-lettered, which no other page shows.
func TestDeadLetterAlertPageShowsTheDeadLetters(t *testing.T) {
	rules, err := os.ReadFile("../alerts/rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?s)- alert: CfguardDeadLetterRateHigh\n.*?ui_path: "([^"]+)"`).FindSubmatch(rules)
	if m == nil {
		t.Fatal("alerts/rules.yml: no ui_path for CfguardDeadLetterRateHigh")
	}
	l, _ := smallLedger(t)
	for _, tc := range []struct {
		src  ui.Source
		dead bool
	}{{ledgerSource{l}, false}, {deadLetterSource{ledgerSource{l}}, true}} {
		u := ui.New(ui.Config{Logger: slog.New(slog.DiscardHandler)}, tc.src)
		rec := httptest.NewRecorder()
		u.ServeHTTP(rec, httptest.NewRequest("GET", string(m[1]), nil))
		body := rec.Body.String()
		if rec.Code != 200 {
			t.Fatalf("%T: %s answered %d", tc.src, m[1], rec.Code)
		}
		if dead := strings.Contains(body, `<dd id="dead-lettered">41, refused by validation`); dead != tc.dead {
			t.Errorf("%T: CfguardDeadLetterRateHigh's page %s shows the records dead-lettered: %t, want %t", tc.src, m[1], dead, tc.dead)
		}
	}
}

// statusSource is a ledger's pages with the statuses and histories a test gives some CEs, as a
// drift would have left them (the ledger stores a CE certified).
type statusSource struct {
	ledgerSource
	status  map[string]certify.Status
	history map[string][]ledger.StatusChange
	version uint64 // the snapshot's posterior version, when set
}

func (s statusSource) Snapshot(ctx context.Context) (ui.Snapshot, error) {
	snap, err := s.ledgerSource.Snapshot(ctx)
	if s.version > 0 {
		snap.PosteriorVersion = s.version
	}
	return snap, err
}

func (s statusSource) patch(ce *ledger.CE) *ledger.CE {
	c := *ce
	if st, ok := s.status[c.ID]; ok {
		c.Status, c.History = st, s.history[c.ID]
	}
	return &c
}

func (s statusSource) List(ctx context.Context, st certify.Status, limit int, after string) ([]*ledger.CE, string, error) {
	ces, next, err := s.ledgerSource.List(ctx, st, limit, after)
	for i := range ces {
		ces[i] = s.patch(ces[i])
	}
	return ces, next, err
}

func (s statusSource) Get(ctx context.Context, id string) (*ledger.CE, error) {
	ce, err := s.ledgerSource.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	return s.patch(ce), nil
}

// TestReissueLinksFollowTheNames: with explain.reissue, a CE's page links the CEs stored as
// "<id>.r<version>" (a long id's stem and ".r<version>") for the same input and target, each
// with what its status says, and a replacement's page the CE it replaces, when that CE stopped
// holding by that version (its history changed its status out of certified at or before it,
// or begins after it when full), as the reissuer's replacements do. A CE of that name with
// another input, a name that is not a version, a version not reached yet, and a name a client
// gave while the CE it names held (also one not certified now), are not linked.
func TestReissueLinksFollowTheNames(t *testing.T) {
	l, m := smallLedger(t)
	x, other := []float64{0.5, 0.25}, []float64{0.5, 0.2505}
	long := func(last string) string { return strings.Repeat("p", ident.MaxLen-1) + last }
	mid := strings.Repeat("m", 110)
	ces := map[string][]float64{
		"ce-000": x, "ce-000.r7": x, "ce-000.r12": x, "ce-000.r9": other, "ce-000.rc2": x,
		"ce-001": x, "ce-001.r3": x, // ce-001 held throughout: a client's own name
		"ce-002": x, "ce-002.r4": x, "ce-002.r6": x, // ce-002 lapsed at version 5 and was certified again
		long("a"): x, long("b"): x, ident.Reissue(long("a"), 5): x, ident.Reissue(long("b"), 5): x,
		mid: x, mid + ".r3": x, ident.Reissue(mid, 4): x,
		"ce-003": x, "ce-003.r1": x, "ce-003.r9": x, "ce-003.r500": x, // ce-003 lapsed at version 5; the posterior is at 20
		"ce-004": x, "ce-004.r2": x, // ce-004's full history begins at version 3, after its lapse
	}
	var put []*ledger.CE
	for id, in := range ces {
		put = append(put, &ledger.CE{ID: id, X: in, XCF: []float64{1, 1}, Target: 1, AnchorVersion: m.Version,
			P1: 0.99, Var1: 0.001, Samples: 1000, Delta: 0.05, Epsilon: 0.01})
	}
	if err := l.Put(context.Background(), put...); err != nil {
		t.Fatal(err)
	}
	lapsed := []ledger.StatusChange{{From: certify.Certified, To: certify.Invalidated, PosteriorVersion: 2}}
	var full []ledger.StatusChange // ledger.MaxHistory changes from version 3 on: the lapse is older
	for v := range ledger.MaxHistory {
		from, to := certify.Invalidated, certify.AtRisk
		if v%2 == 1 {
			from, to = to, from
		}
		full = append(full, ledger.StatusChange{From: from, To: to, PosteriorVersion: uint64(3 + v)})
	}
	src := statusSource{ledgerSource: ledgerSource{l}, status: map[string]certify.Status{
		"ce-000": certify.Invalidated, long("a"): certify.Invalidated, long("b"): certify.AtRisk, mid: certify.Invalidated,
		"ce-002": certify.Certified, "ce-003": certify.AtRisk, "ce-004": certify.Invalidated, "ce-000.r12": certify.Uncertified,
	}, version: 20, history: map[string][]ledger.StatusChange{
		"ce-003": {{From: certify.Certified, To: certify.AtRisk, PosteriorVersion: 5}},
		"ce-004": full,
		"ce-000": lapsed, long("a"): lapsed, long("b"): lapsed, mid: lapsed,
		"ce-002": {{From: certify.Certified, To: certify.AtRisk, PosteriorVersion: 5}, {From: certify.AtRisk, To: certify.Certified, PosteriorVersion: 8}},
	}}
	u := ui.New(ui.Config{Reissue: true, Logger: slog.New(slog.DiscardHandler)}, src)
	page := func(id string) string {
		rec := httptest.NewRecorder()
		u.ServeHTTP(rec, httptest.NewRequest("GET", "/ui/counterfactuals/"+id, nil))
		if rec.Code != 200 {
			t.Fatalf("GET /ui/counterfactuals/%s: %d %s", id, rec.Code, rec.Body)
		}
		return rec.Body.String()
	}
	link := func(id string) string { return `<a href="/ui/counterfactuals/` + id + `">` + id + `</a>` }
	names := func(p string) bool {
		return strings.Contains(p, `id="reissue-of"`) || strings.Contains(p, `id="reissues"`)
	}
	if got, want := page("ce-000"), "Replaced by "+link("ce-000.r12")+" (uncertified: never certified, no guarantee applies); "+link("ce-000.r7")+
		" (certified"; !strings.Contains(got, want) ||
		strings.Contains(got, link("ce-000.r9")) || strings.Contains(got, link("ce-000.rc2")) {
		t.Errorf("ce-000's page: want %q and no other replacement linked", want)
	}
	if !strings.Contains(page("ce-000.r7"), "This explanation replaces "+link("ce-000")) {
		t.Error("ce-000.r7's page does not link ce-000")
	}
	if got := page("ce-003"); !strings.Contains(got, "Replaced by "+link("ce-003.r9")+" (") || strings.Contains(got, link("ce-003.r1")) ||
		strings.Contains(got, link("ce-003.r500")) {
		t.Error("ce-003 (lapsed at version 5, the posterior at 20): want ce-003.r9 linked, not ce-003.r1 nor ce-003.r500")
	}
	if !strings.Contains(page("ce-004.r2"), "This explanation replaces "+link("ce-004")) {
		t.Error("ce-004.r2's page does not link ce-004, whose full history begins after version 2")
	}
	for _, id := range []string{"ce-000.r9", "ce-000.rc2", "ce-001", "ce-001.r3", "ce-002.r4", "ce-003.r1", "ce-003.r500"} {
		if names(page(id)) {
			t.Errorf("%s's page names a reissue", id)
		}
	}
	if got := page("ce-002"); !strings.Contains(got, "Replaced by "+link("ce-002.r6")+" (") || strings.Contains(got, link("ce-002.r4")) {
		t.Error("ce-002 (lapsed at version 5): want ce-002.r6 linked, not ce-002.r4")
	}
	if got := page(mid); !strings.Contains(got, link(mid+".r3")) || !strings.Contains(got, link(ident.Reissue(mid, 4))) {
		t.Errorf("%s's page does not link both its replacements", mid)
	}
	for _, pair := range [][2]string{{long("a"), ident.Reissue(long("a"), 5)}, {long("b"), ident.Reissue(long("b"), 5)}} {
		if got := page(pair[0]); !strings.Contains(got, "Replaced by "+link(pair[1])+" (") {
			t.Errorf("%s's page does not link its replacement %s alone", pair[0], pair[1])
		}
		if got := page(pair[1]); !strings.Contains(got, "This explanation replaces "+link(pair[0])) {
			t.Errorf("%s's page does not link %s", pair[1], pair[0])
		}
	}
}
