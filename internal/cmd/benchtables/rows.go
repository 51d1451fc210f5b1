package main

import (
	"fmt"
	"strings"
)

// row is one measurement of the table: a test binary's benchmarks (cfguard and its reference in
// one run of the binary, rounds = runs of the binary) or a vstorch run (cfguard and PyTorch
// alternated in every round). One row may give several figures from the same rounds.
type row struct {
	name  string // the -rows key
	build string // "default" or "openblas"
	pin   bool   // pinned to one core with taskset
	// A go test benchmark row: the package, -test.bench and -test.benchtime, extra environment,
	// and the samples of one run, one per figure.
	pkg        string
	benchmarks []string // the Benchmark functions run (without "Benchmark")
	sub        string   // a pattern for their sub-benchmarks, or ""
	benchtime  string
	env        []string
	extract    func(o benchOutput) ([]sample, error)
	// A vstorch row: its workloads, one figure each.
	workloads []string
	figures   []figure
}

// bench is the row's -test.bench pattern.
func (r row) bench() string {
	p := "^Benchmark(" + strings.Join(r.benchmarks, "|") + ")$"
	if r.sub != "" {
		p += "/" + r.sub
	}
	return p
}

// predictFlops is the multiply-add flops of vstorch's predictive: 10^4 inputs x 100 draws
// through 30 -> 64 -> 32 -> 2.
const predictFlops = 2.0 * (30*64 + 64*32 + 32*2) * 1e4 * 100

// gflops is an extra for the predictive figures: GFLOP/s and the fraction of the header's peak.
func gflops(gemm string) func(float64, machine) string {
	return func(t float64, m machine) string {
		rate := predictFlops / t / 1e9
		peak := m.dgemm
		if gemm == "sgemm" {
			peak = m.sgemm
		}
		if !(peak > 0) {
			return fmt.Sprintf("%.1f GFLOP/s", rate)
		}
		return fmt.Sprintf("%.1f GFLOP/s, %.0f%% of %s peak", rate, 100*rate/peak, gemm)
	}
}

// pair extracts cfguard's and the reference's metrics from one run.
func pair(oursName, oursUnit, refName, refUnit string, scale float64) func(benchOutput) (sample, error) {
	return func(o benchOutput) (sample, error) {
		a, err := o.metric(oursName, oursUnit)
		if err != nil {
			return sample{}, err
		}
		b, err := o.metric(refName, refUnit)
		if err != nil {
			return sample{}, err
		}
		if !(a > 0) || !(b > 0) {
			return sample{}, fmt.Errorf("%s %s = %v, %s %s = %v: want positive figures", oursName, oursUnit, a, refName, refUnit, b)
		}
		return sample{ours: a * scale, ref: b * scale}, nil
	}
}

// pairs runs several extractors on one run.
func pairs(fs ...func(benchOutput) (sample, error)) func(benchOutput) ([]sample, error) {
	return func(o benchOutput) ([]sample, error) {
		out := make([]sample, len(fs))
		for i, f := range fs {
			s, err := f(o)
			if err != nil {
				return nil, err
			}
			out[i] = s
		}
		return out, nil
	}
}

// vstorchFigures are the figures of vstorch's workloads in one build.
func vstorchFigures(build string) map[string]figure {
	name := map[string]string{"openblas": "OpenBLAS build", "default": "default build (pure Go)"}[build]
	f := map[string]figure{
		"predict-float64": {name: "predictive, 10^4 inputs x 100 draws, 30->64->32->2, float64, " + name, ours: "cfguard f64", ref: "torch f64",
			reads: "x torch's speed", extra: gflops("dgemm")},
		"predict-float32": {name: "predictive, the same in float32, " + name, ours: "cfguard f32", ref: "torch f32",
			reads: "x torch's speed", extra: gflops("sgemm")},
		"update": {name: "last-layer update, 64 records, 50 Adam iterations, " + name, ours: "cfguard", ref: "torch",
			reads: "x torch's speed", target: ">= 1x (stay faster than torch)", atLeast: 1},
		"train": {name: "training, breast cancer, 300 epochs, batch 64, " + name, ours: "cfguard", ref: "torch",
			reads: "x torch's speed", target: ">= 1x (stay level with torch)", atLeast: 1},
	}
	if build == "openblas" {
		p := f["predict-float64"]
		p.target, p.atLeast = ">= 1.5x torch f64's speed", 1.5
		f["predict-float64"] = p
	}
	return f
}

