// Package sidecar reads and writes cfguard's two-file format: a safetensors file of weights and a
// JSON sidecar that describes them and carries their SHA-256,
//
//	<name>.safetensors   the tensors (F64)
//	<name>.json          {"format": ..., "format_version": ..., ..., "weights_sha256": hex SHA-256 of the weights file}
//
// so that a truncated, corrupt or mismatched pair (weights from one save, sidecar from another) is
// detected on load. Both files are written atomically (internal/atomicfile), the weights first and
// the sidecar, which vouches for them, last: a crash in between leaves a pair that Decode rejects
// instead of a silently mixed one. The model (package bnn) and the VAE (package explain) are
// stored this way; each describes its own format with a Kind.
package sidecar

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/cfguard/cfguard/internal/atomicfile"
	"github.com/cfguard/cfguard/internal/safetensors"
)

// Kind is one two-file format.
type Kind struct {
	Format  string // the sidecar's "format", e.g. "cfguard-bnn"
	Version int    // the only "format_version" read and written
	Sidecar string // the sidecar's file name, e.g. "model.json"
	Weights string // the weights' file name, e.g. "model.safetensors"
	// ChecksumOptional accepts a sidecar without weights_sha256 (a hand-written export); a
	// checksum that is present is always verified.
	ChecksumOptional bool
	// Err is wrapped by every error about the files' content (not by I/O errors).
	Err error
}

// header is the part of the sidecar that every Kind shares.
type header struct {
	Format        string `json:"format"`
	FormatVersion int    `json:"format_version"`
	WeightsSHA256 string `json:"weights_sha256"`
}

// Checksum is the hex SHA-256 of a weights file's bytes, as stored in weights_sha256.
func Checksum(weights []byte) string {
	sum := sha256.Sum256(weights)
	return hex.EncodeToString(sum[:])
}

// EncodeWeights serialises the tensors (F64, metadata {"format": k.Format}) and returns the bytes
// with their Checksum, which the caller stores in its sidecar's weights_sha256.
func (k Kind) EncodeWeights(tensors map[string]safetensors.Tensor) (weights []byte, sum string, err error) {
	weights, err = safetensors.Encode(tensors, map[string]string{"format": k.Format})
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", k.Weights, err)
	}
	return weights, Checksum(weights), nil
}

// MarshalSidecar renders v (a struct with the JSON keys format, format_version and
// weights_sha256 besides its own) as indented JSON with a final newline. It checks that v says
// k.Format, k.Version and the given checksum, so that a sidecar cannot vouch for other weights.
func (k Kind) MarshalSidecar(v any, sum string) ([]byte, error) {
	js, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("%s: %w", k.Sidecar, err)
	}
	var h header
	if err := json.Unmarshal(js, &h); err != nil {
		return nil, fmt.Errorf("%s: %w", k.Sidecar, err)
	}
	if h.Format != k.Format || h.FormatVersion != k.Version || h.WeightsSHA256 != sum {
		return nil, fmt.Errorf("%s: sidecar says format %q version %d sha256 %q, want %q version %d sha256 %q (internal error)",
			k.Sidecar, h.Format, h.FormatVersion, h.WeightsSHA256, k.Format, k.Version, sum)
	}
	return append(js, '\n'), nil
}

// Save writes the pair to dir (created if needed), each file atomically, weights first.
func (k Kind) Save(dir string, sidecar, weights []byte) error {
	return atomicfile.WriteFiles(dir, atomicfile.File{Name: k.Weights, Data: weights}, atomicfile.File{Name: k.Sidecar, Data: sidecar})
}

// Read returns the bytes of both files in dir. Errors are the os errors, which name the path.
func (k Kind) Read(dir string) (sidecar, weights []byte, err error) {
	if sidecar, err = os.ReadFile(filepath.Join(dir, k.Sidecar)); err != nil {
		return nil, nil, err
	}
	if weights, err = os.ReadFile(filepath.Join(dir, k.Weights)); err != nil {
		return nil, nil, err
	}
	return sidecar, weights, nil
}

// Decode checks a pair and returns its tensors, with the sidecar unmarshalled into v: the sidecar
// must be JSON of this Kind's format and version, the weights must match its weights_sha256
// (required unless ChecksumOptional) and must parse as safetensors. Errors wrap k.Err and name the
// file at fault.
func (k Kind) Decode(sidecarJSON, weights []byte, v any) (map[string]safetensors.Tensor, error) {
	var h header
	if err := json.Unmarshal(sidecarJSON, &h); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", k.Err, k.Sidecar, err)
	}
	if h.Format != k.Format || h.FormatVersion != k.Version {
		return nil, fmt.Errorf("%w: %s: format %q version %d, want %s version %d", k.Err, k.Sidecar, h.Format, h.FormatVersion, k.Format, k.Version)
	}
	switch {
	case h.WeightsSHA256 == "" && !k.ChecksumOptional:
		return nil, fmt.Errorf("%w: %s has no weights_sha256 for %s", k.Err, k.Sidecar, k.Weights)
	case h.WeightsSHA256 != "":
		if got := Checksum(weights); got != h.WeightsSHA256 {
			return nil, fmt.Errorf("%w: %s has sha256 %s but %s expects %s (truncated, corrupt, or from another save)",
				k.Err, k.Weights, got[:12], k.Sidecar, h.WeightsSHA256[:min(12, len(h.WeightsSHA256))])
		}
	}
	if err := json.Unmarshal(sidecarJSON, v); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", k.Err, k.Sidecar, err)
	}
	tensors, _, err := safetensors.Decode(weights)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", k.Err, k.Weights, err)
	}
	return tensors, nil
}

// Take removes tensor key from tensors and returns its data, which must have the given shape (as
// the sidecar describes it).
func (k Kind) Take(tensors map[string]safetensors.Tensor, key string, shape ...int) ([]float64, error) {
	t, ok := tensors[key]
	if !ok {
		return nil, fmt.Errorf("%w: %s has no tensor %q", k.Err, k.Weights, key)
	}
	if !slices.Equal(t.Shape, shape) {
		return nil, fmt.Errorf("%w: tensor %q has shape %v, %s says %v", k.Err, key, t.Shape, k.Sidecar, shape)
	}
	delete(tensors, key)
	return t.Data, nil
}

// NoneLeft fails, naming them, if tensors still holds tensors that Take did not claim: weights the
// sidecar does not describe.
func (k Kind) NoneLeft(tensors map[string]safetensors.Tensor) error {
	if len(tensors) == 0 {
		return nil
	}
	names := make([]string, 0, len(tensors))
	for n := range tensors {
		names = append(names, n)
	}
	slices.Sort(names)
	return fmt.Errorf("%w: %s has %d tensors %s does not describe: %v", k.Err, k.Weights, len(names), k.Sidecar, names)
}
