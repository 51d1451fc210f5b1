package daemon

import (
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/explain"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// TestVAEDataMustBeTheModelsFeatures: the VAE of PSCE's plausibility term is trained on
// model.dataset only when its rows are the model's features: as many as the model's inputs, and
// the same names in the same order when the model names them.
func TestVAEDataMustBeTheModelsFeatures(t *testing.T) {
	m, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	bc, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	gc, _, err := assets.Load("german_credit")
	if err != nil {
		t.Fatal(err)
	}
	with := func(features []string) *bnn.Model {
		c := *m
		c.Features = features
		return &c
	}
	renamed := slices.Clone(m.Features)
	renamed[3] = "f3"
	spaced := slices.Clone(m.Features) // a model named from a header with blanks around its names
	spaced[3] = " " + spaced[3] + " "
	for _, tc := range []struct {
		name  string
		model *bnn.Model
		rows  []string // the data set's features
		want  string   // in the error; "" for none
	}{
		{"the model's own data", m, bc.Features, ""},
		{"a model without feature names", with(nil), bc.Features, ""},
		{"a renamed feature", with(renamed), bc.Features, `feature 3 is "mean area" in the data set, "f3" in the model`},
		{"a model's name with blanks around it", with(spaced), bc.Features, ""},
		{"features in another order", with(append(slices.Clone(m.Features[1:]), m.Features[0])), bc.Features, "feature 0 is"},
		{"another data set", m, gc.Features, "the data set has"},
		{"fewer features than a model without names has inputs", with(nil), bc.Features[:len(bc.Features)-1], "the data set has 29 features, the model 30"},
		{"more features than a model without names has inputs", with(nil), append(slices.Clone(bc.Features), "extra"), "the data set has 31 features, the model 30"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := *bc
			set.Features = tc.rows
			err := vaeDataFits(&set, tc.model)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("got %v, want an error with %q", err, tc.want)
			}
		})
	}
}

// TestNoVAEFromDataOfOtherFeatures: the explainer of a model whose features are named otherwise
// than model.dataset's trains no VAE: it says why at WARN and writes nothing under state_dir.
func TestNoVAEFromDataOfOtherFeatures(t *testing.T) {
	m, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	c := *m
	c.Features = slices.Clone(m.Features)
	c.Features[3] = "f3"
	logs := &tooltest.Output{}
	e := newExplainer(explainerConfig{stateDir: t.TempDir(), dataset: "breast_cancer", concurrency: 1, pool: drawPool}, func() *bnn.Model { return &c },
		slog.New(slog.NewTextHandler(logs, nil)))
	if err := e.loadOrTrain(context.Background()); err != nil {
		t.Fatal(err)
	}
	if e.vae != nil {
		t.Error("a VAE was trained on data of other features")
	}
	if _, err := os.Stat(e.dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("%s: %v, want nothing written", e.dir, err)
	}
	if want := `feature 3 is \"mean area\" in the data set, \"f3\" in the model`; !strings.Contains(logs.String(), "no training data for the VAE") || !strings.Contains(logs.String(), want) {
		t.Errorf("no WARN line naming the feature (%s):\n%s", want, logs.String())
	}
	// PSCE then runs without its plausibility terms, as docs/API.md says.
	close(e.ready)
	data := daemontest.Bundled(t)
	for i, y := range data.Y {
		if y == 0 {
			if _, err := e.generate(context.Background(), &c, data.X[i], -1, explain.MethodPSCE); err != nil && !errors.Is(err, explain.ErrNotFound) {
				t.Fatalf("PSCE without a VAE: %v", err)
			}
			break
		}
	}
}

// TestBaselinesDoNotWaitForTheVAE: the baselines do not use the VAE, so on a daemon whose VAE is
// not trained they run at once and ask for no training; PSCE then still does.
func TestBaselinesDoNotWaitForTheVAE(t *testing.T) {
	m, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	e := newExplainer(explainerConfig{stateDir: t.TempDir(), dataset: "breast_cancer", maxIterations: 50, concurrency: 1,
		delta: 0.05, epsilon: 0.01, pool: drawPool}, func() *bnn.Model { return m }, slog.New(slog.DiscardHandler))
	runExplainer(t, e)
	data := daemontest.Bundled(t)
	x := data.X[slices.Index(data.Y, 0)]
	for _, method := range explain.Methods {
		if method == explain.MethodPSCE {
			continue
		}
		// A request context already done: a generation that waited for the VAE would be answered
		// errVAEPending; one that does not wait ignores it until its first iteration.
		done, stop := context.WithCancel(context.Background())
		stop()
		_, err := e.generate(done, m, x, -1, method)
		if errors.Is(err, errVAEPending) {
			t.Errorf("%s waited for the VAE", method)
		}
	}
	select {
	case <-e.want:
		t.Fatal("a baseline asked for the VAE's training")
	default:
	}
	if _, err := os.Stat(e.dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("%s: %v, want no VAE trained for the baselines", e.dir, err)
	}
	done, stop := context.WithCancel(context.Background())
	stop()
	if _, err := e.generate(done, m, x, -1, explain.MethodPSCE); !errors.Is(err, errVAEPending) {
		t.Errorf("PSCE before the VAE is trained: %v, want errVAEPending", err)
	}
	select {
	case <-e.want:
	default:
		t.Error("PSCE did not ask for the VAE's training")
	}
}

