// Command benchtables regenerates the Summary table of docs/BENCHMARKS.md: every figure a ratio
// of cfguard to a reference measured in the same run, the median over several rounds with the
// smallest and largest round's ratio, headed by the machine (CPU model, cores, the GEMM peak
// measured on one core), the Go version, the commit and the command line, with the load average
// before and after each row.
//
//	go run ./internal/cmd/benchtables                 # every row, 3 rounds, Markdown on stdout
//	go run ./internal/cmd/benchtables -quick          # a smoke run: 1 round, smaller sizes
//	go run ./internal/cmd/benchtables -rows ingest,psce -rounds 5 -o summary.md
//
// It compiles the benchmarks' packages with `go test -c` (with -tags openblas for the rows of
// the OpenBLAS build) and runs each binary once per round with -test.run '^$' -test.bench X
// -test.benchtime N, pinned to one core with taskset where the row says so; a binary's run
// measures cfguard and its reference one after the other, so rounds alternate them. The
// PyTorch rows run internal/cmd/vstorch (built per build), which alternates torch and cfguard in
// every round itself. A row whose tool is missing (taskset, python with torch, OpenBLAS) is
// printed as skipped with the reason; a row that fails is printed as failed with the error.
// Progress goes to stderr.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// options are the command's flags.
type options struct {
	rounds int
	quick  bool
	rows   []string
	out    string
	core   int
	args   []string // the command line's arguments but -o, for the header
}

func parse(args []string, stderr io.Writer) (options, error) {
	fs := flag.NewFlagSet("benchtables", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := options{args: withoutOutput(args)}
	fs.IntVar(&o.rounds, "rounds", 0, "rounds per row, each running cfguard and its reference (default 3, 1 with -quick)")
	fs.BoolVar(&o.quick, "quick", false, "a smoke run: 1 round unless -rounds says otherwise, fewer iterations, 10^5 instead of 10^6 stored CEs, two vstorch workloads")
	only := fs.String("rows", "", "comma-separated rows to run (default all: "+strings.Join(rowNames(), ",")+")")
	fs.StringVar(&o.out, "o", "", "write the Markdown to this file instead of stdout")
	fs.IntVar(&o.core, "core", 0, "the core the pinned rows run on")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if o.rounds == 0 {
		o.rounds = 3
		if o.quick {
			o.rounds = 1
		}
	}
	if o.rounds < 1 {
		return o, fmt.Errorf("-rounds %d, want >= 1", o.rounds)
	}
	if o.core < 0 || o.core >= runtime.NumCPU() {
		return o, fmt.Errorf("-core %d: this machine has cores 0 to %d", o.core, runtime.NumCPU()-1)
	}
	if *only != "" {
		for _, name := range strings.Split(*only, ",") {
			if !slices.Contains(rowNames(), name) {
				return o, fmt.Errorf("-rows: unknown row %q (have %s)", name, strings.Join(rowNames(), ", "))
			}
			o.rows = append(o.rows, name)
		}
	}
	return o, nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parse(args, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "benchtables:", err)
		return 2
	}
	root, err := moduleRoot(ctx)
	if err != nil {
		fmt.Fprintln(stderr, "benchtables:", err)
		return 1
	}
	tmp, err := os.MkdirTemp("", "benchtables-")
	if err != nil {
		fmt.Fprintln(stderr, "benchtables:", err)
		return 1
	}
	defer os.RemoveAll(tmp)
	h := &harness{o: o, root: root, tmp: tmp, log: stderr, built: map[string]buildResult{}}
	m, reports := h.measure(ctx)
	if err := ctx.Err(); err != nil {
		fmt.Fprintln(stderr, "benchtables: interrupted; printing the rows measured so far")
	}
	w := stdout
	if o.out != "" {
		f, err := os.Create(o.out)
		if err != nil {
			fmt.Fprintln(stderr, "benchtables:", err)
			return 1
		}
		defer f.Close()
		w = f
	}
	if err := writeMarkdown(w, m, reports); err != nil {
		fmt.Fprintln(stderr, "benchtables:", err)
		return 1
	}
	for _, r := range reports {
		if r.failed != "" {
			return 1
		}
	}
	return 0
}

