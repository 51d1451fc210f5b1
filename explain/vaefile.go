package explain

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/atomicfile"
	"github.com/cfguard/cfguard/internal/safetensors"
)

// File names of a saved VAE; they live beside the model's model.safetensors and model.json.
const (
	VAEWeightsFile = "vae.safetensors"
	VAESidecarFile = "vae.json"
	// VAEFormatVersion is the sidecar's schema version; LoadVAE refuses other versions.
	VAEFormatVersion = 1
)

// ErrVAEFile is wrapped by every LoadVAE / DecodeVAE error about the files' content.
var ErrVAEFile = errors.New("bad vae file")

// VAESidecar is the JSON stored beside the VAE's weights: architecture, likelihood variance, the
// scaler it was trained in, and the SHA-256 of the weights file, which ties the pair together.
type VAESidecar struct {
	Format        string     `json:"format"`
	FormatVersion int        `json:"format_version"`
	Inputs        int        `json:"inputs"`
	Hidden        int        `json:"hidden"`
	Latent        int        `json:"latent"`
	Activation    string     `json:"activation"`
	ObsVar        float64    `json:"obs_var"`
	Scaler        bnn.Scaler `json:"scaler"`
	WeightsSHA256 string     `json:"weights_sha256"`
}

// vaeLayers names the VAE's layers as they appear in the weights file ("<name>.weight" with shape
// (out, in) and "<name>.bias" with shape (out)), with their shapes.
func (v *VAE) layers() []struct {
	name string
	l    *dense
} {
	return []struct {
		name string
		l    *dense
	}{{"encoder.fc1", &v.enc}, {"encoder.mu", &v.mu}, {"encoder.logvar", &v.logvar},
		{"decoder.fc1", &v.dec}, {"decoder.out", &v.out}}
}

// EncodeVAE serialises v as (sidecar JSON, safetensors bytes).
func EncodeVAE(v *VAE) (sidecar, weights []byte, err error) {
	if err := v.validate(); err != nil {
		return nil, nil, fmt.Errorf("save vae: %w", err)
	}
	tensors := map[string]safetensors.Tensor{}
	for _, nl := range v.layers() {
		tensors[nl.name+".weight"] = safetensors.Tensor{Shape: []int{nl.l.Out, nl.l.In}, Data: nl.l.W}
		tensors[nl.name+".bias"] = safetensors.Tensor{Shape: []int{nl.l.Out}, Data: nl.l.B}
	}
	weights, err = safetensors.Encode(tensors, map[string]string{"format": "cfguard-vae"})
	if err != nil {
		return nil, nil, fmt.Errorf("save vae: %w", err)
	}
	sum := sha256.Sum256(weights)
	sc := VAESidecar{Format: "cfguard-vae", FormatVersion: VAEFormatVersion, Inputs: v.Inputs, Hidden: v.Hidden,
		Latent: v.Latent, Activation: "relu", ObsVar: v.ObsVar, Scaler: v.Scaler, WeightsSHA256: hex.EncodeToString(sum[:])}
	js, err := json.MarshalIndent(sc, "", "  ")
	if err != nil {
		return nil, nil, fmt.Errorf("save vae: %w", err)
	}
	return append(js, '\n'), weights, nil
}

// SaveVAE writes v to dir (created if needed) as vae.safetensors and vae.json, each atomically.
// The weights go first and the sidecar, which carries their checksum, last: a crash in between
// leaves a pair that LoadVAE rejects as mismatched rather than a silently mixed VAE.
func SaveVAE(dir string, v *VAE) error {
	js, w, err := EncodeVAE(v)
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFiles(dir, atomicfile.File{Name: VAEWeightsFile, Data: w}, atomicfile.File{Name: VAESidecarFile, Data: js}); err != nil {
		return fmt.Errorf("save vae: %w", err)
	}
	return nil
}

// LoadVAE reads a VAE written by SaveVAE. Truncated, mismatched or corrupt files are rejected with
// an error wrapping ErrVAEFile that names the file and what is wrong.
func LoadVAE(dir string) (*VAE, error) {
	js, err := os.ReadFile(filepath.Join(dir, VAESidecarFile))
	if err != nil {
		return nil, fmt.Errorf("load vae: %w", err)
	}
	w, err := os.ReadFile(filepath.Join(dir, VAEWeightsFile))
	if err != nil {
		return nil, fmt.Errorf("load vae: %w", err)
	}
	v, err := DecodeVAE(js, w)
	if err != nil {
		return nil, fmt.Errorf("load vae from %s: %w", dir, err)
	}
	return v, nil
}

