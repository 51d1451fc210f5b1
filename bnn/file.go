package bnn

import (
	"errors"
	"fmt"
	"slices"

	"github.com/cfguard/cfguard/internal/safetensors"
	"github.com/cfguard/cfguard/internal/sidecar"
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
	Format        string        `json:"format"`
	FormatVersion int           `json:"format_version"`
	Layers        []LayerSchema `json:"layers"`
	// Activation follows every layer but the last: relu, tanh or sigmoid (Model.Activation).
	// Required; Decode refuses anything else by name.
	Activation string `json:"activation"`
	// Output is what follows the last layer: log_softmax (what Save writes) or softmax, which
	// give the same class probabilities. Decode refuses anything else by name.
	Output           string   `json:"output"`
	PriorSigma       float64  `json:"prior_sigma"`
	Scaler           Scaler   `json:"scaler"`
	Features         []string `json:"features,omitempty"`
	Classes          []string `json:"classes"`
	PosteriorVersion uint64   `json:"posterior_version"`
	// Records is Model.Records, omitted when unknown (0).
	Records       float64 `json:"records,omitempty"`
	WeightsSHA256 string  `json:"weights_sha256"`
}

// LayerSchema names a layer and its shape; tensors are "<name>.weight_mu" and so on.
type LayerSchema struct {
	Name string `json:"name"`
	In   int    `json:"in"`
	Out  int    `json:"out"`
}

// ErrModelFile is wrapped by every Load error about the files' content.
var ErrModelFile = errors.New("bad model file")

// modelFiles is the two-file format of a model (see internal/sidecar). The checksum is optional
// so that a hand-written torchbnn export loads; structural checks apply either way.
var modelFiles = sidecar.Kind{Format: "cfguard-bnn", Version: FormatVersion, Sidecar: SidecarFile, Weights: WeightsFile,
	ChecksumOptional: true, Err: ErrModelFile}

// Save writes m to dir (created if needed) as model.safetensors and model.json, each atomically.
// The weights are written first and the sidecar, which carries their checksum, last: a crash in
// between leaves a pair that Load rejects as mismatched rather than a silently mixed model.
func Save(dir string, m *Model) error {
	sc, weights, err := Encode(m)
	if err != nil {
		return fmt.Errorf("save model: %w", err)
	}
	if err := modelFiles.Save(dir, sc, weights); err != nil {
		return fmt.Errorf("save model: %w", err)
	}
	return nil
}

// Encode serialises a valid model to the bytes of its two files: the JSON sidecar and the
// safetensors weights (F64, so that a round trip is bit-exact). Decode inverts it.
func Encode(m *Model) (sidecarJSON, weights []byte, err error) {
	tensors, err := fileTensors(m)
	if err != nil {
		return nil, nil, err
	}
	sc := Sidecar{Format: modelFiles.Format, FormatVersion: FormatVersion, Activation: m.Activation.String(), Output: "log_softmax",
		PriorSigma: m.PriorSigma, Scaler: m.Scaler, Features: m.Features, Classes: m.Classes, PosteriorVersion: m.Version,
		Records: m.Records}
	for _, l := range m.Layers {
		sc.Layers = append(sc.Layers, LayerSchema{Name: l.Name, In: l.In, Out: l.Out})
	}
	if weights, sc.WeightsSHA256, err = modelFiles.EncodeWeights(tensors); err != nil {
		return nil, nil, err
	}
	if sidecarJSON, err = modelFiles.MarshalSidecar(sc, sc.WeightsSHA256); err != nil {
		return nil, nil, err
	}
	return sidecarJSON, weights, nil
}

// WeightsSHA256 is the hex SHA-256 of the weights file Encode writes for m (its sidecar's
// weights_sha256), without encoding the sidecar: a posterior's hash, computed for every entry a
// replica plays from its log.
func WeightsSHA256(m *Model) (string, error) {
	tensors, err := fileTensors(m)
	if err != nil {
		return "", err
	}
	_, sum, err := modelFiles.EncodeWeights(tensors)
	return sum, err
}

// fileTensors is a valid model's tensors as its weights file names them (checkFile, tensorsOf).
func fileTensors(m *Model) (map[string]safetensors.Tensor, error) {
	if err := checkFile(m); err != nil {
		return nil, err
	}
	return tensorsOf(m), nil
}

