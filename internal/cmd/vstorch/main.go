// Command vstorch times cfguard's predictive, last-layer update and training side by side with
// the stack the paper used (PyTorch with torchbnn semantics, torch_bench.py beside this file),
// both pinned to one core, interleaved over several rounds, and prints medians, the ratio and
// cfguard's FLOP rate as a fraction of the core's GEMM peak measured in the same run:
//
//	go run ./internal/cmd/vstorch                 # default build: pure-Go gonum BLAS
//	go run -tags openblas ./internal/cmd/vstorch  # production build: OpenBLAS
//
// torch_bench.py is embedded in the binary; vstorch writes it and the bundled breast-cancer data
// (the rows our side uses) to a temporary directory and runs
//
//	taskset -c <core> $CFGUARD_PYTHON torch_bench.py predict|update|train --reps N [--data breast_cancer.csv] ...
//
// with CFGUARD_PYTHON defaulting to /usr/bin/python3 (Debian's python3-torch). CFGUARD_TORCH_BENCH
// names another script speaking the same protocol (arguments above, one JSON line with median_s
// out) to run instead. The command skips (exit status 0, saying why) when python, PyTorch or
// taskset is missing. Our side runs in this process with GOMAXPROCS 1, on a thread locked with
// runtime.LockOSThread, every thread of the process pinned to the core with sched_setaffinity.
//
// The workloads are the script's: predict (10,000 inputs x 100 samples, 30 -> 64 -> 32 -> 2, in
// float64 and float32), update (64 breast-cancer records, 50 Adam iterations on the last layer,
// prior objective with KL weight 0.1 / 64, then KL(q_new || q_prev)) and train (breast cancer,
// 300 epochs, batch 64, Adam lr 0.01). The peak is the best of three n = 1024 dgemm / sgemm calls
// with this build's BLAS (gonum in the default build, so build with -tags openblas to measure
// against the hardware's); -peak measures and prints only those, as one JSON line, without
// PyTorch. Each round prints one line per workload to stderr, "round R/N workload torch Ts
// cfguard Ts", which internal/cmd/benchtables reads.
package main

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/update"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// torchBench is torch_bench.py, the PyTorch side of every workload.
//
//go:embed torch_bench.py
var torchBench []byte

// options are the command's flags and environment.
type options struct {
	core, rounds int
	markdown     bool // print the medians as a Markdown table, headed by the command and commit
	peak         bool // print only the GEMM peaks on the core, as JSON, and need no PyTorch
	only         []string
	python       string
	script       string // $CFGUARD_TORCH_BENCH, or "" for the embedded torch_bench.py
	data         string // the breast-cancer CSV the script's update and train read, once written
}

func parse(args []string, stderr io.Writer) (options, error) {
	fs := flag.NewFlagSet("vstorch", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := options{python: envOr("CFGUARD_PYTHON", "/usr/bin/python3"), script: os.Getenv("CFGUARD_TORCH_BENCH")}
	fs.IntVar(&o.core, "core", 0, "the CPU core both sides are pinned to")
	fs.IntVar(&o.rounds, "rounds", 3, "rounds; each runs every workload once on each side, interleaved")
	fs.BoolVar(&o.markdown, "markdown", false, "print the medians as a Markdown table (for docs/BENCHMARKS.md), headed by the command, commit and machine")
	fs.BoolVar(&o.peak, "peak", false, `measure only this build's GEMM peaks on the core and print them as one JSON line {"backend","core","dgemm","sgemm"} (GFLOP/s); needs no PyTorch`)
	only := fs.String("only", "", "comma-separated workloads to run (default all: "+strings.Join(workloadNames(), ",")+")")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if o.rounds < 1 {
		return o, fmt.Errorf("-rounds %d, want >= 1", o.rounds)
	}
	if *only != "" {
		o.only = strings.Split(*only, ",")
		for _, name := range o.only {
			if !slices.Contains(workloadNames(), name) {
				return o, fmt.Errorf("-only: unknown workload %q (have %s)", name, strings.Join(workloadNames(), ", "))
			}
		}
	}
	return o, nil
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parse(args, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "vstorch:", err)
		return 2
	}
	if o.peak {
		return printPeak(o, stdout, stderr)
	}
	if why := missing(ctx, o); why != "" {
		fmt.Fprintf(stdout, "vstorch: skipped: %s\n", why)
		return 0
	}
	dir, err := os.MkdirTemp("", "vstorch-")
	if err != nil {
		fmt.Fprintln(stderr, "vstorch:", err)
		return 1
	}
	defer os.RemoveAll(dir)
	if o, err = writeInputs(o, dir); err != nil {
		fmt.Fprintln(stderr, "vstorch:", err)
		return 1
	}
	if err := pin(o.core); err != nil {
		fmt.Fprintln(stderr, "vstorch:", err)
		return 1
	}
	if err := compare(ctx, o, stdout, stderr); err != nil {
		fmt.Fprintln(stderr, "vstorch:", err)
		return 1
	}
	return 0
}

