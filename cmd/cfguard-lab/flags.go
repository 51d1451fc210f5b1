package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/dataset"
)

// parseFlags parses a command's flags; flag errors become errUsage.
func parseFlags(fs *flag.FlagSet, args []string, stderr io.Writer) error {
	fs.SetOutput(stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected arguments %v", errUsage, fs.Args())
	}
	return nil
}

func required(name, v string) error {
	if v == "" {
		return fmt.Errorf("%w: --%s is required", errUsage, name)
	}
	return nil
}

// parseFloats parses a comma-separated list of positive numbers (empty fields are skipped).
func parseFloats(s string) ([]float64, error) {
	var out []float64
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		v, err := strconv.ParseFloat(f, 64)
		if err != nil || !(v > 0) {
			return nil, fmt.Errorf("%w: %q is not a positive number", errUsage, f)
		}
		out = append(out, v)
	}
	return out, nil
}

// loadData reads --data (a CSV path) or, when the path does not exist and names a bundled data
// set (breast_cancer, german_credit, spambase), the embedded copy. Class names come from
// --classes, else from the bundled set, else "0".."C-1". It is cmd/cfguard's loadData: the two
// commands share no package so that neither links the other's dependencies.
func loadData(path, classes string) (*dataset.Set, []string, error) {
	var set *dataset.Set
	var names []string
	if _, err := os.Stat(path); err != nil {
		if _, ok := assets.Lookup(path); !ok {
			return nil, nil, fmt.Errorf("--data %s: %w (bundled data sets: %v)", path, err, assets.Names())
		}
		s, d, err := assets.Load(path)
		if err != nil {
			return nil, nil, err
		}
		set, names = s, d.Classes
	} else {
		s, err := dataset.LoadCSV(path)
		if err != nil {
			return nil, nil, err
		}
		set = s
	}
	if classes != "" {
		names = strings.Split(classes, ",")
	}
	if names == nil {
		for c := 0; c < set.NumClasses; c++ {
			names = append(names, fmt.Sprint(c))
		}
	}
	if len(names) < set.NumClasses {
		return nil, nil, fmt.Errorf("%w: %d class names for labels 0..%d", errUsage, len(names), set.NumClasses-1)
	}
	return set, names, nil
}

func cliLogger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelInfo}))
}