// tensorsOf is m's tensors as its weights file names them (torchbnn's keys), m not checked.
func tensorsOf(m *Model) map[string]safetensors.Tensor {
	tensors := map[string]safetensors.Tensor{}
	for _, l := range m.Layers {
		tensors[l.Name+".weight_mu"] = safetensors.Tensor{Shape: []int{l.Out, l.In}, Data: l.WeightMu}
		tensors[l.Name+".weight_log_sigma"] = safetensors.Tensor{Shape: []int{l.Out, l.In}, Data: l.WeightLogSigma}
		tensors[l.Name+".bias_mu"] = safetensors.Tensor{Shape: []int{l.Out}, Data: l.BiasMu}
		tensors[l.Name+".bias_log_sigma"] = safetensors.Tensor{Shape: []int{l.Out}, Data: l.BiasLogSigma}
	}
	return tensors
}

// checkFile refuses a model that has no model files: an invalid one, or an MC Dropout network.
func checkFile(m *Model) error {
	if err := m.Validate(); err != nil {
		return err
	}
	if m.Dropout > 0 {
		return fmt.Errorf("%w: an MC Dropout network (dropout %v) has no posterior to save; model files hold BNNs only", ErrInvalidModel, m.Dropout)
	}
	return nil
}

// Load reads a model directory written by Save (or by a torchbnn export with the same key names
// and a sidecar). Truncated, mismatched or corrupt files are rejected with an error that names
// the directory, the file and what is wrong; the returned model always passes Validate.
func Load(dir string) (*Model, error) {
	js, w, err := modelFiles.Read(dir)
	if err == nil {
		var m *Model
		if m, err = Decode(js, w); err == nil {
			return m, nil
		}
	}
	return nil, fmt.Errorf("load model %s: %w", dir, err)
}

// Decode builds a model from sidecar JSON and safetensors bytes; see Load.
func Decode(sidecarJSON, weights []byte) (*Model, error) {
	var sc Sidecar
	tensors, err := modelFiles.Decode(sidecarJSON, weights, &sc)
	if err != nil {
		return nil, err
	}
	if len(sc.Layers) == 0 {
		return nil, fmt.Errorf("%w: %s lists no layers", ErrModelFile, SidecarFile)
	}
	act, err := sidecarActivation(sc)
	if err != nil {
		return nil, err
	}
	m := &Model{Activation: act, Scaler: sc.Scaler, Features: sc.Features, Classes: sc.Classes, PriorSigma: sc.PriorSigma, Version: sc.PosteriorVersion,
		Records: sc.Records}
	for _, ls := range sc.Layers {
		l := Layer{Name: ls.Name, In: ls.In, Out: ls.Out}
		for _, p := range []struct {
			suffix string
			dst    *[]float64
			shape  []int
		}{{"weight_mu", &l.WeightMu, []int{ls.Out, ls.In}}, {"weight_log_sigma", &l.WeightLogSigma, []int{ls.Out, ls.In}},
			{"bias_mu", &l.BiasMu, []int{ls.Out}}, {"bias_log_sigma", &l.BiasLogSigma, []int{ls.Out}}} {
			if *p.dst, err = modelFiles.Take(tensors, ls.Name+"."+p.suffix, p.shape...); err != nil {
				return nil, err
			}
		}
		m.Layers = append(m.Layers, l)
	}
	if err := modelFiles.NoneLeft(tensors); err != nil {
		return nil, err
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrModelFile, err)
	}
	return m, nil
}

// Outputs accepted in the sidecar's "output" field: both name a softmax over the last layer's
// logits (torchbnn models end in log_softmax; the probabilities are the same).
var sidecarOutputs = []string{"log_softmax", "softmax"}

// sidecarActivation checks the sidecar's "activation" and "output" fields and returns the
// activation. Anything cfguard cannot evaluate is refused by name, never served as something else.
func sidecarActivation(sc Sidecar) (Activation, error) {
	if sc.Activation == "" {
		return 0, fmt.Errorf("%w: %s has no field \"activation\" (want relu, tanh or sigmoid)", ErrModelFile, SidecarFile)
	}
	act, err := ParseActivation(sc.Activation)
	if err != nil {
		return 0, fmt.Errorf("%w: %s: field \"activation\": %v", ErrModelFile, SidecarFile, err)
	}
	if !slices.Contains(sidecarOutputs, sc.Output) {
		return 0, fmt.Errorf("%w: %s: field \"output\" is %q; cfguard evaluates a softmax output only (want log_softmax or softmax)",
			ErrModelFile, SidecarFile, sc.Output)
	}
	return act, nil
}
