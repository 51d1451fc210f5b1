package main

import (
	"bufio"
	"bytes"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// goBenchOutput is what a test binary prints for BenchmarkIngestEndToEnd, with a log line and a
// sub-benchmark of a partial name between the results, as go test interleaves them.
const goBenchOutput = `goos: linux
goarch: amd64
pkg: github.com/cfguard/cfguard/daemon
cpu: Oxide Virtual Turin-like Processor             
BenchmarkIngestEndToEnd/kafka-go-2         	       2	 409136337 ns/op	     50057 records/s
    ingest_bench_test.go:99: some log line
BenchmarkIngestEndToEnd/cfguard/default-2  	       2	 671704386 ns/op	         0.7726 cpu/wall	         0.6233 ratio	     30490 records/s
BenchmarkRecertify/n=1000000               	      20	    108000 ns/op	    108000 ns/update
PASS
`

func TestParseBench(t *testing.T) {
	o, err := parseBench([]byte(goBenchOutput))
	if err != nil {
		t.Fatal(err)
	}
	if o.CPU != "Oxide Virtual Turin-like Processor" {
		t.Errorf("cpu %q", o.CPU)
	}
	if len(o.Results) != 3 {
		t.Fatalf("%d results, want 3: %v", len(o.Results), o.Results)
	}
	for _, tc := range []struct {
		name, unit string
		want       float64
	}{
		{"IngestEndToEnd/kafka-go", "records/s", 50057},
		{"IngestEndToEnd/cfguard/default", "ratio", 0.6233},
		{"IngestEndToEnd/cfguard/default", "ns/op", 671704386},
		{"Recertify/n=1000000", "ns/update", 108000}, // no -GOMAXPROCS suffix at GOMAXPROCS 1
	} {
		if got, err := o.metric(tc.name, tc.unit); err != nil || got != tc.want {
			t.Errorf("%s %s = %v, %v; want %v", tc.name, tc.unit, got, err, tc.want)
		}
	}
	if r := o.Results["IngestEndToEnd/cfguard/default"]; r.N != 2 {
		t.Errorf("N = %d, want 2", r.N)
	}
	if _, err := o.metric("IngestEndToEnd/cfguard/max_records_backlog=64", "records/s"); err == nil || !strings.Contains(err.Error(), "IngestEndToEnd/kafka-go") {
		t.Errorf("a missing result: %v, want an error naming the results there are", err)
	}
	if _, err := o.metric("IngestEndToEnd/kafka-go", "ratio"); err == nil {
		t.Error("a missing unit: no error")
	}
}

func TestParseBenchFailures(t *testing.T) {
	for name, out := range map[string]string{
		"empty":          "",
		"no results":     "goos: linux\nPASS\n",
		"failed":         goBenchOutput + "--- FAIL: BenchmarkAudit\n    audit_bench_test.go:50: boom\n",
		"only malformed": "BenchmarkX 12 notanumber ns/op\nBenchmarkY\n",
	} {
		if _, err := parseBench([]byte(out)); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestParseResultLine(t *testing.T) {
	for line, ok := range map[string]bool{
		"BenchmarkA-2 \t 10\t 5 ns/op":               true,
		"BenchmarkA-2 \t 10\t 5 ns/op\t 3.5e+03 x/s": true,
		"BenchmarkA-2 \t ten\t 5 ns/op":              false,
		"BenchmarkA-2 \t 10\t 5":                     false, // a value without its unit
		"    bench_test.go:12: Benchmark 1 2 3":      false,
		"--- BENCH: BenchmarkA-2":                    false,
	} {
		if _, got := parseResultLine(line); got != ok {
			t.Errorf("parseResultLine(%q) ok = %v, want %v", line, got, ok)
		}
	}
	r, _ := parseResultLine("BenchmarkA/n=10-16 \t 10\t 5 ns/op\t 3.5e+03 x/s")
	if r.Name != "A/n=10" || r.Metrics["x/s"] != 3500 {
		t.Errorf("got %+v", r)
	}
}

func TestParseVstorch(t *testing.T) {
	out := []byte("round 1/2 predict-float64  torch 0.381000s  cfguard 0.157000s\n" +
		"some warning from torch\n" +
		"round 1/2 update           torch 0.023000s  cfguard 0.005000s\n" +
		"round 2/2 predict-float64  torch 0.400000s  cfguard 0.160000s\n")
	rs, err := parseVstorch(out)
	if err != nil {
		t.Fatal(err)
	}
	want := []vstorchRound{{1, "predict-float64", 0.381, 0.157}, {1, "update", 0.023, 0.005}, {2, "predict-float64", 0.4, 0.16}}
	if len(rs) != len(want) {
		t.Fatalf("got %+v", rs)
	}
	for i := range want {
		if rs[i] != want[i] {
			t.Errorf("round line %d: got %+v, want %+v", i, rs[i], want[i])
		}
	}
	for _, bad := range []string{"", "vstorch: skipped: no torch\n", "round 1/1 update torch 0.000000s  cfguard 0.1s\n"} {
		if _, err := parseVstorch([]byte(bad)); err == nil {
			t.Errorf("parseVstorch(%q): no error", bad)
		}
	}
}

func TestMedianAndSpread(t *testing.T) {
	for _, tc := range []struct {
		v              []float64
		med, low, high float64
	}{
		{[]float64{3}, 3, 3, 3},
		{[]float64{5, 1, 3}, 3, 1, 5},
		{[]float64{4, 1, 3, 2}, 2.5, 1, 4},
		{[]float64{2, 2, 9}, 2, 2, 9},
	} {
		in := append([]float64(nil), tc.v...)
		lo, hi := spread(tc.v)
		if m := median(tc.v); m != tc.med || lo != tc.low || hi != tc.high {
			t.Errorf("%v: median %v spread %v-%v, want %v %v-%v", tc.v, m, lo, hi, tc.med, tc.low, tc.high)
		}
		for i := range in {
			if in[i] != tc.v[i] {
				t.Fatalf("median reordered its argument: %v", tc.v)
			}
		}
	}
	if !math.IsNaN(median(nil)) {
		t.Error("median of nothing is not NaN")
	}
}

func TestRatioDirection(t *testing.T) {
	times := figure{}
	if r := times.ratio(sample{ours: 0.5, ref: 1.5}); r != 3 {
		t.Errorf("times: ratio %v, want ref/ours = 3", r)
	}
	rates := figure{rate: true}
	if r := rates.ratio(sample{ours: 30, ref: 50}); r != 0.6 {
		t.Errorf("rates: ratio %v, want ours/ref = 0.6", r)
	}
}

func TestWriteMarkdown(t *testing.T) {
	f := figure{name: "predictive", ours: "cfguard", ref: "torch", reads: "x faster than torch", target: ">= 1.5x", atLeast: 1.5,
		extra: gflops("dgemm")}
	m := machine{cpu: "AMD EPYC", goCPU: "Some CPU", cores: 2, peakBLAS: "openblas", dgemm: 80.64, sgemm: 160, goVersion: "go1.26.8",
		commit: "abc1234-dirty", command: "go run ./internal/cmd/benchtables -rows x", tags: []string{"openblas"}, loadStart: 1.5, loadEnd: 2}
	rows := []rowReport{
		{name: "vstorch", build: "openblas", pinned: "core 1", command: "`a | b`", loadBefore: 1.25, loadAfter: 1.75, results: []result{{
			figure: f, samples: []sample{{ours: 0.1, ref: 0.2}, {ours: 0.1, ref: 0.3}, {ours: 0.1, ref: 0.15}},
		}}},
		{name: "slow", build: "default", pinned: "core 1", results: []result{{
			figure: f, samples: []sample{{ours: 1, ref: 1.2}, {ours: 1, ref: 1.4}, {ours: 1, ref: 1.3}},
		}}},
		{name: "register", build: "openblas", skipped: "taskset not found"},
		{name: "audit", build: "openblas", failed: "round 2: exit status 1\nmore"},
	}
	var b bytes.Buffer
	if err := writeMarkdown(&b, m, rows); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{
		"`go run ./internal/cmd/benchtables -rows x` at abc1234-dirty",
		"AMD EPYC (go test: Some CPU), 2 logical cores",
		"dgemm 80.6, sgemm 160.0 GFLOP/s",
		"load average 1.50 at the start, 2.00 at the end",
		// the median of 2, 3 and 1.5 with the spread; cfguard's median time, its GFLOP/s
		// (8.064 GFLOP in 0.1 s) against the peak
		"| predictive | **2.00**x faster than torch (1.50–3.00), 3 | cfguard: 100 ms (80.6 GFLOP/s, 100% of dgemm peak) | torch 200 ms | >= 1.5x: **met** | openblas, core 1 | 1.25 → 1.75 | `a \\| b` |",
		"**1.30**x faster than torch (1.20–1.40), 3",
		">= 1.5x: **not met**",
		"| register | skipped: taskset not found | — |",
		"| audit | failed: round 2: exit status 1 more | — |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	// Every table line has the header's number of cells.
	sc := bufio.NewScanner(strings.NewReader(out))
	cells := -1
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, "|") {
			continue
		}
		n := len(regexp.MustCompile(`[^\\]\|`).FindAllString(l, -1))
		if cells < 0 {
			cells = n
		} else if n != cells {
			t.Errorf("%d cells, the header has %d: %s", n, cells, l)
		}
	}
}

func TestFormatValue(t *testing.T) {
	for _, tc := range []struct {
		v    float64
		f    figure
		want string
	}{
		{0.157, figure{}, "157 ms"},
		{2.16, figure{}, "2.16 s"},
		{0.000108, figure{}, "108 us"},
		{30490, figure{rate: true, unit: "records"}, "30.5 k records/s"},
		{297.4, figure{rate: true, unit: "registrations"}, "297 registrations/s"},
		{math.NaN(), figure{}, "—"},
	} {
		if got := formatValue(tc.v, tc.f); got != tc.want {
			t.Errorf("formatValue(%v) = %q, want %q", tc.v, got, tc.want)
		}
	}
}

func TestParseFlags(t *testing.T) {
	o, err := parse([]string{"-quick"}, io.Discard)
	if err != nil || o.rounds != 1 || !o.quick {
		t.Errorf("-quick: %+v %v, want 1 round", o, err)
	}
	o, err = parse([]string{"-rows", "ingest,psce", "-rounds", "5"}, io.Discard)
	if err != nil || o.rounds != 5 || len(o.rows) != 2 {
		t.Errorf("-rows: %+v %v", o, err)
	}
	if o, err := parse(nil, io.Discard); err != nil || o.rounds != 3 || o.rows != nil {
		t.Errorf("defaults: %+v %v, want 3 rounds of every row", o, err)
	}
	for _, bad := range [][]string{{"-rows", "nosuch"}, {"-rounds", "-1"}, {"-core", "9999"}, {"stray"}} {
		if _, err := parse(bad, io.Discard); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// TestRowsNameExistingBenchmarks: every benchmark a row's pattern names is declared in its
// package, and every row has one figure per sample it extracts, so a renamed benchmark fails
// here rather than an hour into a run.
func TestRowsNameExistingBenchmarks(t *testing.T) {
	seen := map[string]bool{}
	for _, quick := range []bool{false, true} {
		for _, r := range rows(quick) {
			if !quick && seen[r.name] {
				t.Errorf("row %q twice", r.name)
			}
			seen[r.name] = true
			if r.workloads != nil {
				if len(r.workloads) != len(r.figures) {
					t.Errorf("%s: %d workloads, %d figures", r.name, len(r.workloads), len(r.figures))
				}
				continue
			}
			src := packageSource(t, r.pkg)
			for _, name := range r.benchmarks {
				if !strings.Contains(src, "func Benchmark"+name+"(b *testing.B)") {
					t.Errorf("%s: Benchmark%s is not declared in %s", r.name, name, r.pkg)
				}
			}
			if !regexp.MustCompile(strings.Split(r.bench(), "/")[0]).MatchString("Benchmark" + r.benchmarks[0]) {
				t.Errorf("%s: pattern %q does not match Benchmark%s", r.name, r.bench(), r.benchmarks[0])
			}
		}
	}
}

// packageSource is every _test.go file of a package of this module, concatenated.
func packageSource(t *testing.T, pkg string) string {
	files, err := filepath.Glob(filepath.Join("..", "..", "..", pkg, "*_test.go"))
	if err != nil || len(files) == 0 {
		t.Fatalf("%s: no test files (%v)", pkg, err)
	}
	var b strings.Builder
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		b.Write(raw)
	}
	return b.String()
}

func TestHeaderLeavesOutTheOutputFile(t *testing.T) {
	for _, args := range [][]string{
		{"-rounds", "5", "-o", "/tmp/x.md", "-quick"},
		{"-rounds", "5", "-o=/tmp/x.md", "-quick"},
		{"-rounds", "5", "--o", "/tmp/x.md", "-quick"},
	} {
		o, err := parse(args, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if got := quoteArgs(o.args); got != " -rounds 5 -quick" {
			t.Errorf("%q: header arguments %q, want \" -rounds 5 -quick\"", args, got)
		}
		if o.out != "/tmp/x.md" {
			t.Errorf("%q: -o = %q", args, o.out)
		}
	}
}

func TestShellQuote(t *testing.T) {
	for in, want := range map[string]string{
		"-test.benchtime": "-test.benchtime",
		"^$":              "'^$'",
		"a|b":             "'a|b'",
		"it's":            `'it'\''s'`,
		"":                "''",
	} {
		if got := shellQuote(in); got != want {
			t.Errorf("shellQuote(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestMachineParsers(t *testing.T) {
	cpu := "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n"
	if got := cpuModelOf(bufio.NewScanner(strings.NewReader(cpu))); got != "AMD EPYC 7B13" {
		t.Errorf("cpu model %q", got)
	}
	if got := cpuModelOf(bufio.NewScanner(strings.NewReader("processor: 0\n"))); !strings.HasPrefix(got, "unknown CPU") {
		t.Errorf("no model name: %q", got)
	}
	if got := parseLoadavg("0.55 0.41 0.99 2/345 6789\n"); got != 0.55 {
		t.Errorf("load %v", got)
	}
	if !math.IsNaN(parseLoadavg("")) {
		t.Error("empty loadavg is not NaN")
	}
}
