package daemon

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/explain"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// The first start of a daemon whose model keys are the defaults trains the bundled breast-cancer
// network (bnn.Fit, about half a CPU-second), and most tests start such a daemon. The tests train
// that network once per test binary into a model directory (daemontest.SharedModelDir) and start
// their daemons on it with model.path (daemontest.Config): the posterior is the same bits, and a
// test spends its time on what it tests. TestFirstStartTrainsTheSharedModel holds the two equal.
func TestMain(m *testing.M) { daemontest.Main(m) }

// A first start at the default model keys trains exactly the network of the shared model
// directory: the same weights, scaler, classes, features and version, bit for bit. So a daemon
// started on the directory serves the posterior a first start would have trained.
func TestFirstStartTrainsTheSharedModel(t *testing.T) {
	shared, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	c := config.Default()
	c.StateDir = t.TempDir()
	d := &Daemon{cfg: &c, log: slog.New(slog.DiscardHandler), front: newFront()}
	trained, err := d.initialModel(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	js, ws, err := bnn.Encode(shared)
	if err != nil {
		t.Fatal(err)
	}
	jt, wt, err := bnn.Encode(trained)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(js, jt) || !bytes.Equal(ws, wt) {
		t.Fatalf("a first start trained another network than the shared model directory's:\n%s\n%s", jt, js)
	}
}

// A stop asked for while the first start trains the bundled model (Ctrl-C, or Kubernetes' SIGTERM
// during a long first training) is a clean stop, as one asked for while a replica waits for its
// brokers: Run returns nil, so that cfguard run logs "cfguard stopped" and exits 0, and the next
// start trains again.
func TestStopWhileTrainingTheFirstModelIsClean(t *testing.T) {
	c := config.Default()
	c.StateDir = t.TempDir()
	c.HTTP.Listen, c.Kafka.EmbeddedListen = "127.0.0.1:0", "127.0.0.1:0"
	c.Audit.Schedule = ""
	ctx, stop := context.WithCancelCause(context.Background())
	defer stop(nil)
	// The stop comes as the training begins: the log line that announces it cancels ctx.
	announced := writerFunc(func(p []byte) {
		if bytes.Contains(p, []byte(`msg="training the bundled model (first start)"`)) {
			stop(errors.New("interrupt signal received"))
		}
	})
	err := Run(ctx, Options{Config: &c, Logger: slog.New(slog.NewTextHandler(announced, nil)), Registry: prometheus.NewRegistry()})
	if ctx.Err() == nil {
		t.Fatalf("Run returned before the training began: %v", err)
	}
	if err != nil {
		t.Fatalf("a stop during the first training: Run returned %v, want nil (a clean stop)", err)
	}
}

// writerFunc is an io.Writer that hands each write to itself.
type writerFunc func(p []byte)

func (f writerFunc) Write(p []byte) (int, error) {
	f(p)
	return len(p), nil
}

// A saved VAE that does not load (its weights cut short, as a crash during its save or a full disk
// leaves them) does not stop the daemon: it is moved aside, byte for byte, and the VAE is
// trained again, the same network as the shared one, with a log line that says why (at start,
// not for a first explanation).
func TestDamagedVAEIsMovedAsideAndTrainedAgain(t *testing.T) {
	m, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	state := t.TempDir()
	dir := filepath.Join(state, "vae")
	if err := os.CopyFS(dir, os.DirFS(daemontest.SharedVAEDir(t))); err != nil {
		t.Fatal(err)
	}
	w := filepath.Join(dir, explain.VAEWeightsFile)
	raw, err := os.ReadFile(w)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(w, raw[:len(raw)/2], 0o644); err != nil {
		t.Fatal(err)
	}
	var logs tooltest.Output
	d := config.Default().Model
	e := &explainer{dir: dir, dataset: d.Dataset, seed: d.Seed, posterior: func() *bnn.Model { return m },
		log: slog.New(slog.NewTextHandler(&logs, nil))}
	if err := e.loadOrTrain(context.Background()); err != nil || e.vae == nil {
		t.Fatalf("a damaged VAE: %v (VAE %v)", err, e.vae != nil)
	}
	daemontest.SameVAE(t, dir, daemontest.SharedVAEDir(t))
	aside, _ := filepath.Glob(dir + ".damaged-*")
	if len(aside) != 1 {
		t.Fatalf("damaged VAE directories kept: %v, want one", aside)
	}
	if kept, err := os.ReadFile(filepath.Join(aside[0], explain.VAEWeightsFile)); err != nil || !bytes.Equal(kept, raw[:len(raw)/2]) {
		t.Fatalf("the damaged weights were not kept as they were: %v", err)
	}
	if !strings.Contains(logs.String(), "level=WARN msg=\"the saved VAE does not load: moved aside, training a new one\"") ||
		!strings.Contains(logs.String(), "moved_to="+aside[0]) ||
		!strings.Contains(logs.String(), `msg="training the VAE for PSCE" cause="the saved VAE does not load"`) {
		t.Fatalf("log: %s", logs.String())
	}
}
