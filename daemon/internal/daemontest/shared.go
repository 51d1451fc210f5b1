package daemontest

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/explain"
)

// shared holds what a test binary makes once: the network a first start trains at the default
// model keys, and the VAE a first explanation on it trains.
var shared struct {
	root string // a temporary directory of the test binary, removed by Main

	model, vae struct {
		once sync.Once
		dir  string
		err  error
	}
}

// Main is the TestMain of a package that starts daemons: it runs the tests with
// -test.parallel at least minParallel and removes what they shared when they are done.
func Main(m *testing.M) {
	flag.Parse()
	waitingTestsAtOnce()
	os.Exit(runTests(m))
}

// minParallel is how many of a package's parallel tests run at once unless -test.parallel says
// otherwise. They are the ones that mostly wait (session and send deadlines, a child process, a
// peer that answers late: each marked t.Parallel with a comment, or in a replica test): at go
// test's default, GOMAXPROCS at once, their waits follow one another on a machine of one or two
// cores and the package takes minutes longer there.
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

// mainRan fails the test unless Main is its package's TestMain: the shared files live in Main's
// temporary directory.
func mainRan(t testing.TB) {
	t.Helper()
	if shared.root == "" {
		t.Fatal("daemontest.Main is not this package's TestMain: it makes the directory of the shared model and VAE")
	}
}

func runTests(m *testing.M) int {
	root, err := os.MkdirTemp("", "cfguard-daemon-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "a temporary directory for the shared model:", err)
		return 1
	}
	defer os.RemoveAll(root)
	shared.root = root
	return m.Run()
}

// TrainsDefaultModel says whether c's first start trains the network at the default model keys
// (model.dataset, model.seed and model.epochs as config.Default sets them, no model.path).
func TrainsDefaultModel(c *config.Config) bool {
	d := config.Default().Model
	return c.Model.Path == "" && c.Model.Dataset == d.Dataset && c.Model.Seed == d.Seed && c.Model.Epochs == d.Epochs
}

// BundledModelOf is daemon.Options.BundledModel for a replica of c whose first start would
// train the network at the default model keys: the shared model, handed over in place of
// training it. A replica is not given the shared model as model.path, because its genesis
// records how the first posterior came to be (the data set and its keys), and the tests
// compare it. Nil for any other daemon.
func BundledModelOf(t testing.TB, c *config.Config) func() (*bnn.Model, error) {
	t.Helper()
	if !c.Replication.Enabled || !TrainsDefaultModel(c) {
		return nil
	}
	dir := SharedModelDir(t)
	return func() (*bnn.Model, error) { return bnn.Load(dir) }
}

// SharedModelDir is the model directory of the network a daemon trains on first start at the
// default model keys, trained on the first call as the daemon trains it: bnn.Fit on the bundled
// data set with model.seed and model.epochs. The daemon's TestFirstStartTrainsTheSharedModel
// holds the two equal, bit for bit.
func SharedModelDir(t testing.TB) string {
	t.Helper()
	mainRan(t)
	s := &shared.model
	s.once.Do(func() {
		d := config.Default().Model
		set, ds, err := assets.Load(d.Dataset)
		if err != nil {
			s.err = err
			return
		}
		m, _, err := bnn.Fit(context.Background(), set, ds.Classes, bnn.TrainConfig{Seed: d.Seed, Epochs: d.Epochs})
		if err != nil {
			s.err = err
			return
		}
		dir := filepath.Join(shared.root, "model")
		if err := bnn.Save(dir, m); err != nil {
			s.err = err
			return
		}
		s.dir = dir
	})
	if s.err != nil {
		t.Fatalf("training the shared bundled model: %v", s.err)
	}
	return s.dir
}

// SharedVAEDir is the directory of the VAE that the first explanation of a daemon on the shared
// model trains, trained on the first call as the daemon's explainer trains it:
// explain.TrainVAE on the bundled data set with model.seed.
// TestExplainStoresACertifiedCounterfactual (daemon/internal/tests/endtoend) holds the two equal.
func SharedVAEDir(t testing.TB) string {
	t.Helper()
	model := SharedModelDir(t)
	s := &shared.vae
	s.once.Do(func() {
		m, err := bnn.Load(model)
		if err != nil {
			s.err = err
			return
		}
		d := config.Default().Model
		set, _, err := assets.Load(d.Dataset)
		if err != nil {
			s.err = err
			return
		}
		v, _, err := explain.TrainVAE(context.Background(), m, set.X, explain.TrainConfig{Seed: d.Seed})
		if err != nil {
			s.err = err
			return
		}
		dir := filepath.Join(shared.root, "vae")
		if err := explain.SaveVAE(dir, v); err != nil {
			s.err = err
			return
		}
		s.dir = dir
	})
	if s.err != nil {
		t.Fatalf("training the shared VAE: %v", s.err)
	}
	return s.dir
}

// WithSharedVAE is mutate followed, for a daemon on the shared model (TrainsDefaultModel), by
// a copy of the shared VAE into its state_dir/vae: its first explanation loads the VAE it would
// have trained. Another daemon trains its own.
func WithSharedVAE(t testing.TB, mutate func(c *config.Config)) func(c *config.Config) {
	return func(c *config.Config) {
		if mutate != nil {
			mutate(c)
		}
		if !TrainsDefaultModel(c) {
			return
		}
		if err := os.CopyFS(filepath.Join(c.StateDir, "vae"), os.DirFS(SharedVAEDir(t))); err != nil {
			t.Fatalf("copying the shared VAE into the state directory: %v", err)
		}
	}
}

// SameVAE fails the test unless the VAEs in directories a and b encode to the same bytes.
func SameVAE(t testing.TB, a, b string) {
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
