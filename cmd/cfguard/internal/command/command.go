// Package command is the cfguard command line: its subcommands parse flags and wire the
// packages that do the work. cmd/cfguard's main calls Main; tests run the same command in
// process (Run) or, re-executing their test binary, as a process of its own (Main).
package command

import (
	_ "go4.org/unsafe/assume-no-moving-gc" // gorgonia's guard, at a version that knows Go 1.26

	"context"
	"errors"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/cli"
)

// Main runs cfguard with the process's arguments, stopping on SIGINT or SIGTERM, and exits with
// the command's exit code.
func Main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Program is cfguard's command line. An invalid configuration is a usage error (exit 2), like
// bad flags.
func Program() cli.Program {
	return cli.Program{
		Name:  "cfguard",
		Intro: "cfguard keeps counterfactual explanations honest while the model behind them keeps learning.",
		Outro: "Run 'cfguard COMMAND --help' for a command's flags. docs/CONFIGURATION.md, docs/METRICS.md and docs/API.md document every config key, metric and endpoint.\n" +
			"The paper's experiments are a separate command: cfguard-lab (go run ./cmd/cfguard-lab --help).",
		IsUsage: func(err error) bool { return errors.Is(err, config.ErrInvalid) },
		Commands: []cli.Command{
			{Name: "run", Args: "--config FILE [--accept-topic-reset]",
				Help: "run the daemon (the repo's config.yaml: embedded broker, bundled model)", Run: cmdRun},
			{Name: "broker", Args: "[--listen 127.0.0.1:9092] [--nodes N] [--data-dir DIR] [--topics a,b --partitions N] [--group-min-session-timeout 6s] [--sync-writes] [--retention 168h] [--retention-bytes N] [--max-connections 1024] [--idle-timeout 2m] [--request-timeout 30s] [--metrics-listen ADDR]",
				Help: "run the embedded Kafka-protocol broker alone, N nodes on loopback ports; prints \"brokers: ADDR,...\"", Run: cmdBroker},
			{Name: "train", Args: "--data FILE.csv|NAME --out DIR [--seed N] [--epochs N] [--holdout 0.2] [--classes a,b]",
				Help: "train a Bayesian MLP and write model.safetensors + model.json", Run: cmdTrain},
			{Name: "kl", Args: "--old DIR --new DIR",
				Help: "print {\"kl\": KL(new || old), \"params\": N} for two model directories", Run: cmdKL},
			{Name: "bound", Args: "--p1 P --kl K [--var1 V] [--delta D] [--mode paper|tight]",
				Help: "print the Theorem 1/2 bounds and the KL budget as JSON", Run: cmdBound},
			{Name: "import", Args: "--weights FILE.safetensors --classes a,b --scaler-from CSV|--no-scaler --out DIR [--prior-sigma 0.1] [--activation relu|tanh|sigmoid] [--layers P1,P2,...]",
				Help: "write a model directory from a torchbnn state_dict", Run: cmdImport},
			{Name: "backup", Args: "--config FILE --out FILE [--url URL] [--ca F] [--cert F --key F]",
				Help: "write a verified, consistent snapshot of a running daemon's ledger (GET /v1/backup)", Run: cmdBackup},
			{Name: "import-ces", Args: "--config FILE --from FILE.ndjson [--batch 1000] [--parallel 2] [--progress 5s] [--url URL] [--ca F] [--cert F --key F]",
				Help: "load counterfactuals from NDJSON into a running daemon (POST /v1/counterfactuals:bulk), with progress", Run: cmdImportCEs},
			{Name: "restore", Args: "--config FILE --from FILE",
				Help: "install a backup as state_dir's ledger (never over an existing one; the daemon must be stopped; damaged CE records are quarantined)", Run: cmdRestore},
			{Name: "verify-log", Args: "--config FILE [--from SEQ] [--to SEQ]",
				Help: "re-execute a replicated deployment's posterior log from its input records, entry by entry, and report every difference", Run: cmdVerifyLog},
			{Name: "new-epoch", Args: "--config FILE [--force] [--head-from URL [--wait 60s]]",
				Help: "move a replicated deployment's posterior log past a record its replicas cannot apply, or past a head the log lost (--head-from a replica): a new genesis, signed with the cluster key", Run: cmdNewEpoch},
			{Name: "gen-key", Args: "[--id k1]",
				Help: "print a new cluster key line for replication.key_file (\"<id>:<hex>\"; the first line of the file signs, every line verifies)", Run: cmdGenKey},
			{Name: "check-config", Args: "--config FILE",
				Help: "validate a configuration and print it with every default (exit 2 if invalid)", Run: cmdCheckConfig},
			{Name: "version", Args: "[--json]",
				Help: "print the module version, commit and Go version", Run: cmdVersion},
		},
	}
}

// Run runs cfguard with args (the subcommand first) and returns its exit code (cli.ExitOK,
// cli.ExitError or cli.ExitUsage).
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return Program().Run(ctx, args, stdout, stderr)
}
