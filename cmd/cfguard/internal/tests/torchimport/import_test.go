package torchimport

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/safetensors"
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

// TestImportTorchExportAgrees trains a torchbnn-style BNN in PyTorch with the example script,
// imports its state_dict with `cfguard import`, and checks that cfguard's posterior predictive
// agrees with torch's for the script's probe inputs (rows of both classes and points near the
// decision boundary): two independent Monte-Carlo means of the same quantity, so for every input
// and class
//
//	|p_cfguard - p_torch| <= 4 sqrt(Var_torch / S_torch + Var_cfguard / S_cfguard) + 1e-5,
//
// four standard errors of their difference plus a floor for float32 arithmetic. Importing the
// same weights without the scaler must break the agreement, or the check would have no power.
func TestImportTorchExportAgrees(t *testing.T) {
	py := tooltest.PythonTorch(t)
	csv, err := filepath.Abs("../../../../../assets/data/breast_cancer.csv")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ layout, dtype, samples string }{
		{"sequential", "float32", "20000"},
		{"named", "float64", "5000"},
	} {
		t.Run(tc.layout+"_"+tc.dtype, func(t *testing.T) {
			dir := t.TempDir()
			weights, probePath := filepath.Join(dir, "bc.safetensors"), filepath.Join(dir, "probe.json")
			cmd := tooltest.TorchCommand(py, "../../../../../examples/export_torchbnn.py", "--csv", csv, "--out", weights,
				"--layout", tc.layout, "--dtype", tc.dtype, "--probe", probePath, "--probe-samples", tc.samples)
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
		})
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

// TestImportFlags checks the command's contract on a state_dict written by bnn.Encode (F64,
// named layers fc1..fc3, exactly torchbnn's tensor names).
func TestImportFlags(t *testing.T) {
	dir := t.TempDir()
	m := bnn.New(3, []int{4, 4}, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	_, weights, err := bnn.Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	w := filepath.Join(dir, "w.safetensors")
	os.WriteFile(w, weights, 0o644)
	csv := filepath.Join(dir, "d.csv")
	os.WriteFile(csv, []byte("a,b,c,label\n1,2,3,0\n3,2,5,1\n2,8,4,1\n"), 0o644)
	csv2 := filepath.Join(dir, "d2.csv")
	os.WriteFile(csv2, []byte("a,b,label\n1,2,0\n3,2,1\n"), 0o644)
	bad := filepath.Join(dir, "bad.safetensors")
	os.WriteFile(bad, weights[:len(weights)/2], 0o644)
	// One log sigma of 500: sigma^2 overflows, so every later update would fail.
	tensors, _, err := safetensors.Decode(weights)
	if err != nil {
		t.Fatal(err)
	}
	tensors["fc3.weight_log_sigma"].Data[0] = 500
	wide, err := safetensors.Encode(tensors, nil)
	if err != nil {
		t.Fatal(err)
	}
	huge := filepath.Join(dir, "huge.safetensors")
	os.WriteFile(huge, wide, 0o644)

	out := func(name string) string { return filepath.Join(dir, name) }
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		// 3 -> 4 -> 4 -> 2 chains one way only: fc2 is the only 4 -> 4 layer.
		{"ok", []string{"--weights", w, "--classes", "no,yes", "--scaler-from", csv, "--out", out("ok")}, 0,
			`"layers":[{"name":"fc1","in":3,"out":4},{"name":"fc2","in":4,"out":4},{"name":"fc3","in":4,"out":2}]`},
		{"exists", []string{"--weights", w, "--classes", "no,yes", "--no-scaler", "--out", out("ok")}, 2, "already holds model.json"},
		{"no scaler choice", []string{"--weights", w, "--classes", "no,yes", "--out", out("x")}, 2, "exactly one of --scaler-from"},
		{"both scaler choices", []string{"--weights", w, "--classes", "no,yes", "--no-scaler", "--scaler-from", csv, "--out", out("x")}, 2, "exactly one of --scaler-from"},
		{"missing classes", []string{"--weights", w, "--no-scaler", "--out", out("x")}, 2, "--classes is required"},
		{"classes", []string{"--weights", w, "--classes", "a,b,c", "--no-scaler", "--out", out("x")}, 2, "--classes: torchbnn: 3 class names"},
		{"activation", []string{"--weights", w, "--classes", "no,yes", "--no-scaler", "--activation", "gelu", "--out", out("x")}, 2, `--activation: torchbnn: unknown activation "gelu"`},
		{"prior sigma", []string{"--weights", w, "--classes", "no,yes", "--no-scaler", "--prior-sigma", "0", "--out", out("x")}, 2, "--prior-sigma must be a finite number > 0"},
		{"scaler dimension", []string{"--weights", w, "--classes", "no,yes", "--scaler-from", csv2, "--out", out("y")}, 2, "--scaler-from: torchbnn: the scaler has 2 features"},
		{"scaler csv", []string{"--weights", w, "--classes", "no,yes", "--scaler-from", filepath.Join(dir, "nope.csv"), "--out", out("y")}, 1, "--scaler-from: open"},
		{"layers", []string{"--weights", w, "--classes", "no,yes", "--no-scaler", "--layers", "fc1,fc3", "--out", out("y")}, 2, "--layers: torchbnn: layer order"},
		{"truncated", []string{"--weights", bad, "--classes", "no,yes", "--no-scaler", "--out", out("y")}, 1, "--weights " + bad + ": torchbnn state_dict: corrupt safetensors data"},
		{"huge log sigma", []string{"--weights", huge, "--classes", "no,yes", "--no-scaler", "--out", out("y")}, 1,
			"--weights " + huge + ": torchbnn state_dict: invalid model: fc3.weight_log_sigma[0] = 500, want |log sigma| <= 100"},
		{"missing weights", []string{"--weights", out("none"), "--classes", "no,yes", "--no-scaler", "--out", out("y")}, 1, "--weights: open"},
	} {
		code, stdout, stderr := proc.RunCLI(t, append([]string{"import"}, tc.args...)...)
		if code != tc.code || !strings.Contains(stdout+stderr, tc.want) {
			t.Errorf("%s: exit %d (want %d), output %s%s, want %q", tc.name, code, tc.code, stdout, stderr, tc.want)
		}
	}
	if _, err := os.Stat(out("y")); !os.IsNotExist(err) {
		t.Errorf("a refused import left %s behind: %v", out("y"), err)
	}
	got, err := bnn.Load(out("ok"))
	if err != nil {
		t.Fatal(err)
	}
	for k := range m.Layers {
		if !bnn.LayersEqual(&m.Layers[k], &got.Layers[k]) {
			t.Errorf("layer %d differs after import", k)
		}
	}
	if want := bnn.FitScaler([][]float64{{1, 2, 3}, {3, 2, 5}, {2, 8, 4}}); strings.Join(got.Features, ",") != "a,b,c" ||
		got.Scaler.Mean[2] != want.Mean[2] || got.Scaler.Std[0] != want.Std[0] {
		t.Errorf("features %v scaler %v, want a,b,c and %v", got.Features, got.Scaler, want)
	}
}