// moduleRoot is the directory of the main module's go.mod (the command runs from the repository).
func moduleRoot(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w (is the go command on PATH?)", err)
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", errors.New("not inside the cfguard module: run from the repository (go run ./internal/cmd/benchtables)")
	}
	return filepath.Dir(mod), nil
}

// harness runs the rows and remembers the binaries it built.
type harness struct {
	o     options
	root  string
	tmp   string
	log   io.Writer
	built map[string]buildResult // by package and build
}

type buildResult struct {
	path string
	err  error
}

// build compiles a package's test binary (or, for vstorch, the command) once per build.
func (h *harness) build(ctx context.Context, pkg, build string) (string, error) {
	key := pkg + " " + build
	if b, ok := h.built[key]; ok {
		return b.path, b.err
	}
	out := filepath.Join(h.tmp, strings.NewReplacer("/", "_", ".", "").Replace(pkg)+"-"+build)
	var args []string
	if pkg == "./internal/cmd/vstorch" {
		args = []string{"build", "-o", out}
	} else {
		args = []string{"test", "-c", "-o", out}
	}
	if build == "openblas" {
		args = append(args, "-tags", "openblas")
	}
	args = append(args, pkg)
	fmt.Fprintf(h.log, "benchtables: go %s\n", strings.Join(args, " "))
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = h.root
	msg, err := cmd.CombinedOutput()
	if err != nil {
		err = fmt.Errorf("go %s: %w: %s", strings.Join(args, " "), err, tail(msg, 5))
		if build == "openblas" {
			err = fmt.Errorf("the OpenBLAS build failed (Debian: libopenblas-dev): %w", err)
		}
	}
	h.built[key] = buildResult{out, err}
	return out, err
}

// measure describes the machine and runs the selected rows.
func (h *harness) measure(ctx context.Context) (machine, []rowReport) {
	m := machine{
		cpu:       cpuModel(),
		cores:     runtime.NumCPU(),
		goVersion: goVersion(ctx),
		commit:    commit(ctx, h.root),
		command:   "go run ./internal/cmd/benchtables" + quoteArgs(h.o.args),
		rounds:    h.o.rounds,
		started:   time.Now().UTC().Format("2006-01-02 15:04 UTC"),
		loadStart: loadAverage(),
	}
	h.peak(ctx, &m)
	var reports []rowReport
	for _, r := range rows(h.o.quick) {
		if h.o.rows != nil && !slices.Contains(h.o.rows, r.name) {
			continue
		}
		if ctx.Err() != nil {
			break
		}
		if !slices.Contains(m.tags, r.build) {
			m.tags = append(m.tags, r.build)
		}
		rep := h.runRow(ctx, r, &m)
		reports = append(reports, rep)
	}
	m.loadEnd = loadAverage()
	return m, reports
}

// peak measures the GEMM peak on the core with vstorch -peak, three times, and keeps the medians:
// OpenBLAS's when that build links (the core's peak), else gonum's.
func (h *harness) peak(ctx context.Context, m *machine) {
	for _, build := range []string{"openblas", "default"} {
		bin, err := h.build(ctx, "./internal/cmd/vstorch", build)
		if err != nil {
			m.peakNote = err.Error()
			continue
		}
		var d, s []float64
		for range 3 {
			out, err := exec.CommandContext(ctx, bin, "-peak", "-core", strconv.Itoa(h.o.core)).Output()
			var p struct {
				Backend      string
				Dgemm, Sgemm float64
			}
			if err == nil {
				err = json.Unmarshal(bytes.TrimSpace(out), &p)
			}
			if err != nil {
				m.peakNote = fmt.Sprintf("vstorch -peak: %v", err)
				break
			}
			d, s = append(d, p.Dgemm), append(s, p.Sgemm)
			m.peakBLAS = p.Backend
		}
		if len(d) == 3 {
			m.dgemm, m.sgemm = median(d), median(s)
			m.peakBLAS += fmt.Sprintf(", core %d, median of 3 runs of the best of 3 products", h.o.core)
			if build != "openblas" {
				m.peakBLAS += "; gonum's peak, not the core's: the OpenBLAS build did not link"
			}
			fmt.Fprintf(h.log, "benchtables: peak dgemm %.1f sgemm %.1f GFLOP/s (%s)\n", m.dgemm, m.sgemm, m.peakBLAS)
			return
		}
	}
}

