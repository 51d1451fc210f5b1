package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/dataset"
)

// loadData reads --data (a CSV path) or, when the path does not exist and names a bundled data
// set (breast_cancer, german_credit, spambase), the embedded copy. Class names come from
// --classes, else from the bundled set, else "0".."C-1".
func loadData(path, classes string) (*dataset.Set, []string, error) {
	var set *dataset.Set
	var names []string
	if _, err := os.Stat(path); err != nil {
		if _, ok := assets.Lookup(path); !ok {
			return nil, nil, fmt.Errorf("--data %s: %w (bundled data sets: %v)", path, err, assets.Names())
		}
		s, d, err := assets.Load(path)
		if err != nil {
			return nil, nil, err
		}
		set, names = s, d.Classes
	} else {
		s, err := dataset.LoadCSV(path)
		if err != nil {
			return nil, nil, err
		}
		set = s
	}
	if classes != "" {
		names = strings.Split(classes, ",")
	}
	if names == nil {
		for c := 0; c < set.NumClasses; c++ {
			names = append(names, fmt.Sprint(c))
		}
	}
	if len(names) < set.NumClasses {
		return nil, nil, fmt.Errorf("%w: %d class names for labels 0..%d", errUsage, len(names), set.NumClasses-1)
	}
	return set, names, nil
}

func cliLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

// cmdTrain trains a Bayesian MLP with Bayes-by-backprop and writes the model directory.
func cmdTrain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("train", flag.ContinueOnError)
	data := fs.String("data", "", "CSV file (numeric features, last column label) or a bundled data set name")
	out := fs.String("out", "", "output model directory")
	seed := fs.Uint64("seed", 1, "random seed (split, initialisation, noise)")
	epochs := fs.Int("epochs", 0, "training epochs (0 = default)")
	holdout := fs.Float64("holdout", 0.2, "fraction held out to report test accuracy (0 = train on everything)")
	classes := fs.String("classes", "", "comma-separated class names for labels 0..C-1")
	if err := parseFlags(fs, args, stderr); err != nil {
		return err
	}
	if err := required("data", *data); err != nil {
		return err
	}
	if err := required("out", *out); err != nil {
		return err
	}
	if *holdout < 0 || *holdout >= 1 {
		return fmt.Errorf("%w: --holdout must be in [0, 1)", errUsage)
	}
	set, names, err := loadData(*data, *classes)
	if err != nil {
		return err
	}
	log := cliLogger(stderr)
	train, test := set, (*dataset.Set)(nil)
	if *holdout > 0 {
		train, test = set.Split(1-*holdout, *seed)
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
