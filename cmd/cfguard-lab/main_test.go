package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/internal/cli/clitest"
)

func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var o, e bytes.Buffer
	code = run(context.Background(), args, &o, &e)
	return code, o.String(), e.String()
}

func TestUsageErrorsExit2(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"experiment", "psce"}, // the old cfguard spelling
		{"psce"},               // --data is required
		{"psce", "--data", "breast_cancer", "--seeds", "0"},
		{"psce", "--data", "breast_cancer", "--method", "psce,dice"},
		{"psce", "--data", "breast_cancer", "extra"},
		{"psce", "--data", "breast_cancer", "--protocol", "fast"},
		{"psce", "--data", "breast_cancer", "--model", "svm"},
		{"psce", "--data", "breast_cancer", "--json", "--markdown"},
		{"psce", "--data", "breast_cancer", "--budget", "-1"},
		{"increments", "--data", "breast_cancer", "--lr", "0"},
		{"increments", "--data", "breast_cancer", "--steps", "-1"},
		{"increments", "--data", "breast_cancer", "--sweep", "1e-5,x"},
		{"increments", "--data", "breast_cancer", "--classes", "one"},
		{"stream", "--data", "breast_cancer", "--order", "random"},
		{"stream", "--data", "breast_cancer", "--classes", "a,b,c"}, // a class the bundled set has no row of
		{"stream", "--data", "breast_cancer", "--shift", "swap", "--drift", "1", "--correct", "1"},
		{"stream", "--data", "breast_cancer", "--kl-weight", "-1", "--correct", "1"},
		{"stream", "--data", "breast_cancer", "--kl-weight", "NaN", "--correct", "1"},
		{"stream", "--data", "breast_cancer", "--memory", "-5", "--correct", "1"},
		{"stream", "--data", "breast_cancer", "--settle", "--settle-means", "--correct", "1"},
	} {
		if code, _, errs := runCLI(t, args...); code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, code, errs)
		}
	}
}

func TestHelpAndErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		out  string
	}{
		{[]string{"--help"}, 0, "cfguard-lab psce --data"},
		{[]string{"psce", "--help"}, 0, ""},
		{[]string{"increments", "--data", "no-such-file.csv"}, 1, "bundled data sets"},
	} {
		code, out, errs := runCLI(t, tc.args...)
		if code != tc.code || !strings.Contains(out+errs, tc.out) {
			t.Errorf("%v: exit %d, want %d with %q in\n%s%s", tc.args, code, tc.code, tc.out, out, errs)
		}
	}
}

// The --json contract scripts rely on: one object per method with these keys, fractions in [0,1].
// robustness_ratio is the fresh-seed figure (the paper's, stochastic generator), never smaller
// than zero; robustness_ratio_same_seed is the deterministic rerun's. A budget of 100 iterations
// keeps the searches short (at the paper's 2000, PSCE's nine searches here take twice as long as
// the rest of the run); the output's form does not depend on it.
func TestPSCEJSON(t *testing.T) {
	if testing.Short() {
		t.Skip("trains models and generates counterfactuals")
	}
	code, out, errs := runCLI(t, "psce", "--data", "breast_cancer", "--seeds", "1", "--instances", "3", "--method", "psce,wachter", "--json", "--budget", "100")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	dec := json.NewDecoder(strings.NewReader(out))
	var methods []string
	for dec.More() {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"method", "validity", "im1", "implausibility", "robustness_ratio", "robustness_ratio_same_seed", "in_set", "survival"} {
			if _, ok := m[k]; !ok {
				t.Fatalf("object %v lacks %q", m, k)
			}
		}
		if _, ok := m["robustness_ratio_fresh"]; ok {
			t.Errorf("object %v still has the old key robustness_ratio_fresh", m)
		}
		for _, k := range []string{"validity", "in_set", "survival"} {
			if v, _ := m[k].(float64); v < 0 || v > 1 {
				t.Fatalf("%s = %v, want a fraction", k, m[k])
			}
		}
		methods = append(methods, m["method"].(string))
	}
	if strings.Join(methods, ",") != "psce,wachter" {
		t.Fatalf("methods %v", methods)
	}
}