// runRow runs one row's rounds.
func (h *harness) runRow(ctx context.Context, r row, m *machine) rowReport {
	rep := rowReport{name: r.name, build: r.build, rounds: h.o.rounds, loadBefore: loadAverage()}
	if r.pin {
		rep.pinned = fmt.Sprintf("core %d", h.o.core)
	}
	defer func() { rep.loadAfter = loadAverage() }()
	fmt.Fprintf(h.log, "benchtables: row %s (%s build), load %.2f\n", r.name, r.build, rep.loadBefore)
	var err error
	if r.workloads != nil {
		err = h.runVstorch(ctx, r, &rep)
	} else {
		err = h.runBench(ctx, r, &rep, m)
	}
	if err != nil && rep.skipped == "" {
		rep.failed = err.Error()
		fmt.Fprintf(h.log, "benchtables: row %s failed: %v\n", r.name, err)
	}
	rep.loadAfter = loadAverage()
	return rep
}

// runBench runs a test binary once per round.
func (h *harness) runBench(ctx context.Context, r row, rep *rowReport, m *machine) error {
	args := []string{"-test.run", "^$", "-test.bench", r.bench(), "-test.benchtime", r.benchtime}
	var prefix []string
	if r.pin {
		prefix = []string{"taskset", "-c", strconv.Itoa(h.o.core)}
	}
	tags := ""
	if r.build == "openblas" {
		tags = "-tags openblas "
	}
	quoted := make([]string, 0, len(prefix)+len(args)+1)
	for _, a := range append(append(slices.Clone(prefix), "./"+filepath.Base(r.pkg)+".test"), args...) {
		quoted = append(quoted, shellQuote(a))
	}
	runs := fmt.Sprintf("%d runs", h.o.rounds)
	if h.o.rounds == 1 {
		runs = "1 run"
	}
	rep.command = fmt.Sprintf("`go test -c %s%s`, then `%s%s` in %s, %s", tags, r.pkg, strings.Join(r.env, " ")+spaceIf(r.env), strings.Join(quoted, " "), strings.TrimPrefix(r.pkg, "./"), runs)
	if r.pin {
		if _, err := exec.LookPath("taskset"); err != nil {
			rep.skipped = "taskset not found (Debian: util-linux), and this row is measured on one core"
			return nil
		}
	}
	bin, err := h.build(ctx, r.pkg, r.build)
	if err != nil {
		if r.build == "openblas" {
			rep.skipped = err.Error()
			return nil
		}
		return err
	}
	rep.results = make([]result, len(r.figures))
	for i, f := range r.figures {
		rep.results[i].figure = f
	}
	for round := 1; round <= h.o.rounds; round++ {
		full := append(append(slices.Clone(prefix), bin), args...)
		cmd := exec.CommandContext(ctx, full[0], full[1:]...)
		cmd.Dir = filepath.Join(h.root, r.pkg)
		cmd.Env = append(os.Environ(), r.env...)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		start := time.Now()
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("round %d: %s: %w\n%s", round, strings.Join(quoted, " "), err, tail(out.Bytes(), 15))
		}
		parsed, err := parseBench(out.Bytes())
		if err != nil {
			return fmt.Errorf("round %d: %w", round, err)
		}
		if parsed.CPU != "" {
			m.goCPU = parsed.CPU
		}
		samples, err := r.extract(parsed)
		if err != nil {
			return fmt.Errorf("round %d: %w", round, err)
		}
		for i, s := range samples {
			rep.results[i].samples = append(rep.results[i].samples, s)
		}
		fmt.Fprintf(h.log, "benchtables: %s round %d/%d (%.0f s, load %.2f): %s\n", r.name, round, h.o.rounds, time.Since(start).Seconds(), loadAverage(), roundSummary(rep.results))
	}
	return nil
}

