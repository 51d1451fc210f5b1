package cli

import (
	"errors"
	"flag"
	"io"
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