// printPeak pins the process to the core and prints this build's GEMM peaks as one JSON line.
func printPeak(o options, stdout, stderr io.Writer) int {
	if err := pin(o.core); err != nil {
		fmt.Fprintln(stderr, "vstorch:", err)
		return 1
	}
	line, err := json.Marshal(map[string]any{"backend": bnn.Backend, "core": o.core, "dgemm": peakGFLOPS(false), "sgemm": peakGFLOPS(true)})
	if err != nil {
		fmt.Fprintln(stderr, "vstorch:", err)
		return 1
	}
	fmt.Fprintf(stdout, "%s\n", line)
	return 0
}

// missing says why the comparison cannot run here, or "".
func missing(ctx context.Context, o options) string {
	if o.script != "" {
		if _, err := os.Stat(o.script); err != nil {
			return fmt.Sprintf("the PyTorch benchmark %s not found (unset CFGUARD_TORCH_BENCH to use the embedded torch_bench.py)", o.script)
		}
	}
	if _, err := os.Stat(o.python); err != nil {
		return fmt.Sprintf("python %s not found (set CFGUARD_PYTHON)", o.python)
	}
	if _, err := exec.LookPath("taskset"); err != nil {
		return "taskset not found (Debian: util-linux)"
	}
	if out, err := exec.CommandContext(ctx, o.python, "-c", "import numpy, torch").CombinedOutput(); err != nil {
		return fmt.Sprintf("%s cannot import torch and numpy (Debian: python3-torch): %s", o.python, bytes.TrimSpace(out))
	}
	return ""
}

// writeInputs writes the embedded torch_bench.py (unless $CFGUARD_TORCH_BENCH names another
// script) and the bundled breast-cancer data set into dir, and returns o pointing at them.
func writeInputs(o options, dir string) (options, error) {
	if o.script == "" {
		o.script = filepath.Join(dir, "torch_bench.py")
		if err := os.WriteFile(o.script, torchBench, 0o644); err != nil {
			return o, fmt.Errorf("write the PyTorch benchmark: %w", err)
		}
	}
	set, _, err := assets.Load("breast_cancer")
	if err != nil {
		return o, err
	}
	o.data = filepath.Join(dir, "breast_cancer.csv")
	if err := os.WriteFile(o.data, csv(set.Features, set.X, set.Y), 0o644); err != nil {
		return o, fmt.Errorf("write the data for the PyTorch benchmark: %w", err)
	}
	return o, nil
}

// csv renders a data set as torch_bench.py reads it: a header row, the features as the shortest
// decimals that read back as the same float64, and the label last.
func csv(features []string, X [][]float64, Y []int) []byte {
	var b bytes.Buffer
	for j := range features {
		fmt.Fprintf(&b, "f%d,", j)
	}
	b.WriteString("label\n")
	for i, row := range X {
		for _, v := range row {
			b.WriteString(strconv.FormatFloat(v, 'g', -1, 64))
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(Y[i]))
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// pin runs the rest of the process on one core: one P, this goroutine on its own OS thread, and
// every thread of the process (new threads inherit it) restricted to the core.
func pin(core int) error {
	runtime.GOMAXPROCS(1)
	runtime.LockOSThread()
	var set unix.CPUSet
	set.Set(core)
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return fmt.Errorf("pin: %w", err)
	}
	for _, t := range tasks {
		tid, err := strconv.Atoi(t.Name())
		if err != nil {
			continue
		}
		if err := unix.SchedSetaffinity(tid, &set); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("pin thread %d to core %d: %w", tid, core, err)
		}
	}
	return unix.SchedSetaffinity(0, &set)
}

// workload is one line of the table: the same job on both sides.
type workload struct {
	name  string
	torch []string // torch_bench.py's arguments (without --reps and --data)
	data  bool     // the script reads the breast-cancer data (--data)
	reps  int      // timed runs per round on each side
	flops float64  // multiply-add flops of one run's products (0: not counted)
	gemm  string   // the peak it is compared with: "dgemm" or "sgemm"
	setup func() (func(seed uint64) error, error)
}

