package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/explain"
)

// errBusy: every generation slot is taken; the client should retry later.
var errBusy = errors.New("explain: every generation slot is taken; retry later")

// errVAEPending: the VAE is still being trained for the first explanation.
var errVAEPending = errors.New("explain: the VAE is still being trained; retry shortly")

// explainer generates counterfactuals for /v1/explain. It owns the VAE's lifecycle (loaded from
// <state_dir>/vae, or trained when the first explanation asks for it and saved there), one
// Generator for the current (method, posterior version), and the slots that bound concurrent
// generations (explain.concurrency).
type explainer struct {
	dir     string // <state_dir>/vae
	dataset string // bundled data set the VAE is trained on
	seed    uint64
	maxIter int
	delta   float64
	epsilon float64
	// targetAlpha is certify.verdict_alpha: PSCE searches for CEs that the renewal rule admits.
	targetAlpha float64
	// pool returns the pool a registration under a posterior is measured with: PSCE's final
	// estimate is that pool's, so that what the search stops on is what the registration finds.
	pool      func(*bnn.Model) (*bnn.Pool, error)
	log       *slog.Logger
	posterior func() *bnn.Model

	slots    *slots        // explain.concurrency
	want     chan struct{} // closed (once) by the first explanation request
	wantOnce sync.Once
	ready    chan struct{} // closed once vae is set (it stays nil without training data)
	stopped  chan struct{} // closed when run returns: a VAE not ready by then never will be
	vae      *explain.VAE

	mu     sync.Mutex
	gen    *explain.Generator
	genFor uint64 // posterior version gen samples
}

type explainerConfig struct {
	stateDir, dataset string
	seed              uint64
	maxIterations     int
	concurrency       int
	delta, epsilon    float64
	targetAlpha       float64
	pool              func(*bnn.Model) (*bnn.Pool, error)
}

func newExplainer(c explainerConfig, posterior func() *bnn.Model, log *slog.Logger) *explainer {
	return &explainer{dir: filepath.Join(c.stateDir, "vae"), dataset: c.dataset, seed: c.seed, maxIter: c.maxIterations,
		delta: c.delta, epsilon: c.epsilon, targetAlpha: c.targetAlpha, pool: c.pool, log: log, posterior: posterior,
		slots: newSlots(c.concurrency), want: make(chan struct{}), ready: make(chan struct{}), stopped: make(chan struct{})}
}

