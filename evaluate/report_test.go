package evaluate

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"
)

// reportSums are two summaries whose every figure differs, so that a row or key reading the
// wrong Stat, scale or precision shows; wachter's IM1 and same-seed ratio are undefined.
func reportSums() []MethodSummary {
	st := func(m, s float64) Stat { return Stat{Mean: m, Std: s, N: 3} }
	nan := math.NaN()
	return []MethodSummary{
		{Method: "psce", Seeds: 3, Instances: 25, Updates: 5, Protocol: ProtocolPaper, Model: ModelBNN,
			IM1: st(0.71234, 0.01234), Implausibility: st(5.5, 0.25), RobustnessRatio: st(0.15, 0.02),
			RobustnessRatioSameSeed: st(1.234e-5, 5.67e-6), Validity: st(0.9, 0.05), SearchSuccess: st(0.8, 0.1),
			InSet: st(0.6, 0.2), Survival: st(0.95, 0.01), SurvivalBound: st(0.4, 0.3), BoundHolds: st(1, 0),
			SecondsPerCE: st(0.0123, 0.004), Accuracy: st(0.9649, 0.002), KL: st(0.00033, 0.00002)},
		{Method: "wachter", Seeds: 3, Instances: 25, Updates: 5, Protocol: ProtocolPaper, Model: ModelBNN,
			IM1: Stat{Mean: nan, Std: nan}, Implausibility: st(7.25, 0.5), RobustnessRatio: st(0.3, 0.04),
			RobustnessRatioSameSeed: Stat{Mean: nan, Std: nan}, Validity: st(0.5, 0.25), SearchSuccess: st(0.7, 0.15),
			InSet: st(0.1, 0.05), Survival: st(0.75, 0.125), SurvivalBound: st(0.2, 0.1), BoundHolds: st(0.5, 0.5),
			SecondsPerCE: st(0.5, 0.25), Accuracy: st(0.9649, 0.002), KL: st(0.00033, 0.00002)},
	}
}

// TestWriteTableCells pins WriteTable's rules: a header line with the run's shape (seeds,
// instances, accuracy in percent, KL), then one row per metric and one column per method, each
// cell "mean ± std" of that metric's Stat (fractions as percentages to 0.1, ratios to 4
// decimals, seconds to 3, the same-seed ratio to 3 and 2 significant digits, "n/a" for an
// undefined mean); labels left-aligned, cells right-aligned under their method, a rule of
// dashes as wide as the table under the column names, every column as wide as its widest entry
// (in runes: "±", "δ" and "↑" are one column each). The expected cells are worked by hand
// from reportSums.
func TestWriteTableCells(t *testing.T) {
	var b bytes.Buffer
	if err := WriteTable(&b, reportSums()); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	const header = "bnn, protocol paper: 3 seed(s) x 25 instances; anchor test accuracy 96.49%; KL(q_final || q_anchor) 0.00033"
	if lines[0] != header {
		t.Errorf("header %q, want %q", lines[0], header)
	}
	want := []struct {
		label string
		cells []string
	}{
		{"Metric", []string{"psce", "wachter"}},
		{"", nil}, // the rule
		{"IM1 (↓)", []string{"0.7123 ± 0.0123", "n/a"}},
		{"Implausibility (↓)", []string{"5.5000 ± 0.2500", "7.2500 ± 0.5000"}},
		{"Robustness ratio 1e-3 (↓)", []string{"0.1500 ± 0.0200", "0.3000 ± 0.0400"}},
		{"  same seed, deterministic rerun", []string{"1.23e-05 ± 5.7e-06", "n/a"}},
		{"Validity % (↑)", []string{"90.0 ± 5.0", "50.0 ± 25.0"}},
		{"Search success %", []string{"80.0 ± 10.0", "70.0 ± 15.0"}},
		{"In <δ,ε>-set % (↑)", []string{"60.0 ± 20.0", "10.0 ± 5.0"}},
		{"Survival after 5 updates % (↑)", []string{"95.0 ± 1.0", "75.0 ± 12.5"}},
		{"Theorem 1 keeps >= 0.5 %", []string{"40.0 ± 30.0", "20.0 ± 10.0"}},
		{"Theorem 1 bound holds %", []string{"100.0 ± 0.0", "50.0 ± 50.0"}},
		{"Seconds per CE", []string{"0.012 ± 0.004", "0.500 ± 0.250"}},
	}
	rows := lines[1:]
	if len(rows) != len(want) {
		t.Fatalf("%d lines under the header, want %d:\n%s", len(rows), len(want), out)
	}
	// A field is a run of non-blanks joined by single blanks; fields are at least two blanks apart.
	field := regexp.MustCompile(`\S+( \S+)*`)
	width := utf8.RuneCountInString(rows[0])
	var ends []int   // rune column where each method's cell ends
	var minGap []int // narrowest blank run before each method's column
	for i, w := range want {
		line := rows[i]
		if n := utf8.RuneCountInString(line); n != width {
			t.Errorf("line %q is %d runes wide, want %d", line, n, width)
		}
		if w.label == "" {
			if line != strings.Repeat("-", width) {
				t.Errorf("rule %q, want %d dashes", line, width)
			}
			continue
		}
		if !strings.HasPrefix(line, w.label+" ") {
			t.Errorf("line %q does not start with its label %q", line, w.label)
			continue
		}
		rest := line[len(w.label):]
		locs := field.FindAllStringIndex(rest, -1)
		if len(locs) != len(w.cells) {
			t.Errorf("%s: cells %q, want %q", w.label, field.FindAllString(rest, -1), w.cells)
			continue
		}
		prevEnd := utf8.RuneCountInString(w.label)
		for k, loc := range locs {
			if got := rest[loc[0]:loc[1]]; got != w.cells[k] {
				t.Errorf("%s, %s: %q, want %q", w.label, want[0].cells[k], got, w.cells[k])
			}
			start, end := utf8.RuneCountInString(w.label+rest[:loc[0]]), utf8.RuneCountInString(w.label+rest[:loc[1]])
			if gap := start - prevEnd; gap < 2 {
				t.Errorf("%s: cell %q is %d blanks from its left neighbour, want at least 2", w.label, w.cells[k], gap)
			} else if minGap == nil || len(minGap) <= k {
				minGap = append(minGap, gap)
			} else {
				minGap[k] = min(minGap[k], gap)
			}
			prevEnd = end
			if ends == nil || len(ends) <= k {
				ends = append(ends, end)
			} else if end != ends[k] {
				t.Errorf("%s: cell %q ends at column %d, the column's name at %d (not right-aligned)", w.label, w.cells[k], end, ends[k])
			}
		}
	}
	if len(ends) == 0 {
		t.Fatalf("no cells found:\n%s", out)
	}
	if ends[len(ends)-1] != width {
		t.Errorf("last column ends at %d of %d", ends[len(ends)-1], width)
	}
	// Every column is as wide as its widest entry: somewhere only the two-blank separator
	// precedes it.
	for k, g := range minGap {
		if g != 2 {
			t.Errorf("column %s: at least %d blanks before it in every line, want 2 somewhere", want[0].cells[k], g)
		}
	}
}