func workloads() []workload {
	predict := func(prec bnn.Precision) func() (func(uint64) error, error) {
		return func() (func(uint64) error, error) {
			rng := rand.New(rand.NewPCG(1, 1))
			m := bnn.New(30, bnn.DefaultHidden, []string{"a", "b"}, bnn.DefaultPriorSigma, rng)
			X := make([][]float64, 10000)
			for i := range X {
				X[i] = make([]float64, 30)
				for j := range X[i] {
					X[i][j] = rng.NormFloat64()
				}
			}
			return func(seed uint64) error {
				_, err := m.PredictWith(context.Background(), X, 100, seed, prec)
				return err
			}, nil
		}
	}
	perForward := 2.0 * (30*64 + 64*32 + 32*2)
	return []workload{
		{"predict-float64", []string{"predict", "--dtype", "64"}, false, 3, perForward * 1e4 * 100, "dgemm", predict(bnn.Float64)},
		{"predict-float32", []string{"predict", "--dtype", "32"}, false, 3, perForward * 1e4 * 100, "sgemm", predict(bnn.Float32)},
		{"update", []string{"update", "--dtype", "64"}, true, 5, 0, "", func() (func(uint64) error, error) {
			set, d, err := assets.Load("breast_cancer")
			if err != nil {
				return nil, err
			}
			m := bnn.New(30, bnn.DefaultHidden, d.Classes, bnn.DefaultPriorSigma, rand.New(rand.NewPCG(2, 2)))
			m.Scaler = bnn.FitScaler(set.X) // torch_bench standardises with the whole data's moments
			return func(seed uint64) error {
				_, _, err := update.LastLayer(context.Background(), m, set.X[:64], set.Y[:64],
					update.Config{LR: 1e-5, Iterations: 50, BatchSize: 64, KLWeight: 0.1, Seed: seed})
				return err
			}, nil
		}},
		{"train", []string{"train", "--dtype", "64", "--epochs", "300"}, true, 1, 0, "", func() (func(uint64) error, error) {
			set, d, err := assets.Load("breast_cancer")
			if err != nil {
				return nil, err
			}
			return func(seed uint64) error {
				_, _, err := bnn.Fit(context.Background(), set, d.Classes, bnn.TrainConfig{Epochs: 300, BatchSize: 64, LR: 0.01, KLWeight: 0.1, Seed: seed})
				return err
			}, nil
		}},
	}
}

func workloadNames() []string {
	var names []string
	for _, w := range workloads() {
		names = append(names, w.name)
	}
	return names
}

// torchResult is the JSON line torch_bench.py prints.
type torchResult struct {
	What    string  `json:"what"`
	Dtype   string  `json:"dtype"`
	MedianS float64 `json:"median_s"`
	MinS    float64 `json:"min_s"`
	Reps    int     `json:"reps"`
}

// torch runs torch_bench.py pinned to the core and returns the median it reports.
func torch(ctx context.Context, o options, w workload) (float64, error) {
	full := append([]string{"-c", strconv.Itoa(o.core), o.python, o.script}, w.torch...)
	full = append(full, "--reps", strconv.Itoa(w.reps))
	if w.data {
		full = append(full, "--data", o.data)
	}
	cmd := exec.CommandContext(ctx, "taskset", full...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return 0, fmt.Errorf("%s: %w: %s", strings.Join(cmd.Args, " "), err, strings.TrimSpace(errb.String()))
	}
	return parseTorch(out.Bytes())
}

// parseTorch returns median_s from the last JSON line of torch_bench.py's output.
func parseTorch(out []byte) (float64, error) {
	var last string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if l := strings.TrimSpace(sc.Text()); strings.HasPrefix(l, "{") {
			last = l
		}
	}
	if last == "" {
		return 0, fmt.Errorf("torch_bench printed no JSON line: %q", out)
	}
	var r torchResult
	if err := json.Unmarshal([]byte(last), &r); err != nil {
		return 0, fmt.Errorf("torch_bench output %q: %w", last, err)
	}
	if !(r.MedianS > 0) {
		return 0, fmt.Errorf("torch_bench output %q has no positive median_s", last)
	}
	return r.MedianS, nil
}

