package serving

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
)

// A start that fails after the port answered (here at a ledger that is not one) returns its
// error and leaves nothing listening.
func TestFailedStartStopsServing(t *testing.T) {
	c := daemontest.Config(t, nil)
	if err := os.WriteFile(filepath.Join(c.StateDir, "cfguard.db"), []byte("not a ledger"), 0o600); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	err = daemon.Run(context.Background(), daemon.Options{Config: &c, Logger: slog.New(slog.DiscardHandler), HTTPListener: ln})
	if err == nil || !strings.Contains(err.Error(), "cfguard.db") {
		t.Fatalf("Run on a damaged ledger: %v, want the ledger's refusal", err)
	}
	if conn, err := net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second); err == nil {
		conn.Close()
		t.Errorf("%s still accepts connections after the start failed", ln.Addr())
	}
}
