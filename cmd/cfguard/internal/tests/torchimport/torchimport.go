// Package torchimport checks `cfguard import` against PyTorch: Check trains a torchbnn-style BNN
// in PyTorch with the example script, imports its state_dict with `cfguard import`, and checks
// that cfguard's posterior predictive agrees with torch's for the script's probe inputs (rows of both classes and points near the
// decision boundary): two independent Monte-Carlo means of the same quantity, so for every input
// and class
//
//	|p_cfguard - p_torch| <= 4 sqrt(Var_torch / S_torch + Var_cfguard / S_cfguard) + 1e-5,
//
// four standard errors of their difference plus a floor for float32 arithmetic. Importing the
// same weights without the scaler must break the agreement, or the check would have no power.
package torchimport

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// probe is what examples/export_torchbnn.py --probe writes: torch's Monte-Carlo predictive.
type probe struct {
	Inputs  [][]float64 `json:"inputs"`
	P       [][]float64 `json:"p"`
	Var     [][]float64 `json:"var"`
	Samples int         `json:"samples"`
}

// float32Floor covers torch's float32 arithmetic where the Monte-Carlo error vanishes (p at 0 or 1).
const float32Floor = 1e-5

// Check exports the bundled breast-cancer model from PyTorch with the example script in the given
// layout ("sequential" or "named") and dtype, torch's predictive estimated with samples draws,
// imports it, and fails the test unless cfguard's predictive agrees (and the same weights
// without the scaler do not).
func Check(t *testing.T, layout, dtype, samples string) {
	t.Helper()
	py := tooltest.PythonTorch(t)
	root := tooltest.RepoRoot(t)
	csv := filepath.Join(root, "assets", "data", "breast_cancer.csv")
	dir := t.TempDir()
	weights, probePath := filepath.Join(dir, "bc.safetensors"), filepath.Join(dir, "probe.json")
	cmd := tooltest.TorchCommand(py, filepath.Join(root, "examples", "export_torchbnn.py"), "--csv", csv, "--out", weights,
		"--layout", layout, "--dtype", dtype, "--probe", probePath, "--probe-samples", samples)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("export_torchbnn.py: %v\n%s", err, out)
	}
	t.Logf("export: %s", out)
	raw, err := os.ReadFile(probePath)
	if err != nil {
		t.Fatal(err)
	}
	var pr probe
	if err := json.Unmarshal(raw, &pr); err != nil {
		t.Fatal(err)
	}
	model := filepath.Join(dir, "model")
	if code, stdout, stderr := proc.RunCLI(t, "import", "--weights", weights, "--classes", "malignant,benign", "--scaler-from", csv, "--out", model); code != 0 {
		t.Fatalf("import exit %d: %s", code, stderr)
	} else {
		t.Logf("import: %s", stdout)
	}
	m, err := bnn.Load(model)
	if err != nil {
		t.Fatal(err)
	}
	const S = 20000
	maxZ, mid := agreement(t, m, pr, S, true)
	t.Logf("largest |difference| / (4 standard errors + floor): %.3f over %d inputs, %d with 0.05 < p < 0.95", maxZ, len(pr.Inputs), mid)
	if mid < 3 {
		t.Fatalf("only %d probe inputs have a predictive away from 0 and 1: the comparison has no power", mid)
	}

	// Without the scaler the network sees raw features: the agreement must break.
	bad := filepath.Join(dir, "raw")
	if code, _, stderr := proc.RunCLI(t, "import", "--weights", weights, "--classes", "malignant,benign", "--no-scaler", "--out", bad); code != 0 {
		t.Fatalf("import --no-scaler exit %d: %s", code, stderr)
	}
	mb, err := bnn.Load(bad)
	if err != nil {
		t.Fatal(err)
	}
	if z, _ := agreement(t, mb, pr, S, false); z <= 1 {
		t.Errorf("a model without the scaler agrees with torch (max ratio %.3f): the check cannot tell models apart", z)
	}
}

// agreement compares m's predictive (S draws) with torch's probe and returns the largest
// |difference| / tolerance and the number of inputs with 0.05 < p < 0.95. With check set, an
// input over tolerance fails the test.
func agreement(t *testing.T, m *bnn.Model, pr probe, S int, check bool) (maxRatio float64, mid int) {
	t.Helper()
	pg, err := m.Predict(pr.Inputs, S, 12345)
	if err != nil {
		t.Fatal(err)
	}
	for i := range pr.Inputs {
		if p := pr.P[i][1]; p > 0.05 && p < 0.95 {
			mid++
		}
		for c := range pr.P[i] {
			diff := math.Abs(pg.P(i, c) - pr.P[i][c])
			se := math.Sqrt(pr.Var[i][c]/float64(pr.Samples) + pg.V(i, c)/float64(S))
			tol := 4*se + float32Floor
			maxRatio = math.Max(maxRatio, diff/tol)
			if check {
				t.Logf("input %d class %d: cfguard %.5f torch %.5f |diff| %.2g tolerance %.2g", i, c, pg.P(i, c), pr.P[i][c], diff, tol)
				if diff > tol {
					t.Errorf("input %d class %d: cfguard p %.6f, torch p %.6f: |diff| %.3g > 4 se %.3g + %g", i, c, pg.P(i, c), pr.P[i][c], diff, 4*se, float32Floor)
				}
			}
		}
	}
	return maxRatio, mid
}