// ours times reps runs of fn after one warm-up run and returns their median.
func ours(fn func(uint64) error, reps int, seed *uint64) (float64, error) {
	var ts []float64
	for i := 0; i <= reps; i++ {
		*seed++
		start := time.Now()
		if err := fn(*seed); err != nil {
			return 0, err
		}
		if i > 0 {
			ts = append(ts, time.Since(start).Seconds())
		}
	}
	return median(ts), nil
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// compare measures the GEMM peaks, then runs the rounds and prints the table.
func compare(ctx context.Context, o options, stdout, stderr io.Writer) error {
	peaks := map[string]float64{"dgemm": peakGFLOPS(false), "sgemm": peakGFLOPS(true)}
	var ws []workload
	for _, w := range workloads() {
		if o.only == nil || slices.Contains(o.only, w.name) {
			ws = append(ws, w)
		}
	}
	fns := make([]func(uint64) error, len(ws))
	for i, w := range ws {
		fn, err := w.setup()
		if err != nil {
			return fmt.Errorf("%s: %w", w.name, err)
		}
		fns[i] = fn
	}
	torchT, oursT := make([][]float64, len(ws)), make([][]float64, len(ws))
	var seed uint64
	for r := 0; r < o.rounds; r++ {
		for i, w := range ws {
			if err := ctx.Err(); err != nil {
				return err
			}
			t, err := torch(ctx, o, w)
			if err != nil {
				return fmt.Errorf("%s: %w", w.name, err)
			}
			g, err := ours(fns[i], w.reps, &seed)
			if err != nil {
				return fmt.Errorf("%s: %w", w.name, err)
			}
			torchT[i], oursT[i] = append(torchT[i], t), append(oursT[i], g)
			fmt.Fprintf(stderr, "round %d/%d %-16s torch %.6fs  cfguard %.6fs\n", r+1, o.rounds, w.name, t, g)
		}
	}
	rows := make([]resultRow, len(ws))
	for i, w := range ws {
		rows[i] = resultRow{workload: w, torch: median(torchT[i]), ours: median(oursT[i])}
	}
	if o.markdown {
		return writeMarkdown(stdout, o, rows, peaks)
	}
	fmt.Fprintf(stdout, "cfguard (%s BLAS, %s) vs %s, core %d, %d rounds, medians:\n", bnn.Backend, runtime.Version(), filepath.Base(o.script), o.core, o.rounds)
	fmt.Fprintf(stdout, "GEMM peak on this core (n = 1024, %s): dgemm %.1f GFLOP/s, sgemm %.1f GFLOP/s\n", bnn.Backend, peaks["dgemm"], peaks["sgemm"])
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "workload\ttorch s\tcfguard s\ttorch/cfguard\tcfguard GFLOP/s\tof peak\t")
	for _, r := range rows {
		rate, frac := r.rate(peaks)
		fmt.Fprintf(tw, "%s\t%.3f\t%.3f\t%.2f\t%s\t%s\t\n", r.name, r.torch, r.ours, r.torch/r.ours, rate, frac)
	}
	return tw.Flush()
}

// resultRow is one workload's medians over the rounds.
type resultRow struct {
	workload
	torch, ours float64 // seconds
}

// rate is cfguard's GFLOP/s and its fraction of the GEMM peak ("-" for a workload whose flops are
// not counted).
func (r resultRow) rate(peaks map[string]float64) (rate, frac string) {
	if r.flops <= 0 {
		return "-", "-"
	}
	gf := r.flops / r.ours / 1e9
	return fmt.Sprintf("%.1f", gf), fmt.Sprintf("%.0f%% %s", 100*gf/peaks[r.gemm], r.gemm)
}

// buildCommit is the commit this build was made from: the binary's VCS stamp, else (a build with
// -buildvcs=false) what git says of the working directory, else "unknown".
func buildCommit() string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && len(s.Value) >= 7 {
				return s.Value[:7]
			}
		}
	}
	if out, err := exec.Command("git", "rev-parse", "--short=7", "HEAD").Output(); err == nil {
		return strings.TrimSpace(string(out))
	}
	return "unknown"
}

// writeMarkdown prints the medians as a Markdown table, headed by what produced them: the command
// line, the commit and Go version of this build, the engine and the core, so that a table pasted
// into the docs carries its provenance.
func writeMarkdown(w io.Writer, o options, rows []resultRow, peaks map[string]float64) error {
	commit := buildCommit()
	args := []string{"go run"}
	if bnn.Backend != "gonum" {
		args = append(args, "-tags openblas")
	}
	args = append(args, "./internal/cmd/vstorch", fmt.Sprintf("-core %d -rounds %d", o.core, o.rounds))
	if len(o.only) > 0 {
		args = append(args, "-only "+strings.Join(o.only, ","))
	}
	args = append(args, "-markdown")
	fmt.Fprintf(w, "`%s` at %s (%s, %s engine, core %d, %d rounds, medians; GEMM peak: dgemm %.1f, sgemm %.1f GFLOP/s)\n\n",
		strings.Join(args, " "), commit, runtime.Version(), bnn.Backend, o.core, o.rounds, peaks["dgemm"], peaks["sgemm"])
	fmt.Fprintln(w, "| workload | torch s | cfguard s | torch/cfguard | cfguard GFLOP/s | of peak |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|")
	for _, r := range rows {
		rate, frac := r.rate(peaks)
		fmt.Fprintf(w, "| %s | %.3f | %.3f | %.2f | %s | %s |\n", r.name, r.torch, r.ours, r.torch/r.ours, rate, frac)
	}
	return nil
}
