package main

import (
	"github.com/cfguard/cfguard/internal/cli"

	"fmt"
	"strconv"
	"strings"
)

// parseFloats parses a comma-separated list of positive numbers (empty fields are skipped).
func parseFloats(s string) ([]float64, error) {
	var out []float64
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		v, err := strconv.ParseFloat(f, 64)
		if err != nil || !(v > 0) {
			return nil, fmt.Errorf("%w: %q is not a positive number", cli.ErrUsage, f)
		}
		out = append(out, v)
	}
	return out, nil
}

// commandLine renders a command and its arguments as a shell would take them back: an empty
// argument or one with spaces or quotes is single-quoted.
func commandLine(cmd string, args []string) string {
	out := []string{cmd}
	for _, a := range args {
		if a == "" || strings.ContainsAny(a, " '\"$") {
			a = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		out = append(out, a)
	}
	return strings.Join(out, " ")
}
