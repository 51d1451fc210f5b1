package main

import (
	"bufio"
	"bytes"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// benchResult is one line of `go test -bench` output: the benchmark's name without the
// -GOMAXPROCS suffix, its iterations and every metric by unit (ns/op, records/s, ratio, ...).
type benchResult struct {
	Name    string
	N       int
	Metrics map[string]float64
}

// benchOutput is what one run of a test binary printed: its results by name and the cpu line.
type benchOutput struct {
	CPU     string
	Results map[string]benchResult
}

// procSuffix is the -GOMAXPROCS suffix go test appends to a benchmark's name.
var procSuffix = regexp.MustCompile(`-\d+$`)

// parseBench reads the output of a test binary run with -test.bench. A benchmark that failed
// (its "--- FAIL" line) is an error; a line that does not parse as a result is ignored, as
// go test interleaves logs with results.
func parseBench(out []byte) (benchOutput, error) {
	res := benchOutput{Results: map[string]benchResult{}}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if cpu, ok := strings.CutPrefix(line, "cpu: "); ok {
			res.CPU = strings.TrimSpace(cpu)
			continue
		}
		if strings.HasPrefix(strings.TrimSpace(line), "--- FAIL: Benchmark") {
			return res, fmt.Errorf("benchmark failed: %s", strings.TrimSpace(line))
		}
		r, ok := parseResultLine(line)
		if ok {
			res.Results[r.Name] = r
		}
	}
	if err := sc.Err(); err != nil {
		return res, err
	}
	if len(res.Results) == 0 {
		return res, fmt.Errorf("no benchmark result in the output:\n%s", tail(out, 20))
	}
	return res, nil
}

// parseResultLine parses "BenchmarkX/sub-2   20   123 ns/op   4.5 ratio ...".
func parseResultLine(line string) (benchResult, bool) {
	f := strings.Fields(line)
	if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") || len(f)%2 != 0 {
		return benchResult{}, false
	}
	n, err := strconv.Atoi(f[1])
	if err != nil {
		return benchResult{}, false
	}
	r := benchResult{Name: procSuffix.ReplaceAllString(strings.TrimPrefix(f[0], "Benchmark"), ""), N: n, Metrics: map[string]float64{}}
	for i := 2; i+1 < len(f); i += 2 {
		v, err := strconv.ParseFloat(f[i], 64)
		if err != nil {
			return benchResult{}, false
		}
		r.Metrics[f[i+1]] = v
	}
	return r, true
}

// metric is the value of unit in the result named name, or an error that names both and what
// the run printed.
func (o benchOutput) metric(name, unit string) (float64, error) {
	r, ok := o.Results[name]
	if !ok {
		have := make([]string, 0, len(o.Results))
		for n := range o.Results {
			have = append(have, n)
		}
		slices.Sort(have)
		return 0, fmt.Errorf("no result for %s (have %s)", name, strings.Join(have, ", "))
	}
	v, ok := r.Metrics[unit]
	if !ok {
		return 0, fmt.Errorf("%s reported no %q", name, unit)
	}
	return v, nil
}

// vstorchRound is one workload of one round of internal/cmd/vstorch, from its progress line
// "round 1/3 predict-float64  torch 0.381000s  cfguard 0.157000s".
type vstorchRound struct {
	Round    int
	Workload string
	Torch    float64 // seconds
	Ours     float64 // seconds
}

var vstorchLine = regexp.MustCompile(`^round (\d+)/\d+ (\S+)\s+torch ([0-9.eE+-]+)s\s+cfguard ([0-9.eE+-]+)s\s*$`)

// parseVstorch returns every round line of vstorch's stderr.
func parseVstorch(stderr []byte) ([]vstorchRound, error) {
	var rounds []vstorchRound
	sc := bufio.NewScanner(bytes.NewReader(stderr))
	for sc.Scan() {
		m := vstorchLine.FindStringSubmatch(strings.TrimSpace(sc.Text()))
		if m == nil {
			continue
		}
		r, _ := strconv.Atoi(m[1])
		t, err1 := strconv.ParseFloat(m[3], 64)
		g, err2 := strconv.ParseFloat(m[4], 64)
		if err1 != nil || err2 != nil || !(t > 0) || !(g > 0) {
			return nil, fmt.Errorf("vstorch round line %q: times must be positive numbers", sc.Text())
		}
		rounds = append(rounds, vstorchRound{Round: r, Workload: m[2], Torch: t, Ours: g})
	}
	if len(rounds) == 0 {
		return nil, fmt.Errorf("vstorch printed no round line:\n%s", tail(stderr, 20))
	}
	return rounds, nil
}

// tail is the last n lines of out.
func tail(out []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
