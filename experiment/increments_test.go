package experiment

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

func breastCancer(t *testing.T) IncrementsConfig {
	t.Helper()
	set, d, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	return IncrementsConfig{Data: set, Classes: d.Classes, Seed: 1}
}

// TestSweepBreastCancer runs the paper's experiment on the bundled breast cancer data at the
// three learning rates and checks: Theorem 1 holds at every update (stepwise and from the
// anchor), the anchor is accurate, the CE is delta-safe under the anchor, each row's numbers
// are what certify computes from its p1 and KL, p1 of an update is p2 of the one before, and
// the KL grows with the learning rate at every update.
func TestSweepBreastCancer(t *testing.T) {
	cfg := breastCancer(t)
	var logs bytes.Buffer
	res, err := SweepLR(context.Background(), cfg, nil, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 3 {
		t.Fatalf("%d results, want 3", len(res))
	}
	for _, lr := range DefaultSweepLRs {
		r := res[lr]
		if r == nil {
			t.Fatalf("no result for lr %g", lr)
		}
		if r.TestAccuracy < 0.93 {
			t.Errorf("anchor test accuracy %.3f < 0.93", r.TestAccuracy)
		}
		if r.CE.P < 1-DefaultDelta {
			t.Errorf("CE p under the anchor %.4f < 1 - delta", r.CE.P)
		}
		if r.CE.Target == r.CE.From {
			t.Errorf("CE target %d equals the predicted class", r.CE.Target)
		}
		checkCEGeometry(t, cfg, r.CE)
		if len(r.Rows) != DefaultUpdates {
			t.Fatalf("lr %g: %d rows", lr, len(r.Rows))
		}
		for i, row := range r.Rows {
			t.Logf("lr %-6g %s p1 %.4f p2 %.4f KL %.6f bound %.4f holds %v | anchor KL %.6f bound %.4f | V1 %.2e V2 %.2e Vbound %.3f",
				lr, row.Update, row.P1, row.P2, row.KL, row.Bound, row.Holds, row.AnchorKL, row.AnchorBound, row.V1, row.V2, row.VarBound)
			if row.Update != PaperRows[i].Update {
				t.Errorf("update %d is %q, want %q (the paper's)", i+1, row.Update, PaperRows[i].Update)
			}
			if !row.Holds || !row.AnchorHolds || !row.VarHolds {
				t.Errorf("lr %g %s: bound failed: %+v", lr, row.Update, row)
			}
			if want := row.P1 - 2*math.Sqrt(row.KL/2); math.Abs(row.Bound-want) > 1e-12 {
				t.Errorf("bound %v, want %v", row.Bound, want)
			}
			if want := certify.ProbLower(row.AnchorP, row.AnchorKL, certify.Paper); row.AnchorBound != want {
				t.Errorf("anchor bound %v, want %v", row.AnchorBound, want)
			}
			if i > 0 && row.P1 != r.Rows[i-1].P2 {
				t.Errorf("%s: p1 %v is not the previous p2 %v", row.Update, row.P1, r.Rows[i-1].P2)
			}
			if i == 0 && (row.P1 != r.CE.P || row.AnchorKL != row.KL) {
				t.Errorf("first update: p1 %v (anchor p %v), anchor KL %v vs KL %v", row.P1, r.CE.P, row.AnchorKL, row.KL)
			}
			if !(row.KL > 0) || row.Version != uint64(i+1) || (i > 0 && row.UpdateRows <= r.Rows[i-1].UpdateRows) {
				t.Errorf("%s: KL %v, version %d, %d rows (cumulative data must grow)", row.Update, row.KL, row.Version, row.UpdateRows)
			}
		}
		if !r.AllHold() {
			t.Errorf("lr %g: AllHold false", lr)
		}
	}
	for i := range DefaultUpdates {
		a, b, c := res[1e-5].Rows[i].KL, res[1e-4].Rows[i].KL, res[1e-3].Rows[i].KL
		if !(a < b && b < c) {
			t.Errorf("update %d: KL does not grow with lr: %g, %g, %g", i+1, a, b, c)
		}
	}
	// The paper's regime: at lr 1e-5 every step's KL is far inside the delta budget.
	for _, row := range res[1e-5].Rows {
		if row.KL > certify.KLBudget(DefaultDelta) {
			t.Errorf("lr 1e-5 %s: KL %v over the budget", row.Update, row.KL)
		}
	}
	if !strings.Contains(logs.String(), "msg=update") || !strings.Contains(logs.String(), "msg=\"anchor trained\"") {
		t.Errorf("logs lack the expected events:\n%s", logs.String())
	}

	// JSON rows carry the paper's column names.
	var buf bytes.Buffer
	if err := res[1e-5].WriteJSONRows(&buf); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(&buf)
	n := 0
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		for _, k := range []string{"update", "p1", "p2", "kl", "bound", "holds"} {
			if _, ok := m[k]; !ok {
				t.Errorf("JSON row lacks %q: %s", k, sc.Text())
			}
		}
		n++
	}
	if n != DefaultUpdates {
		t.Errorf("%d JSON rows", n)
	}

	// The plot renders to every supported format, atomically.
	dir := t.TempDir()
	if d := os.Getenv("CFGUARD_PLOT_DIR"); d != "" {
		dir = d // keep the figures for a look
	}
	for _, name := range []string{"inc.svg", "inc.png"} {
		path := filepath.Join(dir, name)
		if err := PlotIncrements(path, res); err != nil {
			t.Fatal(err)
		}
		if fi, err := os.Stat(path); err != nil || fi.Size() < 1000 {
			t.Errorf("%s: %v, %v", name, fi, err)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "inc.svg")); !bytes.Contains(b, []byte("<svg")) {
		t.Error("svg output is not SVG")
	}
	if err := PlotIncrements(filepath.Join(dir, "inc.gif"), res); err == nil {
		t.Error("unknown format accepted")
	}
	if err := PlotIncrements(filepath.Join(dir, "x.svg"), nil); err == nil {
		t.Error("empty results accepted")
	}
}

