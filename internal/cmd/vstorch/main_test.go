package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/dataset"
)

func TestParseTorch(t *testing.T) {
	out := []byte("some warning\n{\"what\": \"predict\", \"dtype\": \"float64\", \"reps\": 5, \"median_s\": 0.46, \"min_s\": 0.44}\n")
	if got, err := parseTorch(out); err != nil || got != 0.46 {
		t.Fatalf("parseTorch = %v, %v", got, err)
	}
	for _, bad := range []string{"", "no json here\n", `{"median_s": 0}`, `{"median_s": "x"}`} {
		if _, err := parseTorch([]byte(bad)); err == nil {
			t.Errorf("parseTorch(%q): no error", bad)
		}
	}
}

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want float64
	}{{[]float64{3}, 3}, {[]float64{5, 1, 3}, 3}, {[]float64{4, 1, 3, 2}, 2.5}} {
		if got := median(tc.in); got != tc.want {
			t.Errorf("median(%v) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

// TestSkipsWithoutTheScript: when $CFGUARD_TORCH_BENCH names a script that is not there, the
// command says so and exits 0, having run nothing.
func TestSkipsWithoutTheScript(t *testing.T) {
	missingPath := filepath.Join(t.TempDir(), "torch_bench.py")
	t.Setenv("CFGUARD_TORCH_BENCH", missingPath)
	var out, errb bytes.Buffer
	if code := run(context.Background(), nil, &out, &errb); code != 0 || !strings.Contains(out.String(), "skipped") || !strings.Contains(out.String(), missingPath) {
		t.Fatalf("exit %d, stdout %q, stderr %q", code, out.String(), errb.String())
	}
}

func TestFlags(t *testing.T) {
	var errb bytes.Buffer
	for _, args := range [][]string{{"-rounds", "0"}, {"-only", "predict-float16"}, {"-nope"}} {
		if _, err := parse(args, &errb); err == nil {
			t.Errorf("parse(%v): no error", args)
		}
	}
	o, err := parse([]string{"-only", "update,train", "-core", "1"}, &errb)
	if err != nil || o.core != 1 || len(o.only) != 2 {
		t.Fatalf("parse: %+v, %v", o, err)
	}
}

// TestDataForTheScriptIsOurs: the CSV written for torch_bench.py reads back as exactly the rows
// our side of the update and train workloads uses.
func TestDataForTheScriptIsOurs(t *testing.T) {
	set, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	back, err := dataset.Parse(bytes.NewReader(csv(set.Features, set.X, set.Y)))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(back.Y, set.Y) || len(back.X) != len(set.X) {
		t.Fatalf("labels or row count differ: %d rows, want %d", len(back.X), len(set.X))
	}
	for i := range set.X {
		if !slices.Equal(back.X[i], set.X[i]) {
			t.Fatalf("row %d: %v, want %v", i, back.X[i], set.X[i])
		}
	}
}

// TestEmbeddedScript runs the embedded torch_bench.py on each workload at its smallest size and
// reads its answer the way the comparison does. It needs python3 with PyTorch.
func TestEmbeddedScript(t *testing.T) {
	if testing.Short() {
		t.Skip("starts python three times (-short)")
	}
	o, err := parse(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	o.script = ""
	if why := missing(context.Background(), o); why != "" {
		t.Skip(why)
	}
	if o, err = writeInputs(o, t.TempDir()); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(o.script); err != nil || !bytes.Equal(b, torchBench) {
		t.Fatalf("written script %s differs from the embedded one (%v)", o.script, err)
	}
	for _, args := range [][]string{
		{"predict", "--dtype", "32", "--inputs", "50", "--samples", "3"},
		{"update", "--data", o.data},
		{"train", "--data", o.data, "--epochs", "1"},
	} {
		cmd := exec.Command(o.python, append([]string{o.script, "--reps", "1"}, args...)...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("%v: %v: %s", cmd.Args, err, errb.String())
		}
		if _, err := parseTorch(out.Bytes()); err != nil {
			t.Errorf("%s: %v", args[0], err)
		}
	}
	cmd := exec.Command(o.python, o.script, "update")
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "--data") {
		t.Errorf("update without --data: err %v, output %q; want a usage error naming --data", err, out)
	}
}

func TestMarkdownTable(t *testing.T) {
	rows := []resultRow{
		{workload: workload{name: "predict-f64", flops: 2e9, gemm: "dgemm"}, torch: 0.3, ours: 0.2},
		{workload: workload{name: "update"}, torch: 0.017, ours: 0.0046},
	}
	var b strings.Builder
	if err := writeMarkdown(&b, options{core: 1, rounds: 7, only: []string{"predict-f64", "update"}}, rows, map[string]float64{"dgemm": 20, "sgemm": 40}); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{
		"./internal/cmd/vstorch -core 1 -rounds 7 -only predict-f64,update -markdown",
		"| workload | torch s | cfguard s | torch/cfguard | cfguard GFLOP/s | of peak |",
		"| predict-f64 | 0.300 | 0.200 | 1.50 | 10.0 | 50% dgemm |", // 2e9 flops in 0.2 s = 10 GFLOP/s, half the 20 peak
		"| update | 0.017 | 0.005 | 3.70 | - | - |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("Markdown output lacks %q:\n%s", want, out)
		}
	}
}
