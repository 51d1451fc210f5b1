package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cfguard/cfguard/internal/sidecar"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/ledger"
)

// bootstrapModel sets the current posterior: the ledger's when it has one (a restart), else the
// model directory model.path, else a model trained on the bundled data set model.dataset. A new
// posterior is checkpointed before anything else happens. The ledger is the only source of
// truth for the posterior; model.export_dir holds a copy of it (see exporter).
func (d *Daemon) bootstrapModel(ctx context.Context) error {
	d.noteLegacyModelDir()
	origin, err := configOrigin(d.cfg)
	if err != nil {
		return err
	}
	m, err := d.ledger.Current()
	switch {
	case err == nil:
		if err := d.checkOrigin(origin); err != nil {
			return err
		}
		d.log.Info("resuming from the state store", "posterior_version", m.Version, "state_dir", d.cfg.StateDir)
		d.setCurrent(m)
		return nil
	case !errors.Is(err, ledger.ErrNoPosterior):
		return err
	}
	if m, err = d.initialModel(ctx); err != nil {
		return err
	}
	if err := d.ledger.Checkpoint(&ledger.Checkpoint{Model: m, Origin: origin}); err != nil {
		return err
	}
	d.setCurrent(m)
	return nil
}

// initialModel is the first posterior the configuration names: model.path's, or one trained on
// the bundled data set model.dataset.
func (d *Daemon) initialModel(ctx context.Context) (*bnn.Model, error) {
	if d.cfg.Model.Path != "" {
		m, err := bnn.Load(d.cfg.Model.Path)
		if err != nil {
			return nil, fmt.Errorf("model.path: %w", err)
		}
		d.log.Info("loaded model", "path", d.cfg.Model.Path, "params", m.NumParams(), "classes", m.Classes)
		return m, nil
	}
	if d.bundledModel != nil {
		return d.bundledModel()
	}
	set, ds, err := assets.Load(d.cfg.Model.Dataset)
	if err != nil {
		return nil, fmt.Errorf("model.dataset: %w", err)
	}
	d.log.Info("training the bundled model (first start)", "dataset", ds.Name, "rows", set.Len(), "features", len(set.Features))
	d.front.setPhase("training the bundled model on " + ds.Name + " (first start)")
	m, _, err := bnn.Fit(ctx, set, ds.Classes, bnn.TrainConfig{Seed: d.cfg.Model.Seed, Epochs: d.cfg.Model.Epochs,
		Progress: func(e bnn.EpochStats) {
			d.log.Info("training", "epoch", e.Epoch, "loss", fmt.Sprintf("%.4f", e.Loss), "accuracy", fmt.Sprintf("%.3f", e.Accuracy))
		}})
	switch {
	case err != nil && ctx.Err() != nil && errors.Is(err, context.Canceled):
		// A stop asked for while training (a first training on a large data set takes minutes):
		// a clean stop, as while a replica waits for its brokers; the next start trains again.
		return nil, fmt.Errorf("%w: training on %s (%v)", errStoppedAtStart, ds.Name, context.Cause(ctx))
	case err != nil:
		return nil, fmt.Errorf("training on %s: %w", ds.Name, err)
	}
	return m, nil
}

// noteLegacyModelDir: releases before the export wrote the first posterior to <state_dir>/model
// and never updated it. It is not read and not deleted (it is the operator's); say so once.
func (d *Daemon) noteLegacyModelDir() {
	dir := filepath.Join(d.cfg.StateDir, "model")
	if _, err := os.Stat(filepath.Join(dir, bnn.SidecarFile)); err == nil && dir != d.cfg.ExportDir() {
		d.log.Warn("state_dir/model is a stale copy of the first posterior from an older release and is not used: "+
			"the ledger holds the posterior and model.export_dir receives each promoted one; remove the directory when convenient",
			"dir", dir, "export_dir", d.cfg.ExportDir())
	}
}

// configOrigin names the first posterior the configuration asks for: the SHA-256 of
// model.path's weights file (so a model directory that moved still matches), or the bundled data
// set with its training seed and epochs. The ledger stores it with its first posterior
// (ledger.Checkpoint.Origin).
func configOrigin(c *config.Config) (string, error) {
	if c.Model.Path != "" {
		f := filepath.Join(c.Model.Path, bnn.WeightsFile)
		b, err := os.ReadFile(f)
		if err != nil {
			return "", fmt.Errorf("model.path: %w", err)
		}
		return "model weights sha256 " + sidecar.Checksum(b), nil
	}
	return fmt.Sprintf("model.dataset %s (model.seed %d, model.epochs %d)", c.Model.Dataset, c.Model.Seed, c.Model.Epochs), nil
}

// checkOrigin refuses a configuration whose model.* keys name another first posterior than the
// one the ledger grew from: the ledger is the source of truth, and a silently ignored model.path
// or model.dataset would let an operator believe another model is being certified.
func (d *Daemon) checkOrigin(want string) error {
	have, err := d.ledger.Origin()
	if err != nil {
		return err
	}
	switch {
	case have == "":
		d.log.Warn("the ledger records no origin for its first posterior (written by an older release); model.* keys are not checked against it",
			"ledger", d.ledger.Path())
		return nil
	case have == want:
		return nil
	}
	return d.originRefused(have, want)
}

// originRefused is the refusal of a ledger whose first posterior came from have when the
// configuration names want (checkOrigin, and ledger.Open's *OriginError).
func (d *Daemon) originRefused(have, want string) error {
	if d.cfg.Model.Path != "" {
		want += " in model.path " + d.cfg.Model.Path
	}
	path := filepath.Join(d.cfg.StateDir, ledger.FileName)
	return fmt.Errorf("%w: state_dir %s holds a ledger whose first posterior came from %s, but the configuration names %s. "+
		"The ledger is the source of truth and was not changed. To keep it, restore the model.* keys; to start over with the new model, "+
		"set state_dir to an empty directory (or move %s aside)", config.ErrInvalid, d.cfg.StateDir, have, want, path)
}
