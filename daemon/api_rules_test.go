package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/ui"
)

// fakeState is a stateReader whose KL history holds kl entries; it remembers the n last asked for.
type fakeState struct {
	kl    int
	asked int
	ces   map[string]*ledger.CE // what Get finds
}

func (f *fakeState) Get(id string) (*ledger.CE, error) {
	if ce, ok := f.ces[id]; ok {
		return ce, nil
	}
	return nil, ledger.ErrNotFound
}
func (f *fakeState) List(certify.Status, int, string) ([]*ledger.CE, error) {
	return nil, nil
}
func (f *fakeState) State() (ledger.State, error) { return ledger.State{Applied: 7}, nil }
func (f *fakeState) KLHistory(n int) ([]ledger.KLEntry, error) {
	f.asked = n
	h := make([]ledger.KLEntry, min(n, f.kl))
	for i := range h {
		h[i] = ledger.KLEntry{Seq: uint64(i + 1), PosteriorVersion: uint64(i + 1), Outcome: certify.OutcomePromoted}
	}
	return h, nil
}
func (f *fakeState) Anchors() ([]ledger.Anchor, error)                { return nil, nil }
func (f *fakeState) Outbox(uint64, int) ([]ledger.OutboxEntry, error) { return nil, nil }
func (f *fakeState) OutboxNewest(n int) ([]ledger.OutboxEntry, error) {
	f.asked = n
	return []ledger.OutboxEntry{{Seq: 9}}, nil
}

// rulesCore is a fakeCore that remembers the deadline of its readiness check and the
// authorization its reads were forwarded with, and answers readiness with notReady.
type rulesCore struct {
	fakeCore
	notReady  error
	deadline  time.Time
	auth      []string
	forwarded bool // a read was marked forwarded by another replica
	readErr   error
}

func (c *rulesCore) readiness(ctx context.Context) error {
	c.deadline, _ = ctx.Deadline()
	return c.notReady
}

func (c *rulesCore) find(_ context.Context, _ string, auth string, forwarded bool) (*ledger.CE, string, error) {
	c.auth = append(c.auth, auth)
	c.forwarded = c.forwarded || forwarded
	return nil, "", c.readErr
}

func (c *rulesCore) list(_ context.Context, _ certify.Status, _ int, _, auth string, forwarded bool, _ []int) ([]*ledger.CE, string, error) {
	c.auth = append(c.auth, auth)
	c.forwarded = c.forwarded || forwarded
	return nil, "", c.readErr
}

// within2s reports whether deadline is 2 s after a moment between start and end.
func within2s(deadline, start, end time.Time) bool {
	return !deadline.Before(start.Add(2*time.Second)) && !deadline.After(end.Add(2*time.Second))
}

// rulesAPI is an API over rulesCore and fakeState, without a daemon, on a loopback address.
func rulesAPI(token string, c *rulesCore, st *fakeState) *api {
	if c.m == nil {
		c.m = smallModel(4)
	}
	return &api{
		cfg: apiConfig{token: token, maxBodyBytes: 1 << 20, loopback: true, budget: 0.5, delta: 0.05, epsilon: 0.02,
			mode: "enforce", onBreach: "pause"},
		state: st, core: c, predict: &inputBudget{max: maxPredictBatch}, metrics: http.NotFoundHandler(),
	}
}

// serve sends one request to a's routes from a loopback client.
func serve(a *api, method, target, body string, header map[string]string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, target, strings.NewReader(body))
	req.Host = "127.0.0.1:8080"
	for k, v := range header {
		req.Header.Set(k, v)
	}
	rec := httptest.NewRecorder()
	a.routes().ServeHTTP(rec, req)
	return rec
}

