package daemon

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/explain"
	"github.com/cfguard/cfguard/internal/tooltest"
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

// The first explanation of a daemon trains the VAE of PSCE's plausibility term
// (explainer.loadOrTrain, about 3 CPU-seconds) and saves it under state_dir/vae. The VAE is a
// deterministic function of the model's scaler, the bundled data set and model.seed
// (explain.TrainVAE), none of which an update changes, so the tests that explain train it once
// per test binary too and start their daemons with it in state_dir/vae (withSharedVAE), where the
// daemon loads it as it loads the one it saved. TestExplainStoresACertifiedCounterfactual trains
// its own on its first explanation and holds the two equal.
var sharedVAE struct {
	once sync.Once
	dir  string
	err  error
}

func TestMain(m *testing.M) {
	flag.Parse()
	waitingTestsAtOnce()
	os.Exit(runTests(m))
}

// minParallel is how many of this package's parallel tests run at once unless -test.parallel
// says otherwise. They are the ones that mostly wait (session and send deadlines, a child
// process, a peer that answers late: each marked t.Parallel with a comment, or in a replica
// test): at go test's default, GOMAXPROCS at once, their waits follow one another on a
// machine of one or two cores and the package takes minutes longer there.
const minParallel = 4

// waitingTestsAtOnce sets -test.parallel to minParallel, or GOMAXPROCS when more, unless it
// was given.
func waitingTestsAtOnce() {
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given {
		flag.Set("test.parallel", strconv.Itoa(max(minParallel, runtime.GOMAXPROCS(0))))
	}
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
// (model.dataset, model.seed and model.epochs as config.Default sets them, no model.path).
func trainsDefaultModel(c *config.Config) bool {
	d := config.Default().Model
	return c.Model.Path == "" && c.Model.Dataset == d.Dataset && c.Model.Seed == d.Seed && c.Model.Epochs == d.Epochs
}

// bundledModelOf is the bundledModel hook for a replica of c whose first start would train the
// network at the default model keys: the shared model, handed over in place of training it. A
// replica is not given the shared model as model.path, because its genesis records how the first
// posterior came to be (the data set and its keys), and the tests compare it. Nil for any other
// daemon.
func bundledModelOf(t testing.TB, c *config.Config) func() (*bnn.Model, error) {
	t.Helper()
	if !c.Replication.Enabled || !trainsDefaultModel(c) {
		return nil
	}
	dir := sharedModelDir(t)
	return func() (*bnn.Model, error) { return bnn.Load(dir) }
}

// sharedModelDir is the model directory of the network a daemon trains on first start at the
// default model keys, trained (as the daemon does, initialModel) on the first call.
func sharedModelDir(t testing.TB) string {
	t.Helper()
	sharedModel.once.Do(func() {
		c := config.Default()
		d := &Daemon{cfg: &c, log: slog.New(slog.DiscardHandler), front: newFront()}
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

// sharedVAEDir is the directory of the VAE that the first explanation of a daemon on the shared
// model trains, trained (by the explainer's loadOrTrain) on the first call.
func sharedVAEDir(t testing.TB) string {
	t.Helper()
	model := sharedModelDir(t)
	sharedVAE.once.Do(func() {
		m, err := bnn.Load(model)
		if err != nil {
			sharedVAE.err = err
			return
		}
		d := config.Default().Model
		e := &explainer{dir: filepath.Join(sharedModel.root, "vae"), dataset: d.Dataset, seed: d.Seed,
			posterior: func() *bnn.Model { return m }, log: slog.New(slog.DiscardHandler)}
		if err := e.loadOrTrain(context.Background()); err != nil {
			sharedVAE.err = err
			return
		}
		if e.vae == nil {
			sharedVAE.err = fmt.Errorf("no VAE trained for data set %s", d.Dataset)
			return
		}
		sharedVAE.dir = e.dir
	})
	if sharedVAE.err != nil {
		t.Fatalf("training the shared VAE: %v", sharedVAE.err)
	}
	return sharedVAE.dir
}

// withSharedVAE is mutate followed, for a daemon on the shared model (trainsDefaultModel), by a
// copy of the shared VAE into its state_dir/vae: its first explanation loads the VAE it would
// have trained. Another daemon trains its own.
func withSharedVAE(t testing.TB, mutate func(c *config.Config)) func(c *config.Config) {
	return func(c *config.Config) {
		if mutate != nil {
			mutate(c)
		}
		if !trainsDefaultModel(c) {
			return
		}
		if err := os.CopyFS(filepath.Join(c.StateDir, "vae"), os.DirFS(sharedVAEDir(t))); err != nil {
			t.Fatalf("copying the shared VAE into the state directory: %v", err)
		}
	}
}

// sameVAE fails the test unless the VAEs in directories a and b encode to the same bytes.
func sameVAE(t testing.TB, a, b string) {
	t.Helper()
	var enc [2][2][]byte
	for i, dir := range []string{a, b} {
		v, err := explain.LoadVAE(dir)
		if err != nil {
			t.Fatal(err)
		}
		if enc[i][0], enc[i][1], err = explain.EncodeVAE(v); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(enc[0][0], enc[1][0]) || !bytes.Equal(enc[0][1], enc[1][1]) {
		t.Fatalf("the VAE in %s is not the one in %s:\n%s\n%s", a, b, enc[0][0], enc[1][0])
	}
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

// A saved VAE that does not load (its weights cut short, as a crash during its save or a full disk
// leaves them) no longer stops the daemon: it is moved aside, byte for byte, and the VAE is
// trained again, the same network as the shared one.
func TestDamagedVAEIsMovedAsideAndTrainedAgain(t *testing.T) {
	m, err := bnn.Load(sharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	state := t.TempDir()
	dir := filepath.Join(state, "vae")
	if err := os.CopyFS(dir, os.DirFS(sharedVAEDir(t))); err != nil {
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
	sameVAE(t, dir, sharedVAEDir(t))
	aside, _ := filepath.Glob(dir + ".damaged-*")
	if len(aside) != 1 {
		t.Fatalf("damaged VAE directories kept: %v, want one", aside)
	}
	if kept, err := os.ReadFile(filepath.Join(aside[0], explain.VAEWeightsFile)); err != nil || !bytes.Equal(kept, raw[:len(raw)/2]) {
		t.Fatalf("the damaged weights were not kept as they were: %v", err)
	}
	if !strings.Contains(logs.String(), "level=WARN msg=\"the saved VAE does not load: moved aside, training a new one\"") ||
		!strings.Contains(logs.String(), "moved_to="+aside[0]) {
		t.Fatalf("log: %s", logs.String())
	}
}
