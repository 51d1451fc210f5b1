package daemon

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestTokenGuardsEveryV1Endpoint: with http.token set, reads of stored CEs (applicants'
// features) need it too; health and readiness stay open; /metrics needs its own token when set.
// The metrics token begins with a space and holds a tab, as a token may (config refuses only what
// a header cannot carry): both reach the server as sent.
func TestTokenGuardsEveryV1Endpoint(t *testing.T) {
	const metricsToken = " m3\ttrics"
	r := startDaemon(t, func(c *config.Config) { c.HTTP.Token, c.HTTP.MetricsToken = "t0ken", metricsToken })
	// Every route the table marks "token", so that a route added later is checked too.
	for pattern, auth := range routeTable() {
		if auth != "token" {
			continue
		}
		method, p, _ := strings.Cut(pattern, " ")
		p = strings.ReplaceAll(p, "{id}", "x")
		body := ""
		if method == "POST" {
			body = "{}"
		}
		resp, _ := r.RawDo(t, method, p, body, nil)
		if resp.StatusCode != http.StatusUnauthorized || resp.Header.Get("WWW-Authenticate") == "" {
			t.Errorf("%s %s without a token: %d, want 401 with WWW-Authenticate", method, p, resp.StatusCode)
		}
		resp, _ = r.RawDo(t, method, p, body, map[string]string{"Authorization": "Bearer " + metricsToken})
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("%s %s with the metrics token: %d, want 401", method, p, resp.StatusCode)
		}
	}
	if resp, _ := r.RawDo(t, "GET", "/v1/model", "", map[string]string{"Authorization": "Bearer t0ken"}); resp.StatusCode != 200 {
		t.Errorf("GET /v1/model with the token: %d", resp.StatusCode)
	}
	for _, p := range []string{"/healthz", "/readyz"} {
		if code, _ := r.Get(t, p); code != 200 {
			t.Errorf("GET %s: %d, want 200 without a token", p, code)
		}
	}
	if code, _ := r.Get(t, "/metrics"); code != http.StatusUnauthorized {
		t.Errorf("GET /metrics without the metrics token: %d, want 401", code)
	}
	resp, body := r.RawDo(t, "GET", "/metrics", "", map[string]string{"Authorization": "Bearer " + metricsToken})
	if resp.StatusCode != 200 || !bytes.Contains(body, []byte("cfguard_posterior_version")) {
		t.Errorf("GET /metrics with its token: %d", resp.StatusCode)
	}
}

// TestPosteriorEndpointServesTheCertifiedPosterior: GET /v1/model/posterior and its sidecar are
// the current posterior in model.path's format, bit for bit, with the version and an ETag that
// If-None-Match honours; after an update both change together.
func TestPosteriorEndpointServesTheCertifiedPosterior(t *testing.T) {
	r := startDaemon(t, nil)
	fetch := func(path, etag string) (*http.Response, []byte) {
		h := map[string]string{}
		if etag != "" {
			h["If-None-Match"] = etag
		}
		return r.RawDo(t, "GET", path, "", h)
	}
	resp, weights := fetch("/v1/model/posterior", "")
	sresp, sidecar := fetch("/v1/model/posterior/sidecar", "")
	if resp.StatusCode != 200 || sresp.StatusCode != 200 {
		t.Fatalf("posterior %d, sidecar %d", resp.StatusCode, sresp.StatusCode)
	}
	m, err := bnn.Decode(sidecar, weights)
	if err != nil {
		t.Fatalf("the served files do not load as a model directory would: %v", err)
	}
	cur := r.D.current()
	wantSide, wantW, err := bnn.Encode(cur)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(weights, wantW) || !bytes.Equal(sidecar, wantSide) || m.Version != cur.Version {
		t.Fatal("served posterior differs from the current one")
	}
	sum := sha256.Sum256(weights)
	if got := resp.Header.Get(headerWeightsSHA256); got != hex.EncodeToString(sum[:]) || sresp.Header.Get(headerWeightsSHA256) != got {
		t.Fatalf("weights sha256 header %q", got)
	}
	if v := resp.Header.Get(headerPosteriorVersion); v != strconv.FormatUint(cur.Version, 10) {
		t.Fatalf("version header %q, want %d", v, cur.Version)
	}
	etag := resp.Header.Get("ETag")
	if r2, b := fetch("/v1/model/posterior", etag); r2.StatusCode != http.StatusNotModified || len(b) != 0 {
		t.Fatalf("If-None-Match with the current ETag: %d (%d bytes), want 304", r2.StatusCode, len(b))
	}
	// An update makes a new version; the old ETag no longer matches.
	data := daemontest.Bundled(t)
	var recs [][]byte
	for i := 0; i < 32; i++ {
		recs = append(recs, daemontest.Record("u"+strconv.Itoa(i), data.X[i], data.Y[i]))
	}
	r.Produce(t, recs...)
	waitfor.Cond(t, 30*time.Second, "an update", func() bool { return r.D.current().Version > cur.Version })
	r3, b3 := fetch("/v1/model/posterior", etag)
	if r3.StatusCode != 200 || bytes.Equal(b3, weights) || r3.Header.Get(headerPosteriorVersion) == strconv.FormatUint(cur.Version, 10) {
		t.Fatalf("after an update: %d, same bytes %v, version %s", r3.StatusCode, bytes.Equal(b3, weights), r3.Header.Get(headerPosteriorVersion))
	}
}

