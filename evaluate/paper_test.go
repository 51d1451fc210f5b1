package evaluate

import (
	"bytes"
	"math"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/explain"
)

// TestPaperConfig holds PaperConfig to the paper's supplementary hyper-parameter tables.
func TestPaperConfig(t *testing.T) {
	for _, tc := range []struct {
		method, dataset string
		check           func(c explain.Config) bool
	}{
		{"psce", "breast_cancer", func(c explain.Config) bool { return *c.Weights == explain.PaperWeights }},
		{"psce", "spambase", func(c explain.Config) bool {
			return c.Weights.Latent == 0.001 && c.Weights.ELBO == 0.002 && c.Weights.Class == 1
		}},
		{"psce", "mnist", func(c explain.Config) bool {
			return c.Weights.Latent == 1e-4 && c.Weights.Delta == 1 && c.Weights.Var == 0.1
		}},
		{"psce-paper", "mnist", func(c explain.Config) bool { return *c.Weights == explain.PaperWeights }},
		{"bayescf", "german_credit", func(c explain.Config) bool {
			return c.Weights.Prox == 0.001 && c.Weights.Pred == 1 && c.Weights.Class == 0
		}},
		{"bayescf", "digits", func(c explain.Config) bool { return c.Weights.Prox == 1e-7 }},
		{"schut", "mnist", func(c explain.Config) bool { return c.MoveSize == 0.2 && c.MaxChanges == 5 && c.Confidence == 0.95 }},
		{"schut", "spambase", func(c explain.Config) bool { return c.MoveSize == 0.1 && c.MaxChanges == 20 }},
		{"schut", "my.csv", func(c explain.Config) bool { return c.MaxChanges == 10 }},
		{"roar", "breast_cancer", func(c explain.Config) bool {
			return c.DeltaMax == 0.1 && c.Weights.Robust == 1 && c.Weights.ProxL1 == 0.1
		}},
	} {
		c, err := PaperConfig(tc.method, tc.dataset, explain.Config{})
		if err != nil {
			t.Fatal(err)
		}
		if c.MaxIter != 2000 || c.LR != 0.1 || c.Stop != explain.StopEstimate || !tc.check(c) {
			t.Errorf("%s on %s: %+v (weights %+v)", tc.method, tc.dataset, c, *c.Weights)
		}
	}
	if c, _ := PaperConfig("wachter", "spambase", explain.Config{MaxIter: 7}); c.MaxIter != 7 {
		t.Errorf("budget override: max_iter %d, want 7", c.MaxIter)
	}
}

// TestWriteMarkdown: the paper's figure for the same model, data set, method and metric sits
// beside ours; data sets and rows the paper lacks get "—"; MC Dropout has no Theorem 1 rows.
func TestWriteMarkdown(t *testing.T) {
	st := func(m float64) Stat { return Stat{Mean: m, Std: m / 10, N: 2} }
	sum := MethodSummary{Method: "psce", Seeds: 2, Instances: 25, Updates: 5, Protocol: ProtocolPaper, Model: ModelBNN,
		Validity: st(0.9), SearchSuccess: st(0.8), InSet: st(0.5), IM1: st(0.7), Implausibility: st(6), RobustnessRatio: st(0.1),
		Survival: st(1), SurvivalBound: st(0.9), SecondsPerCE: st(0.5), Accuracy: st(0.96), KL: st(0.004)}
	var b bytes.Buffer
	if err := WriteMarkdown(&b, []MethodSummary{sum}, "breast_cancer", "cfguard-lab psce --data breast_cancer"); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{"| Validity % (↑) | 90.0 ± 9.0 | 86.8 ± 3.2 |", "| IM1 (↓) | 0.7000 ± 0.0700 | 1.5540 ± 0.2427 |",
		"| Search success % (the method's own rule met) | 80.0 ± 8.0 | — |", "Theorem 1", "Produced by `cfguard-lab psce --data breast_cancer`"} {
		if !strings.Contains(out, want) {
			t.Errorf("lacks %q:\n%s", want, out)
		}
	}
	b.Reset()
	sum.Model, sum.KL = ModelDropout, Stat{Mean: math.NaN()}
	if err := WriteMarkdown(&b, []MethodSummary{sum}, "digits", "x"); err != nil {
		t.Fatal(err)
	}
	if out := b.String(); !strings.Contains(out, "| Validity % (↑) | 90.0 ± 9.0 | — |") || strings.Contains(out, "Theorem 1") || strings.Contains(out, "KL") {
		t.Errorf("digits, MC Dropout:\n%s", out)
	}
	if f, ok := paperLookup(ModelDropout, "mnist", "bayescf", "validity"); !ok || f != (paperFigure{47.8, 3.3}) {
		t.Errorf("paper's MC Dropout BayesCF validity on MNIST: %v %v", f, ok)
	}
	if n := len(paperFigures); n != 2*5*5*4 {
		t.Errorf("%d paper figures, want 2 models x 5 data sets x 5 methods x 4 metrics", n)
	}
}
