package command

import (
	"github.com/cfguard/cfguard/internal/cli"

	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/bnn/torchbnn"
	"github.com/cfguard/cfguard/dataset"
)

// importFlags maps torchbnn.Options fields to the flags that set them, so that an option error
// names the flag.
var importFlags = map[string]string{"Classes": "--classes", "Scaler": "--scaler-from", "Features": "--scaler-from",
	"PriorSigma": "--prior-sigma", "Activation": "--activation", "Layers": "--layers"}

// cmdImport turns a torchbnn state_dict saved with safetensors into a cfguard model directory.
func cmdImport(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("import", flag.ContinueOnError)
	weights := fs.String("weights", "", "safetensors file holding a torchbnn model's state_dict (float32 or float64)")
	classes := fs.String("classes", "", "comma-separated class names, one per output logit, in output order")
	scalerFrom := fs.String("scaler-from", "", "CSV (features, last column label) to fit the feature scaler on: the data the model was trained on")
	noScaler := fs.Bool("no-scaler", false, "the model takes raw features: write the identity scaler")
	priorSigma := fs.Float64("prior-sigma", bnn.DefaultPriorSigma, "standard deviation of the N(0, sigma^2) prior the model was trained with")
	activation := fs.String("activation", "relu", "activation between layers: relu, tanh or sigmoid")
	layers := fs.String("layers", "", "comma-separated layer prefixes in network order, when the shapes leave it ambiguous")
	out := fs.String("out", "", "model directory to create (model.safetensors + model.json)")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	for _, r := range [][2]string{{"weights", *weights}, {"classes", *classes}, {"out", *out}} {
		if err := cli.Required(r[0], r[1]); err != nil {
			return err
		}
	}
	if (*scalerFrom == "") == !*noScaler {
		return fmt.Errorf("%w: give exactly one of --scaler-from CSV (fit the scaler the model was trained with) and --no-scaler (it takes raw features)", cli.ErrUsage)
	}
	if !(*priorSigma > 0) || math.IsInf(*priorSigma, 0) {
		return fmt.Errorf("%w: --prior-sigma must be a finite number > 0, got %v", cli.ErrUsage, *priorSigma)
	}
	if err := refuseExistingModel("import", *out); err != nil {
		return err
	}
	opts := torchbnn.Options{Classes: splitList(*classes), PriorSigma: *priorSigma, Activation: *activation}
	if *layers != "" {
		opts.Layers = splitList(*layers)
	}
	if *scalerFrom != "" {
		set, err := dataset.LoadCSV(*scalerFrom)
		if err != nil {
			return fmt.Errorf("--scaler-from: %w", err)
		}
		if set.NumClasses > len(opts.Classes) {
			return fmt.Errorf("%w: --scaler-from %s has labels 0..%d but --classes names %d", cli.ErrUsage, *scalerFrom, set.NumClasses-1, len(opts.Classes))
		}
		sc := bnn.FitScaler(set.X)
		opts.Scaler, opts.Features = &sc, set.Features
	}
	raw, err := os.ReadFile(*weights)
	if err != nil {
		return fmt.Errorf("--weights: %w", err)
	}
	m, err := torchbnn.Import(raw, opts)
	var oe *torchbnn.OptionError
	switch {
	case errors.As(err, &oe):
		return fmt.Errorf("%w: %s: %v", cli.ErrUsage, importFlags[oe.Option], err)
	case err != nil:
		return fmt.Errorf("--weights %s: %w", *weights, err)
	}
	if err := bnn.Save(*out, m); err != nil {
		return err
	}
	type shape struct {
		Name string `json:"name"`
		In   int    `json:"in"`
		Out  int    `json:"out"`
	}
	var shapes []shape
	for _, l := range m.Layers {
		shapes = append(shapes, shape{l.Name, l.In, l.Out})
	}
	return writeJSON(stdout, map[string]any{"out": *out, "layers": shapes, "params": m.NumParams(), "classes": m.Classes,
		"prior_sigma": m.PriorSigma, "scaler": map[bool]string{true: "identity", false: *scalerFrom}[*noScaler], "posterior_version": m.Version})
}

// refuseExistingModel keeps a command (import, train) from replacing a model directory's files.
func refuseExistingModel(cmd, dir string) error {
	for _, name := range []string{bnn.SidecarFile, bnn.WeightsFile} {
		if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
			return fmt.Errorf("%w: --out %s already holds %s; %s writes a new model directory, choose another or remove it", cli.ErrUsage, dir, name, cmd)
		}
	}
	return nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		out = append(out, strings.TrimSpace(f))
	}
	return out
}