// TestWriteTableEmpty: no summaries give the line "no results".
func TestWriteTableEmpty(t *testing.T) {
	var b bytes.Buffer
	if err := WriteTable(&b, nil); err != nil || b.String() != "no results\n" {
		t.Errorf("got %q, %v", b.String(), err)
	}
}

// failWriter refuses every write.
type failWriter struct{}

var errRefused = errors.New("refused")

func (failWriter) Write([]byte) (int, error) { return 0, errRefused }

// TestReportWriterErrors: a writer's error is returned, not swallowed, by every report writer.
func TestReportWriterErrors(t *testing.T) {
	sums := reportSums()
	for name, err := range map[string]error{
		"table":       WriteTable(failWriter{}, sums),
		"empty table": WriteTable(failWriter{}, nil),
		"json":        WriteJSON(failWriter{}, sums),
		"markdown":    WriteMarkdown(failWriter{}, sums, "breast_cancer", "x"),
	} {
		if !errors.Is(err, errRefused) {
			t.Errorf("%s: got %v, want the writer's error", name, err)
		}
	}
}

// TestWriteJSONKeys pins WriteJSON's documented keys: one object per method and line holding
// exactly method, protocol, model, seeds, instances, updates and, for each metric, "<key>" the
// mean and "<key>_std" the standard deviation of that metric's Stat, null where undefined
// (NaN or infinite: wachter's IM1 here is summarize's figure for an AE_y that reconstructs x'
// exactly in one seed, mean +Inf and std NaN).
func TestWriteJSONKeys(t *testing.T) {
	sums := reportSums()
	sums[1].IM1 = Stat{Mean: math.Inf(1), Std: math.NaN(), N: 3}
	var b bytes.Buffer
	if err := WriteJSON(&b, sums); err != nil {
		t.Fatal(err)
	}
	stats := func(s MethodSummary) map[string]Stat {
		return map[string]Stat{"validity": s.Validity, "search_success": s.SearchSuccess, "im1": s.IM1,
			"implausibility": s.Implausibility, "robustness_ratio": s.RobustnessRatio,
			"robustness_ratio_same_seed": s.RobustnessRatioSameSeed, "in_set": s.InSet, "survival": s.Survival,
			"survival_bound": s.SurvivalBound, "bound_holds": s.BoundHolds, "seconds_per_ce": s.SecondsPerCE,
			"accuracy": s.Accuracy, "kl": s.KL}
	}
	number := func(v float64) any {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return nil
		}
		return v
	}
	sc := bufio.NewScanner(&b)
	i := 0
	for ; sc.Scan(); i++ {
		if i >= len(sums) {
			t.Fatalf("extra line %s", sc.Text())
		}
		s := sums[i]
		var obj map[string]any
		if err := json.Unmarshal(sc.Bytes(), &obj); err != nil {
			t.Fatal(err)
		}
		want := map[string]any{"method": s.Method, "protocol": s.Protocol, "model": s.Model,
			"seeds": float64(s.Seeds), "instances": float64(s.Instances), "updates": float64(s.Updates)}
		for k, st := range stats(s) {
			want[k], want[k+"_std"] = number(st.Mean), number(st.Std)
		}
		for k, v := range want {
			if got, ok := obj[k]; !ok || got != v {
				t.Errorf("%s: %q = %v (present %v), want %v", s.Method, k, got, ok, v)
			}
		}
		for k := range obj {
			if _, ok := want[k]; !ok {
				t.Errorf("%s: unexpected key %q", s.Method, k)
			}
		}
	}
	if i != len(sums) {
		t.Errorf("%d lines, want %d", i, len(sums))
	}
}