// With http.token set, only "Bearer <token>" passes; a refusal names the realm a client is to
// authenticate to. Without a token on a loopback address, a Host of an IPv6 address passes also
// without a port, and a DNS name does not.
func TestAPIAuthorizationRules(t *testing.T) {
	for _, c := range []struct {
		name, token, authorization, host string
		want                             int
	}{
		{"the bearer token", "t0ken", "Bearer t0ken", "", 200},
		{"the scheme in lower case (RFC 9110: case-insensitive)", "t0ken", "bearer t0ken", "", 200},
		{"the token without its scheme", "t0ken", "t0ken", "", 401},
		{"another scheme", "t0ken", "Basic t0ken", "", 401},
		{"a token that only begins as it", "t0ken", "Bearer t0ken2", "", 401},
		{"no token, IPv6 without a port", "", "", "[::1]", 200},
		{"no token, IPv6 with a port", "", "", "[::1]:8080", 200},
		{"no token, localhost without a port", "", "", "LOCALHOST", 200},
		{"no token, a name ending in localhost", "", "", "evil-localhost:8080", 403},
	} {
		t.Run(c.name, func(t *testing.T) {
			a := rulesAPI(c.token, &rulesCore{}, &fakeState{})
			req := httptest.NewRequest("GET", "/v1/model", nil)
			req.Host = "127.0.0.1:8080"
			if c.host != "" {
				req.Host = c.host
			}
			if c.authorization != "" {
				req.Header.Set("Authorization", c.authorization)
			}
			rec := httptest.NewRecorder()
			a.routes().ServeHTTP(rec, req)
			if rec.Code != c.want {
				t.Fatalf("GET /v1/model: %d %s, want %d", rec.Code, rec.Body, c.want)
			}
			if c.want == 401 {
				if got := rec.Header().Get("WWW-Authenticate"); got != `Bearer realm="cfguard"` {
					t.Errorf("WWW-Authenticate %q, want Bearer realm=\"cfguard\"", got)
				}
				if !strings.Contains(rec.Body.String(), "missing or wrong bearer token") {
					t.Errorf("the refusal %s does not say the bearer token is missing or wrong", rec.Body)
				}
			}
		})
	}
}

// Both posterior files are served with Cache-Control no-cache, their content type and length;
// If-None-Match matches the current ETag also weak, in a list, or as "*", and nothing else; a
// header that is not entity tags is 400, as If-Match's is.
func TestPosteriorHeaderRules(t *testing.T) {
	a := rulesAPI("", &rulesCore{}, &fakeState{})
	for _, c := range []struct{ path, ctype string }{
		{"/v1/model/posterior", "application/octet-stream"},
		{"/v1/model/posterior/sidecar", "application/json"},
	} {
		rec := serve(a, "GET", c.path, "", nil)
		etag := rec.Header().Get("ETag")
		if rec.Code != 200 || rec.Header().Get("Content-Type") != c.ctype || rec.Header().Get("Cache-Control") != "no-cache" ||
			rec.Header().Get("Content-Length") != strconv.Itoa(rec.Body.Len()) || etag == "" {
			t.Fatalf("GET %s: %d %v, want 200, %s, no-cache, its length and an ETag", c.path, rec.Code, rec.Header(), c.ctype)
		}
		for _, m := range []struct {
			ifNoneMatch string
			want        int
		}{
			{etag, 304},
			{"W/" + etag, 304},
			{"*", 304},
			{`"other", ` + etag, 304},
			{`"other"`, 200},
			{strings.Trim(etag, `"`), 400},
		} {
			rec := serve(a, "GET", c.path, "", map[string]string{"If-None-Match": m.ifNoneMatch})
			if rec.Code != m.want {
				t.Errorf("GET %s If-None-Match %s: %d, want %d", c.path, m.ifNoneMatch, rec.Code, m.want)
			}
			if rec.Code == 304 && (rec.Header().Get("Cache-Control") != "no-cache" || rec.Header().Get("ETag") != etag || rec.Body.Len() != 0) {
				t.Errorf("GET %s If-None-Match %s: 304 with %v and %d bytes, want no-cache, the ETag and no body", c.path, m.ifNoneMatch, rec.Header(), rec.Body.Len())
			}
		}
	}
}

