package main

import (
	"github.com/cfguard/cfguard/internal/cli"

	"context"
	"flag"
	"fmt"
	"io"

	"github.com/cfguard/cfguard/evaluate"
)

// cmdPSCE compares counterfactual generators on the paper's metrics plus survival under
// last-layer updates: a paper-style table, or one JSON object per method with --json.
func cmdPSCE(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("psce", flag.ContinueOnError)
	data := fs.String("data", "", "CSV file or bundled data set name")
	classes := fs.String("classes", "", "comma-separated class names")
	seeds := fs.Int("seeds", 5, "number of seeds (train/test splits and models)")
	seed := fs.Uint64("seed", 1, "first seed")
	instances := fs.Int("instances", 100, "test instances per seed")
	methods := fs.String("method", "psce,wachter,schut", "comma-separated methods")
	asJSON := fs.Bool("json", false, "print one JSON object per method instead of the table")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if err := cli.Required("data", *data); err != nil {
		return err
	}
	if *seeds < 1 || *instances < 1 {
		return fmt.Errorf("%w: --seeds and --instances must be positive", cli.ErrUsage)
	}
	ms, err := evaluate.ParseMethods(*methods)
	if err != nil {
		return fmt.Errorf("%w: %v", cli.ErrUsage, err)
	}
	set, names, err := cli.LoadData(*data, *classes)
	if err != nil {
		return err
	}
	sums, err := evaluate.Run(ctx, evaluate.Config{Data: set, Classes: names, Seeds: *seeds, Seed: *seed,
		Instances: *instances, Methods: ms, Logger: cli.Logger(stderr)})
	if err != nil {
		return err
	}
	if *asJSON {
		return evaluate.WriteJSON(stdout, sums)
	}
	return evaluate.WriteTable(stdout, sums)
}
