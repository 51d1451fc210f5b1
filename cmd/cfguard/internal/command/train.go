package command

import (
	"github.com/cfguard/cfguard/internal/cli"

	"context"
	"flag"
	"fmt"
	"io"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/dataset"
)

// cmdTrain trains a Bayesian MLP with Bayes-by-backprop and writes the model directory.
func cmdTrain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("train", flag.ContinueOnError)
	data := fs.String("data", "", "CSV file (numeric features, last column label) or a bundled data set name")
	out := fs.String("out", "", "output model directory")
	seed := fs.Uint64("seed", 1, "random seed (split, initialisation, noise)")
	epochs := fs.Int("epochs", 0, "training epochs (0 = default)")
	holdout := fs.Float64("holdout", 0.2, "fraction held out to report test accuracy (0 = train on everything)")
	classes := fs.String("classes", "", "comma-separated class names for labels 0..C-1")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if err := cli.Required("data", *data); err != nil {
		return err
	}
	if err := cli.Required("out", *out); err != nil {
		return err
	}
	if *holdout < 0 || *holdout >= 1 {
		return fmt.Errorf("%w: --holdout must be in [0, 1)", cli.ErrUsage)
	}
	if *epochs < 0 {
		return fmt.Errorf("%w: --epochs must be >= 0 (0: the trainer's default), got %d", cli.ErrUsage, *epochs)
	}
	if err := refuseExistingModel("train", *out); err != nil {
		return err
	}
	set, names, err := cli.LoadData(*data, *classes)
	if err != nil {
		return err
	}
	log := cli.Logger(stderr)
	train, test := set, (*dataset.Set)(nil)
	if *holdout > 0 {
		train, test = set.Split(1-*holdout, *seed)
		if train.Len() == 0 || test.Len() == 0 {
			return fmt.Errorf("%w: --holdout %v of the %d rows of %s leaves %d to train on and %d to test on: "+
				"give a --holdout that leaves rows on both sides, or --holdout 0 to train on every row", cli.ErrUsage,
				*holdout, set.Len(), *data, train.Len(), test.Len())
		}
	}
	cfg := bnn.TrainConfig{Epochs: *epochs, Seed: *seed, Progress: func(e bnn.EpochStats) {
		log.Info("epoch", "epoch", e.Epoch, "loss", fmt.Sprintf("%.4f", e.Loss), "nll", fmt.Sprintf("%.4f", e.NLL), "kl", fmt.Sprintf("%.1f", e.KL), "accuracy", fmt.Sprintf("%.3f", e.Accuracy))
	}}
	log.Info("training", "rows", train.Len(), "features", len(set.Features), "classes", names)
	m, stats, err := bnn.Fit(ctx, train, names, cfg)
	if err != nil {
		return err
	}
	res := map[string]any{"out": *out, "rows": train.Len(), "params": m.NumParams(), "epochs": stats.Epochs, "seconds": stats.Duration.Seconds()}
	if test != nil {
		acc, err := accuracy(m, test, *seed)
		if err != nil {
			return err
		}
		res["test_accuracy"], res["test_rows"] = acc, test.Len()
	}
	if err := bnn.Save(*out, m); err != nil {
		return err
	}
	return writeJSON(stdout, res)
}

// accuracy is the fraction of rows whose posterior-predictive argmax (500 draws) is the label.
func accuracy(m *bnn.Model, s *dataset.Set, seed uint64) (float64, error) {
	p, err := m.Predict(s.X, 500, seed)
	if err != nil {
		return 0, err
	}
	ok := 0
	for i, y := range s.Y {
		if p.Argmax(i) == y {
			ok++
		}
	}
	return float64(ok) / float64(s.Len()), nil
}
