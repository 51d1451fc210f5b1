package evaluate

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strings"
)

// WriteTable writes the summaries as a paper-style text table: one row per metric, one column
// per method, "mean ± std" over seeds.
func WriteTable(w io.Writer, sums []MethodSummary) error {
	if len(sums) == 0 {
		_, err := fmt.Fprintln(w, "no results")
		return err
	}
	s0 := sums[0]
	// prec < 0 prints 3 significant digits (%.3g): the same-seed robustness ratio is ~1e-5.
	type row struct {
		label string
		get   func(MethodSummary) Stat
		scale float64
		prec  int
	}
	rows := []row{
		{"IM1 (↓)", func(s MethodSummary) Stat { return s.IM1 }, 1, 4},
		{"Implausibility (↓)", func(s MethodSummary) Stat { return s.Implausibility }, 1, 4},
		{"Robustness ratio 1e-3 (↓)", func(s MethodSummary) Stat { return s.RobustnessRatio }, 1, 4},
		{"  same seed, deterministic rerun", func(s MethodSummary) Stat { return s.RobustnessRatioSameSeed }, 1, -1},
		{"Validity % (↑)", func(s MethodSummary) Stat { return s.Validity }, 100, 1},
		{"Search success %", func(s MethodSummary) Stat { return s.SearchSuccess }, 100, 1},
		{"In <δ,ε>-set % (↑)", func(s MethodSummary) Stat { return s.InSet }, 100, 1},
		{fmt.Sprintf("Survival after %d updates %% (↑)", s0.Updates), func(s MethodSummary) Stat { return s.Survival }, 100, 1},
		{"Theorem 1 keeps >= 0.5 %", func(s MethodSummary) Stat { return s.SurvivalBound }, 100, 1},
		{"Theorem 1 bound holds %", func(s MethodSummary) Stat { return s.BoundHolds }, 100, 1},
		{"Seconds per CE", func(s MethodSummary) Stat { return s.SecondsPerCE }, 1, 3},
	}
	cells := make([][]string, len(rows)+1)
	cells[0] = []string{"Metric"}
	for _, s := range sums {
		cells[0] = append(cells[0], s.Method)
	}
	for i, r := range rows {
		cells[i+1] = []string{r.label}
		for _, s := range sums {
			st := r.get(s)
			cell := "n/a"
			if !math.IsNaN(st.Mean) {
				cell = fmt.Sprintf("%.*f ± %.*f", r.prec, st.Mean*r.scale, r.prec, st.Std*r.scale)
				if r.prec < 0 {
					cell = fmt.Sprintf("%.3g ± %.2g", st.Mean*r.scale, st.Std*r.scale)
				}
			}
			cells[i+1] = append(cells[i+1], cell)
		}
	}
	width := make([]int, len(cells[0]))
	for _, line := range cells {
		for j, c := range line {
			width[j] = max(width[j], len([]rune(c)))
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s, protocol %s: %d seed(s) x %d instances; anchor test accuracy %.2f%%; KL(q_final || q_anchor) %.3g\n",
		s0.Model, s0.Protocol, s0.Seeds, s0.Instances, 100*s0.Accuracy.Mean, s0.KL.Mean)
	for i, line := range cells {
		for j, c := range line {
			pad := width[j] - len([]rune(c))
			if j == 0 {
				b.WriteString(c + strings.Repeat(" ", pad))
			} else {
				b.WriteString("  " + strings.Repeat(" ", pad) + c)
			}
		}
		b.WriteByte('\n')
		if i == 0 {
			b.WriteString(strings.Repeat("-", sum(width)+2*(len(width)-1)) + "\n")
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func sum(xs []int) int {
	s := 0
	for _, x := range xs {
		s += x
	}
	return s
}

// WriteJSON writes one JSON object per method and line. The keys method, protocol, model,
// validity, search_success, im1,
// implausibility, robustness_ratio (the fresh-seed ratio, comparable with the paper's), in_set
// and survival are the means over seeds (fractions in [0, 1] for validity, in_set and
// survival); "<key>_std" are the standard deviations; further keys
// (robustness_ratio_same_seed, survival_bound, bound_holds, seconds_per_ce, accuracy, kl,
// seeds, instances, updates) extend them. An undefined mean (no valid counterfactual in any
// seed, or robustness_ratio_same_seed when skipped) is null.
func WriteJSON(w io.Writer, sums []MethodSummary) error {
	enc := json.NewEncoder(w)
	for _, s := range sums {
		obj := map[string]any{"method": s.Method, "protocol": s.Protocol, "model": s.Model, "seeds": s.Seeds, "instances": s.Instances, "updates": s.Updates}
		for _, f := range []struct {
			key string
			st  Stat
		}{{"validity", s.Validity}, {"search_success", s.SearchSuccess}, {"im1", s.IM1}, {"implausibility", s.Implausibility},
			{"robustness_ratio", s.RobustnessRatio}, {"robustness_ratio_same_seed", s.RobustnessRatioSameSeed},
			{"in_set", s.InSet}, {"survival", s.Survival},
			{"survival_bound", s.SurvivalBound}, {"bound_holds", s.BoundHolds},
			{"seconds_per_ce", s.SecondsPerCE}, {"accuracy", s.Accuracy}, {"kl", s.KL}} {
			obj[f.key] = jsonNumber(f.st.Mean)
			obj[f.key+"_std"] = jsonNumber(f.st.Std)
		}
		if err := enc.Encode(obj); err != nil {
			return err
		}
	}
	return nil
}

func jsonNumber(v float64) any {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return nil
	}
	return v
}
