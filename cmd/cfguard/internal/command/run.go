package command

import (
	"github.com/cfguard/cfguard/internal/cli"

	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/ledger"
)

// cmdRun loads the configuration and runs the daemon until SIGINT/SIGTERM.
func cmdRun(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("run", flag.ContinueOnError)
	path := fs.String("config", "config.yaml", "configuration file (see config.yaml and README.md)")
	acceptReset := fs.Bool("accept-topic-reset", false, "confirm that kafka.topic was reset (deleted and recreated): a partition that no longer holds the ledger's offset is read from its log start (this start only)")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	cfg, err := config.LoadFile(*path)
	if err != nil {
		return err // config.ErrInvalid: exit code 2
	}
	if err := cfg.CheckModel(); err != nil {
		return fmt.Errorf("%s: %w", *path, err)
	}
	log := newLogger(stderr, cfg.Log)
	if cfg.Empty() {
		// An empty file is valid, but say what it means rather than run silently on defaults.
		out, err := cfg.YAML()
		if err != nil {
			return err
		}
		log.Warn("the configuration file holds no keys: running with every default, printed below", "config", *path)
		fmt.Fprintf(stderr, "%s", out)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	log.Info("cfguard starting", "config", *path, "state_dir", cfg.StateDir, "embedded_broker", cfg.Embedded())
	// Say at once that a signal was heard: stopping drains the ledger and the broker, which may take a while.
	logged := make(chan struct{})
	heard := context.AfterFunc(ctx, func() {
		defer close(logged)
		log.Info("cfguard stopping", "cause", context.Cause(ctx).Error())
	})
	err = daemon.Run(ctx, daemon.Options{Config: cfg, Logger: log, Registry: reg, ConfigPath: *path, AcceptTopicReset: *acceptReset})
	if !heard() {
		<-logged // before the last line
	}
	if err != nil {
		return namingConfig(err, *path)
	}
	log.Info("cfguard stopped")
	return nil
}

func newLogger(w io.Writer, c config.Log) *slog.Logger {
	opts := &slog.HandlerOptions{Level: c.Level}
	if c.Format == config.LogJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// namingConfig makes the recovery commands of a damaged-ledger error name the configuration
// file at path (absolute, so that they work from any directory); other errors pass unchanged.
func namingConfig(err error, path string) error {
	if !errors.Is(err, ledger.ErrCorrupt) {
		return err
	}
	if abs, aerr := filepath.Abs(path); aerr == nil {
		path = abs
	}
	return withConfig{err: err, config: path}
}

// withConfig puts the configuration file this daemon ran with into the recovery commands of a
// damaged-ledger error, so that they work as printed.
type withConfig struct {
	err    error
	config string
}

func (e withConfig) Error() string {
	return strings.ReplaceAll(e.err.Error(), ledger.RecoveryConfigPlaceholder, "--config "+ledger.ShellQuote(e.config))
}

func (e withConfig) Unwrap() error { return e.err }
