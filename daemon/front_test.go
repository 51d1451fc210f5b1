package daemon

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
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