// checkCEGeometry checks that ce lies where the straight-line search puts it: x is its test row
// of the seeded split, and x' = x + alpha (n - x) for alpha one of the steps j/CESearchSteps,
// j = 1..CESearchSteps, with n the training row Nearest, labelled Target.
func checkCEGeometry(t *testing.T, cfg IncrementsConfig, ce CE) {
	t.Helper()
	train, test := cfg.Data.Split(TrainFrac, cfg.Seed)
	if !slices.Equal(ce.X, test.X[ce.TestIndex]) || train.Y[ce.Nearest] != ce.Target {
		t.Errorf("CE: x is not test row %d, or training row %d is not labelled %d", ce.TestIndex, ce.Nearest, ce.Target)
	}
	j := math.Round(ce.Alpha * CESearchSteps)
	if j < 1 || j > CESearchSteps || math.Abs(ce.Alpha-j/CESearchSteps) > 1e-12 {
		t.Errorf("CE alpha %v is not a step j/%d, j = 1..%d", ce.Alpha, CESearchSteps, CESearchSteps)
	}
	n := train.X[ce.Nearest]
	for k := range ce.X {
		if want := ce.X[k] + ce.Alpha*(n[k]-ce.X[k]); math.Abs(ce.XCF[k]-want) > 1e-9*math.Max(1, math.Abs(want)) {
			t.Fatalf("CE feature %d: x' %v, want x + alpha (n - x) = %v", k, ce.XCF[k], want)
		}
	}
}

// TestIncrementsDeterministic checks that a run is a function of its seed, with the vcl
// objective (new rows only) to exercise that path too.
func TestIncrementsDeterministic(t *testing.T) {
	if testing.Short() {
		t.Skip("trains twice")
	}
	cfg := breastCancer(t)
	cfg.Objective, cfg.Updates, cfg.Samples = "vcl", 2, 500
	cfg.Train = bnn.TrainConfig{Epochs: 10}
	a, err := Increments(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Increments(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range a.Rows {
		a.Rows[i].LossStart, b.Rows[i].LossStart = 0, 0
		if a.Rows[i] != b.Rows[i] {
			t.Errorf("row %d differs: %+v vs %+v", i, a.Rows[i], b.Rows[i])
		}
	}
	if a.Config.UpdateData != NewOnly || a.Rows[0].UpdateRows > 10 {
		t.Errorf("vcl should train on the new rows only: %s, %d rows", a.Config.UpdateData, a.Rows[0].UpdateRows)
	}
}

func TestIncrementsRejects(t *testing.T) {
	good := breastCancer(t)
	for _, tc := range []struct {
		name string
		mod  func(*IncrementsConfig)
		want string
	}{
		{"no data", func(c *IncrementsConfig) { c.Data = nil }, "no data"},
		{"class names", func(c *IncrementsConfig) { c.Classes = c.Classes[:1] }, "class names"},
		{"delta", func(c *IncrementsConfig) { c.Delta = 0.7 }, "delta"},
		{"updates", func(c *IncrementsConfig) { c.Updates = 6 }, "updates 6"},
		{"objective", func(c *IncrementsConfig) { c.Objective = "sgd" }, "objective"},
		{"update data", func(c *IncrementsConfig) { c.UpdateData = "all" }, "update data"},
		{"samples", func(c *IncrementsConfig) { c.Samples = 1 }, "samples"},
		{"lr", func(c *IncrementsConfig) { c.LR = -1 }, "lr"},
	} {
		cfg := good
		tc.mod(&cfg)
		if _, err := Increments(context.Background(), cfg, nil); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v, want one mentioning %q", tc.name, err, tc.want)
		}
	}
	// 100 rows: a training split of 80, whose first 95..98% are 76, 77, 78 and 78 rows
	// (round(0.95 80) ...), so the last of three updates, 97%->98%, would have no new row.
	// Refused before any training.
	small := good
	small.Data, small.Updates = good.Data.Subset(seq(100)), 3
	if _, err := Increments(context.Background(), small, nil); err == nil || !strings.Contains(err.Error(), "80 training rows give an empty 1% increment at 97%") {
		t.Errorf("100 rows: %v, want an empty increment at 97%%", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Increments(ctx, good, nil); err == nil || !strings.Contains(err.Error(), "canceled") {
		t.Errorf("cancelled: %v", err)
	}
}
