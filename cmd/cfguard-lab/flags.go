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