// DecodeVAE builds a VAE from sidecar JSON and safetensors bytes; see LoadVAE.
func DecodeVAE(sidecarJSON, weights []byte) (*VAE, error) {
	var sc VAESidecar
	if err := json.Unmarshal(sidecarJSON, &sc); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrVAEFile, VAESidecarFile, err)
	}
	if sc.Format != "cfguard-vae" || sc.FormatVersion != VAEFormatVersion {
		return nil, fmt.Errorf("%w: %s: format %q version %d, want cfguard-vae version %d",
			ErrVAEFile, VAESidecarFile, sc.Format, sc.FormatVersion, VAEFormatVersion)
	}
	if sc.Activation != "relu" {
		return nil, fmt.Errorf("%w: %s: activation %q, want relu", ErrVAEFile, VAESidecarFile, sc.Activation)
	}
	sum := sha256.Sum256(weights)
	if got := hex.EncodeToString(sum[:]); got != sc.WeightsSHA256 {
		return nil, fmt.Errorf("%w: %s has sha256 %s but %s expects %q (truncated, corrupt, or from another save)",
			ErrVAEFile, VAEWeightsFile, got[:12], VAESidecarFile, sc.WeightsSHA256)
	}
	tensors, _, err := safetensors.Decode(weights)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrVAEFile, VAEWeightsFile, err)
	}
	if sc.Inputs < 1 || sc.Hidden < 1 || sc.Latent < 1 {
		return nil, fmt.Errorf("%w: %s: inputs %d hidden %d latent %d, want all >= 1", ErrVAEFile, VAESidecarFile, sc.Inputs, sc.Hidden, sc.Latent)
	}
	v := &VAE{Inputs: sc.Inputs, Hidden: sc.Hidden, Latent: sc.Latent, ObsVar: sc.ObsVar, Scaler: sc.Scaler}
	shapes := map[string][2]int{ // out, in
		"encoder.fc1": {sc.Hidden, sc.Inputs}, "encoder.mu": {sc.Latent, sc.Hidden}, "encoder.logvar": {sc.Latent, sc.Hidden},
		"decoder.fc1": {sc.Hidden, sc.Latent}, "decoder.out": {sc.Inputs, sc.Hidden},
	}
	want := 0
	for _, nl := range v.layers() {
		sh := shapes[nl.name]
		nl.l.Out, nl.l.In = sh[0], sh[1]
		for _, p := range []struct {
			key   string
			dst   *[]float64
			shape []int
		}{{nl.name + ".weight", &nl.l.W, []int{sh[0], sh[1]}}, {nl.name + ".bias", &nl.l.B, []int{sh[0]}}} {
			t, ok := tensors[p.key]
			if !ok {
				return nil, fmt.Errorf("%w: %s has no tensor %q", ErrVAEFile, VAEWeightsFile, p.key)
			}
			if fmt.Sprint(t.Shape) != fmt.Sprint(p.shape) {
				return nil, fmt.Errorf("%w: tensor %q has shape %v, sidecar implies %v", ErrVAEFile, p.key, t.Shape, p.shape)
			}
			*p.dst = t.Data
			want++
		}
	}
	if len(tensors) != want {
		var names []string
		for k := range tensors {
			names = append(names, k)
		}
		sort.Strings(names)
		return nil, fmt.Errorf("%w: %s has %d tensors %v, sidecar describes %d", ErrVAEFile, VAEWeightsFile, len(tensors), names, want)
	}
	if err := v.validate(); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrVAEFile, err)
	}
	return v, nil
}

// validate checks shapes, finiteness, the likelihood variance and the scaler.
func (v *VAE) validate() error {
	if v == nil {
		return errors.New("nil vae")
	}
	if !(v.ObsVar > 0) || !finite(v.ObsVar) {
		return fmt.Errorf("obs_var %v, want finite and > 0", v.ObsVar)
	}
	if len(v.Scaler.Mean) != v.Inputs || len(v.Scaler.Std) != v.Inputs {
		return fmt.Errorf("scaler has %d/%d entries, want %d", len(v.Scaler.Mean), len(v.Scaler.Std), v.Inputs)
	}
	for j := 0; j < v.Inputs; j++ {
		if !finite(v.Scaler.Mean[j]) || !(v.Scaler.Std[j] > 0) || !finite(v.Scaler.Std[j]) {
			return fmt.Errorf("scaler entry %d has mean %v std %v", j, v.Scaler.Mean[j], v.Scaler.Std[j])
		}
	}
	want := map[string][2]int{"encoder.fc1": {v.Hidden, v.Inputs}, "encoder.mu": {v.Latent, v.Hidden},
		"encoder.logvar": {v.Latent, v.Hidden}, "decoder.fc1": {v.Hidden, v.Latent}, "decoder.out": {v.Inputs, v.Hidden}}
	for _, nl := range v.layers() {
		sh := want[nl.name]
		if nl.l.Out != sh[0] || nl.l.In != sh[1] || len(nl.l.W) != sh[0]*sh[1] || len(nl.l.B) != sh[0] {
			return fmt.Errorf("layer %s is %dx%d with %d weights and %d biases, want %dx%d", nl.name, nl.l.Out, nl.l.In, len(nl.l.W), len(nl.l.B), sh[0], sh[1])
		}
		if err := nl.l.finite(); err != nil {
			return fmt.Errorf("layer %s: %v", nl.name, err)
		}
	}
	return nil
}
