// Command cfguard keeps counterfactual explanations honest while the model behind them keeps
// learning. main only parses flags and wires commands; the work lives in the packages.
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

	"github.com/cfguard/cfguard/config"
)

// Exit codes.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2 // bad flags, bad configuration (config.ErrInvalid)
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
		{"run", "--config FILE", "run the daemon (the repo's config.yaml: embedded broker, bundled model)", cmdRun},
		{"train", "--data FILE.csv --out DIR [--seed N] [--epochs N]", "train a Bayesian MLP and write model.safetensors + model.json", cmdTrain},
		{"kl", "--old DIR --new DIR", "print {\"kl\": KL(new || old), \"params\": N} for two model directories", cmdKL},
		{"bound", "--p1 P --kl K [--var1 V] [--delta D] [--mode paper|tight]", "print the Theorem 1/2 bounds and the KL budget as JSON", cmdBound},
		{"import", "--weights FILE.safetensors --classes a,b --scaler-from CSV|--no-scaler --out DIR", "write a model directory from a torchbnn state_dict", cmdImport},
		{"backup", "--config FILE --out FILE", "write a verified, consistent snapshot of a running daemon's ledger (GET /v1/backup)", cmdBackup},
		{"restore", "--config FILE --from FILE", "install a backup as state_dir's ledger (never over an existing one; the daemon must be stopped)", cmdRestore},
		{"check-config", "--config FILE", "validate a configuration and print it with every default (exit 2 if invalid)", cmdCheckConfig},
		{"version", "[--json]", "print the module version, commit and Go version", cmdVersion},
	}
}

func usage(w io.Writer) {
	fmt.Fprintf(w, "cfguard keeps counterfactual explanations honest while the model behind them keeps learning.\n\nUsage:\n")
	for _, c := range commands() {
		fmt.Fprintf(w, "  cfguard %s %s\n      %s\n", c.name, c.args, c.help)
	}
	fmt.Fprintf(w, "\nRun 'cfguard COMMAND --help' for a command's flags. README.md documents every config key, metric and endpoint.\n"+
		"The paper's experiments are a separate command: cfguard-lab (go run ./cmd/cfguard-lab --help).\n")
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
		case errors.Is(err, cli.ErrUsage), errors.Is(err, config.ErrInvalid):
			fmt.Fprintf(stderr, "cfguard %s: %v\n", c.name, err)
			return exitUsage
		default:
			fmt.Fprintf(stderr, "cfguard %s: %v\n", c.name, err)
			return exitError
		}
	}
	fmt.Fprintf(stderr, "cfguard: unknown command %q\n\n", args[0])
	usage(stderr)
	return exitUsage
}
