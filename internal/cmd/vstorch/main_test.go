package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
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

// TestSkipsWithoutTheScript: without torch_bench.py the command says so and exits 0, having run
// nothing.
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