func TestPredictEndpoint(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	code, body := r.Do(t, "POST", "/v1/predict", "", map[string]any{"xs": data.X[:20]})
	if code != 200 {
		t.Fatalf("predict: %d %s", code, body)
	}
	var resp struct {
		PosteriorVersion uint64 `json:"posterior_version"`
		Samples          int
		Predictions      []prediction
	}
	if err := json.Unmarshal(body, &resp); err != nil {
		t.Fatal(err)
	}
	m := r.D.current()
	// The version's shared draws, made independently of the daemon's cache.
	pool, err := bnn.NewPool(m, r.D.cfg.Certify.Samples, m.Version^poolSeed, bnn.Float64)
	if err != nil {
		t.Fatal(err)
	}
	want, err := pool.Predict(context.Background(), data.X[:20])
	if err != nil {
		t.Fatal(err)
	}
	if resp.PosteriorVersion != m.Version || resp.Samples != r.D.cfg.Certify.Samples || len(resp.Predictions) != 20 {
		t.Fatalf("predict response %+v", resp)
	}
	agree := 0
	for i, p := range resp.Predictions {
		if p.Index != want.Argmax(i) || p.Class != m.Classes[p.Index] || p.P[p.Index] != want.P(i, p.Index) || p.Var[p.Index] != want.V(i, p.Index) {
			t.Fatalf("prediction %d: %+v, want class %d p %v", i, p, want.Argmax(i), want.P(i, want.Argmax(i)))
		}
		if p.Index == data.Y[i] {
			agree++
		}
	}
	if agree < 16 {
		t.Fatalf("the posterior predicts only %d of 20 training labels", agree)
	}
	code, body = r.Do(t, "POST", "/v1/predict", "", map[string]any{"x": data.X[0]})
	if code != 200 || !bytes.Contains(body, []byte(`"prediction":{`)) {
		t.Fatalf("single predict: %d %s", code, body)
	}
}

