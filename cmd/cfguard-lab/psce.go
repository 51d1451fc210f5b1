package main

import (
	"github.com/cfguard/cfguard/internal/cli"

	"context"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"github.com/cfguard/cfguard/evaluate"
	"github.com/cfguard/cfguard/explain"
)

// cmdPSCE compares counterfactual generators on the paper's metrics plus survival under
// last-layer updates: a paper-style table, one JSON object per method with --json, or with
// --markdown a Markdown table beside the paper's figures.
func cmdPSCE(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("psce", flag.ContinueOnError)
	data := fs.String("data", "", "CSV file or bundled data set name")
	classes := fs.String("classes", "", "comma-separated class names")
	seeds := fs.Int("seeds", 5, "number of seeds (train/test splits and models)")
	seed := fs.Uint64("seed", 1, "first seed")
	instances := fs.Int("instances", 100, "test instances per seed")
	methods := fs.String("method", strings.Join(evaluate.DefaultMethods, ","), "comma-separated methods")
	protocol := fs.String("protocol", evaluate.ProtocolPaper, "paper (fixed budget, every generated CE accepted) or search (search until the rule is confirmed)")
	model := fs.String("model", evaluate.ModelBNN, "bnn or dropout (MC Dropout)")
	samples := fs.Int("samples", 1000, "posterior draws of the generators' final ensembles and of the validity predictive (confirmation: half)")
	epochs := fs.Int("epochs", 0, "training epochs of the classifier (0: the default)")
	budget := fs.Int("budget", 0, "iteration budget of every method (0: the paper's 2000, or the generator's default with --protocol search)")
	kappaRaw := fs.Bool("kappa-raw", false, "add the robustness ratio's kappa (1e-3) to the raw features instead of the standardised ones")
	asJSON := fs.Bool("json", false, "print one JSON object per method instead of the table")
	markdown := fs.Bool("markdown", false, "print a Markdown table with the paper's figures beside ours")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if err := cli.Required("data", *data); err != nil {
		return err
	}
	if *seeds < 1 || *instances < 1 || *samples < 4 || *epochs < 0 || *budget < 0 {
		return fmt.Errorf("%w: --seeds and --instances must be positive, --samples at least 4, --epochs and --budget not negative", cli.ErrUsage)
	}
	if *protocol != evaluate.ProtocolPaper && *protocol != evaluate.ProtocolSearch {
		return fmt.Errorf("%w: --protocol %q, want paper or search", cli.ErrUsage, *protocol)
	}
	if *model != evaluate.ModelBNN && *model != evaluate.ModelDropout {
		return fmt.Errorf("%w: --model %q, want bnn or dropout", cli.ErrUsage, *model)
	}
	if *asJSON && *markdown {
		return fmt.Errorf("%w: --json and --markdown exclude each other", cli.ErrUsage)
	}
	ms, err := evaluate.ParseMethods(*methods)
	if err != nil {
		return fmt.Errorf("%w: %v", cli.ErrUsage, err)
	}
	set, names, err := cli.LoadData(*data, *classes)
	if err != nil {
		return err
	}
	name := strings.TrimSuffix(filepath.Base(*data), filepath.Ext(*data))
	cfg := evaluate.Config{Data: set, Classes: names, Seeds: *seeds, Seed: *seed, Instances: *instances, Methods: ms,
		Protocol: *protocol, Model: *model, Dataset: name, ValiditySamples: *samples, Logger: cli.Logger(stderr),
		Explain: explain.Config{FinalSamples: *samples, CheckSamples: max(*samples/2, 2), PoolSize: min(explain.DefaultPoolSize, *samples), MaxIter: *budget}}
	cfg.Train.Epochs = *epochs
	cfg.KappaRaw = *kappaRaw
	if *protocol == evaluate.ProtocolPaper {
		cfg.SkipSameSeedRR = true // not a figure of the paper's; one search per instance less
	}
	sums, err := evaluate.Run(ctx, cfg)
	if err != nil {
		return err
	}
	switch {
	case *asJSON:
		return evaluate.WriteJSON(stdout, sums)
	case *markdown:
		return evaluate.WriteMarkdown(stdout, sums, name, commandLine("cfguard-lab psce", args))
	}
	return evaluate.WriteTable(stdout, sums)
}
