// Command cfguard-lab runs the paper's experiments: the incremental-update table and the PSCE
// comparison. It is separate from cmd/cfguard so that the sidecar's binary links only what the
// sidecar runs (the experiments need plotting, fonts and PDF). main only parses flags and wires
// commands; the work lives in the experiment and evaluate packages.
package main

import (
	"github.com/cfguard/cfguard/internal/cli"

	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	_ "go4.org/unsafe/assume-no-moving-gc" // gorgonia's guard, at a version that knows Go 1.26
)

// Exit codes, as cmd/cfguard's.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2 // bad flags or arguments
)

// cli.ErrUsage marks errors that should exit with code 2.

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

type command struct {
	name, args, help string
	run              func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"increments", "--data FILE.csv|NAME [--seed N] [--lr 1e-5] [--sweep 1e-5,1e-4,1e-3] [--out DIR]",
			"the paper's incremental-update table: one JSON row per update, and a plot in DIR", cmdIncrements},
		{"psce", "--data FILE.csv|NAME [--seeds 5] [--instances 100] [--method psce,wachter,schut] [--json]",
			"PSCE against Wachter and Schut: validity, IM1, implausibility, robustness ratio, <delta,epsilon>-set, survival", cmdPSCE},
	}
}

func usage(w io.Writer) {
	fmt.Fprintf(w, "cfguard-lab runs the paper's experiments on cfguard's models and generators.\n\nUsage:\n")
	for _, c := range commands() {
		fmt.Fprintf(w, "  cfguard-lab %s %s\n      %s\n", c.name, c.args, c.help)
	}
	fmt.Fprintf(w, "\nRun 'cfguard-lab COMMAND --help' for a command's flags. README.md documents the outputs.\n")
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stdout)
		if len(args) == 0 {
			return exitUsage
		}
		return exitOK
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, args[1:], stdout, stderr)
		switch {
		case err == nil, errors.Is(err, flag.ErrHelp):
			return exitOK
		case errors.Is(err, cli.ErrUsage):
			fmt.Fprintf(stderr, "cfguard-lab %s: %v\n", c.name, err)
			return exitUsage
		default:
			fmt.Fprintf(stderr, "cfguard-lab %s: %v\n", c.name, err)
			return exitError
		}
	}
	fmt.Fprintf(stderr, "cfguard-lab: unknown command %q\n\n", args[0])
	usage(stderr)
	return exitUsage
}
