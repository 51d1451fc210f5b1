package cli

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseFlagsUsageErrors(t *testing.T) {
	for _, args := range [][]string{{"--nope"}, {"stray"}, {"--n", "x"}} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		fs.Int("n", 0, "")
		if err := ParseFlags(fs, args, io.Discard); !errors.Is(err, ErrUsage) {
			t.Errorf("%v: %v, want ErrUsage", args, err)
		}
	}
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	if err := ParseFlags(fs, []string{"-h"}, io.Discard); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v, want flag.ErrHelp", err)
	}
	if err := Required("out", ""); !errors.Is(err, ErrUsage) {
		t.Errorf("Required: %v", err)
	}
}

// A flag error is printed on the command's stderr (with the flag set's usage), and says which
// flag; Required names the missing flag and accepts any value given.
func TestFlagErrorsSayWhat(t *testing.T) {
	var stderr bytes.Buffer
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.Int("n", 0, "how many")
	ParseFlags(fs, []string{"--nope"}, &stderr)
	if got := stderr.String(); !strings.Contains(got, "flag provided but not defined: -nope") || !strings.Contains(got, "how many") {
		t.Errorf("stderr %q, want the error and the usage", got)
	}
	if err := Required("out", ""); err == nil || !strings.Contains(err.Error(), "--out is required") {
		t.Errorf("Required(out, \"\"): %v, want one saying --out is required", err)
	}
	if err := Required("out", "x"); err != nil {
		t.Errorf("Required(out, x): %v, want nil", err)
	}
}

// Logger writes INFO and above, not DEBUG.
func TestLoggerLevel(t *testing.T) {
	var buf bytes.Buffer
	log := Logger(&buf)
	log.Debug("hidden")
	log.Info("shown")
	if got := buf.String(); strings.Contains(got, "hidden") || !strings.Contains(got, "level=INFO msg=shown") {
		t.Errorf("logged %q, want the INFO line only", got)
	}
}

func TestLoadData(t *testing.T) {
	set, names, err := LoadData("breast_cancer", "")
	if err != nil || set.Len() != 569 || len(names) != 2 || names[1] != "benign" {
		t.Fatalf("bundled: %v rows, names %v, %v", set, names, err)
	}
	p := filepath.Join(t.TempDir(), "d.csv")
	os.WriteFile(p, []byte("a,b,label\n1,2,0\n3,4,2\n"), 0o644)
	if _, names, err := LoadData(p, ""); err != nil || len(names) != 3 || names[2] != "2" {
		t.Fatalf("csv: names %v, %v", names, err)
	}
	if _, _, err := LoadData(p, "x,y"); !errors.Is(err, ErrUsage) {
		t.Fatalf("too few class names: %v, want ErrUsage", err)
	}
	for classes, want := range map[string]string{"x,y,x": `--classes: class 2 is "x"`, "x,,z": `--classes: class 1 is ""`} {
		if _, _, err := LoadData(p, classes); !errors.Is(err, ErrUsage) || !strings.Contains(err.Error(), want) {
			t.Fatalf("--classes %s: %v, want ErrUsage saying %s", classes, err, want)
		}
	}
	if _, _, err := LoadData(filepath.Join(t.TempDir(), "none.csv"), ""); err == nil {
		t.Fatal("a missing file that is not a bundled name must fail")
	}
}

// --classes names the classes of a bundled set too; a missing file that is not a bundled name
// says so and lists the bundled names; a CSV that does not load is an error.
func TestLoadDataClassesAndErrors(t *testing.T) {
	if _, names, err := LoadData("breast_cancer", "bad,good"); err != nil || strings.Join(names, ",") != "bad,good" {
		t.Errorf("bundled with --classes: names %v, %v; want [bad good]", names, err)
	}
	_, _, err := LoadData(filepath.Join(t.TempDir(), "none.csv"), "")
	if !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "breast_cancer") {
		t.Errorf("missing file: %v, want ErrNotExist listing the bundled sets", err)
	}
	p := filepath.Join(t.TempDir(), "bad.csv")
	os.WriteFile(p, []byte("a,b,class\n1,2,0\n"), 0o644) // the last column must be "label"
	if set, names, err := LoadData(p, ""); err == nil {
		t.Errorf("bad CSV: %v, %v, want an error", set, names)
	}
}
