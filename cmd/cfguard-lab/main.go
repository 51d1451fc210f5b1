// Command cfguard-lab runs the paper's experiments: the incremental-update table, the PSCE
// comparison, and stream (the daemon's update replayed over a stream of increments). It is separate from cmd/cfguard so that the sidecar's binary links only what the
// sidecar runs (the experiments need plotting, fonts and PDF). main only parses flags and wires
// commands; the work lives in the experiment and evaluate packages.
package main

import (
	_ "go4.org/unsafe/assume-no-moving-gc" // gorgonia's guard, at a version that knows Go 1.26

	"context"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/cfguard/cfguard/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// program is cfguard-lab's command line.
func program() cli.Program {
	return cli.Program{
		Name:  "cfguard-lab",
		Intro: "cfguard-lab runs the paper's experiments on cfguard's models and generators.",
		Outro: "Run 'cfguard-lab COMMAND --help' for a command's flags. docs/CLI.md documents the outputs.",
		Commands: []cli.Command{
			{Name: "increments", Args: "--data FILE.csv|NAME [--classes a,b] [--seed N] [--objective prior|vcl] [--lr 1e-5] [--steps 50] [--sweep 1e-5,1e-4,1e-3] [--out DIR] [--markdown]",
				Help: "the paper's incremental-update table: one JSON row per update, and a plot in DIR", Run: cmdIncrements},
			{Name: "psce", Args: "--data FILE.csv|NAME [--classes a,b] [--protocol paper|search] [--model bnn|dropout] [--seed 1] [--seeds 5] [--instances 100] [--epochs N] [--method psce,bayescf,schut,wachter,roar] [--samples 1000] [--budget N] [--kappa-raw] [--json|--markdown]",
				Help: "PSCE against BayesCF, Schut, Wachter and ROAR: validity, IM1, implausibility, robustness ratio, <delta,epsilon>-set, survival", Run: cmdPSCE},
			{Name: "stream", Args: "--data FILE.csv|NAME [--classes a,b] [--learner default|paper|vcl-adam] [--kl-weight W] [--memory M] [--increment 10] [--random] [--correct 1000] [--drift 0] [--shift flip|region] [--order shuffled|label] [--every 50] [--fit 0.8] [--unseen 0] [--settle | --settle-means] [--seed N]",
				Help: "the daemon's update on a stream of increments: held-out quality, counterfactual stand-ins, update KLs, records until a drift invalidates them", Run: cmdStream},
		},
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return program().Run(ctx, args, stdout, stderr)
}
