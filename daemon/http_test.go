package daemon

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// gatedCore holds every prediction at a gate, so that a test knows how many run at once.
type gatedCore struct {
	core
	entered chan struct{}
	gate    chan struct{}
}

func (g *gatedCore) predict(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
	g.entered <- struct{}{}
	<-g.gate
	return g.core.predict(ctx, m, xs)
}

// stoppedCore predicts through a batcher that has stopped, as a request still draining when the
// daemon stops does.
type stoppedCore struct {
	core
	b *batcher
}

func (s stoppedCore) predict(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
	return s.b.do(ctx, m, xs)
}

// TestPredictAfterTheStopIs503WithRetryAfter: a prediction the stopped batcher refuses is a
// 503 with Retry-After, as a registration during a stop is, not a 500.
func TestPredictAfterTheStopIs503WithRetryAfter(t *testing.T) {
	r := startDaemon(t, nil)
	a := r.D.newAPI(alerts.NewHTTPMetrics(prometheus.NewRegistry(), 1))
	b := newBatcher(1, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	b.run(ctx)
	a.core = stoppedCore{core: r.D, b: b}
	srv := httptest.NewServer(a.routes())
	t.Cleanup(srv.Close)
	body, _ := json.Marshal(map[string]any{"x": daemontest.Bundled(t).X[0]})
	// A batcher that waits for the call to be taken would answer only at the client's timeout.
	cl := &http.Client{Timeout: 30 * time.Second}
	resp, err := cl.Post(srv.URL+"/v1/predict", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || !bytes.Contains(out, []byte("stopping")) {
		t.Fatalf("POST /v1/predict after the stop: %d (Retry-After %q) %s, want 503 with Retry-After saying the daemon stops",
			resp.StatusCode, resp.Header.Get("Retry-After"), out)
	}
}

// TestPredictBeyondTheLimitIs429WithRetryAfter: with http.max_predict_inputs = 10, of 8
// concurrent predictions of 5 inputs 2 run and 6 are answered 429 with Retry-After at once; the 2
// then answer correctly, and their inputs are free again after.
func TestPredictBeyondTheLimitIs429WithRetryAfter(t *testing.T) {
	const limit, n = 2, 8
	r := startDaemon(t, func(c *config.Config) { c.HTTP.MaxPredictInputs = 5 * limit })
	hm := alerts.NewHTTPMetrics(prometheus.NewRegistry(), 1)
	a := r.D.newAPI(hm)
	g := &gatedCore{core: r.D, entered: make(chan struct{}, n), gate: make(chan struct{})}
	a.core = g
	srv := httptest.NewServer(a.routes())
	var open sync.Once
	t.Cleanup(func() { open.Do(func() { close(g.gate) }); srv.Close() })

	data := daemontest.Bundled(t)
	body, _ := json.Marshal(map[string]any{"xs": data.X[:5]})
	type answer struct {
		code       int
		retryAfter string
		body       []byte
	}
	answers := make(chan answer, n)
	post := func() answer {
		resp, err := http.Post(srv.URL+"/v1/predict", "application/json", bytes.NewReader(body))
		if err != nil {
			return answer{code: -1, body: []byte(err.Error())}
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return answer{resp.StatusCode, resp.Header.Get("Retry-After"), b}
	}
	for range n {
		go func() { answers <- post() }()
	}
	next := func() answer {
		select {
		case a := <-answers:
			return a
		case <-time.After(20 * time.Second):
			t.Fatalf("no answer within 20 s (%d predictions running, limit %d)", len(g.entered), limit)
			return answer{}
		}
	}
	for range n - limit {
		if a := next(); a.code != http.StatusTooManyRequests || a.retryAfter != "1" || !bytes.Contains(a.body, []byte("http.max_predict_inputs")) {
			t.Fatalf("a prediction over the limit: %d Retry-After %q %s, want 429 with Retry-After 1", a.code, a.retryAfter, a.body)
		}
	}
	waitfor.Cond(t, 10*time.Second, "the predictions within the limit to run", func() bool { return len(g.entered) == limit })
	open.Do(func() { close(g.gate) })
	for range limit {
		a := next()
		var resp struct{ Predictions []prediction }
		if err := json.Unmarshal(a.body, &resp); a.code != 200 || err != nil || len(resp.Predictions) != 5 {
			t.Fatalf("a prediction within the limit: %d %s", a.code, a.body)
		}
	}
	if got := testutil.ToFloat64(hm.Rejected(alerts.RoutePredict)); got != n-limit {
		t.Errorf("cfguard_http_requests_rejected_total{route=predict} %v, want %d", got, n-limit)
	}
	for range limit { // the slots were given back
		go func() { answers <- post() }()
		<-g.entered
	}
	for range limit {
		if a := next(); a.code != 200 {
			t.Fatalf("a prediction after the others ended: %d %s", a.code, a.body)
		}
	}
}

// deadlineRecorder records the write deadlines a handler sets through http.ResponseController.
type deadlineRecorder struct {
	*httptest.ResponseRecorder
	deadlines []time.Time
}

func (d *deadlineRecorder) SetWriteDeadline(t time.Time) error {
	d.deadlines = append(d.deadlines, t)
	return nil
}

// TestLongResponsesOutliveTheWriteTimeout: GET /v1/backup (it streams the whole ledger) sets a
// deadline of backupStall before each chunk instead of http.write_timeout, POST /v1/audit (it
// answers when every CE is measured) lifts http.write_timeout, and POST /v1/explain extends it
// by explain.timeout.
func TestLongResponsesOutliveTheWriteTimeout(t *testing.T) {
	r := startDaemon(t, daemontest.WithSharedVAE(t, func(c *config.Config) { c.HTTP.WriteTimeout, c.Explain.Timeout = time.Minute, 5*time.Minute }))
	a := r.D.newAPI(alerts.NewHTTPMetrics(prometheus.NewRegistry(), 1))

	rec := &deadlineRecorder{ResponseRecorder: httptest.NewRecorder()}
	before := time.Now()
	a.routes().ServeHTTP(rec, localRequest("GET", "/v1/backup", nil))
	after := time.Now()
	if rec.Code != 200 || rec.Body.Len() == 0 || len(rec.deadlines) == 0 {
		t.Fatalf("backup: %d, %d bytes, write deadlines %v, want one per chunk", rec.Code, rec.Body.Len(), rec.deadlines)
	}
	for _, d := range rec.deadlines {
		if d.Before(before.Add(backupStall)) || d.After(after.Add(backupStall)) {
			t.Fatalf("backup: write deadline %v, want backupStall (%v) after the chunk's start", d.Sub(before), backupStall)
		}
	}

	rec = &deadlineRecorder{ResponseRecorder: httptest.NewRecorder()}
	a.routes().ServeHTTP(rec, localRequest("POST", "/v1/audit", nil))
	if rec.Code != 200 || len(rec.deadlines) != 1 || !rec.deadlines[0].IsZero() {
		t.Fatalf("audit: %d %s, write deadlines %v, want one lifted (zero) deadline", rec.Code, rec.Body, rec.deadlines)
	}

	x, _ := json.Marshal(daemontest.Bundled(t).X[0])
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // the deadline is set before the generation, which then ends at once
	rec = &deadlineRecorder{ResponseRecorder: httptest.NewRecorder()}
	before = time.Now()
	a.routes().ServeHTTP(rec, localRequest("POST", "/v1/explain", strings.NewReader(`{"x":`+string(x)+`}`)).WithContext(ctx))
	if len(rec.deadlines) != 1 || rec.deadlines[0].Before(before.Add(6*time.Minute)) || rec.deadlines[0].After(time.Now().Add(6*time.Minute)) {
		t.Fatalf("explain: write deadlines %v, want one at now + explain.timeout + http.write_timeout (6m)", rec.deadlines)
	}
}

// localRequest is httptest.NewRequest to 127.0.0.1, as a client of a daemon on a loopback address
// without a token must send it (openRequest).
func localRequest(method, target string, body io.Reader) *http.Request {
	r := httptest.NewRequest(method, target, body)
	r.Host = "127.0.0.1"
	return r
}

// endlessBackup is a backupSource that writes zeros in chunks of 1 MiB until a write fails, and
// says on done that it returned.
type endlessBackup struct{ done chan error }

func (e endlessBackup) Backup(ctx context.Context, w io.Writer) (ledger.Info, error) {
	chunk := make([]byte, 1<<20)
	for {
		if _, err := w.Write(chunk); err != nil {
			e.done <- err
			return ledger.Info{}, err
		}
	}
}

// A client of GET /v1/backup that stops reading does not hold the snapshot's read transaction
// for as long as it keeps the connection: once a chunk waits longer than backupStall to be taken,
// the write fails and the backup returns.
func TestBackupOfAClientThatStopsReadingEnds(t *testing.T) {
	src := endlessBackup{done: make(chan error, 1)}
	a := &api{cfg: apiConfig{maxBodyBytes: 1 << 20, backupStall: 200 * time.Millisecond}, metrics: http.NotFoundHandler(), backup: src}
	srv := httptest.NewServer(a.routes())
	defer srv.Close()
	c, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET /v1/backup HTTP/1.1\r\nHost: cfguard\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	// It reads nothing: the socket buffers fill, and the server's writes wait.
	select {
	case err := <-src.done:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("the backup's write failed with %v, want a deadline exceeded", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the backup still writes 30 s after its client stopped reading")
	}
}

// TestLimitListenerCloseWakesAWaitingAccept: with every slot taken, Accept waits; closing the
// listener (as Shutdown does) ends that wait, so a full server still shuts down.
func TestLimitListenerCloseWakesAWaitingAccept(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gauge := prometheus.NewGauge(prometheus.GaugeOpts{Name: "conns"})
	l := newLimitListener(ln, 1, gauge)
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	held, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	c2, err := net.Dial("tcp", ln.Addr().String()) // waits in the backlog
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	accepted := acceptOne(l)
	select {
	case err := <-accepted:
		t.Fatalf("a second connection was accepted over the limit of 1 (err %v)", err)
	case <-time.After(100 * time.Millisecond):
	}
	if got := testutil.ToFloat64(gauge); got != 1 {
		t.Fatalf("gauge %v with one connection held", got)
	}
	l.Close()
	select {
	case err := <-accepted:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Accept after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Accept still waits for a slot after Close")
	}
	held.Close()
	held.Close() // a second Close gives nothing back twice
	if got := testutil.ToFloat64(gauge); got != 0 {
		t.Fatalf("gauge %v after the held connection closed", got)
	}
}

// TestInputBudget holds the admission rule of POST /v1/predict: requests are admitted while
// their inputs fit the bound, one of any size when none is admitted, and a release (once, even
// if called twice) gives its inputs back.
func TestInputBudget(t *testing.T) {
	b := newInputBudget(100, 0)
	b.rejected = prometheus.NewCounter(prometheus.CounterOpts{Name: "rejected"})
	steps := []struct {
		name  string
		n     int
		admit bool
	}{
		{"a request alone larger than the bound", 150, true},
		{"one more input while it runs", 1, false},
	}
	var releases []func()
	for _, s := range steps {
		release, ok := b.acquire(s.n)
		if ok != s.admit {
			t.Fatalf("%s: admitted %v, want %v", s.name, ok, s.admit)
		}
		if ok {
			releases = append(releases, release)
		}
	}
	releases[0]()
	releases[0]() // a second release gives nothing back twice
	for i := range 50 {
		release, ok := b.acquire(2)
		if !ok {
			t.Fatalf("request %d of 2 inputs refused with %d of 100 admitted", i, 2*i)
		}
		defer release()
	}
	if _, ok := b.acquire(1); ok {
		t.Fatal("a request admitted past the bound")
	}
	if got := testutil.ToFloat64(b.rejected); got != 2 {
		t.Errorf("rejections counted %v, want 2", got)
	}
	if d := newInputBudget(0, 10000); d.max != 10000*runtime.GOMAXPROCS(0) {
		t.Errorf("default bound %d, want 10000 per CPU", d.max)
	}
}

// Without a token, the API refuses what a web page could make a browser send: a request with an
// Origin header, and, on a loopback address, a Host that is neither an IP address nor localhost
// (a DNS name rebound to this machine). With a token, the token decides.
func TestAPIWithoutATokenRefusesWebPages(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	for _, c := range []struct {
		name          string
		loopback      bool
		token, bearer string
		host, origin  string
		want          int
	}{
		{"loopback, an IP address", true, "", "", "127.0.0.1:8080", "", 200},
		{"loopback, localhost", true, "", "", "LocalHost:8080", "", 200},
		{"loopback, IPv6", true, "", "", "[::1]:8080", "", 200},
		{"loopback, no port", true, "", "", "127.0.0.1", "", 200},
		{"loopback, a DNS name", true, "", "", "rebound.example:8080", "", 403},
		{"loopback, a page's request", true, "", "", "127.0.0.1:8080", "https://evil.example", 403},
		{"every interface, a DNS name", false, "", "", "cfguard.internal:8080", "", 200},
		{"every interface, a page's request", false, "", "", "cfguard.internal:8080", "https://evil.example", 403},
		{"a token, a DNS name and a page", true, "s3cret", "s3cret", "rebound.example:8080", "https://app.example", 200},
		{"a token, none sent", true, "s3cret", "", "127.0.0.1:8080", "", 401},
	} {
		t.Run(c.name, func(t *testing.T) {
			a := &api{cfg: apiConfig{loopback: c.loopback, metricsToken: c.token}, metrics: ok}
			req := httptest.NewRequest("GET", "/metrics", nil)
			req.Host = c.host
			if c.origin != "" {
				req.Header.Set("Origin", c.origin)
			}
			if c.bearer != "" {
				req.Header.Set("Authorization", "Bearer "+c.bearer)
			}
			rec := httptest.NewRecorder()
			a.routes().ServeHTTP(rec, req)
			if rec.Code != c.want {
				t.Errorf("%d %s, want %d", rec.Code, rec.Body, c.want)
			}
			if c.want == 403 && !strings.Contains(rec.Body.String(), "http.token") {
				t.Errorf("the refusal %s does not say to set http.token", rec.Body)
			}
		})
	}
	// The UI, without a token, on a loopback address: the same Host rule (a browser's page sends
	// no Origin to its own site).
	for host, want := range map[string]int{"127.0.0.1:8080": 200, "localhost": 200, "rebound.example:8080": 403} {
		a := &api{cfg: apiConfig{loopback: true}, metrics: ok}
		req := httptest.NewRequest("GET", "/ui/static/style.css", nil)
		req.Host = host
		rec := httptest.NewRecorder()
		a.routes().ServeHTTP(rec, req)
		if rec.Code != want {
			t.Errorf("the UI's style sheet for Host %q: %d, want %d", host, rec.Code, want)
		}
	}
	for listen, want := range map[string]bool{"127.0.0.1:8080": true, "localhost:8080": true, "[::1]:0": true, "0.0.0.0:8080": false, ":8080": false, "10.0.0.5:8080": false} {
		if got := loopbackListen(listen); got != want {
			t.Errorf("loopbackListen(%q) = %v, want %v", listen, got, want)
		}
	}
}

// fixedBackup is a backupSource that writes body and returns info and err.
type fixedBackup struct {
	body string
	info ledger.Info
	err  error
}

func (f fixedBackup) Backup(ctx context.Context, w io.Writer) (ledger.Info, error) {
	if _, err := io.WriteString(w, f.body); err != nil {
		return ledger.Info{}, err
	}
	return f.info, f.err
}

// TestBackupTrailersTellTheSnapshotOrItsFailure: GET /v1/backup streams the snapshot and then
// says in its trailers which transaction and which posterior version it holds; a snapshot that
// failed says only why, in Cfguard-Backup-Error, and names no transaction or version.
func TestBackupTrailersTellTheSnapshotOrItsFailure(t *testing.T) {
	for _, tc := range []struct {
		name                   string
		src                    fixedBackup
		txid, version, failure string
	}{
		{"a snapshot", fixedBackup{body: "bbolt", info: ledger.Info{TxID: 41, PosteriorVersion: 7}}, "41", "7", ""},
		{"a failed snapshot", fixedBackup{body: "bbo", info: ledger.Info{TxID: 41, PosteriorVersion: 7}, err: errors.New("disk: input/output error")},
			"", "", "disk: input/output error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := &api{cfg: apiConfig{maxBodyBytes: 1 << 20}, metrics: http.NotFoundHandler(), backup: tc.src}
			srv := httptest.NewServer(a.routes())
			defer srv.Close()
			resp, err := http.Get(srv.URL + "/v1/backup")
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != http.StatusOK || string(body) != tc.src.body {
				t.Fatalf("%d %q, want 200 and the snapshot's bytes %q", resp.StatusCode, body, tc.src.body)
			}
			got := [3]string{resp.Trailer.Get(trailerBackupTxID), resp.Trailer.Get(trailerBackupVersion), resp.Trailer.Get(trailerBackupError)}
			if want := [3]string{tc.txid, tc.version, tc.failure}; got != want {
				t.Errorf("trailers txid, posterior version, error %q, want %q", got, want)
			}
		})
	}
}

// countedBackup counts the snapshots taken.
type countedBackup struct{ n atomic.Int32 }

func (c *countedBackup) Backup(ctx context.Context, w io.Writer) (ledger.Info, error) {
	c.n.Add(1)
	_, err := io.WriteString(w, "bbolt")
	return ledger.Info{TxID: 1}, err
}

// TestBackupHeadTakesNoSnapshot: HEAD /v1/backup answers GET's status and headers without a
// snapshot taken (it would be read whole only to be thrown away); a GET takes one.
func TestBackupHeadTakesNoSnapshot(t *testing.T) {
	src := &countedBackup{}
	a := &api{cfg: apiConfig{maxBodyBytes: 1 << 20}, metrics: http.NotFoundHandler(), backup: src}
	srv := httptest.NewServer(a.routes())
	defer srv.Close()
	resp, err := http.Head(srv.URL + "/v1/backup")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/octet-stream" || src.n.Load() != 0 {
		t.Fatalf("HEAD: %d %q, %d snapshots taken; want 200 application/octet-stream and none", resp.StatusCode, resp.Header.Get("Content-Type"), src.n.Load())
	}
	resp, err = http.Get(srv.URL + "/v1/backup")
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if src.n.Load() != 1 {
		t.Fatalf("GET took %d snapshots, want 1", src.n.Load())
	}
}

// TestBackupEndsWithItsRequest: the snapshot is written under the request's context, so a
// backup whose request has ended (its client gone, or the drain of a stop timed out) stops and
// says so in Cfguard-Backup-Error.
func TestBackupEndsWithItsRequest(t *testing.T) {
	l := openLedger(t)
	a := &api{cfg: apiConfig{maxBodyBytes: 1 << 20}, metrics: http.NotFoundHandler(), backup: l}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	rec := httptest.NewRecorder()
	a.routes().ServeHTTP(rec, localRequest("GET", "/v1/backup", nil).WithContext(ctx))
	res := rec.Result()
	if e := res.Trailer.Get(trailerBackupError); !strings.Contains(e, context.Canceled.Error()) || rec.Body.Len() != 0 {
		t.Errorf("a backup whose request ended: %d bytes, error trailer %q, want none and %q", rec.Body.Len(), e, context.Canceled)
	}
	if id := res.Trailer.Get(trailerBackupTxID); id != "" {
		t.Errorf("a backup whose request ended names transaction %q", id)
	}
}

// failOnce is a net.Listener whose first Accept fails, as one does when the process is out of
// file descriptors.
type failOnce struct {
	net.Listener
	failed bool
}

func (f *failOnce) Accept() (net.Conn, error) {
	if !f.failed {
		f.failed = true
		return nil, errors.New("accept: too many open files")
	}
	return f.Listener.Accept()
}

// TestLimitListenerFailedAcceptGivesItsSlotBack: an Accept that fails holds no connection, so
// its slot is given back: with a limit of one, the next connection is still accepted.
func TestLimitListenerFailedAcceptGivesItsSlotBack(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gauge := prometheus.NewGauge(prometheus.GaugeOpts{Name: "conns"})
	l := newLimitListener(&failOnce{Listener: ln}, 1, gauge)
	defer l.Close()
	if c, err := l.Accept(); err == nil || c != nil {
		t.Fatalf("first Accept: %v, %v; want the listener's error", c, err)
	}
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	accepted := acceptOne(l)
	select {
	case err := <-accepted:
		if err != nil {
			t.Fatalf("Accept after a failed one: %v", err)
		}
	case <-time.After(time.Minute):
		l.Close()
		<-accepted
		t.Fatal("Accept still waits for the slot of an Accept that failed")
	}
	if got := testutil.ToFloat64(gauge); got != 0 {
		t.Errorf("gauge %v after the only connection closed", got)
	}
}

// TestUnusedConnectionIsClosedAfterItsGrace: a drain closes a connection that carried no
// request once it has read nothing for the grace, counted from its accept or its last Read that
// returned bytes (a Read that returns none does not count), and not a moment sooner.
func TestUnusedConnectionIsClosedAfterItsGrace(t *testing.T) {
	const grace = time.Hour
	for _, tc := range []struct {
		name   string
		read   bool // the client sends a byte and the server reads it
		after  time.Duration
		closed bool
	}{
		{"accepted, just before the grace", false, grace - time.Nanosecond, false},
		{"accepted, at the grace", false, grace, true},
		{"read from, just before the grace", true, grace - time.Nanosecond, false},
		{"read from, at the grace", true, grace, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			l := newLimitListener(ln, 1, prometheus.NewGauge(prometheus.GaugeOpts{Name: "conns"}))
			defer l.Close()
			before := time.Now()
			client, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer client.Close()
			c, err := l.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			lc := limitConnOf(c)
			if got := lc.lastRead.Load(); got < before.UnixNano() {
				t.Fatalf("last read %v before the accept (%v)", time.Unix(0, got), before)
			}
			if tc.read {
				lc.lastRead.Store(0)
				c.SetReadDeadline(time.Now().Add(-time.Second))
				if n, err := c.Read(make([]byte, 1)); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("a read past its deadline: %d, %v", n, err)
				}
				if got := lc.lastRead.Load(); got != 0 {
					t.Fatalf("a read of no bytes set the last read to %v", time.Unix(0, got))
				}
				if _, err := client.Write([]byte("G")); err != nil {
					t.Fatal(err)
				}
				c.SetReadDeadline(time.Now().Add(time.Minute))
				before = time.Now()
				if n, err := c.Read(make([]byte, 1)); n != 1 || err != nil {
					t.Fatalf("read %d, %v", n, err)
				}
				if got := lc.lastRead.Load(); got < before.UnixNano() {
					t.Fatalf("last read %v, before the read (%v)", time.Unix(0, got), before)
				}
			}
			u := newUnusedConns(slog.New(slog.DiscardHandler))
			u.track(c, http.StateNew)
			u.closeStale(time.Unix(0, lc.lastRead.Load()).Add(tc.after), grace)
			// The server's side answers the client on a kept connection; a closed one ends it.
			c.Write([]byte("k"))
			client.SetReadDeadline(time.Now().Add(time.Minute))
			b := make([]byte, 1)
			n, err := client.Read(b)
			if closed := n == 0 && errors.Is(err, io.EOF); closed != tc.closed || !tc.closed && (n != 1 || b[0] != 'k') {
				t.Fatalf("closed %v (client read %q, %v), want %v", closed, b[:n], err, tc.closed)
			}
			if _, tracked := u.conns[c]; tracked == tc.closed {
				t.Errorf("still tracked %v after the drain's pass, want %v", tracked, !tc.closed)
			}
		})
	}
}

