package experiment

import (
	"bytes"
	"math"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

// AllHold is false as soon as one row's bound fails, stepwise or from the anchor.
func TestAllHold(t *testing.T) {
	for _, tc := range []struct {
		name string
		rows []Row
		want bool
	}{
		{"both hold", []Row{{Holds: true, AnchorHolds: true}, {Holds: true, AnchorHolds: true}}, true},
		{"a step fails", []Row{{Holds: true, AnchorHolds: true}, {Holds: false, AnchorHolds: true}}, false},
		{"from the anchor fails", []Row{{Holds: true, AnchorHolds: false}, {Holds: true, AnchorHolds: true}}, false},
	} {
		if got := (&IncrementsResult{Rows: tc.rows}).AllHold(); got != tc.want {
			t.Errorf("%s: AllHold %v, want %v", tc.name, got, tc.want)
		}
	}
}

// WriteMarkdown states the set-up and the command, and puts each row beside the paper's row of
// the same update, or dashes where the paper has none.
func TestWriteMarkdown(t *testing.T) {
	r := &IncrementsResult{
		Config:       IncrementsConfig{Seed: 7, LR: 1e-5, Steps: 300, Objective: "prior", UpdateData: Cumulative},
		TestAccuracy: 0.9561,
		CE:           CE{TestIndex: 3, From: 0, Target: 1, P: 0.95123},
		Rows: []Row{
			{Update: "96%->97%", P1: 0.95, P2: 0.96, KL: 0.000123, Bound: 0.9343, Holds: true, AnchorKL: 0.0002},
			{Update: "100%->101%", P1: 0.96, P2: 0.5, KL: 0.01, Bound: 0.8186, Holds: false, AnchorKL: 0.0125},
		},
	}
	var b bytes.Buffer
	if err := r.WriteMarkdown(&b, "cfguard-lab increments"); err != nil {
		t.Fatal(err)
	}
	// The paper's 96%->97% row: p1 0.9981, p2 0.9971, KL 0.000355, bound 0.9714.
	want := "Seed 7, lr 1e-05, 300 Adam iterations per update (prior objective, cumulative data); anchor test accuracy 95.61%; " +
		"the CE: test row 3, class 0 -> 1, p1 0.9512 under the anchor.\nProduced by `cfguard-lab increments`.\n\n" +
		"| update | p1 (ours) | p1 (paper) | p2 (ours) | p2 (paper) | KL (ours) | KL (paper) | bound (ours) | bound (paper) | holds (ours) | KL from the anchor (ours) |\n" +
		"|---|---|---|---|---|---|---|---|---|---|---|\n" +
		"| 96%->97% | 0.9500 | 0.9981 | 0.9600 | 0.9971 | 0.000123 | 0.000355 | 0.9343 | 0.9714 | yes | 0.0002 |\n" +
		"| 100%->101% | 0.9600 | — | 0.5000 | — | 0.01 | — | 0.8186 | — | no | 0.0125 |\n"
	if got := b.String(); got != want {
		t.Errorf("markdown:\n%s\nwant:\n%s", got, want)
	}
}

// HeldOut returns the mean log loss, the Brier score, the calibration error and the accuracy, in
// that order. Two records of class 0 with predictives (0.8, 0.2) and (0.3, 0.7): log loss
// (-ln 0.8 - ln 0.3)/2; Brier ((0.2² + 0.2²) + (0.7² + 0.7²))/2 = 0.53; top classes 0.8 (right)
// and 0.7 (wrong) in bins of their own, so ECE (|1 - 0.8| + |0 - 0.7|)/2 = 0.45; accuracy 1/2.
func TestHeldOut(t *testing.T) {
	p := &bnn.Predictive{N: 2, C: 2, S: 1, Mean: []float64{0.8, 0.2, 0.3, 0.7}, Var: make([]float64, 4)}
	nll, brier, ece, acc, err := HeldOut(p, []int{0, 0})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name      string
		got, want float64
	}{
		{"nll", nll, -(math.Log(0.8) + math.Log(0.3)) / 2},
		{"brier", brier, 0.53},
		{"ece", ece, 0.45},
		{"accuracy", acc, 0.5},
	} {
		if math.Abs(c.got-c.want) > 1e-12 {
			t.Errorf("%s %v, want %v", c.name, c.got, c.want)
		}
	}
	if _, _, _, _, err := HeldOut(p, []int{0, 2}); err == nil {
		t.Error("a label outside the classes: no error")
	}
}

// PlotIncrements refuses a learning rate without rows (nil or empty) rather than draw nothing
// for it.
func TestPlotIncrementsRejectsEmptyRuns(t *testing.T) {
	path := filepath.Join(t.TempDir(), "inc.svg")
	for name, res := range map[string]map[float64]*IncrementsResult{
		"nil result": {1e-5: nil},
		"no rows":    {1e-5: {}},
	} {
		if err := PlotIncrements(path, res); err == nil || !strings.Contains(err.Error(), "lr 1e-05 has no rows") {
			t.Errorf("%s: %v, want an error naming lr 1e-05", name, err)
		}
	}
}