// POST /v1/predict takes exactly one of x and xs, and xs of 1 to maxPredictBatch inputs: the
// count is checked before the inputs are.
func TestPredictInputCountRules(t *testing.T) {
	a := rulesAPI("", &rulesCore{}, &fakeState{})
	empties := func(n int) string { return `{"xs":[` + strings.TrimSuffix(strings.Repeat("[],", n), ",") + `]}` }
	for _, c := range []struct {
		name, body, says string
	}{
		{"both x and xs", `{"x":[1,2,3],"xs":[[1,2,3]]}`, "give exactly one of x (one input) or xs (a batch)"},
		{"neither", `{}`, "give exactly one of x (one input) or xs (a batch)"},
		{"an empty batch", `{"xs":[]}`, "xs must hold 1..10000 inputs, got 0"},
		{"one input too many", empties(maxPredictBatch + 1), "xs must hold 1..10000 inputs, got 10001"},
		{"as many as it takes", empties(maxPredictBatch), "xs[0] has 0 features, the model takes 3"},
	} {
		t.Run(c.name, func(t *testing.T) {
			rec := serve(a, "POST", "/v1/predict", c.body, nil)
			if rec.Code != 400 || !strings.Contains(rec.Body.String(), c.says) {
				t.Fatalf("%d %s, want 400 saying %q", rec.Code, rec.Body, c.says)
			}
		})
	}
	rec := serve(a, "POST", "/v1/predict", `{"xs":[[1,2,3],[0,0,0]]}`, nil)
	var out struct {
		PosteriorVersion uint64 `json:"posterior_version"`
		Predictions      []prediction
	}
	if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &out) != nil || out.PosteriorVersion != 4 || len(out.Predictions) != 2 {
		t.Fatalf("a batch of two: %d %s", rec.Code, rec.Body)
	}
}

// idCore is a rulesCore whose find answers held (the CE the id's owner holds) or err: on a
// replica, the owner of the id's partition, which may be another replica.
type idCore struct {
	rulesCore
	held *ledger.CE
	err  error
}

func (c *idCore) find(context.Context, string, string, bool) (*ledger.CE, string, error) {
	return c.held, "r2", c.err
}

// heldState is a fakeState whose ledger holds ce under every id: on a replica, a copy of a share
// it held before, or nothing of the id's partition.
type heldState struct {
	fakeState
	ce *ledger.CE
}

func (s *heldState) Get(string) (*ledger.CE, error) {
	if s.ce == nil {
		return nil, ledger.ErrNotFound
	}
	return s.ce, nil
}

// POST /v1/explain with an id answers 409 before any generation when the id's owner holds a CE,
// also on a replica that does not hold the id's partition, and goes on to generate when the
// owner holds none (whatever this replica's ledger keeps) or cannot say now, for the
// registration to judge the id. The only generation slot is taken here, so a request that goes
// on is answered 429.
func TestExplainIDTakenRules(t *testing.T) {
	stored := &ledger.CE{ID: "ce-1"}
	for _, c := range []struct {
		name  string
		held  *ledger.CE // the owner's answer
		err   error      // the owner's error
		local *ledger.CE // this replica's ledger
		want  int
	}{
		{"held by the owner, another replica", stored, nil, nil, 409},
		{"held here", stored, nil, stored, 409},
		{"held by none", nil, ledger.ErrNotFound, nil, 429},
		{"an old copy here, deleted since by the owner", nil, ledger.ErrNotFound, stored, 429},
		{"damaged here", nil, ledger.ErrQuarantined, nil, 429},
		{"a partition without an owner", nil, ceshare.ErrNoOwner, nil, 429},
		{"a partition being rebuilt", nil, cluster.ErrRebuilding, nil, 429},
		{"an owner that does not answer", nil, &cluster.UnreachableError{Err: errors.New("dial: refused"), RetryAfter: time.Second}, nil, 429},
		{"a ledger that cannot be read", nil, errors.New("ledger: read: input/output error"), nil, 429},
	} {
		t.Run(c.name, func(t *testing.T) {
			a := rulesAPI("", &rulesCore{}, &fakeState{})
			a.core = &idCore{rulesCore: rulesCore{fakeCore: fakeCore{m: smallModel(4)}}, held: c.held, err: c.err}
			a.state = &heldState{ce: c.local}
			a.exp = &explainer{slots: newSlots(1)}
			release, ok := a.exp.slots.acquire()
			if !ok {
				t.Fatal("no slot")
			}
			defer release()
			rec := serve(a, "POST", "/v1/explain", `{"id":"ce-1","x":[0,0,0]}`, nil)
			if rec.Code != c.want {
				t.Fatalf("%d %s, want %d", rec.Code, rec.Body, c.want)
			}
		})
	}
}