// drawPool draws a pool of 1000 networks of m, as the daemon measures registrations with at
// the defaults.
func drawPool(m *bnn.Model) (*bnn.Pool, error) { return bnn.NewPool(m, 1000, 1, bnn.Float64) }

// The daemon's generators are valid for every certify.delta, certify.verdict_alpha and
// certify.samples the configuration accepts: their confirmation ensemble is large enough to show
// a CE in the renewal rule's set (explain's 500 draws alone could never confirm a delta under
// 0.025 at the default alpha), their final estimate has the registration's draws, no fewer than
// the confirmation's, and at the defaults they are explain's own 500 and 1000 draws.
func TestGeneratorConfigCanConfirmEveryDelta(t *testing.T) {
	def := config.Default().Certify
	if cfg := generatorConfig(explain.MethodPSCE, 0, def.Delta, def.Epsilon, def.VerdictAlpha, def.Samples); cfg.CheckSamples != explain.DefaultCheckSamples ||
		cfg.FinalSamples != explain.DefaultFinalSamples {
		t.Errorf("at the defaults: %d and %d draws, want explain's %d and %d", cfg.CheckSamples, cfg.FinalSamples,
			explain.DefaultCheckSamples, explain.DefaultFinalSamples)
	}
	for _, delta := range []float64{0.001, 0.01, 0.02, 0.049, 0.05, 0.1, 0.3, 0.499} {
		for _, alpha := range []float64{1e-6, 0.001, 0.01, 0.1, 0.499} {
			least := certify.MinRenewableSamples(delta, alpha)
			for _, samples := range []int{max(2, least), 1000, 4 * least} {
				if samples < least {
					continue // refused by the configuration
				}
				for _, method := range explain.Methods {
					cfg := generatorConfig(method, 0, delta, def.Epsilon, alpha, samples)
					if err := cfg.Validate(); err != nil {
						t.Errorf("%s at delta %v, verdict_alpha %v, %d samples: %v", method, delta, alpha, samples, err)
					}
					if cfg.FinalSamples != samples || cfg.CheckSamples > cfg.FinalSamples {
						t.Errorf("%s at delta %v, verdict_alpha %v, %d samples: %d draws confirm, %d measure the result", method, delta, alpha,
							samples, cfg.CheckSamples, cfg.FinalSamples)
					}
				}
			}
		}
	}
}

// TestSavedVAEIsLoadedAtStart: a VAE saved under state_dir is loaded as soon as the explainer
// runs, before any explanation asks for it, and makes PSCE ready; it is the saved network.
func TestSavedVAEIsLoadedAtStart(t *testing.T) {
	m, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	state := t.TempDir()
	if err := os.CopyFS(filepath.Join(state, "vae"), os.DirFS(daemontest.SharedVAEDir(t))); err != nil {
		t.Fatal(err)
	}
	d := config.Default().Model
	e := newExplainer(explainerConfig{stateDir: state, dataset: d.Dataset, seed: d.Seed, concurrency: 1, pool: drawPool},
		func() *bnn.Model { return m }, slog.New(slog.DiscardHandler))
	runExplainer(t, e)
	select {
	case <-e.ready:
	case <-time.After(time.Minute):
		t.Fatal("a saved VAE is not ready a minute after the start, with no explanation asked for")
	}
	select {
	case <-e.want:
		t.Fatal("the start asked for the VAE's training")
	default:
	}
	if e.vae == nil {
		t.Fatal("ready without the saved VAE")
	}
	daemontest.SameVAE(t, e.dir, daemontest.SharedVAEDir(t))
}

// runExplainer runs e until the test ends, then checks that it stopped without an error.
func runExplainer(t *testing.T, e *explainer) {
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- e.run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-ran; err != nil {
			t.Errorf("run: %v", err)
		}
	})
}
