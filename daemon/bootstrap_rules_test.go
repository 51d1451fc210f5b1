package daemon

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/ledger"
)

// modelCopy copies the shared model directory to a new directory and, when flip, changes one
// byte of its weights (another model for the origin check, which reads only the weights).
func modelCopy(t *testing.T, flip bool) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	if err := os.CopyFS(dir, os.DirFS(daemontest.SharedModelDir(t))); err != nil {
		t.Fatal(err)
	}
	if flip {
		p := filepath.Join(dir, bnn.WeightsFile)
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		b[len(b)/2] ^= 0x40
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// A restart whose model.* keys name another first posterior than the one the ledger grew from
// is refused as an invalid configuration naming both, and the ledger is left as it was: the
// weights of model.path are compared by their SHA-256 (a moved model directory still matches),
// the bundled data set by its name, model.seed and model.epochs. A ledger that records no
// origin (written by an older release) accepts any model.* keys.
func TestRestartRefusesAnotherFirstPosterior(t *testing.T) {
	shared, moved, other := daemontest.SharedModelDir(t), modelCopy(t, false), modelCopy(t, true)
	def := config.Default().Model
	for _, c := range []struct {
		name           string
		first, restart func(m *config.Model) // the model keys of the first start and of the restart
		legacy         bool                  // the first posterior checkpointed without its origin
		refused        string                // what the refusal names, "" for a restart that resumes
	}{
		{"the same model.path", func(m *config.Model) { m.Path = shared }, func(m *config.Model) { m.Path = shared }, false, ""},
		{"model.path moved", func(m *config.Model) { m.Path = shared }, func(m *config.Model) { m.Path = moved }, false, ""},
		{"other weights in model.path", func(m *config.Model) { m.Path = shared }, func(m *config.Model) { m.Path = other }, false, " in model.path " + other},
		{"model.dataset after model.path", func(m *config.Model) { m.Path = shared }, func(m *config.Model) {}, false, "model.dataset " + def.Dataset},
		{"the same model.dataset", func(m *config.Model) {}, func(m *config.Model) {}, false, ""},
		{"another model.seed", func(m *config.Model) {}, func(m *config.Model) { m.Seed++ }, false, "model.seed"},
		{"another model.epochs", func(m *config.Model) {}, func(m *config.Model) { m.Epochs++ }, false, "model.epochs"},
		{"no origin recorded", func(m *config.Model) {}, func(m *config.Model) { m.Path = other }, true, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			l := openLedger(t)
			start := func(keys func(m *config.Model)) (*Daemon, error) {
				cfg := config.Default()
				cfg.StateDir = filepath.Dir(l.Path())
				keys(&cfg.Model)
				d := &Daemon{cfg: &cfg, ledger: l, log: slog.New(slog.DiscardHandler), front: newFront(),
					bundledModel: func() (*bnn.Model, error) { return bnn.Load(shared) }}
				return d, d.bootstrapModel(context.Background())
			}
			if c.legacy {
				m, err := bnn.Load(shared)
				if err != nil {
					t.Fatal(err)
				}
				if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
					t.Fatal(err)
				}
			} else if _, err := start(c.first); err != nil {
				t.Fatal(err)
			}
			origin, err := l.Origin()
			if err != nil {
				t.Fatal(err)
			}
			d, err := start(c.restart)
			if c.refused == "" {
				if err != nil || d.current() == nil {
					t.Fatalf("restart: %v, want it to resume from the ledger", err)
				}
				return
			}
			if !errors.Is(err, config.ErrInvalid) || !strings.Contains(err.Error(), "first posterior came from "+origin+", but the configuration names ") ||
				!strings.Contains(err.Error(), c.refused) {
				t.Fatalf("restart: %v, want an invalid configuration naming the ledger's origin %q and %q", err, origin, c.refused)
			}
			if now, err := l.Origin(); err != nil || now != origin {
				t.Fatalf("the ledger's origin after the refusal: %q %v, want %q", now, err, origin)
			}
		})
	}
}

// A first posterior copied to <state_dir>/model by an older release is not used: the daemon
// warns once at start that it is stale, unless model.export_dir is that directory.
func TestLegacyModelDirIsNamedStale(t *testing.T) {
	for _, c := range []struct {
		name   string
		export string // model.export_dir under state_dir
		warned bool
	}{
		{"export elsewhere", "export", true},
		{"export there", "model", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := config.Default()
			cfg.StateDir = t.TempDir()
			cfg.Model.ExportDir = filepath.Join(cfg.StateDir, c.export)
			if err := os.CopyFS(filepath.Join(cfg.StateDir, "model"), os.DirFS(daemontest.SharedModelDir(t))); err != nil {
				t.Fatal(err)
			}
			logs := &tooltest.Output{}
			d := &Daemon{cfg: &cfg, log: slog.New(slog.NewTextHandler(logs, nil))}
			d.noteLegacyModelDir()
			if got := strings.Contains(logs.String(), "state_dir/model is a stale copy"); got != c.warned {
				t.Fatalf("warned %v, want %v:\n%s", got, c.warned, logs.String())
			}
		})
	}
}