// A CE's ETag names its registration, not its answer: the answer's status, bound and
// posterior_version change with the posterior while the ETag stays. A GET whose If-None-Match
// names the ETag of an earlier answer is therefore answered in full (200, the current status),
// never 304, which would have a polling client or a cache keep the status it read first; "*"
// (a CE is stored) is 304, and If-Match still compares the registration's tag.
func TestCEGetIfNoneMatchAnswersTheCurrentState(t *testing.T) {
	ce := &ledger.CE{ID: "ce-1", X: []float64{0, 0, 0}, XCF: []float64{1, 1, 1}, Target: 1, Status: certify.Certified,
		PosteriorVersion: 4, CreatedAt: time.Unix(1700000000, 0).UTC()}
	core := &idCore{rulesCore: rulesCore{fakeCore: fakeCore{m: smallModel(4)}}, held: ce}
	a := rulesAPI("", &rulesCore{}, &fakeState{})
	a.core = core
	first := serve(a, "GET", "/v1/counterfactuals/ce-1", "", nil)
	tag := first.Header().Get("ETag")
	if first.Code != http.StatusOK || tag == "" || !strings.Contains(first.Body.String(), `"status":"certified"`) {
		t.Fatalf("GET: %d ETag %q %s", first.Code, tag, first.Body)
	}
	later := *ce // the same registration, measured under a later posterior
	later.Status, later.PosteriorVersion = certify.Invalidated, 9
	core.held = &later
	for _, c := range []struct {
		header, value string
		want          int
	}{
		{"If-None-Match", tag, http.StatusOK},
		{"If-None-Match", "W/" + tag, http.StatusOK},
		{"If-None-Match", "*", http.StatusNotModified},
		{"If-Match", tag, http.StatusOK},
		{"If-Match", `"00000000000000000000000000000000"`, http.StatusPreconditionFailed},
	} {
		rec := serve(a, "GET", "/v1/counterfactuals/ce-1", "", map[string]string{c.header: c.value})
		if rec.Code != c.want || rec.Header().Get("ETag") != tag {
			t.Errorf("GET with %s %s after the CE's status changed: %d ETag %q; want %d with the ETag %s", c.header, c.value, rec.Code, rec.Header().Get("ETag"), c.want, tag)
		}
		if rec.Code == http.StatusOK && !strings.Contains(rec.Body.String(), `"status":"invalidated"`) {
			t.Errorf("GET with %s %s: %s; want the current status, invalidated", c.header, c.value, rec.Body)
		}
	}
}

// A list query that is refused (an unknown parameter, a bad status or limit) is 400 also with
// an If-Match or If-None-Match that would fail: RFC 9110 (13.2.1) has a server ignore the
// conditions of a request it would refuse without them, so the client learns what to fix. A
// good query still evaluates them (412, 304).
func TestListQueryIsCheckedBeforeConditions(t *testing.T) {
	a := rulesAPI("", &rulesCore{}, &fakeState{})
	const other = `"00000000000000000000000000000000"`
	for _, c := range []struct {
		query, header, value string
		want                 int
	}{
		{"?statu=certified", "If-Match", other, http.StatusBadRequest},
		{"?status=certifed", "If-Match", other, http.StatusBadRequest},
		{"?limit=0", "If-None-Match", "*", http.StatusBadRequest},
		{"?status=certified", "If-Match", other, http.StatusPreconditionFailed},
		{"?limit=5", "If-None-Match", "*", http.StatusNotModified},
		{"", "If-Match", "*", http.StatusOK},
	} {
		rec := serve(a, "GET", "/v1/counterfactuals"+c.query, "", map[string]string{c.header: c.value})
		if rec.Code != c.want {
			t.Errorf("GET /v1/counterfactuals%s with %s %s: %d %s; want %d", c.query, c.header, c.value, rec.Code, rec.Body, c.want)
		}
	}
}

// waitingCore is a rulesCore that never applies the version a prediction waits for: its
// awaitVersion returns the current posterior once ctx ends.
type waitingCore struct{ rulesCore }

func (c *waitingCore) awaitVersion(ctx context.Context, _ uint64) (*bnn.Model, error) {
	<-ctx.Done()
	return c.m, nil
}

