package replica

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/config"
)

// A replica whose cluster key file every user of the machine may read or write says so at start,
// at WARN, naming the file, its mode and the chmod; one its owner (and group) alone may read
// starts without the line.
func TestNewWarnsOfAKeyFileEveryUserMayRead(t *testing.T) {
	for _, c := range []struct {
		mode os.FileMode
		warn bool
	}{{0o600, false}, {0o440, false}, {0o644, true}, {0o606, true}, {0o602, true}} {
		p := filepath.Join(t.TempDir(), "cluster.key")
		if err := os.WriteFile(p, []byte("k1:"+strings.Repeat("5a", 32)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, c.mode); err != nil {
			t.Fatal(err)
		}
		cfg := config.Default()
		cfg.Replication.Enabled, cfg.Replication.ReplicaID, cfg.Replication.KeyFile = true, "r1", p
		var logs bytes.Buffer
		if _, err := New(Options{Config: &cfg, Registry: prometheus.NewRegistry(), Logger: slog.New(slog.NewTextHandler(&logs, nil))}); err != nil {
			t.Fatal(err)
		}
		warned := strings.Contains(logs.String(), "level=WARN") && strings.Contains(logs.String(), "chmod o-rw") &&
			strings.Contains(logs.String(), "key_file="+p) && strings.Contains(logs.String(), "mode="+c.mode.String())
		if warned != c.warn || strings.Contains(logs.String(), "level=WARN") != c.warn {
			t.Errorf("key file of mode %v: warned %v, want %v; the log:\n%s", c.mode, warned, c.warn, logs.String())
		}
	}
}
