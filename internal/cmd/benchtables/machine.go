package main

import (
	"bufio"
	"context"
	"math"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// cpuModel is the first "model name" of /proc/cpuinfo, or "unknown CPU" saying why.
func cpuModel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return "unknown CPU (" + err.Error() + ")"
	}
	defer f.Close()
	return cpuModelOf(bufio.NewScanner(f))
}

func cpuModelOf(sc *bufio.Scanner) string {
	for sc.Scan() {
		key, value, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(key) == "model name" {
			return strings.TrimSpace(value)
		}
	}
	return "unknown CPU (no model name in /proc/cpuinfo)"
}

// loadAverage is the 1-minute load average of /proc/loadavg (NaN when unreadable).
func loadAverage() float64 {
	raw, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return math.NaN()
	}
	return parseLoadavg(string(raw))
}

func parseLoadavg(s string) float64 {
	f := strings.Fields(s)
	if len(f) == 0 {
		return math.NaN()
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return math.NaN()
	}
	return v
}

// goVersion is the version of the go command that builds the benchmarks.
func goVersion(ctx context.Context) string {
	out, err := exec.CommandContext(ctx, "go", "env", "GOVERSION").Output()
	if err != nil {
		return "go (version unknown: " + err.Error() + ")"
	}
	return strings.TrimSpace(string(out))
}

// commit is the short hash of HEAD, with "-dirty" when the working tree has changes.
func commit(ctx context.Context, dir string) string {
	cmd := exec.CommandContext(ctx, "git", "rev-parse", "--short", "HEAD")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		return "unknown commit (git rev-parse: " + err.Error() + ")"
	}
	c := strings.TrimSpace(string(out))
	st := exec.CommandContext(ctx, "git", "status", "--porcelain")
	st.Dir = dir
	if s, err := st.Output(); err != nil || len(strings.TrimSpace(string(s))) > 0 {
		c += "-dirty"
	}
	return c
}