// TestPSCEMarkdown: --markdown prints the paper's figures for the same model, data set and
// method beside ours, and the command that produced the table.
func TestPSCEMarkdown(t *testing.T) {
	if testing.Short() {
		t.Skip("trains models and generates counterfactuals")
	}
	args := []string{"psce", "--data", "breast_cancer", "--seeds", "1", "--instances", "2", "--method", "wachter,roar", "--model", "dropout", "--samples", "100", "--markdown"}
	code, out, errs := runCLI(t, args...)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	for _, want := range []string{
		"| metric | wachter (ours) | wachter (paper) | roar (ours) | roar (paper) |",
		"breast_cancer, MC Dropout, protocol paper: 1 seed(s) x 2 test rows",
		"| 99.0 ± 1.3 |",      // the paper's MC Dropout Wachter validity on breast cancer
		"| 0.8146 ± 0.0328 |", // the paper's MC Dropout ROAR IM1 on breast cancer
		"Produced by `cfguard-lab " + strings.Join(args, " ") + "`", // no argument needs quoting
	} {
		if !strings.Contains(out, want) {
			t.Errorf("markdown lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "Theorem 1") {
		t.Errorf("MC Dropout table has the BNN-only rows:\n%s", out)
	}
}

// TestIncrements: one learning rate (no sweep) prints one JSON row per update with the paper's
// columns and writes the same rows and the plot to --out.
func TestIncrements(t *testing.T) {
	if testing.Short() {
		t.Skip("trains a model")
	}
	out := t.TempDir()
	code, stdout, errs := runCLI(t, "increments", "--data", "breast_cancer", "--sweep", "", "--out", out)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	rows := strings.Split(strings.TrimSpace(stdout), "\n")
	if len(rows) != 5 {
		t.Fatalf("%d rows, want 5 updates:\n%s", len(rows), stdout)
	}
	for _, r := range rows {
		var row map[string]any
		if err := json.Unmarshal([]byte(r), &row); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"update", "p1", "p2", "kl", "bound", "holds"} {
			if _, ok := row[k]; !ok {
				t.Fatalf("row %s lacks %q", r, k)
			}
		}
	}
	jsonl, err := os.ReadFile(filepath.Join(out, "increments.jsonl"))
	if err != nil || string(jsonl) != stdout {
		t.Errorf("increments.jsonl differs from stdout: %v", err)
	}
	svg, err := os.ReadFile(filepath.Join(out, "increments.svg"))
	if err != nil || !strings.Contains(string(svg), "<svg") {
		t.Errorf("increments.svg: %v, %d bytes", err, len(svg))
	}
}

// TestIncrementsMarkdown: --markdown prints the --lr rows beside the paper's table, and the
// command (its empty --sweep quoted) that produced them.
func TestIncrementsMarkdown(t *testing.T) {
	if testing.Short() {
		t.Skip("trains a model")
	}
	code, out, errs := runCLI(t, "increments", "--data", "breast_cancer", "--sweep", "", "--steps", "20", "--markdown", "--out", t.TempDir())
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	for _, want := range []string{"20 Adam iterations per update", "--sweep '' --steps 20 --markdown",
		"| 95%->96% | ", "| 0.9977 |", "| 0.000477 |", "| 99%->100% | "} {
		if !strings.Contains(out, want) {
			t.Errorf("markdown lacks %q:\n%s", want, out)
		}
	}
	if n := strings.Count(out, "\n| 9"); n != 5 {
		t.Errorf("%d update rows, want 5:\n%s", n, out)
	}
}

// The overview (cfguard-lab --help) and docs/CLI.md's synopsis name every flag of every command,
// as the command's own -h lists them, and no command, flag or default the binary does not have.
func TestOverviewAndCLIDocNameEveryFlag(t *testing.T) {
	doc, err := os.ReadFile("../../docs/CLI.md")
	if err != nil {
		t.Fatal(err)
	}
	clitest.CheckSynopsis(t, program(), doc, "docs/CLI.md")
}

// --correct and --drift may be 0 (CLI.md: ">= 0"): a stream of no increment, or of drift only,
// prints its summary rather than failing.
func TestStreamOfNoCorrectIncrement(t *testing.T) {
	for _, args := range [][]string{
		{"stream", "--data", "breast_cancer", "--correct", "0", "--increment", "64"},
		{"stream", "--data", "breast_cancer", "--correct", "0", "--drift", "1", "--increment", "64", "--every", "1"},
	} {
		code, out, errs := runCLI(t, args...)
		var sum streamSummary
		if code != 0 || json.Unmarshal([]byte(out), &sum) != nil {
			t.Fatalf("%v: exit %d, want 0 and a JSON summary; stdout %q, stderr %q", args, code, out, errs)
		}
	}
}
