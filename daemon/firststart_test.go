package daemon

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
)

// The first start of a daemon whose model keys are the defaults trains the bundled breast-cancer
// network (bnn.Fit, about half a CPU-second), and most tests start such a daemon. The tests train
// that network once per test binary into a model directory and start their daemons on it with
// model.path (startDaemonWith): the posterior is the same bits, and a test spends its time on
// what it tests. TestFirstStartTrainsTheSharedModel holds the two equal.
var sharedModel struct {
	root string // a temporary directory of the test binary, removed by TestMain

	once sync.Once
	dir  string
	err  error
}

func TestMain(m *testing.M) {
	os.Exit(runTests(m))
}

func runTests(m *testing.M) int {
	root, err := os.MkdirTemp("", "cfguard-daemon-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "a temporary directory for the shared model:", err)
		return 1
	}
	defer os.RemoveAll(root)
	sharedModel.root = root
	return m.Run()
}

// trainsDefaultModel says whether c's first start trains the network at the default model keys
// (model.dataset, model.seed and model.epochs as config.Default sets them, no model.path). A
// replica is left to train its own: the replicas' genesis records how the first posterior came
// to be, and their tests compare it.
func trainsDefaultModel(c *config.Config) bool {
	d := config.Default().Model
	return c.Model.Path == "" && c.Model.Dataset == d.Dataset && c.Model.Seed == d.Seed && c.Model.Epochs == d.Epochs &&
		!c.Replication.Enabled
}

// sharedModelDir is the model directory of the network a daemon trains on first start at the
// default model keys, trained (as the daemon does, initialModel) on the first call.
func sharedModelDir(t testing.TB) string {
	t.Helper()
	sharedModel.once.Do(func() {
		c := config.Default()
		d := &Daemon{cfg: &c, log: slog.New(slog.DiscardHandler)}
		m, err := d.initialModel(context.Background())
		if err != nil {
			sharedModel.err = err
			return
		}
		dir := filepath.Join(sharedModel.root, "model")
		if err := bnn.Save(dir, m); err != nil {
			sharedModel.err = err
			return
		}
		sharedModel.dir = dir
	})
	if sharedModel.err != nil {
		t.Fatalf("training the shared bundled model: %v", sharedModel.err)
	}
	return sharedModel.dir
}

// A first start at the default model keys trains exactly the network of the shared model
// directory: the same weights, scaler, classes, features and version, bit for bit. So a daemon
// started on the directory serves the posterior a first start would have trained.
func TestFirstStartTrainsTheSharedModel(t *testing.T) {
	shared, err := bnn.Load(sharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	c := config.Default()
	c.StateDir = t.TempDir()
	d := &Daemon{cfg: &c, log: slog.New(slog.DiscardHandler)}
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