func spaceIf(env []string) string {
	if len(env) > 0 {
		return " "
	}
	return ""
}

// roundSummary is the last round's ratios, for the progress line.
func roundSummary(rs []result) string {
	var parts []string
	for _, r := range rs {
		if n := len(r.samples); n > 0 {
			parts = append(parts, formatRatio(r.ratio(r.samples[n-1]))+r.reads)
		}
	}
	return strings.Join(parts, "; ")
}

// runVstorch runs vstorch for the row's workloads over every round; vstorch alternates torch
// and cfguard itself and prints one line per workload and round.
func (h *harness) runVstorch(ctx context.Context, r row, rep *rowReport) error {
	args := []string{"-core", strconv.Itoa(h.o.core), "-rounds", strconv.Itoa(h.o.rounds), "-only", strings.Join(r.workloads, ",")}
	tags := ""
	if r.build == "openblas" {
		tags = "-tags openblas "
	}
	rep.command = fmt.Sprintf("`go run %s./internal/cmd/vstorch %s`", tags, strings.Join(args, " "))
	bin, err := h.build(ctx, "./internal/cmd/vstorch", r.build)
	if err != nil {
		if r.build == "openblas" {
			rep.skipped = err.Error()
			return nil
		}
		return err
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = h.root
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	// vstorch's round lines go to stderr; copy them to the progress log as they come.
	cmd.Stderr = io.MultiWriter(&stderr, prefixWriter{h.log, "benchtables: " + r.name + ": "})
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("vstorch %s: %w\n%s", strings.Join(args, " "), err, tail(stderr.Bytes(), 10))
	}
	if why, ok := strings.CutPrefix(strings.TrimSpace(stdout.String()), "vstorch: skipped: "); ok {
		rep.skipped = why
		return nil
	}
	rounds, err := parseVstorch(stderr.Bytes())
	if err != nil {
		return err
	}
	rep.results = make([]result, len(r.workloads))
	for i, w := range r.workloads {
		rep.results[i].figure = r.figures[i]
		for _, rd := range rounds {
			if rd.Workload == w {
				rep.results[i].samples = append(rep.results[i].samples, sample{ours: rd.Ours, ref: rd.Torch})
			}
		}
		if len(rep.results[i].samples) != h.o.rounds {
			return fmt.Errorf("vstorch printed %d rounds of %s, want %d", len(rep.results[i].samples), w, h.o.rounds)
		}
	}
	return nil
}

// prefixWriter writes each write to w with a prefix (vstorch writes whole lines).
type prefixWriter struct {
	w      io.Writer
	prefix string
}

func (p prefixWriter) Write(b []byte) (int, error) {
	if _, err := fmt.Fprintf(p.w, "%s%s", p.prefix, b); err != nil {
		return 0, err
	}
	return len(b), nil
}

// withoutOutput is args without -o and its value: where the table is written is no part of how
// it was measured, and a local path has no place in the docs that paste it.
func withoutOutput(args []string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "-o" || a == "--o":
			i++ // and its value
		case strings.HasPrefix(a, "-o=") || strings.HasPrefix(a, "--o="):
		default:
			out = append(out, a)
		}
	}
	return out
}

// quoteArgs renders the command's arguments as typed, each quoted where a shell needs it.
func quoteArgs(args []string) string {
	var b strings.Builder
	for _, a := range args {
		b.WriteString(" " + shellQuote(a))
	}
	return b.String()
}
