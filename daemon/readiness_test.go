package daemon

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestReadinessReportsADeadBroker: once the embedded broker stops accepting connections,
// /readyz answers 503 naming it, while /healthz (the process lives) stays 200.
func TestReadinessReportsADeadBroker(t *testing.T) {
	r := startDaemon(t, nil)
	r.d.broker.Close()
	waitfor.Cond(t, 10*time.Second, "readyz to fail", func() bool { code, _ := r.get(t, "/readyz"); return code == http.StatusServiceUnavailable })
	if _, body := r.get(t, "/readyz"); !strings.Contains(string(body), "embedded broker") {
		t.Fatalf("readyz body %q does not name the embedded broker", body)
	}
	if code, _ := r.get(t, "/healthz"); code != http.StatusOK {
		t.Fatalf("healthz %d with the broker down, want 200", code)
	}
}
