package main

import (
	"github.com/cfguard/cfguard/internal/cli"

	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/cfguard/cfguard/experiment"
)

// cmdIncrements runs the paper's incremental-update experiment: one JSON row per update for
// --lr, then the rows of the other sweep learning rates; writes DIR/increments.svg.
func cmdIncrements(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("increments", flag.ContinueOnError)
	data := fs.String("data", "", "CSV file or bundled data set name")
	classes := fs.String("classes", "", "comma-separated class names")
	seed := fs.Uint64("seed", 1, "random seed")
	lr := fs.Float64("lr", 1e-5, "learning rate of the updates")
	sweep := fs.String("sweep", "1e-5,1e-4,1e-3", "learning rates to sweep as well (\"\" for none)")
	objective := fs.String("objective", "prior", "update objective: prior (paper) or vcl")
	steps := fs.Int("steps", 0, "Adam iterations per update (0: the update package's default, 50)")
	out := fs.String("out", "out", "directory for the plot and the rows")
	markdown := fs.Bool("markdown", false, "print the --lr rows as a Markdown table beside the paper's (the files are written as usual)")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if err := cli.Required("data", *data); err != nil {
		return err
	}
	if !(*lr > 0) {
		return fmt.Errorf("%w: --lr must be positive", cli.ErrUsage)
	}
	if *steps < 0 {
		return fmt.Errorf("%w: --steps must not be negative", cli.ErrUsage)
	}
	lrs, err := parseFloats(*sweep)
	if err != nil {
		return err
	}
	set, names, err := cli.LoadData(*data, *classes)
	if err != nil {
		return err
	}
	all := []float64{*lr}
	for _, v := range lrs {
		if v != *lr {
			all = append(all, v)
		}
	}
	results, err := experiment.SweepLR(ctx, experiment.IncrementsConfig{Data: set, Classes: names, Seed: *seed, Objective: *objective, Steps: *steps}, all, cli.Logger(stderr))
	if err != nil {
		return err
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(*out, "increments.jsonl"))
	if err != nil {
		return err
	}
	defer f.Close()
	for _, v := range all {
		w := io.MultiWriter(stdout, f)
		if *markdown {
			w = f
		}
		if err := results[v].WriteJSONRows(w); err != nil {
			return err
		}
	}
	if *markdown {
		if err := results[*lr].WriteMarkdown(stdout, commandLine("cfguard-lab increments", args)); err != nil {
			return err
		}
	}
	plot := filepath.Join(*out, "increments.svg")
	if err := experiment.PlotIncrements(plot, results); err != nil {
		return err
	}
	fmt.Fprintf(stderr, "wrote %s and %s\n", plot, f.Name())
	return f.Close()
}
