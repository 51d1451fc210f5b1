package bnn

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cfguard/cfguard/internal/atomicfile"
	"github.com/cfguard/cfguard/internal/safetensors"
)

// File names inside a model directory.
const (
	WeightsFile = "model.safetensors"
	SidecarFile = "model.json"
	// FormatVersion is the sidecar's schema version; Load refuses other versions.
	FormatVersion = 1
)

// Sidecar is the JSON description stored beside the weights: architecture, scaler, names, and
// the SHA-256 of the weights file, which ties the pair together.
type Sidecar struct {
	Format           string        `json:"format"`
	FormatVersion    int           `json:"format_version"`
	Layers           []LayerSchema `json:"layers"`
	Activation       string        `json:"activation"`
	Output           string        `json:"output"`
	PriorSigma       float64       `json:"prior_sigma"`
	Scaler           Scaler        `json:"scaler"`
	Features         []string      `json:"features,omitempty"`
	Classes          []string      `json:"classes"`
	PosteriorVersion uint64        `json:"posterior_version"`
	WeightsSHA256    string        `json:"weights_sha256"`
}

// LayerSchema names a layer and its shape; tensors are "<name>.weight_mu" and so on.
type LayerSchema struct {
	Name string `json:"name"`
	In   int    `json:"in"`
	Out  int    `json:"out"`
}

// ErrModelFile is wrapped by every Load error about the files' content.
var ErrModelFile = errors.New("bad model file")

// Save writes m to dir (created if needed) as model.safetensors and model.json, each atomically.
// The weights are written first and the sidecar, which carries their checksum, last: a crash in
// between leaves a pair that Load rejects as mismatched rather than a silently mixed model.
func Save(dir string, m *Model) error {
	sidecar, weights, err := Encode(m)
	if err != nil {
		return fmt.Errorf("save model: %w", err)
	}
	if err := atomicfile.WriteFiles(dir, atomicfile.File{Name: WeightsFile, Data: weights}, atomicfile.File{Name: SidecarFile, Data: sidecar}); err != nil {
		return fmt.Errorf("save model: %w", err)
	}
	return nil
}

// Encode serialises a valid model to the bytes of its two files: the JSON sidecar and the
// safetensors weights (F64, so that a round trip is bit-exact). Decode inverts it.
func Encode(m *Model) (sidecar, weights []byte, err error) {
	if err := m.Validate(); err != nil {
		return nil, nil, err
	}
	tensors := map[string]safetensors.Tensor{}
	sc := Sidecar{Format: "cfguard-bnn", FormatVersion: FormatVersion, Activation: "relu", Output: "log_softmax",
		PriorSigma: m.PriorSigma, Scaler: m.Scaler, Features: m.Features, Classes: m.Classes, PosteriorVersion: m.Version}
	for _, l := range m.Layers {
		sc.Layers = append(sc.Layers, LayerSchema{Name: l.Name, In: l.In, Out: l.Out})
		tensors[l.Name+".weight_mu"] = safetensors.Tensor{Shape: []int{l.Out, l.In}, Data: l.WeightMu}
		tensors[l.Name+".weight_log_sigma"] = safetensors.Tensor{Shape: []int{l.Out, l.In}, Data: l.WeightLogSigma}
		tensors[l.Name+".bias_mu"] = safetensors.Tensor{Shape: []int{l.Out}, Data: l.BiasMu}
		tensors[l.Name+".bias_log_sigma"] = safetensors.Tensor{Shape: []int{l.Out}, Data: l.BiasLogSigma}
	}
	weights, err = safetensors.Encode(tensors, map[string]string{"format": "cfguard-bnn"})
	if err != nil {
		return nil, nil, err
	}
	sum := sha256.Sum256(weights)
	sc.WeightsSHA256 = hex.EncodeToString(sum[:])
	js, err := json.MarshalIndent(sc, "", "  ")
	if err != nil {
		return nil, nil, err
	}
	return append(js, '\n'), weights, nil
}

// Load reads a model directory written by Save (or by a torchbnn export with the same key names
// and a sidecar). Truncated, mismatched or corrupt files are rejected with an error that names
// the file and what is wrong; the returned model always passes Validate.
func Load(dir string) (*Model, error) {
	js, err := os.ReadFile(filepath.Join(dir, SidecarFile))
	if err != nil {
		return nil, fmt.Errorf("load model: %w", err)
	}
	w, err := os.ReadFile(filepath.Join(dir, WeightsFile))
	if err != nil {
		return nil, fmt.Errorf("load model: %w", err)
	}
	return Decode(js, w)
}

// Decode builds a model from sidecar JSON and safetensors bytes; see Load.
func Decode(sidecarJSON, weights []byte) (*Model, error) {
	var sc Sidecar
	if err := json.Unmarshal(sidecarJSON, &sc); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrModelFile, SidecarFile, err)
	}
	if sc.Format != "cfguard-bnn" || sc.FormatVersion != FormatVersion {
		return nil, fmt.Errorf("%w: %s: format %q version %d, want cfguard-bnn version %d", ErrModelFile, SidecarFile, sc.Format, sc.FormatVersion, FormatVersion)
	}
	if sc.WeightsSHA256 != "" {
		sum := sha256.Sum256(weights)
		if got := hex.EncodeToString(sum[:]); got != sc.WeightsSHA256 {
			return nil, fmt.Errorf("%w: %s has sha256 %s but %s expects %s (truncated, or from another save)", ErrModelFile, WeightsFile, got[:12], SidecarFile, sc.WeightsSHA256[:min(12, len(sc.WeightsSHA256))])
		}
	}
	tensors, _, err := safetensors.Decode(weights)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrModelFile, WeightsFile, err)
	}
	if len(sc.Layers) == 0 {
		return nil, fmt.Errorf("%w: %s lists no layers", ErrModelFile, SidecarFile)
	}
	m := &Model{Scaler: sc.Scaler, Features: sc.Features, Classes: sc.Classes, PriorSigma: sc.PriorSigma, Version: sc.PosteriorVersion}
	want := 0
	for _, ls := range sc.Layers {
		l := Layer{Name: ls.Name, In: ls.In, Out: ls.Out}
		for _, p := range []struct {
			suffix string
			dst    *[]float64
			shape  []int
		}{{"weight_mu", &l.WeightMu, []int{ls.Out, ls.In}}, {"weight_log_sigma", &l.WeightLogSigma, []int{ls.Out, ls.In}},
			{"bias_mu", &l.BiasMu, []int{ls.Out}}, {"bias_log_sigma", &l.BiasLogSigma, []int{ls.Out}}} {
			key := ls.Name + "." + p.suffix
			t, ok := tensors[key]
			if !ok {
				return nil, fmt.Errorf("%w: %s has no tensor %q", ErrModelFile, WeightsFile, key)
			}
			if fmt.Sprint(t.Shape) != fmt.Sprint(p.shape) {
				return nil, fmt.Errorf("%w: tensor %q has shape %v, sidecar says %v", ErrModelFile, key, t.Shape, p.shape)
			}
			*p.dst = t.Data
			want++
		}
		m.Layers = append(m.Layers, l)
	}
	if len(tensors) != want {
		return nil, fmt.Errorf("%w: %s has %d tensors, sidecar describes %d", ErrModelFile, WeightsFile, len(tensors), want)
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrModelFile, err)
	}
	return m, nil
}
