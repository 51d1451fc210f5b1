package daemon

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
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