// TestSlots: explain.concurrency generations run at once (every core's worth when 0); one more
// is refused at once and counted, and a slot given back is taken again.
func TestSlots(t *testing.T) {
	if got := cap(newSlots(0).c); got != runtime.GOMAXPROCS(0) {
		t.Errorf("explain.concurrency 0: %d slots, want one per core (%d)", got, runtime.GOMAXPROCS(0))
	}
	s := newSlots(2)
	s.rejected = prometheus.NewCounter(prometheus.CounterOpts{Name: "rejected"})
	var releases []func()
	for i, admit := range []bool{true, true, false, false} {
		release, ok := s.acquire()
		if ok != admit {
			t.Fatalf("request %d with 2 slots: admitted %v, want %v", i, ok, admit)
		}
		if ok {
			releases = append(releases, release)
		}
	}
	releases[0]()
	if release, ok := s.acquire(); !ok {
		t.Error("a slot given back was not taken again")
	} else {
		release()
	}
	releases[1]()
	if got := testutil.ToFloat64(s.rejected); got != 2 {
		t.Errorf("rejections counted %v, want 2", got)
	}
}

// acceptOne accepts one connection from l in the background, closes it, and sends Accept's error.
func acceptOne(l net.Listener) <-chan error {
	accepted := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			c.Close()
		}
		accepted <- err
	}()
	return accepted
}

