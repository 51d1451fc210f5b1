package daemon

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// exportOf is an exporter of the shared model, at version 3, to dir, logging to logs, with its metrics in reg.
func exportOf(t *testing.T, dir string, logs *tooltest.Output) (*exporter, *prometheus.Registry, *bnn.Model) {
	t.Helper()
	m, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	m.Version = 3 // a posterior after some updates
	reg := prometheus.NewRegistry()
	e := newExporter(dir, &posteriorCache{}, func() *bnn.Model { return m }, slog.New(slog.NewTextHandler(logs, nil)), alerts.NewMetrics(reg))
	return e, reg, m
}

// A failed write of the posterior export counts every attempt in cfguard_export_failures_total
// and logs one ERROR line per episode of failures; the first write that works again says so
// once at INFO and sets cfguard_export_posterior_version, and a later failure starts a new
// episode.
func TestExportFailuresAreCountedAndLoggedOncePerEpisode(t *testing.T) {
	blocker := filepath.Join(t.TempDir(), "blocker")
	if err := os.WriteFile(blocker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	logs := &tooltest.Output{}
	dir := filepath.Join(blocker, "export") // under a regular file: cannot be created
	e, reg, m := exportOf(t, dir, logs)
	const failed, works = "writing the posterior export failed", "writing the posterior export works again"
	for range 3 {
		e.write("posterior promoted")
	}
	if n, f := strings.Count(logs.String(), failed), daemontest.GatherCounter(reg, alerts.NameExportFailures); n != 1 || f != 3 {
		t.Fatalf("3 failed writes: %d ERROR lines, %v counted; want 1 and 3:\n%s", n, f, logs)
	}
	if v := daemontest.GatherCounter(reg, alerts.NameExportVersion); v != 0 {
		t.Fatalf("%s %v before any export was written, want 0", alerts.NameExportVersion, v)
	}

	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	e.write("posterior promoted")
	e.write("posterior promoted")
	if n := strings.Count(logs.String(), works); n != 1 {
		t.Fatalf("the writes after the failures: %d lines saying it works again, want 1:\n%s", n, logs)
	}
	if v := daemontest.GatherCounter(reg, alerts.NameExportVersion); v != float64(m.Version) || e.written != m.Version {
		t.Fatalf("%s %v (written %d) after the export was written, want %d", alerts.NameExportVersion, v, e.written, m.Version)
	}

	if err := os.RemoveAll(blocker); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(blocker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	e.write("posterior promoted")
	if n, f := strings.Count(logs.String(), failed), daemontest.GatherCounter(reg, alerts.NameExportFailures); n != 2 || f != 4 {
		t.Fatalf("a failure after the export worked again: %d ERROR lines, %v counted; want 2 and 4:\n%s", n, f, logs)
	}
}

// At start the export directory is compared with the current posterior file by file: an export
// that holds it exactly is left alone and reported in cfguard_export_posterior_version; one whose
// sidecar or weights differ in any byte is rewritten from the ledger, saying so.
func TestExportCheckedAtStart(t *testing.T) {
	for _, c := range []struct {
		name   string
		change func(side, weights []byte) ([]byte, []byte)
		repair bool
	}{
		{"as written", func(s, w []byte) ([]byte, []byte) { return s, w }, false},
		{"sidecar changed", func(s, w []byte) ([]byte, []byte) { return append(bytes.Clone(s), '\n'), w }, true},
		{"weights changed", func(s, w []byte) ([]byte, []byte) {
			w = bytes.Clone(w)
			w[len(w)/2] ^= 0x40
			return s, w
		}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			logs := &tooltest.Output{}
			e, reg, m := exportOf(t, dir, logs)
			pf, err := e.files.get(m)
			if err != nil {
				t.Fatal(err)
			}
			side, weights := c.change(pf.sidecar, pf.weights)
			if err := os.WriteFile(filepath.Join(dir, bnn.SidecarFile), side, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, bnn.WeightsFile), weights, 0o644); err != nil {
				t.Fatal(err)
			}
			e.verify()
			if got := strings.Contains(logs.String(), "rewriting it from the ledger"); got != c.repair {
				t.Fatalf("repair logged %v, want %v:\n%s", got, c.repair, logs)
			}
			s, err1 := os.ReadFile(filepath.Join(dir, bnn.SidecarFile))
			w, err2 := os.ReadFile(filepath.Join(dir, bnn.WeightsFile))
			if err1 != nil || err2 != nil || !bytes.Equal(s, pf.sidecar) || !bytes.Equal(w, pf.weights) {
				t.Fatalf("the export after the start check does not hold the posterior (%v %v)", err1, err2)
			}
			if v := daemontest.GatherCounter(reg, alerts.NameExportVersion); v != float64(m.Version) || e.written != m.Version {
				t.Fatalf("%s %v (written %d), want %d", alerts.NameExportVersion, v, e.written, m.Version)
			}
		})
	}
}