// A prediction whose min_version the daemon does not apply within replication.register_wait
// is answered 503 with Retry-After also when the wait outlasts http.write_timeout (a single
// daemon does not check register_wait against it): the write deadline is moved past the wait,
// as POST /v1/explain moves it past explain.timeout, instead of cutting the answer.
func TestPredictMinVersionWaitOutlastsWriteTimeout(t *testing.T) {
	a := rulesAPI("", &rulesCore{}, &fakeState{})
	a.core = &waitingCore{rulesCore{fakeCore: fakeCore{m: smallModel(4)}}}
	a.cfg.writeTimeout, a.cfg.versionWait = 200*time.Millisecond, 600*time.Millisecond
	srv := httptest.NewUnstartedServer(a.routes())
	srv.Config.WriteTimeout = a.cfg.writeTimeout
	srv.Start()
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/v1/predict", "application/json", strings.NewReader(`{"x":[0,0,0],"min_version":5}`))
	if err != nil {
		t.Fatalf("min_version 5, never applied, waited 600ms past a write timeout of 200ms: %v; want 503", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("min_version 5, never applied: %d Retry-After %q; want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}

// A prediction with min_version whose inputs no posterior takes (the wrong number of features, a
// value far out of the model's range) is 400 naming the input, as without min_version: it is not
// held for replication.register_wait and then answered 503 with Retry-After, which would have
// the client send again a request that no version answers.
func TestPredictMinVersionChecksItsInputsFirst(t *testing.T) {
	a := rulesAPI("", &rulesCore{}, &fakeState{})
	a.core = &waitingCore{rulesCore{fakeCore: fakeCore{m: smallModel(4)}}}
	a.cfg.versionWait = time.Second
	for body, says := range map[string]string{
		`{"x":[0,0],"min_version":5}`:                          "x has 2 features, the model takes 3",
		`{"xs":[[0,0,0],[0,0,0,0]],"min_version":5}`:           "xs[1] has 4 features, the model takes 3",
		`{"x":[0,1e300,0],"min_version":18446744073709551615}`: "x[1] = 1e+300",
	} {
		start := time.Now()
		rec := serve(a, "POST", "/v1/predict", body, nil)
		if rec.Code != http.StatusBadRequest || !strings.Contains(rec.Body.String(), says) {
			t.Errorf("%s: %d %s after %v; want 400 saying %q", body, rec.Code, rec.Body, time.Since(start).Round(time.Millisecond), says)
		}
	}
}

// GET /v1/model answers the configuration's figures and the newest 100 KL entries; /healthz and
// /readyz answer their documented bodies, /readyz within 2 s of readiness; /ui is moved for good
// to /ui/.
func TestModelHealthAndReadyAnswers(t *testing.T) {
	st := &fakeState{kl: 150}
	c := &rulesCore{}
	a := rulesAPI("", c, st)
	rec := serve(a, "GET", "/v1/model", "", nil)
	var model map[string]any
	if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &model) != nil {
		t.Fatalf("GET /v1/model: %d %s", rec.Code, rec.Body)
	}
	want := map[string]any{"posterior_version": 4.0, "kl_budget": 0.5, "delta": 0.05, "epsilon": 0.02, "mode": "enforce",
		"on_breach": "pause", "applied": 7.0}
	for k, v := range want {
		if model[k] != v {
			t.Errorf("GET /v1/model %s = %v, want %v", k, model[k], v)
		}
	}
	for _, k := range []string{"classes", "features", "params", "kl_history", "anchors", "offsets", "counters", "counterfactuals", "replication", "prequential", "records_represented"} {
		if _, ok := model[k]; !ok {
			t.Errorf("GET /v1/model has no %s", k)
		}
	}
	if h, _ := model["kl_history"].([]any); len(h) != 100 || st.asked != 100 {
		t.Errorf("GET /v1/model: %d KL entries (asked for %d), want the newest 100", len(h), st.asked)
	}

	if rec := serve(a, "GET", "/healthz", "", nil); rec.Code != 200 || strings.TrimSpace(rec.Body.String()) != `{"status":"ok"}` {
		t.Errorf("GET /healthz: %d %s", rec.Code, rec.Body)
	}
	start := time.Now()
	rec = serve(a, "GET", "/readyz", "", nil)
	var ready map[string]any
	if rec.Code != 200 || json.Unmarshal(rec.Body.Bytes(), &ready) != nil || ready["status"] != "ready" || ready["posterior_version"] != 4.0 {
		t.Errorf("GET /readyz: %d %s, want 200 status ready at version 4", rec.Code, rec.Body)
	}
	if !within2s(c.deadline, start, time.Now()) {
		t.Errorf("readiness was given %v, want 2 s", c.deadline.Sub(start))
	}
	c.notReady = errors.New("embedded broker down")
	if rec := serve(a, "GET", "/readyz", "", nil); rec.Code != 503 || !strings.Contains(rec.Body.String(), "embedded broker down") {
		t.Errorf("GET /readyz when not ready: %d %s, want 503 saying why", rec.Code, rec.Body)
	}

	if rec := serve(a, "GET", "/ui", "", nil); rec.Code != http.StatusMovedPermanently || rec.Header().Get("Location") != "/ui/" {
		t.Errorf("GET /ui: %d Location %q, want 301 to /ui/", rec.Code, rec.Header().Get("Location"))
	}
}

// The UI reads what the API answers: the newest 100 KL entries, readiness within 2 s, pages and
// CEs forwarded with the API's token as a bearer header (none without a token), the errors of a
// replica that will answer as ErrNotYet and of a blocked partition as ErrBlocked, the publisher's
// state, and every gauge and counter of the registry by series.
func TestUISourceRules(t *testing.T) {
	st := &fakeState{kl: 150}
	c := &rulesCore{notReady: errors.New("not yet")}
	s := uiSource{a: rulesAPI("t0ken", c, st), alpha: 0.01}
	start := time.Now()
	snap, err := s.Snapshot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.History) != 100 || st.asked != 100 || snap.NotReady != "not yet" || snap.Alpha != 0.01 || snap.Budget != 0.5 || snap.Mode != "enforce" {
		t.Errorf("snapshot: %d KL entries (asked %d), not ready %q, alpha %v, budget %v, mode %q", len(snap.History), st.asked, snap.NotReady, snap.Alpha, snap.Budget, snap.Mode)
	}
	if !within2s(c.deadline, start, time.Now()) {
		t.Errorf("the snapshot's readiness was given %v, want 2 s", c.deadline.Sub(start))
	}
	if snap.Gauges != nil {
		t.Errorf("gauges without a registry: %v, want none", snap.Gauges)
	}

	for _, token := range []string{"t0ken", ""} {
		c := &rulesCore{}
		s := uiSource{a: rulesAPI(token, c, st)}
		s.List(context.Background(), 0, 10, "")
		s.Get(context.Background(), "ce-1")
		want := ""
		if token != "" {
			want = "Bearer " + token
		}
		if len(c.auth) != 2 || c.auth[0] != want || c.auth[1] != want || c.forwarded {
			t.Errorf("token %q: reads forwarded with %q (marked forwarded: %v), want %q and not marked forwarded", token, c.auth, c.forwarded, want)
		}
	}

	other := errors.New("disk full")
	for _, e := range []struct {
		err             error
		notYet, blocked bool
	}{
		{cluster.ErrBlocked, false, true},
		{ceshare.ErrNoOwner, true, false},
		{cluster.ErrRebuilding, true, false},
		{other, false, false},
	} {
		c := &rulesCore{readErr: e.err}
		s := uiSource{a: rulesAPI("", c, st)}
		_, _, lerr := s.List(context.Background(), 0, 10, "")
		_, gerr := s.Get(context.Background(), "ce-1")
		for _, got := range []error{lerr, gerr} {
			if errors.Is(got, ui.ErrNotYet) != e.notYet || errors.Is(got, ui.ErrBlocked) != e.blocked || !errors.Is(got, e.err) {
				t.Errorf("%v read as %v: not yet %v, blocked %v; want %v, %v", e.err, got, errors.Is(got, ui.ErrNotYet), errors.Is(got, ui.ErrBlocked), e.notYet, e.blocked)
			}
		}
	}
	if _, _, err := (uiSource{a: rulesAPI("", &rulesCore{}, st)}).List(context.Background(), 0, 10, ""); err != nil {
		t.Errorf("a page read without an error: %v", err)
	}

	if p := s.Publishing(); p != (ui.Publishing{}) {
		t.Errorf("publishing not known: %+v, want the zero state", p)
	}
	var pub atomic.Pointer[ui.Publishing]
	s.a.publishing = &pub
	if p := s.Publishing(); p != (ui.Publishing{}) {
		t.Errorf("publishing not stored yet: %+v, want the zero state", p)
	}
	pub.Store(&ui.Publishing{Attempts: 3, Err: "broker down"})
	if p := s.Publishing(); p.Attempts != 3 || p.Err != "broker down" {
		t.Errorf("publishing: %+v, want the stored state", p)
	}

	if ev, err := s.Events(5); err != nil || len(ev) != 1 || ev[0].Seq != 9 || st.asked != 5 {
		t.Errorf("events: %+v %v (asked for %d), want the 5 newest", ev, err, st.asked)
	}

	reg := prometheus.NewRegistry()
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "g"}, []string{"p", "q"})
	g.WithLabelValues("0", `a"b`).Set(3)
	cnt := prometheus.NewCounter(prometheus.CounterOpts{Name: "c_total"})
	cnt.Add(2)
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "h"})
	h.Observe(1)
	reg.MustRegister(g, cnt, h)
	got := uiSource{a: s.a, metrics: reg}.gauges()
	wantG := map[string]float64{`g{p="0",q="a\"b"}`: 3, "c_total": 2}
	if len(got) != len(wantG) {
		t.Errorf("gauges %v, want %v", got, wantG)
	}
	for k, v := range wantG {
		if got[k] != v {
			t.Errorf("gauges[%s] = %v, want %v (all: %v)", k, got[k], v, got)
		}
	}
}

