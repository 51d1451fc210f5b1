package bnn

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/internal/safetensors"
)

func TestSaveLoadRoundTripIsBitExact(t *testing.T) {
	m := smallModel(9)
	m.Features = []string{"a", "b", "c"}
	m.Version, m.Records = 12, 123.25
	m.Layers[2].WeightMu[0] = math.Nextafter(0.1, 1) // a value float32 could not hold
	m.Scaler.Mean[2], m.Scaler.Std[2] = math.Nextafter(0.5, 1), math.Nextafter(1, 2)
	dir := t.TempDir()
	if err := Save(dir, m); err != nil {
		t.Fatal(err)
	}
	got, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !SameBody(m, got) || !LayersEqual(m.Last(), got.Last()) || got.Version != 12 ||
		strings.Join(got.Classes, ",") != "no,yes,maybe" || strings.Join(got.Features, ",") != "a,b,c" ||
		!BitsEqual(got.Scaler.Mean, m.Scaler.Mean) || !BitsEqual(got.Scaler.Std, m.Scaler.Std) ||
		got.PriorSigma != m.PriorSigma || got.Records != 123.25 || got.Activation != m.Activation {
		t.Fatalf("round trip changed the model")
	}
	// The sidecar names the output as torchbnn's models give it: log-probabilities.
	var side struct {
		Output string `json:"output"`
	}
	if b, err := os.ReadFile(filepath.Join(dir, SidecarFile)); err != nil || json.Unmarshal(b, &side) != nil || side.Output != "log_softmax" {
		t.Errorf("the sidecar's output is %q (%v), want log_softmax", side.Output, err)
	}
	// No temporary files are left behind.
	ents, _ := os.ReadDir(dir)
	if len(ents) != 2 {
		t.Fatalf("directory holds %d entries, want 2", len(ents))
	}
}

func TestLoadRejectsBadFiles(t *testing.T) {
	m := smallModel(10)
	sidecar, weights, err := Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	flip := append([]byte(nil), weights...)
	flip[len(flip)-3] ^= 0x40
	other := smallModel(11)
	other.Layers[1].Out, other.Layers[2].In = 6, 6
	other.Layers[1].WeightMu = make([]float64, 6*5)
	other.Layers[1].WeightLogSigma = make([]float64, 6*5)
	other.Layers[1].BiasMu, other.Layers[1].BiasLogSigma = make([]float64, 6), make([]float64, 6)
	other.Layers[2].WeightMu, other.Layers[2].WeightLogSigma = make([]float64, 3*6), make([]float64, 3*6)
	otherSidecar, otherWeights, err := Encode(other)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name             string
		sidecar, weights []byte
		want             string
	}{
		{"truncated weights", sidecar, weights[:len(weights)/2], "sha256"},
		{"flipped byte", sidecar, flip, "sha256"},
		{"weights from another save", sidecar, otherWeights, "sha256"},
		{"sidecar from another save", otherSidecar, weights, "sha256"},
		{"truncated sidecar", sidecar[:len(sidecar)/2], weights, "model.json"},
		{"empty weights", sidecar, nil, "sha256"},
		{"wrong format", []byte(`{"format":"other","format_version":1}`), weights, "format"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode(tc.sidecar, tc.weights)
			if err == nil || !errors.Is(err, ErrModelFile) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrModelFile mentioning %q", err, tc.want)
			}
		})
	}
	// Without a checksum (a hand-written torch export) structural checks still apply.
	noSum := []byte(strings.Replace(string(sidecar), `"weights_sha256"`, `"ignored"`, 1))
	if _, err := Decode(noSum, weights[:len(weights)-8]); err == nil || !strings.Contains(err.Error(), "truncated") {
		t.Fatalf("truncated weights without checksum: %v", err)
	}
	// A NaN parameter inside a well-formed file is caught by validation.
	bad := smallModel(12)
	tensors := map[string]safetensors.Tensor{}
	for _, l := range bad.Layers {
		wm := append([]float64(nil), l.WeightMu...)
		if l.Name == "fc2" {
			wm[0] = math.NaN()
		}
		tensors[l.Name+".weight_mu"] = safetensors.Tensor{Shape: []int{l.Out, l.In}, Data: wm}
		tensors[l.Name+".weight_log_sigma"] = safetensors.Tensor{Shape: []int{l.Out, l.In}, Data: l.WeightLogSigma}
		tensors[l.Name+".bias_mu"] = safetensors.Tensor{Shape: []int{l.Out}, Data: l.BiasMu}
		tensors[l.Name+".bias_log_sigma"] = safetensors.Tensor{Shape: []int{l.Out}, Data: l.BiasLogSigma}
	}
	w, _ := safetensors.Encode(tensors, nil)
	if _, err := Decode(noSum, w); err == nil || !strings.Contains(err.Error(), "fc2.weight_mu") {
		t.Fatalf("NaN weight: %v", err)
	}
	// A tensor no layer takes (a file of another architecture, or a stray one) is refused by name.
	for _, l := range bad.Layers {
		tensors[l.Name+".weight_mu"] = safetensors.Tensor{Shape: []int{l.Out, l.In}, Data: l.WeightMu}
	}
	w, _ = safetensors.Encode(tensors, nil)
	if _, err := Decode(noSum, w); err != nil {
		t.Fatalf("the well-formed tensors do not decode: %v", err)
	}
	tensors["fc9.weight_mu"] = safetensors.Tensor{Shape: []int{1}, Data: []float64{0}}
	w, _ = safetensors.Encode(tensors, nil)
	if _, err := Decode(noSum, w); !errors.Is(err, ErrModelFile) || !strings.Contains(err.Error(), "fc9.weight_mu") {
		t.Fatalf("an extra tensor: %v, want ErrModelFile naming it", err)
	}
	// Missing files name the file.
	if _, err := Load(filepath.Join(t.TempDir(), "nope")); err == nil || !strings.Contains(err.Error(), "model.json") {
		t.Fatalf("missing dir: %v", err)
	}
}