// TestRequestsAreCountedByRouteAndCode: cfguard_http_requests_total counts every answer once,
// under the route that answered it (a refusal by the token check included) or "other" when no
// route took the request (an unknown path, a method no route has, a path with a "." segment).
func TestRequestsAreCountedByRouteAndCode(t *testing.T) {
	r := startDaemon(t, func(c *config.Config) { c.HTTP.Token = "tok" })
	hm := alerts.NewHTTPMetrics(prometheus.NewRegistry(), 1)
	a := r.D.newAPI(hm)
	srv := httptest.NewServer(a.routes())
	t.Cleanup(srv.Close)
	for _, q := range []struct {
		method, path string
		token        bool
		want         int
	}{
		{"GET", "/healthz", false, 200},
		{"GET", "/healthz", false, 200},
		{"GET", "/v1/counterfactuals/nope", true, 404},
		{"GET", "/v1/counterfactuals/nope", false, 401},
		{"GET", "/v1/nothing", true, 404},
		{"PUT", "/v1/counterfactuals", true, 405},
		{"GET", "/v1/counterfactuals/.", true, 400},
		{"GET", "/ui/nothing", true, 404},
	} {
		req, _ := http.NewRequest(q.method, srv.URL+q.path, nil)
		if q.token {
			req.Header.Set("Authorization", "Bearer tok")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != q.want {
			t.Fatalf("%s %s: %d, want %d", q.method, q.path, resp.StatusCode, q.want)
		}
	}
	for _, c := range []struct {
		route, code string
		want        float64
	}{
		{"GET /healthz", "200", 2},
		{"GET /v1/counterfactuals/{id}", "404", 1},
		{"GET /v1/counterfactuals/{id}", "401", 1},
		{"other", "404", 1},
		{"other", "405", 1},
		{"other", "400", 1},
		{"ui", "404", 1},
	} {
		if got := testutil.ToFloat64(hm.Requests(c.route).WithLabelValues(c.code)); got != c.want {
			t.Errorf("cfguard_http_requests_total{route=%q, code=%q} %v, want %v", c.route, c.code, got, c.want)
		}
	}
	if n := testutil.CollectAndCount(hm.Requests("GET /healthz")); n != 7 {
		t.Errorf("%d series of cfguard_http_requests_total, want the 7 above", n)
	}
}

// TestBodyOverTheLimitIsRefusedBeforeItIsRead: a request whose Content-Length is over
// http.max_body_bytes is answered 413 at once, without 100 Continue to a client that waits for
// it, and its connection closed; the client sends no byte of the body. A body of the limit is
// read, and one that turns out longer than its Content-Length allows is not taken either.
func TestBodyOverTheLimitIsRefusedBeforeItIsRead(t *testing.T) {
	r := startDaemon(t, func(c *config.Config) { c.HTTP.MaxBodyBytes = 1000 })
	hm := alerts.NewHTTPMetrics(prometheus.NewRegistry(), 1)
	srv := httptest.NewServer(r.D.newAPI(hm).routes())
	t.Cleanup(srv.Close)
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// The deadline only ends a test whose server waits for a body that never comes.
	conn.SetDeadline(time.Now().Add(time.Minute))
	fmt.Fprintf(conn, "POST /v1/counterfactuals HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"+
		"Content-Length: 1000000000\r\nExpect: 100-continue\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer before the body: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusRequestEntityTooLarge || !resp.Close ||
		!strings.Contains(string(body), "request body over 1000 bytes (http.max_body_bytes): its Content-Length is 1000000000") {
		t.Fatalf("%d (close %v) %s; want 413 naming the limit, the connection closed", resp.StatusCode, resp.Close, body)
	}
	if got := testutil.ToFloat64(hm.Requests("other").WithLabelValues("413")); got != 1 {
		t.Errorf("cfguard_http_requests_total{route=other, code=413} %v, want 1", got)
	}
	// A body of the limit is read (and refused as the JSON it is not); one past it is refused by
	// its Content-Length, or, sent without one (chunked), as it is read.
	for _, c := range []struct {
		n       int
		chunked bool
		code    int
		want    string
	}{{1000, false, 400, "bad JSON"}, {1001, false, 413, "request body over 1000 bytes (http.max_body_bytes): its Content-Length is 1001"},
		{1000, true, 400, "bad JSON"}, {1001, true, 413, "request body over 1000 bytes (http.max_body_bytes)"}} {
		var body io.Reader = strings.NewReader(strings.Repeat(" ", c.n-1) + "x")
		if c.chunked {
			body = io.MultiReader(body) // no length the client can see
		}
		resp, err := http.Post(srv.URL+"/v1/counterfactuals", "application/json", body)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.code || !strings.Contains(string(b), c.want) {
			t.Errorf("a body of %d bytes (chunked %v): %d %s, want %d saying %q", c.n, c.chunked, resp.StatusCode, b, c.code, c.want)
		}
	}
}

// TestQueryParametersOnlyWhereARouteTakesThem: a /v1/ route other than the list refuses query
// parameters (400 naming them) rather than ignore them: a DELETE with ?dry_run=1 must not delete.
// The list takes its own; the probes and /metrics are left as they are.
func TestQueryParametersOnlyWhereARouteTakesThem(t *testing.T) {
	r := startDaemon(t, nil)
	srv := httptest.NewServer(r.D.newAPI(alerts.NewHTTPMetrics(prometheus.NewRegistry(), 1)).routes())
	t.Cleanup(srv.Close)
	for _, c := range []struct {
		method, target string
		want           int
		says           string
	}{
		{"DELETE", "/v1/counterfactuals/nope?dry_run=1", 400, `DELETE /v1/counterfactuals/nope takes no query parameters, got \"dry_run=1\"`},
		{"DELETE", "/v1/counterfactuals/nope", 404, ""},
		{"GET", "/v1/model?version=3", 400, "takes no query parameters"},
		{"GET", "/v1/model", 200, ""},
		{"POST", "/v1/audit?x", 400, "takes no query parameters"},
		{"GET", "/v1/counterfactuals?limit=5", 200, ""},
		{"GET", "/healthz?probe=1", 200, ""},
	} {
		req, _ := http.NewRequest(c.method, srv.URL+c.target, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.want || !strings.Contains(string(b), c.says) {
			t.Errorf("%s %s: %d %s, want %d saying %q", c.method, c.target, resp.StatusCode, b, c.want, c.says)
		}
	}
}
