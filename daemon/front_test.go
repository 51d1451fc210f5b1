package daemon

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
)

// While the daemon starts, /healthz says it lives and every other request is 503 with
// Retry-After and the phase; once the API is served, the API answers everything.
func TestFrontAnswersWhileStarting(t *testing.T) {
	f := newFront()
	f.setPhase("opening the ledger")
	for _, c := range []struct {
		method, path string
		code         int
		status       string // /healthz's status field, or "" for an error body
	}{
		{"GET", "/healthz", 200, "starting"},
		{"HEAD", "/healthz", 200, "starting"},
		{"POST", "/healthz", 503, ""},
		{"GET", "/readyz", 503, ""},
		{"GET", "/metrics", 503, ""},
		{"POST", "/v1/counterfactuals", 503, ""},
	} {
		w := httptest.NewRecorder()
		f.ServeHTTP(w, httptest.NewRequest(c.method, c.path, nil))
		if w.Code != c.code {
			t.Errorf("%s %s: %d, want %d", c.method, c.path, w.Code, c.code)
			continue
		}
		if c.method == "HEAD" {
			continue
		}
		var body map[string]string
		if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
			t.Fatalf("%s %s: %v: %s", c.method, c.path, err, w.Body)
		}
		if c.status != "" {
			if body["status"] != c.status || body["phase"] != "opening the ledger" {
				t.Errorf("%s %s: %v, want status %q and the phase", c.method, c.path, body, c.status)
			}
			continue
		}
		if body["error"] != "starting: opening the ledger" || w.Header().Get("Retry-After") != "10" {
			t.Errorf("%s %s: %v (Retry-After %q), want the phase and Retry-After 10", c.method, c.path, body, w.Header().Get("Retry-After"))
		}
	}

	// People get a page that says the same, with the UI's style sheet.
	for _, c := range []struct {
		path string
		code int
		want string
	}{
		{"/ui/", 503, "cfguard is starting: opening the ledger."},
		{"/ui/counterfactuals/ce-1", 503, "cfguard is starting: opening the ledger."},
		{"/ui", 503, "cfguard is starting: opening the ledger."},
		{"/ui/static/style.css", 200, "body"},
	} {
		w := httptest.NewRecorder()
		f.ServeHTTP(w, httptest.NewRequest("GET", c.path, nil))
		if w.Code != c.code || !strings.Contains(w.Body.String(), c.want) {
			t.Errorf("GET %s: %d %.200s, want %d with %q", c.path, w.Code, w.Body, c.code, c.want)
		}
		if c.code == 503 && (w.Header().Get("Retry-After") != "10" || !strings.HasPrefix(w.Header().Get("Content-Type"), "text/html")) {
			t.Errorf("GET %s: Retry-After %q, Content-Type %q, want 10 and a page", c.path, w.Header().Get("Retry-After"), w.Header().Get("Content-Type"))
		}
	}

	f.serve(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusTeapot) }))
	for _, path := range []string{"/healthz", "/readyz"} {
		w := httptest.NewRecorder()
		f.ServeHTTP(w, httptest.NewRequest("GET", path, nil))
		if w.Code != http.StatusTeapot {
			t.Errorf("GET %s once the API is served: %d, want the API's answer", path, w.Code)
		}
	}
}

// What the start is doing is said without absolute paths, as every 5xx answer's error: the
// phase names a file by its base name in /healthz, in the 503 answers and on the page.
func TestStartingPhaseNamesNoAbsolutePath(t *testing.T) {
	f := newFront()
	f.setPhase("opening the ledger /var/lib/cfguard/ledger.db")
	const want = "opening the ledger ledger.db"
	w := httptest.NewRecorder()
	f.ServeHTTP(w, httptest.NewRequest("GET", "/healthz", nil))
	var body map[string]string
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil || body["phase"] != want {
		t.Errorf("GET /healthz: %v %s, want the phase %q", err, w.Body, want)
	}
	for _, path := range []string{"/readyz", "/ui/"} {
		w := httptest.NewRecorder()
		f.ServeHTTP(w, httptest.NewRequest("GET", path, nil))
		if w.Code != 503 || !strings.Contains(w.Body.String(), want) || strings.Contains(w.Body.String(), "/var/lib") {
			t.Errorf("GET %s: %d %.300s, want 503 with %q and no absolute path", path, w.Code, w.Body, want)
		}
	}
}

// The HTTP server's error is reported once: by run when the server fails while the daemon runs
// (closing it afterwards returns nil), or by close when the server failed before run started;
// run returns nil once the daemon's context ends and the server has drained.
func TestServerErrorIsReportedOnce(t *testing.T) {
	c := config.Default()
	d := &Daemon{cfg: &c, log: slog.New(slog.DiscardHandler)}
	start := func() (*server, net.Listener) {
		t.Helper()
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return d.serveOn(&http.Server{Handler: http.NotFoundHandler()}, ln), ln
	}
	// ran runs s.run(ctx), failing the test if it has not returned within a minute.
	ran := func(ctx context.Context, s *server) error {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- s.run(ctx) }()
		select {
		case err := <-done:
			return err
		case <-time.After(time.Minute):
			t.Fatal("the server's run did not return")
			return nil
		}
	}

	s, ln := start()
	ln.Close()
	if err := ran(context.Background(), s); err == nil {
		t.Fatal("run of a server whose listener closed: nil, want its error")
	}
	if err := s.close(); err != nil {
		t.Errorf("close after run reported the error: %v, want nil", err)
	}

	s, ln = start()
	ln.Close()
	<-s.done
	if err := s.close(); err == nil {
		t.Error("close of a server that failed before run: nil, want its error")
	}

	s, _ = start()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := ran(ctx, s); err != nil {
		t.Errorf("run once the context ended: %v, want nil", err)
	}
	if err := s.close(); err != nil {
		t.Errorf("close after a clean run: %v", err)
	}
}
