package daemon

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/explain"
)

// The explainer keeps one Generator, built again only when the posterior version or the method
// asked for changes (a Generator samples its posterior once), with its networks drawn through the
// registrations' pool of that version and seeded by that version, so that the same question
// under the same posterior gets the same answer. PSCE runs without its plausibility terms only
// when there is no VAE; the baselines never ask for them.
func TestExplainerGeneratorIsKeptPerPosteriorVersionAndMethod(t *testing.T) {
	m, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	vae, err := explain.LoadVAE(daemontest.SharedVAEDir(t))
	if err != nil {
		t.Fatal(err)
	}
	version := func(v uint64) *bnn.Model {
		c := *m
		c.Version = v
		return &c
	}
	for _, withVAE := range []bool{false, true} {
		var drawn []uint64 // the versions whose pool was drawn
		e := newExplainer(explainerConfig{stateDir: t.TempDir(), concurrency: 1, delta: 0.05, epsilon: 0.01,
			pool: func(m *bnn.Model) (*bnn.Pool, error) {
				drawn = append(drawn, m.Version)
				return bnn.NewPool(m, 20, 1, bnn.Float64)
			}}, func() *bnn.Model { return m }, slog.New(slog.DiscardHandler))
		if withVAE {
			e.vae = vae
		}
		var last *explain.Generator
		for _, s := range []struct {
			version uint64
			method  explain.Method
			rebuilt bool
		}{
			{3, explain.MethodPSCE, true},
			{3, explain.MethodPSCE, false},
			{3, explain.MethodWachter, true},
			{4, explain.MethodWachter, true},
			{4, explain.MethodWachter, false},
			{4, explain.MethodPSCE, true},
			{3, explain.MethodPSCE, true},
		} {
			before := len(drawn)
			g, err := e.generator(version(s.version), s.method)
			if err != nil {
				t.Fatalf("version %d, %s: %v", s.version, s.method, err)
			}
			cfg := g.Config()
			if got := g != last; got != s.rebuilt || (len(drawn) > before) != s.rebuilt {
				t.Errorf("VAE %v, version %d, %s: generator rebuilt %v with %d pools drawn, want %v", withVAE, s.version, s.method, got,
					len(drawn)-before, s.rebuilt)
			}
			if s.rebuilt && !slices.Equal(drawn[before:], []uint64{s.version}) {
				t.Errorf("VAE %v, version %d, %s: pools drawn for versions %v, want %d", withVAE, s.version, s.method, drawn[before:], s.version)
			}
			if cfg.Method != s.method || cfg.Seed != s.version || cfg.FinalPool == nil || cfg.FinalSamples != 20 {
				t.Errorf("VAE %v, version %d, %s: a generator of %s seeded %d with %d final draws, want %s seeded %d with the pool's 20",
					withVAE, s.version, s.method, cfg.Method, cfg.Seed, cfg.FinalSamples, s.method, s.version)
			}
			if want := s.method == explain.MethodPSCE && !withVAE; cfg.WithoutVAE != want {
				t.Errorf("VAE %v, version %d, %s: without the VAE's terms %v, want %v", withVAE, s.version, s.method, cfg.WithoutVAE, want)
			}
			last = g
		}
	}
}

// The confirmation ensemble of the daemon's generators has explain's 500 draws, or, when
// certify.delta and certify.verdict_alpha are set, the draws whose margin is half of delta when
// more (certify.MinRenewableSamples(delta/2, alpha)), and never more than the registration's
// certify.samples, which the final estimate has.
func TestGeneratorConfigConfirmationDraws(t *testing.T) {
	half := certify.MinRenewableSamples(0.005, 0.01) // delta 0.01 at alpha 0.01
	if half <= explain.DefaultCheckSamples {
		t.Fatalf("delta 0.01 at alpha 0.01 needs %d draws, not more than explain's %d", half, explain.DefaultCheckSamples)
	}
	for _, tc := range []struct {
		name         string
		delta, alpha float64
		samples      int
		check        int
	}{
		{"the defaults", 0.05, 0.01, 1000, explain.DefaultCheckSamples},
		{"a small delta", 0.01, 0.01, 100 * half, half},
		{"a small delta, fewer samples", 0.01, 0.01, half - 1, half - 1},
		{"fewer samples than explain's", 0.05, 0.01, 100, 100},
		{"no verdict_alpha", 0.01, 0, 100 * half, explain.DefaultCheckSamples},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := generatorConfig(explain.MethodPSCE, 0, tc.delta, 0.01, tc.alpha, tc.samples)
			if cfg.CheckSamples != tc.check || cfg.FinalSamples != tc.samples {
				t.Errorf("%d draws confirm, %d measure the result; want %d and %d", cfg.CheckSamples, cfg.FinalSamples, tc.check, tc.samples)
			}
		})
	}
}

// A PSCE explanation asked for when the VAE is ready is generated even if the explainer has
// stopped meanwhile (the stop drains the requests running) and even if the request's context is
// done: the answer is the generation's, neither errStopping nor errVAEPending.
func TestReadyVAEServesExplanationsAfterTheStop(t *testing.T) {
	m, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	e := newExplainer(explainerConfig{stateDir: t.TempDir(), maxIterations: 1, concurrency: 1, delta: 0.05, epsilon: 0.01,
		pool: func(m *bnn.Model) (*bnn.Pool, error) { return bnn.NewPool(m, 20, 1, bnn.Float64) }},
		func() *bnn.Model { return m }, slog.New(slog.DiscardHandler))
	close(e.ready) // no VAE: PSCE without its plausibility terms
	close(e.stopped)
	data := daemontest.Bundled(t)
	x := data.X[slices.Index(data.Y, 0)]
	live := context.Background()
	done, stop := context.WithCancel(live)
	stop()
	// Both channels closed: an answer that picked one of them at random would give errStopping
	// (or errVAEPending) on some of these calls.
	for i := range 64 {
		for _, ctx := range []context.Context{live, done} {
			if _, err := e.generate(ctx, m, x, -1, explain.MethodPSCE); errors.Is(err, errStopping) || errors.Is(err, errVAEPending) {
				t.Fatalf("call %d (context done %v): %v, want the generation's answer", i, ctx.Err() != nil, err)
			}
		}
	}
}
