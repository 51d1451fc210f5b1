package daemon

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// exportMatches reports whether dir holds exactly the files of the daemon's current posterior.
func exportMatches(t *testing.T, r *running, dir string) bool {
	t.Helper()
	side, err1 := os.ReadFile(filepath.Join(dir, bnn.SidecarFile))
	w, err2 := os.ReadFile(filepath.Join(dir, bnn.WeightsFile))
	if err1 != nil || err2 != nil {
		return false
	}
	pf, err := r.D.posteriorFiles()
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Equal(side, pf.sidecar) && bytes.Equal(w, pf.weights)
}

// TestExportFollowsThePosteriorAndRepairsItself: model.export_dir receives the current posterior
// at start and after each promotion; a damaged or deleted export is rewritten at the next start,
// and the daemon says so.
func TestExportFollowsThePosteriorAndRepairsItself(t *testing.T) {
	state, export := t.TempDir(), filepath.Join(t.TempDir(), "shared")
	mutate := func(c *config.Config) { c.StateDir, c.Model.ExportDir = state, export }
	r := startDaemon(t, mutate)
	waitfor.Cond(t, 10*time.Second, "the first export", func() bool { return exportMatches(t, r, export) })
	v0 := r.D.current().Version
	data := daemontest.Bundled(t)
	var recs [][]byte
	for i := 0; i < 32; i++ {
		recs = append(recs, daemontest.Record("e"+strconv.Itoa(i), data.X[i], data.Y[i]))
	}
	r.Produce(t, recs...)
	waitfor.Cond(t, 30*time.Second, "an update", func() bool { return r.D.current().Version > v0 })
	v1 := r.D.current().Version
	// cfguard_export_posterior_version is set once the files are durable (it may trail them,
	// never lead): when it reports the update, the directory holds it.
	waitfor.Cond(t, 10*time.Second, "cfguard_export_posterior_version to report the update", func() bool {
		return r.Metric(t, "cfguard_export_posterior_version") == float64(v1)
	})
	if !exportMatches(t, r, export) {
		t.Fatalf("cfguard_export_posterior_version is %d, but %s does not hold that posterior", v1, export)
	}
	r.Stop(t)

	for name, c := range map[string]struct {
		damage func()
		said   string
	}{
		"truncated weights": {func() { os.Truncate(filepath.Join(export, bnn.WeightsFile), 100) }, "rewriting it from the ledger"},
		"deleted sidecar":   {func() { os.Remove(filepath.Join(export, bnn.SidecarFile)) }, "rewriting it from the ledger"},
		"flipped byte": {func() {
			p := filepath.Join(export, bnn.WeightsFile)
			b, _ := os.ReadFile(p)
			b[len(b)/2] ^= 0x40
			os.WriteFile(p, b, 0o644)
		}, "rewriting it from the ledger"},
		"emptied volume": {func() {
			os.Remove(filepath.Join(export, bnn.SidecarFile))
			os.Remove(filepath.Join(export, bnn.WeightsFile))
		}, "the posterior export is missing"},
	} {
		t.Run(name, func(t *testing.T) {
			c.damage()
			// A missing export is said at INFO: this daemon logs from INFO on.
			logs := &tooltest.Output{}
			r := startDaemonWith(t, mutate, func(o *Options) { o.Logger = slog.New(slog.NewTextHandler(logs, nil)) }, nil)
			waitfor.Cond(t, 10*time.Second, "the repaired export", func() bool { return exportMatches(t, r, export) })
			if !strings.Contains(logs.String(), c.said) {
				t.Fatalf("the repair was not logged (want %q):\n%s", c.said, logs.String())
			}
			r.Stop(t)
		})
	}

	// A ledger behind the export (restored from a backup, or a new state_dir): the export is
	// rewritten, and the log says which is ahead.
	r = startDaemon(t, func(c *config.Config) { c.StateDir, c.Model.ExportDir = t.TempDir(), export })
	waitfor.Cond(t, 10*time.Second, "the export rewritten from a ledger behind it", func() bool { return exportMatches(t, r, export) })
	if want := fmt.Sprintf("of posterior version %d, ahead of the ledger's %d", v1, v0); !strings.Contains(r.Logs.String(), want) {
		t.Errorf("the log does not say %q:\n%s", want, r.Logs.String())
	}
}
