// Package cli holds what cfguard's commands (cmd/cfguard, cmd/cfguard-lab) share: a program of
// subcommands with its exit codes (Program), flag parsing whose errors are usage errors (exit
// code 2), and loading a data set given as --data. It links nothing heavy, so that neither
// command pulls in the other's dependencies.
package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/dataset"
)

// ErrUsage marks errors that a command reports with exit code 2: bad flags or arguments.
var ErrUsage = errors.New("usage")

// ParseFlags parses a command's flags; flag errors and stray arguments wrap ErrUsage, and -h
// returns flag.ErrHelp.
func ParseFlags(fs *flag.FlagSet, args []string, stderr io.Writer) error {
	fs.SetOutput(stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", ErrUsage, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected arguments %v", ErrUsage, fs.Args())
	}
	return nil
}

// Required is a usage error when flag --name is empty.
func Required(name, v string) error {
	if v == "" {
		return fmt.Errorf("%w: --%s is required", ErrUsage, name)
	}
	return nil
}

// LoadData reads --data: a CSV path or, when no such file exists and the name is a bundled data
// set (breast_cancer, german_credit, spambase, digits, mnist), the embedded copy. Class names come from
// classes (comma-separated), else from the bundled set, else "0".."C-1".
func LoadData(path, classes string) (*dataset.Set, []string, error) {
	var set *dataset.Set
	var names []string
	bundled := false
	if _, err := os.Stat(path); err != nil {
		if _, ok := assets.Lookup(path); !ok {
			return nil, nil, fmt.Errorf("--data %s: %w (bundled data sets: %v)", path, err, assets.Names())
		}
		s, d, err := assets.Load(path)
		if err != nil {
			return nil, nil, err
		}
		set, names, bundled = s, d.Classes, true
	} else {
		s, err := dataset.LoadCSV(path)
		if err != nil {
			return nil, nil, err
		}
		set = s
	}
	if classes != "" {
		names = strings.Split(classes, ",")
		seen := make(map[string]bool, len(names))
		for i, n := range names {
			if n == "" || seen[n] {
				return nil, nil, fmt.Errorf("%w: --classes: class %d is %q; give every class a name of its own", ErrUsage, i, n)
			}
			seen[n] = true
		}
	}
	if names == nil {
		for c := 0; c < set.NumClasses; c++ {
			names = append(names, fmt.Sprint(c))
		}
	}
	if len(names) < set.NumClasses {
		return nil, nil, fmt.Errorf("%w: %d class names for labels 0..%d", ErrUsage, len(names), set.NumClasses-1)
	}
	// A CSV may lack the rows of its last classes, so more names than labels seen can be meant; a
	// bundled data set has all of its classes, and a name more would be a class with no row.
	if bundled && len(names) > set.NumClasses {
		return nil, nil, fmt.Errorf("%w: --classes: %d class names for the bundled %s, which has %d classes", ErrUsage, len(names), path, set.NumClasses)
	}
	return set, names, nil
}

// Logger is the logger of a command's progress: text lines at INFO and above on w (stderr).
func Logger(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelInfo}))
}
