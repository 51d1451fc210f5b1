package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/explain"
	"github.com/cfguard/cfguard/ledger"
)

// bootstrapModel sets the current posterior: the ledger's when it has one (a restart), else the
// model directory model.path, else a model trained on the bundled data set model.dataset. A new
// posterior is checkpointed before anything else happens, and also written to
// <state_dir>/model for inspection with `cfguard kl`.
func (d *Daemon) bootstrapModel(ctx context.Context) error {
	m, err := d.ledger.Current()
	switch {
	case err == nil:
		d.log.Info("resuming from the state store", "posterior_version", m.Version, "state_dir", d.cfg.StateDir)
		d.setCurrent(m)
		return nil
	case !errors.Is(err, ledger.ErrNoPosterior):
		return err
	}
	if d.cfg.Model.Path != "" {
		if m, err = bnn.Load(d.cfg.Model.Path); err != nil {
			return fmt.Errorf("model.path: %w", err)
		}
		d.log.Info("loaded model", "path", d.cfg.Model.Path, "params", m.NumParams(), "classes", m.Classes)
	} else {
		set, ds, err := assets.Load(d.cfg.Model.Dataset)
		if err != nil {
			return fmt.Errorf("model.dataset: %w", err)
		}
		d.log.Info("training the bundled model (first start)", "dataset", ds.Name, "rows", set.Len(), "features", len(set.Features))
		m, _, err = bnn.Fit(ctx, set, ds.Classes, bnn.TrainConfig{Seed: d.cfg.Model.Seed, Epochs: d.cfg.Model.Epochs,
			Progress: func(e bnn.EpochStats) {
				d.log.Info("training", "epoch", e.Epoch, "loss", fmt.Sprintf("%.4f", e.Loss), "accuracy", fmt.Sprintf("%.3f", e.Accuracy))
			}})
		if err != nil {
			return fmt.Errorf("training on %s: %w", ds.Name, err)
		}
	}
	if err := d.ledger.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
		return err
	}
	if err := bnn.Save(filepath.Join(d.cfg.StateDir, "model"), m); err != nil {
		return err
	}
	d.setCurrent(m)
	return nil
}

// provideVAE is the component that makes the VAE available to /v1/explain without delaying
// start-up: a saved VAE is loaded at once; otherwise it is trained (seconds of CPU) when the
// first explanation asks for it (wantVAE), then saved. vaeReady is closed when it is available.
func (d *Daemon) provideVAE(ctx context.Context) error {
	if _, err := os.Stat(filepath.Join(d.cfg.StateDir, "vae")); err != nil {
		select {
		case <-d.wantVAE:
		case <-ctx.Done():
			return nil
		}
	}
	if err := d.loadOrTrainVAE(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	close(d.vaeReady)
	<-ctx.Done()
	return nil
}

// loadOrTrainVAE provides the VAE that PSCE's plausibility term needs: <state_dir>/vae if
// present, else trained on the bundled data set (in the model's standardised space) and saved.
// Without training data (a user model and no bundled set), explanations fall back to no VAE.
func (d *Daemon) loadOrTrainVAE(ctx context.Context) error {
	dir := filepath.Join(d.cfg.StateDir, "vae")
	if _, err := os.Stat(dir); err == nil {
		v, err := explain.LoadVAE(dir)
		if err != nil {
			return fmt.Errorf("%s: %w", dir, err)
		}
		d.vae = v
		return nil
	}
	set, _, err := assets.Load(d.cfg.Model.Dataset)
	if err != nil || len(set.Features) != d.current().Inputs() {
		d.log.Warn("no training data for the VAE: /v1/explain runs PSCE without its plausibility term", "dataset", d.cfg.Model.Dataset)
		return nil
	}
	d.log.Info("training the VAE for PSCE (first start)", "rows", set.Len())
	v, _, err := explain.TrainVAE(ctx, d.current(), set.X, explain.TrainConfig{Seed: d.cfg.Model.Seed})
	if err != nil {
		return fmt.Errorf("training the VAE: %w", err)
	}
	if err := explain.SaveVAE(dir, v); err != nil {
		return err
	}
	d.vae = v
	return nil
}