// rows are the table's rows in order; quick makes them smaller (fewer iterations, 10^5 instead
// of 10^6 stored CEs, fewer vstorch workloads).
func rows(quick bool) []row {
	q := func(full, small string) string {
		if quick {
			return small
		}
		return full
	}
	var out []row
	for _, build := range []string{"openblas", "default"} {
		ws := []string{"predict-float64", "predict-float32", "update", "train"}
		if quick {
			ws = []string{"predict-float64", "update"}
		}
		figs := vstorchFigures(build)
		r := row{name: "vstorch-" + build, build: build, pin: true, workloads: ws}
		for _, w := range ws {
			r.figures = append(r.figures, figs[w])
		}
		out = append(out, r)
	}
	n, env := "1000000", []string{"CFGUARD_BENCH_1M=1"}
	if quick {
		n, env = "100000", nil
	}
	size := map[string]string{"1000000": "10^6", "100000": "10^5"}[n]
	out = append(out,
		row{name: "ingest", build: "default", pin: true, pkg: "./daemon",
			// Every backlog cap runs: a third level in the pattern (cfguard/default) would hide
			// kafka-go's result, as go test runs a partial match but does not report it.
			benchmarks: []string{"IngestEndToEnd"}, benchtime: q("2x", "1x"),
			extract: pairs(pair("IngestEndToEnd/cfguard/default", "records/s", "IngestEndToEnd/kafka-go", "records/s", 1)),
			figures: []figure{{name: "ingest end to end, default config, a backlog of 20,480 records", ours: "the daemon", ref: "plain kafka-go group read",
				rate: true, unit: "records", reads: "x kafka-go's rate", target: ">= 0.5", atLeast: 0.5}}},
		row{name: "recertify", build: "default", pin: true, pkg: "./ledger",
			benchmarks: []string{"Recertify", "ScanHeaders"}, sub: "^n=" + n + "$", benchtime: q("20x", "5x"), env: env,
			extract: pairs(pair("Recertify/n="+n, "ns/update", "ScanHeaders/n="+n, "ns/update", 1e-9)),
			figures: []figure{{name: "re-certify " + size + " stored CEs, no status change", ours: "indexed re-certification", ref: "a cursor over every CE header",
				reads: "x the scan's speed"}}},
		row{name: "psce", build: "default", pin: true, pkg: "./explain",
			benchmarks: []string{"GeneratePSCE", "PredictSameDraws"}, benchtime: q("20x", "5x"),
			extract: pairs(pair("GeneratePSCE", "ns/op", "PredictSameDraws", "ns/op", 1e-9)),
			figures: []figure{{name: "one PSCE counterfactual (breast cancer, default config, float64)", ours: "PSCE",
				ref: "one predictive over as many draws as the search evaluated", reads: "x the speed of that predictive"}}},
		row{name: "audit", build: "openblas", pin: true, pkg: "./ledger",
			benchmarks: []string{"Audit"}, benchtime: q("2x", "1x"),
			extract: pairs(pair("Audit", "audit-s", "Audit", "floor-s", 1), pair("Audit", "pool-audit-s", "Audit", "floor-s", 1)),
			figures: []figure{
				{name: "audit of 10^5 CEs (100 draws each)", ours: "audit", ref: "GEMM floor at the run's dgemm peak",
					reads: "x the floor's speed", target: ">= 0.5", atLeast: 0.5},
				{name: "the same audit with one shared pool of draws, as the daemon runs it", ours: "audit", ref: "GEMM floor",
					reads: "x the floor's speed", target: ">= 0.5", atLeast: 0.5}}},
		row{name: "register", build: "openblas", pkg: "./daemon",
			benchmarks: []string{"RegisterConcurrent", "RegisterConcurrentDaemonProcess"}, benchtime: q("1000x", "100x"),
			extract: pairs(
				pair("RegisterConcurrent/clients=16", "registrations/s", "RegisterConcurrent/clients=1", "registrations/s", 1),
				pair("RegisterConcurrentDaemonProcess/clients=16", "registrations/s", "RegisterConcurrentDaemonProcess/clients=1", "registrations/s", 1)),
			figures: []figure{
				{name: "registrations, 16 concurrent clients against 1, in process (clients in the daemon's process, HTTP on loopback)", ours: "16 clients", ref: "1 client",
					rate: true, unit: "registrations", reads: "x one client's rate", target: ">= 8x", atLeast: 8},
				{name: "registrations, 16 concurrent clients against 1, end to end (the daemon in its own process, clients over loopback HTTP)", ours: "16 clients", ref: "1 client",
					rate: true, unit: "registrations", reads: "x one client's rate", target: ">= 8x", atLeast: 8}}},
		row{name: "predict-concurrent", build: "openblas", pkg: "./daemon",
			benchmarks: []string{"PredictConcurrent"}, benchtime: q("1000x", "200x"),
			extract: pairs(pair("PredictConcurrent/batched", "req/s", "PredictConcurrent/direct", "req/s", 1)),
			figures: []figure{{name: "`POST /v1/predict` engine calls, 50 clients of one input each, 1000 draws f64", ours: "batched on a lane per core",
				ref: "one engine call per request", rate: true, unit: "requests", reads: "x the rate of one call per request", target: ">= 3x", atLeast: 3}}},
	)
	return out
}

// rowNames are the -rows keys, in order.
func rowNames() []string {
	var names []string
	for _, r := range rows(false) {
		names = append(names, r.name)
	}
	return names
}

// shellQuote quotes an argument for a command line a reader can paste.
func shellQuote(s string) string {
	if s != "" && !strings.ContainsAny(s, " '\"$|()^*?[]{}\\;&<>!`~#") {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