func FuzzDecode(f *testing.F) {
	sidecar, weights, _ := Encode(smallModel(13))
	f.Add(weights)
	f.Add(weights[:40])
	f.Fuzz(func(t *testing.T, w []byte) {
		noSum := []byte(strings.Replace(string(sidecar), `"weights_sha256"`, `"ignored"`, 1))
		m, err := Decode(noSum, w)
		if err == nil {
			if verr := m.Validate(); verr != nil {
				t.Fatalf("Decode returned an invalid model: %v", verr)
			}
		}
	})
}

// TestSidecarActivationAndOutput: the sidecar's activation is honoured (a tanh model round-trips
// as tanh and predicts as before), its output must be a softmax, and anything else is refused by
// name, naming model.json and the field, never served as ReLU.
func TestSidecarActivationAndOutput(t *testing.T) {
	m := handModel(Tanh)
	sc, w, err := Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(sc), `"activation": "tanh"`) {
		t.Fatalf("sidecar does not record tanh:\n%s", sc)
	}
	got, err := Decode(sc, w)
	if err != nil {
		t.Fatal(err)
	}
	x := [][]float64{{0.3}}
	a, _ := m.Predict(x, 2, 1)
	b, _ := got.Predict(x, 2, 1)
	if got.Activation != Tanh || a.P(0, 1) != b.P(0, 1) {
		t.Fatalf("round trip: activation %v, p %v vs %v", got.Activation, b.P(0, 1), a.P(0, 1))
	}
	edit := func(field, value string) []byte {
		var js map[string]any
		if err := json.Unmarshal(sc, &js); err != nil {
			t.Fatal(err)
		}
		if value == "<absent>" {
			delete(js, field)
		} else {
			js[field] = value
		}
		out, _ := json.Marshal(js)
		return out
	}
	if got, err := Decode(edit("output", "softmax"), w); err != nil || got.Activation != Tanh {
		t.Fatalf(`output "softmax" is a softmax too: %v`, err)
	}
	for _, tc := range []struct {
		field, value string
		want         []string
	}{
		{"activation", "gelu", []string{"model.json", `"activation"`, `"gelu"`, "relu, tanh or sigmoid"}},
		{"activation", "ReLU", []string{"model.json", `"activation"`, `"ReLU"`}},
		{"activation", "<absent>", []string{"model.json", `no field "activation"`}},
		{"output", "sigmoid", []string{"model.json", `"output"`, `"sigmoid"`, "log_softmax or softmax"}},
		{"output", "<absent>", []string{"model.json", `"output"`}},
	} {
		_, err := Decode(edit(tc.field, tc.value), w)
		if !errors.Is(err, ErrModelFile) {
			t.Fatalf("%s = %s: got %v, want ErrModelFile", tc.field, tc.value, err)
		}
		for _, s := range tc.want {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("%s = %s: error %q does not mention %s", tc.field, tc.value, err, s)
			}
		}
	}
}

// WeightsSHA256 is the SHA-256 of the weights file Encode writes and the weights_sha256 its
// sidecar records, for every model Encode takes; one Encode refuses (an MC Dropout network, an
// invalid model) it refuses too. A change of any weight changes it.
func TestWeightsSHA256IsTheEncodedWeightsHash(t *testing.T) {
	for _, seed := range []uint64{1, 2, 9} {
		m := smallModel(seed)
		m.Version = seed
		sc, w, err := Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		var side struct {
			WeightsSHA256 string `json:"weights_sha256"`
		}
		if err := json.Unmarshal(sc, &side); err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(w)
		got, err := WeightsSHA256(m)
		if err != nil || got != hex.EncodeToString(sum[:]) || got != side.WeightsSHA256 {
			t.Fatalf("seed %d: WeightsSHA256 = %q, %v; want the weights' hash %x, as the sidecar says (%s)", seed, got, err, sum, side.WeightsSHA256)
		}
		m.Last().BiasLogSigma[0] = math.Nextafter(m.Last().BiasLogSigma[0], 0)
		if again, _ := WeightsSHA256(m); again == got {
			t.Errorf("seed %d: one weight changed by an ulp, the same hash", seed)
		}
	}
	m := smallModel(3)
	m.Dropout = 0.1
	_, _, encErr := Encode(m)
	if _, err := WeightsSHA256(m); err == nil || encErr == nil || !errors.Is(err, ErrInvalidModel) {
		t.Errorf("an MC Dropout network: WeightsSHA256 %v, Encode %v; want both refused", err, encErr)
	}
	m = smallModel(3)
	m.Layers[0].WeightMu = m.Layers[0].WeightMu[:1]
	if _, err := WeightsSHA256(m); err == nil {
		t.Error("an invalid model: WeightsSHA256 took it")
	}
}
