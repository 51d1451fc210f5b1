package command

import (
	"github.com/cfguard/cfguard/internal/cli"

	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/cfguard/cfguard/config"
)

// cmdCheckConfig validates a configuration file and prints the effective configuration, every
// default included and secrets redacted. Exit code 2 on an invalid configuration.
func cmdCheckConfig(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("check-config", flag.ContinueOnError)
	path := fs.String("config", "config.yaml", "configuration file to check")
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
	out, err := cfg.YAML()
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "# %s is valid; the effective configuration (defaults included, secrets redacted):\n", *path)
	fmt.Fprintf(stdout, "# model.export_dir resolves to %s\n", cfg.ExportDir())
	_, err = stdout.Write(out)
	return err
}

// buildInfo is what `cfguard version` prints.
type buildInfo struct {
	Module   string `json:"module"`
	Version  string `json:"version"`
	Commit   string `json:"commit,omitempty"`
	Time     string `json:"commit_time,omitempty"`
	Modified bool   `json:"modified,omitempty"`
	Go       string `json:"go"`
	Platform string `json:"platform"`
}

// readBuildInfo reads the module version and the VCS stamp the Go toolchain embeds (go build
// from a git checkout stamps vcs.revision; `go run` and tests do not, and say "(devel)").
func readBuildInfo() buildInfo {
	b := buildInfo{Version: "(unknown)", Go: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return b
	}
	b.Module, b.Version = bi.Main.Path, bi.Main.Version
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Commit = s.Value
		case "vcs.time":
			b.Time = s.Value
		case "vcs.modified":
			b.Modified = s.Value == "true"
		}
	}
	return b
}

// cmdVersion prints the module version, the commit and the Go version.
func cmdVersion(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("version", flag.ContinueOnError)
	asJSON := fs.Bool("json", false, "print one JSON object")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	b := readBuildInfo()
	if *asJSON {
		return json.NewEncoder(stdout).Encode(b)
	}
	commit := b.Commit
	if commit == "" {
		commit = "unknown (not built from a VCS checkout)"
	} else if b.Modified {
		commit += " (modified)"
	}
	_, err := fmt.Fprintf(stdout, "cfguard %s\n  module %s\n  commit %s\n  %s %s\n", b.Version, b.Module, commit, b.Go, b.Platform)
	return err
}