func TestExplainBusyAnswers429WithRetryAfter(t *testing.T) {
	r := startDaemon(t, func(c *config.Config) { c.Explain.Concurrency = 1 })
	release, err := r.D.exp.acquire()
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	x, _ := json.Marshal(daemontest.Bundled(t).X[0])
	resp, body := r.RawDo(t, "POST", "/v1/explain", `{"x":`+string(x)+`}`, nil)
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("explain with every slot taken: %d Retry-After %q %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
}

// fakeCore answers the API with canned results, to test its status mapping in isolation.
type fakeCore struct {
	m        *bnn.Model
	auditErr error
}

func (f *fakeCore) current() *bnn.Model                        { return f.m }
func (f *fakeCore) snapshot(read func(*bnn.Model) error) error { return read(f.m) }
func (f *fakeCore) posteriorFiles() (*posteriorFiles, error)   { return encodePosterior(f.m) }
func (f *fakeCore) forget(context.Context, string, ledger.RequestRef, []string) error {
	return ledger.ErrNotFound
}
func (f *fakeCore) find(context.Context, string, string, bool) (*ledger.CE, string, error) {
	return nil, "", ledger.ErrNotFound
}
func (f *fakeCore) list(context.Context, certify.Status, int, string, string, bool, []int) ([]*ledger.CE, string, error) {
	return nil, "", nil
}
func (f *fakeCore) holdOutcome(context.Context, string, string, int64) (cluster.RequestOutcome, bool, error) {
	return cluster.RequestOutcome{}, false, nil
}
func (f *fakeCore) auditState(context.Context, string, bool) (auditStatus, error) {
	return auditStatus{}, nil
}
func (f *fakeCore) readiness(context.Context) error            { return nil }
func (f *fakeCore) replication(context.Context) map[string]any { return nil }
func (f *fakeCore) prequential() map[string]any                { return nil }
func (f *fakeCore) audit(context.Context, string, bool) (cluster.AuditAnswer, error) {
	return cluster.AuditAnswer{}, f.auditErr
}
func (f *fakeCore) register(context.Context, registration) (*ledger.CE, error) {
	return nil, ledger.ErrExists
}
func (f *fakeCore) registerMany(_ context.Context, rs []registration, _ *time.Duration) ([]registered, error) {
	out := make([]registered, len(rs))
	for i := range out {
		out[i].err = ledger.ErrExists
	}
	return out, nil
}
func (f *fakeCore) predict(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
	return m.Predict(xs, 2, 1)
}
func (f *fakeCore) awaitVersion(context.Context, uint64) (*bnn.Model, error) { return f.m, nil }

func TestAuditWhileOneRunsIs409WithRetryAfter(t *testing.T) {
	var a auditor
	t0 := time.Now()
	if err := a.begin("schedule", t0); err != nil {
		t.Fatal(err)
	}
	err := a.begin("api", t0.Add(time.Second))
	var busy *auditBusyError
	if !errors.As(err, &busy) || busy.trigger != "schedule" {
		t.Fatalf("second audit: %v, want auditBusyError naming the scheduled one", err)
	}
	if st := a.status(); !st.Running || st.Trigger != "schedule" {
		t.Fatalf("status %+v", st)
	}
	a.end(ledger.AuditReport{Evaluated: 3}, nil, t0.Add(4*time.Second))
	if st := a.status(); st.Running || st.Last == nil || st.Last.Evaluated != 3 {
		t.Fatalf("status after end %+v", st)
	}
	if err := a.begin("api", t0.Add(5*time.Second)); err != nil {
		t.Fatalf("an audit after the last ended: %v", err)
	}
	// The API maps the busy error to 409 with Retry-After.
	m := bnn.New(3, []int{4}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	api := &api{cfg: apiConfig{maxBodyBytes: 1 << 20}, metrics: http.NotFoundHandler(), core: &fakeCore{m: m, auditErr: &auditBusyError{trigger: "schedule", started: t0, remaining: 2500 * time.Millisecond}}}
	rec := httptest.NewRecorder()
	api.routes().ServeHTTP(rec, httptest.NewRequest("POST", "/v1/audit", nil))
	if rec.Code != http.StatusConflict || rec.Header().Get("Retry-After") != "3" {
		t.Fatalf("busy audit: %d Retry-After %q", rec.Code, rec.Header().Get("Retry-After"))
	}
}

// A prediction with min_version is answered under that version or a later one: sent before the
// daemon applied it, it waits for the increment that makes it (records produced after the
// request), and answers under it; min_version at or below the current version answers at once;
// one the daemon does not reach within replication.register_wait is 503 with Retry-After,
// naming the version it serves, and nothing else is held meanwhile (an unconditioned
// prediction is answered while it waits).
func TestPredictWaitsForItsMinVersion(t *testing.T) {
	waiting := make(chan uint64, 2) // the min_version of each prediction that waits
	r := startDaemonWith(t, func(c *config.Config) { c.Replication.RegisterWait = 50 * time.Second }, func(o *Options) {
		o.Hooks.PredictAwait = func(v uint64) {
			select {
			case waiting <- v:
			default:
			}
		}
	}, nil)
	data := daemontest.Bundled(t)
	x := mustJSON(t, data.X[0])
	// predict sends a prediction with min_version min; it may run on another goroutine than the
	// test's, so a failed request is an answer with code 0 and the error as its body.
	predict := func(min uint64) (int, uint64, http.Header, string) {
		resp, err := r.Client.Post(r.Base+"/v1/predict", "application/json", strings.NewReader(`{"x":`+x+`,"min_version":`+strconv.FormatUint(min, 10)+`}`))
		if err != nil {
			return 0, 0, nil, err.Error()
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return 0, 0, nil, err.Error()
		}
		var out struct {
			PosteriorVersion uint64 `json:"posterior_version"`
		}
		if resp.StatusCode == http.StatusOK && json.Unmarshal(body, &out) != nil {
			return 0, 0, nil, "an answer that is not JSON: " + string(body)
		}
		return resp.StatusCode, out.PosteriorVersion, resp.Header, string(body)
	}
	v0 := r.D.current().Version
	if code, v, _, body := predict(v0); code != http.StatusOK || v != v0 {
		t.Fatalf("min_version %d, the current version: %d %s; want 200 under %d", v0, code, body, v0)
	}
	type answer struct {
		code int
		v    uint64
		body string
	}
	got := make(chan answer, 1)
	go func() {
		code, v, _, body := predict(v0 + 1)
		got <- answer{code, v, body}
	}()
	// Without records no version comes: the request is not answered, and an unconditioned one
	// is answered meanwhile.
	select {
	case a := <-got:
		t.Fatalf("answered before the daemon applied version %d: %d %s", v0+1, a.code, a.body)
	case <-time.After(time.Second):
	}
	if code, body := r.Do(t, "POST", "/v1/predict", "", map[string]any{"x": data.X[0]}); code != http.StatusOK {
		t.Fatalf("a prediction while another waits for its version: %d %s", code, body)
	}
	var recs [][]byte
	for i := range 64 {
		recs = append(recs, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, recs...)
	select {
	case a := <-got:
		if a.code != http.StatusOK || a.v < v0+1 {
			t.Fatalf("min_version %d: %d under %d %s; want 200 under %d or later", v0+1, a.code, a.v, a.body, v0+1)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("no answer within 60 s of the records that make the version it waits for")
	}

	// A daemon that stops while a prediction waits answers it at once, 503 saying it stops,
	// rather than holding its stop up for the rest of the wait (50 s here, past the 10 s the
	// server gives its requests to end). The stop comes once the prediction waits in the daemon:
	// a request that has not reached it yet would find the daemon gone.
	far := r.D.current().Version + 5
	go func() {
		code, v, _, body := predict(far)
		got <- answer{code, v, body}
	}()
	for waits := false; !waits; {
		select {
		case a := <-got:
			t.Fatalf("answered before the daemon reached version %d or stopped: %d %s", far, a.code, a.body)
		case v := <-waiting:
			waits = v == far
		case <-time.After(time.Minute):
			t.Fatalf("a prediction with min_version %d did not wait for its version within a minute", far)
		}
	}
	r.Stop(t)
	if a := <-got; a.code != http.StatusServiceUnavailable || !strings.Contains(a.body, "the daemon is stopping") {
		t.Fatalf("a prediction waiting for its version when the daemon stops: %d %s; want 503 saying it stops", a.code, a.body)
	}

	r2 := startDaemon(t, func(c *config.Config) { c.Replication.RegisterWait = 200 * time.Millisecond })
	v := r2.D.current().Version
	resp, body := r2.RawDo(t, "POST", "/v1/predict", `{"x":`+mustJSON(t, data.X[0])+`,"min_version":`+strconv.FormatUint(v+5, 10)+`}`, nil)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
		!strings.Contains(string(body), fmt.Sprintf("serves posterior version %d", v)) {
		t.Fatalf("min_version %d, never applied: %d Retry-After %q %s; want 503 naming version %d", v+5, resp.StatusCode, resp.Header.Get("Retry-After"), body, v)
	}
}
