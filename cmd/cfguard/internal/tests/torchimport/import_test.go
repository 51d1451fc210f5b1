package torchimport

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/safetensors"
)

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
	csv3 := filepath.Join(dir, "d3.csv")
	os.WriteFile(csv3, []byte("a,b,c,label\n1,2,3,0\n3,2,5,2\n2,8,4,1\n"), 0o644)
	// A directory holding a model's weights without its sidecar is a model directory too.
	weightsOnly := filepath.Join(dir, "weights-only")
	os.MkdirAll(weightsOnly, 0o755)
	os.WriteFile(filepath.Join(weightsOnly, bnn.WeightsFile), weights, 0o644)
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
		{"weights exist", []string{"--weights", w, "--classes", "no,yes", "--no-scaler", "--out", weightsOnly}, 2, "already holds model.safetensors"},
		// Class names are trimmed; without --prior-sigma the prior is bnn.DefaultPriorSigma.
		{"raw", []string{"--weights", w, "--classes", " no , yes ", "--no-scaler", "--out", out("raw")}, 0, `"prior_sigma":0.1,"scaler":"identity"`},
		{"no scaler choice", []string{"--weights", w, "--classes", "no,yes", "--out", out("x")}, 2, "exactly one of --scaler-from"},
		{"both scaler choices", []string{"--weights", w, "--classes", "no,yes", "--no-scaler", "--scaler-from", csv, "--out", out("x")}, 2, "exactly one of --scaler-from"},
		{"missing classes", []string{"--weights", w, "--no-scaler", "--out", out("x")}, 2, "--classes is required"},
		{"classes", []string{"--weights", w, "--classes", "a,b,c", "--no-scaler", "--out", out("x")}, 2, "--classes: torchbnn: 3 class names"},
		{"activation", []string{"--weights", w, "--classes", "no,yes", "--no-scaler", "--activation", "gelu", "--out", out("x")}, 2, `--activation: torchbnn: unknown activation "gelu"`},
		{"prior sigma", []string{"--weights", w, "--classes", "no,yes", "--no-scaler", "--prior-sigma", "0", "--out", out("x")}, 2, "--prior-sigma must be a finite number > 0"},
		{"infinite prior sigma", []string{"--weights", w, "--classes", "no,yes", "--no-scaler", "--prior-sigma", "+Inf", "--out", out("x")}, 2, "--prior-sigma must be a finite number > 0"},
		{"scaler labels", []string{"--weights", w, "--classes", "no,yes", "--scaler-from", csv3, "--out", out("y")}, 2, "--scaler-from " + csv3 + " has labels 0..2 but --classes names 2"},
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
	if b, err := os.ReadFile(filepath.Join(weightsOnly, bnn.WeightsFile)); err != nil || !bytes.Equal(b, weights) {
		t.Errorf("an import into a directory holding model.safetensors changed it: %v", err)
	}
	if _, err := os.Stat(filepath.Join(weightsOnly, bnn.SidecarFile)); !os.IsNotExist(err) {
		t.Errorf("a refused import wrote %s: %v", bnn.SidecarFile, err)
	}
	raw, err := bnn.Load(out("raw"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(raw.Classes, ",") != "no,yes" || raw.PriorSigma != bnn.DefaultPriorSigma {
		t.Errorf("classes %q, prior sigma %v; want no,yes and %v", raw.Classes, raw.PriorSigma, bnn.DefaultPriorSigma)
	}
	got, err := bnn.Load(out("ok"))
	if err != nil {
		t.Fatal(err)
	}
	if got.Activation != bnn.ReLU {
		t.Errorf("activation %v, want relu when --activation is not given", got.Activation)
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
