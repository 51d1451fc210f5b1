package explain

import (
	"errors"
	"fmt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/safetensors"
	"github.com/cfguard/cfguard/internal/sidecar"
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

// vaeFiles is the two-file format of a VAE (see internal/sidecar); the checksum is required.
var vaeFiles = sidecar.Kind{Format: "cfguard-vae", Version: VAEFormatVersion, Sidecar: VAESidecarFile, Weights: VAEWeightsFile, Err: ErrVAEFile}

// layers names the VAE's layers as they appear in the weights file ("<name>.weight" with shape
// (out, in) and "<name>.bias" with shape (out)).
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
func EncodeVAE(v *VAE) (sidecarJSON, weights []byte, err error) {
	if err := v.validate(); err != nil {
		return nil, nil, fmt.Errorf("save vae: %w", err)
	}
	tensors := map[string]safetensors.Tensor{}
	for _, nl := range v.layers() {
		tensors[nl.name+".weight"] = safetensors.Tensor{Shape: []int{nl.l.Out, nl.l.In}, Data: nl.l.W}
		tensors[nl.name+".bias"] = safetensors.Tensor{Shape: []int{nl.l.Out}, Data: nl.l.B}
	}
	sc := VAESidecar{Format: vaeFiles.Format, FormatVersion: VAEFormatVersion, Inputs: v.Inputs, Hidden: v.Hidden,
		Latent: v.Latent, Activation: "relu", ObsVar: v.ObsVar, Scaler: v.Scaler}
	if weights, sc.WeightsSHA256, err = vaeFiles.EncodeWeights(tensors); err != nil {
		return nil, nil, fmt.Errorf("save vae: %w", err)
	}
	if sidecarJSON, err = vaeFiles.MarshalSidecar(sc, sc.WeightsSHA256); err != nil {
		return nil, nil, fmt.Errorf("save vae: %w", err)
	}
	return sidecarJSON, weights, nil
}

// SaveVAE writes v to dir (created if needed) as vae.safetensors and vae.json, each atomically.
// The weights go first and the sidecar, which carries their checksum, last: a crash in between
// leaves a pair that LoadVAE rejects as mismatched rather than a silently mixed VAE.
func SaveVAE(dir string, v *VAE) error {
	js, w, err := EncodeVAE(v)
	if err != nil {
		return err
	}
	if err := vaeFiles.Save(dir, js, w); err != nil {
		return fmt.Errorf("save vae: %w", err)
	}
	return nil
}

// LoadVAE reads a VAE written by SaveVAE. Truncated, mismatched or corrupt files are rejected with
// an error wrapping ErrVAEFile that names the file and what is wrong.
func LoadVAE(dir string) (*VAE, error) {
	js, w, err := vaeFiles.Read(dir)
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
	tensors, err := vaeFiles.Decode(sidecarJSON, weights, &sc)
	if err != nil {
		return nil, err
	}
	if sc.Activation != "relu" {
		return nil, fmt.Errorf("%w: %s: field \"activation\" is %q; the VAE supports only relu", ErrVAEFile, VAESidecarFile, sc.Activation)
	}
	if sc.Inputs < 1 || sc.Hidden < 1 || sc.Latent < 1 {
		return nil, fmt.Errorf("%w: %s: inputs %d hidden %d latent %d, want all >= 1", ErrVAEFile, VAESidecarFile, sc.Inputs, sc.Hidden, sc.Latent)
	}
	v := &VAE{Inputs: sc.Inputs, Hidden: sc.Hidden, Latent: sc.Latent, ObsVar: sc.ObsVar, Scaler: sc.Scaler}
	shapes := map[string][2]int{ // out, in
		"encoder.fc1": {sc.Hidden, sc.Inputs}, "encoder.mu": {sc.Latent, sc.Hidden}, "encoder.logvar": {sc.Latent, sc.Hidden},
		"decoder.fc1": {sc.Hidden, sc.Latent}, "decoder.out": {sc.Inputs, sc.Hidden},
	}
	for _, nl := range v.layers() {
		sh := shapes[nl.name]
		nl.l.Out, nl.l.In = sh[0], sh[1]
		if nl.l.W, err = vaeFiles.Take(tensors, nl.name+".weight", sh[0], sh[1]); err != nil {
			return nil, err
		}
		if nl.l.B, err = vaeFiles.Take(tensors, nl.name+".bias", sh[0]); err != nil {
			return nil, err
		}
	}
	if err := vaeFiles.NoneLeft(tensors); err != nil {
		return nil, err
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