// A request body is bounded by http.max_body_bytes on every route: a body of the limit is read,
// one byte more is a 413 naming the setting.
func TestBodyLimitRule(t *testing.T) {
	const limit = 64
	a := rulesAPI("", &rulesCore{}, &fakeState{})
	a.cfg.maxBodyBytes = limit
	input := `{"x":[1,2,3]}`
	for _, c := range []struct {
		name string
		size int
		want int
		says string
	}{
		{"at the limit", limit, 200, `"prediction":`},
		{"one byte over", limit + 1, 413, "request body over 64 bytes (http.max_body_bytes)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			body := strings.Repeat(" ", c.size-len(input)) + input
			rec := serve(a, "POST", "/v1/predict", body, nil)
			if rec.Code != c.want || !strings.Contains(rec.Body.String(), c.says) {
				t.Fatalf("a body of %d bytes: %d %s, want %d saying %q", len(body), rec.Code, rec.Body, c.want, c.says)
			}
		})
	}
}

// A bulk line refused because its id is taken (ErrExists) is "exists", with the stored CE's
// etag, when the CE stored there is the line's: on a single daemon, whose ledger says so. On a
// replica the refusal is the owner's word that the id holds another CE, and the copy this
// replica's ledger may keep of a share it held before is not read: the line keeps its 409.
func TestBulkLineExistsOnlyByTheLedgerThatHoldsIt(t *testing.T) {
	stored := &ledger.CE{ID: "b-1", X: []float64{1, 2, 3}, XCF: []float64{3, 2, 1}, Target: 1, CreatedAt: time.Unix(1e9, 0).UTC()}
	line := `{"id":"b-1","x":[1,2,3],"x_cf":[3,2,1],"target":1}`
	for _, replicated := range []bool{false, true} {
		a := rulesAPI("", &rulesCore{}, &fakeState{ces: map[string]*ledger.CE{"b-1": stored}}) // registerMany: ErrExists
		a.cfg.replicated = replicated
		rec := serve(a, "POST", "/v1/counterfactuals:bulk", line+"\n", nil)
		var out bulkResponse
		if rec.Code != http.StatusOK || json.Unmarshal(rec.Body.Bytes(), &out) != nil || len(out.Results) != 1 {
			t.Fatalf("replicated %v: %d %s", replicated, rec.Code, rec.Body)
		}
		res := out.Results[0]
		switch {
		case !replicated && (res.Status != "exists" || res.ETag != etag(stored)):
			t.Errorf("single daemon: %+v; want exists with the stored CE's etag %s", res, etag(stored))
		case replicated && (res.Status != "" || res.ETag != "" || res.Code != http.StatusConflict):
			t.Errorf("replica: %+v; want the owner's 409, no etag", res)
		}
	}
}
