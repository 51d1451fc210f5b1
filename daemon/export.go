package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/atomicfile"
)

// exporter writes the current posterior to model.export_dir (default <state_dir>/export) in the
// format model.path reads, for a model server on a shared volume. The ledger is the source of
// truth; the export is a copy of it that is never read back. Each file is written atomically
// (temp file, fsync, rename, directory fsync), the weights first and the sidecar, which carries
// their SHA-256, last: a reader sees the old pair, the new pair, or a pair whose checksum
// disagrees (and retries), never a silently mixed model.
//
// cfguard_export_posterior_version is set after both files are durable, so it never reports a
// version the directory does not hold; a scrape between the rename and the gauge sees the
// previous version (a reader of the files and a reader of /metrics cannot be served one atomic
// snapshot, and a gauge that led the files would claim an export that may not exist after a
// crash).
//
// It runs beside ingestion and coalesces: after a burst of updates it writes the latest
// posterior once. At start it checks what the directory holds and rewrites a missing, damaged
// or stale export, saying so in the log.
type exporter struct {
	dir     string
	files   *posteriorCache
	current func() *bnn.Model
	log     *slog.Logger
	kick    chan struct{} // capacity 1: "the posterior changed"

	metrics *alerts.Metrics // cfguard_export_posterior_version, cfguard_export_failures_total
	written uint64          // version last written (run's goroutine only)
	failing bool            // the last write failed (run's goroutine only): one ERROR line per episode
}

func newExporter(dir string, files *posteriorCache, current func() *bnn.Model, log *slog.Logger, m *alerts.Metrics) *exporter {
	return &exporter{dir: dir, files: files, current: current, log: log, kick: make(chan struct{}, 1),
		metrics: m}
}

// changed tells the exporter that the posterior changed; it never blocks.
func (e *exporter) changed() {
	select {
	case e.kick <- struct{}{}:
	default:
	}
}

// run is the component. A failed write is logged and counted, and retried at the next change or
// after exportRetry: the export is a convenience, never a reason to stop certifying.
func (e *exporter) run(ctx context.Context) error {
	e.verify()
	retry := time.NewTicker(exportRetry)
	defer retry.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-e.kick:
		case <-retry.C:
		}
		if e.written == e.current().Version {
			continue
		}
		e.write("posterior promoted")
	}
}

// exportRetry is how often a failed export is tried again without a new posterior.
const exportRetry = 30 * time.Second

func (e *exporter) write(why string) {
	m := e.current()
	pf, err := e.files.get(m)
	if err == nil {
		err = atomicfile.WriteFiles(e.dir, atomicfile.File{Name: bnn.WeightsFile, Data: pf.weights}, atomicfile.File{Name: bnn.SidecarFile, Data: pf.sidecar})
	}
	if err != nil {
		e.metrics.IncExportFailures()
		if !e.failing {
			e.log.Error("writing the posterior export failed; retrying at each new posterior and every 30 s (cfguard_export_failures_total counts the failures)",
				"dir", e.dir, "posterior_version", m.Version, "err", err)
		}
		e.failing = true
		return
	}
	if e.failing {
		e.log.Info("writing the posterior export works again", "dir", e.dir, "posterior_version", m.Version)
		e.failing = false
	}
	e.written = m.Version
	e.metrics.Exported(m.Version)
	e.log.Debug("posterior exported", "dir", e.dir, "posterior_version", m.Version, "why", why)
}

// verify compares the export directory with the current posterior at start and rewrites it when
// it is missing, damaged or stale, logging which.
func (e *exporter) verify() {
	m := e.current()
	pf, err := e.files.get(m)
	if err != nil {
		e.metrics.IncExportFailures()
		e.log.Error("encoding the posterior for export", "err", err)
		return
	}
	side, serr := os.ReadFile(filepath.Join(e.dir, bnn.SidecarFile))
	w, werr := os.ReadFile(filepath.Join(e.dir, bnn.WeightsFile))
	switch {
	case errors.Is(serr, fs.ErrNotExist) && errors.Is(werr, fs.ErrNotExist):
		e.log.Info("the posterior export is missing (a first start, or an emptied volume); writing it from the ledger",
			"dir", e.dir, "posterior_version", m.Version)
		e.write("first export")
		return
	case serr == nil && werr == nil && bytes.Equal(side, pf.sidecar) && bytes.Equal(w, pf.weights):
		e.written = m.Version
		e.metrics.Exported(m.Version)
		return
	}
	var why string
	if serr != nil || werr != nil {
		why = fmt.Sprintf("unreadable (%v)", errors.Join(serr, werr))
	} else if old, err := bnn.Decode(side, w); err != nil {
		why = fmt.Sprintf("damaged (%v)", err)
	} else if old.Version == m.Version {
		why = "different from the ledger's posterior of the same version"
	} else if old.Version > m.Version {
		why = fmt.Sprintf("of posterior version %d, ahead of the ledger's %d (a ledger restored from a backup, or another one)", old.Version, m.Version)
	} else {
		why = fmt.Sprintf("stale (posterior version %d, the ledger's is %d)", old.Version, m.Version)
	}
	e.log.Warn("the posterior export was "+why+"; rewriting it from the ledger, which is the source of truth", "dir", e.dir, "posterior_version", m.Version)
	e.write("repair")
}