// run is the component that makes the VAE available without delaying start-up: a saved VAE is
// loaded at once; otherwise it is trained (seconds of CPU) when the first explanation asks for
// it, then saved. When it returns, the explanations still waiting for the VAE are answered
// errStopping.
func (e *explainer) run(ctx context.Context) error {
	defer close(e.stopped)
	if _, err := os.Stat(e.dir); err != nil {
		select {
		case <-e.want:
		case <-ctx.Done():
			return nil
		}
	}
	if err := e.loadOrTrain(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	close(e.ready)
	<-ctx.Done()
	return nil
}

// loadOrTrain provides the VAE that PSCE's plausibility term needs: <state_dir>/vae if present,
// else trained on the bundled data set (in the model's standardised space) and saved. Without
// training data (a user model and no bundled set of its dimension), generation runs without it.
// The saved VAE is a cache of a deterministic training (explain.TrainVAE): one that does not load
// (truncated, a save cut short by a crash, a format of another build) is moved aside to
// <state_dir>/vae.damaged-<time>, kept for inspection, and trained again.
func (e *explainer) loadOrTrain(ctx context.Context) error {
	cause := "first explanation" // what the training log line says it is for
	if _, err := os.Stat(e.dir); err == nil {
		v, err := explain.LoadVAE(e.dir)
		if err == nil {
			e.vae = v
			return nil
		}
		aside := e.dir + ".damaged-" + time.Now().UTC().Format("20060102T150405.000Z")
		if rerr := os.Rename(e.dir, aside); rerr != nil {
			return fmt.Errorf("%s: %w; moving it aside to train a new one failed: %v (move %s away; the VAE is trained again at the next start)",
				e.dir, err, rerr, e.dir)
		}
		e.log.Warn("the saved VAE does not load: moved aside, training a new one", "dir", e.dir, "moved_to", aside, "err", err)
		cause = "the saved VAE does not load"
	}
	m := e.posterior()
	set, _, err := assets.Load(e.dataset)
	if err == nil {
		err = vaeDataFits(set, m)
	}
	if err != nil {
		e.log.Warn("no training data for the VAE: /v1/explain runs PSCE without its plausibility term", "dataset", e.dataset, "err", err)
		return nil
	}
	e.log.Info("training the VAE for PSCE", "cause", cause, "rows", set.Len())
	start := time.Now()
	v, _, err := explain.TrainVAE(ctx, m, set.X, explain.TrainConfig{Seed: e.seed})
	if err != nil {
		return fmt.Errorf("training the VAE: %w", err)
	}
	if err := explain.SaveVAE(e.dir, v); err != nil {
		return err
	}
	e.log.Info("VAE trained", "dir", e.dir, "took", time.Since(start).Round(time.Millisecond))
	e.vae = v
	return nil
}

// acquire takes a generation slot without waiting; release gives it back.
func (e *explainer) acquire() (release func(), err error) {
	release, ok := e.slots.acquire()
	if !ok {
		return nil, fmt.Errorf("%w (explain.concurrency: %d at once)", errBusy, cap(e.slots.c))
	}
	return release, nil
}

// generate runs one generation for x under posterior m (the caller holds a slot). target < 0
// picks the other class. Only PSCE asks for the VAE and waits for it: the baselines do not use
// it, so they run at once on a daemon whose VAE is not trained yet.
func (e *explainer) generate(ctx context.Context, m *bnn.Model, x []float64, target int, method explain.Method) (*explain.Result, error) {
	if method != explain.MethodPSCE {
		return e.generateWith(ctx, m, x, target, method)
	}
	e.wantOnce.Do(func() { close(e.want) })
	select {
	case <-e.ready: // checked first: a VAE that is ready serves the requests the stop drains
	default:
		select {
		case <-e.ready:
		case <-ctx.Done():
			return nil, errVAEPending
		case <-e.stopped:
			return nil, fmt.Errorf("explain: %w", errStopping)
		}
	}
	return e.generateWith(ctx, m, x, target, method)
}

// generateWith runs the generation with the Generator for (m's version, method).
func (e *explainer) generateWith(ctx context.Context, m *bnn.Model, x []float64, target int, method explain.Method) (*explain.Result, error) {
	g, err := e.generator(m, method)
	if err != nil {
		return nil, err
	}
	return g.Generate(ctx, x, target)
}

// generator returns the Generator for (m's version, method), rebuilt when either changes (a
// Generator samples its posterior once), its final ensemble the pool registrations under m are
// measured with.
func (e *explainer) generator(m *bnn.Model, method explain.Method) (*explain.Generator, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.gen == nil || e.gen.Config().Method != method || e.genFor != m.Version {
		pool, err := e.pool(m)
		if err != nil {
			return nil, fmt.Errorf("explain: drawing posterior version %d's networks: %w", m.Version, err)
		}
		cfg := generatorConfig(method, e.maxIter, e.delta, e.epsilon, e.targetAlpha, pool.Samples())
		cfg.Seed, cfg.FinalPool, cfg.Precision = m.Version, pool, pool.Precision()
		var vae *explain.VAE
		if method == explain.MethodPSCE {
			// generate waited for ready, after which vae is not written again. Ready without a
			// VAE: no training data fits the model (loadOrTrain logged why).
			vae = e.vae
			cfg.WithoutVAE = vae == nil
		}
		e.gen, e.genFor = explain.NewGenerator(m, vae, cfg), m.Version
	}
	return e.gen, nil
}

// generatorConfig is the configuration of the daemon's generators: explain's defaults, the
// daemon's iteration cap, and its <delta, epsilon>-set with the renewal rule's confidence
// (targetAlpha, certify.verdict_alpha), so that PSCE looks for CEs the daemon registers as
// certified. The final estimate has the registration's samples draws (certify.samples; the
// generator takes the registration's pool itself); the confirmation ensemble has explain's
// 500, or the draws whose margin at p = 1 is half of delta (certify.MinRenewableSamples(delta/2,
// targetAlpha)) when more, but no more than the final estimate. With 500 alone a small delta
// (under 0.025 at alpha 0.01) could never be confirmed, and every search would run to the cap.
func generatorConfig(method explain.Method, maxIter int, delta, epsilon, targetAlpha float64, samples int) explain.Config {
	cfg := explain.DefaultConfig(method)
	cfg.MaxIter, cfg.Delta, cfg.Epsilon, cfg.TargetAlpha, cfg.FinalSamples = maxIter, delta, epsilon, targetAlpha, samples
	if targetAlpha > 0 && delta > 0 {
		cfg.CheckSamples = max(cfg.CheckSamples, certify.MinRenewableSamples(delta/2, targetAlpha))
	}
	cfg.CheckSamples = min(cfg.CheckSamples, samples)
	return cfg
}

// vaeDataFits reports why the rows of set cannot train the VAE of the model m, nil when they
// can: they must have m's input dimension and, when m names its features, the same names in the
// same order (rows of other features would teach the VAE another distribution). A model's names
// are compared without the blanks around them, which a data set's names never have.
func vaeDataFits(set *dataset.Set, m *bnn.Model) error {
	if len(set.Features) != m.Inputs() {
		return fmt.Errorf("the data set has %d features, the model %d", len(set.Features), m.Inputs())
	}
	for i, f := range m.Features { // none when the model names no feature
		if set.Features[i] != strings.TrimSpace(f) {
			return fmt.Errorf("feature %d is %q in the data set, %q in the model", i, set.Features[i], f)
		}
	}
	return nil
}
