package command

import (
	"github.com/cfguard/cfguard/internal/cli"

	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	return enc.Encode(v)
}

// cmdKL prints KL(new || old) over every stochastic parameter.
func cmdKL(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kl", flag.ContinueOnError)
	oldDir := fs.String("old", "", "model directory of the old posterior q1")
	newDir := fs.String("new", "", "model directory of the new posterior q2")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if err := cli.Required("old", *oldDir); err != nil {
		return err
	}
	if err := cli.Required("new", *newDir); err != nil {
		return err
	}
	q1, err := bnn.Load(*oldDir)
	if err != nil {
		return fmt.Errorf("--old: %w", err)
	}
	q2, err := bnn.Load(*newDir)
	if err != nil {
		return fmt.Errorf("--new: %w", err)
	}
	kl, n, err := certify.KL(q2, q1)
	if err != nil {
		return err
	}
	return writeJSON(stdout, map[string]any{"kl": kl, "params": n, "direction": "KL(new || old)", "same_body": bnn.SameBody(q2, q1)})
}

// boundResult is the JSON printed by `cfguard bound`.
type boundResult struct {
	Mode       string   `json:"mode"`
	P1         float64  `json:"p1"`
	KL         float64  `json:"kl"`
	Delta      float64  `json:"delta"`
	P2Lower    float64  `json:"p2_lower"`
	Var1       *float64 `json:"var1,omitempty"`
	Var2Upper  *float64 `json:"var2_upper,omitempty"`
	KLMax      float64  `json:"kl_max"`      // the daemon's KL budget for delta (certify.on_breach): (0.5 - delta)^2 / 2 in either mode
	KLMaxForP1 float64  `json:"kl_max_p1"`   // the largest KL at which p1's bound holds in mode (certify.KLBudgetForP1In)
	StillValid bool     `json:"still_valid"` // p2_lower >= 0.5
}

// cmdBound evaluates Theorems 1 and 2 for given numbers.
func cmdBound(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bound", flag.ContinueOnError)
	p1 := fs.Float64("p1", math.NaN(), "predictive probability of the CE's class under the old posterior, in [0,1]")
	kl := fs.Float64("kl", math.NaN(), "KL(new || old) >= 0")
	var1 := fs.Float64("var1", math.NaN(), "optional: predictive variance under the old posterior")
	delta := fs.Float64("delta", 0.05, "delta of the delta-safe set, in (0, 0.5)")
	mode := fs.String("mode", "paper", "paper (Theorems 1, 2) or tight (TV bound)")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	m, err := certify.ParseMode(*mode)
	if err != nil {
		return fmt.Errorf("%w: %v", cli.ErrUsage, err)
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	switch {
	case !given["p1"] || !given["kl"]:
		return fmt.Errorf("%w: --p1 and --kl are required", cli.ErrUsage)
	case !(*p1 >= 0 && *p1 <= 1):
		return fmt.Errorf("%w: --p1 must be in [0, 1], got %v", cli.ErrUsage, *p1)
	case !(*kl >= 0) || math.IsInf(*kl, 0):
		return fmt.Errorf("%w: --kl must be a finite number >= 0, got %v", cli.ErrUsage, *kl)
	case !(*delta > 0 && *delta < 0.5):
		return fmt.Errorf("%w: --delta must be in (0, 0.5), got %v", cli.ErrUsage, *delta)
	}
	r := boundResult{Mode: string(m), P1: *p1, KL: *kl, Delta: *delta,
		P2Lower: certify.ProbLower(*p1, *kl, m), KLMax: certify.KLBudget(*delta), KLMaxForP1: certify.KLBudgetForP1In(*p1, m)}
	r.StillValid = r.P2Lower >= 0.5
	if given["var1"] {
		if !(*var1 >= 0 && *var1 <= 0.25) {
			return fmt.Errorf("%w: --var1 must be in [0, 0.25], got %v", cli.ErrUsage, *var1)
		}
		v := certify.VarUpper(*var1, *kl, m)
		r.Var1, r.Var2Upper = var1, &v
	}
	return writeJSON(stdout, r)
}
