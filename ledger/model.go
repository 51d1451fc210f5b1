package ledger

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/cfguard/cfguard/bnn"
)

// modelMagic starts every stored posterior. The value is the model file pair of bnn.Save in one
// blob: magic, sidecar length (u32 LE), sidecar JSON, safetensors weights. bnn.Decode checks the
// weights' SHA-256 recorded in the sidecar, so a torn or altered blob is rejected on read.
var modelMagic = []byte("CFGM1\x00")

// encodeModel validates m and serialises it with bnn.Encode.
func encodeModel(m *bnn.Model) ([]byte, error) {
	if m == nil {
		return nil, fmt.Errorf("%w: nil model", ErrInvalid)
	}
	sc, w, err := bnn.Encode(m)
	if err != nil {
		return nil, fmt.Errorf("%w: posterior version %d: %w", ErrInvalid, m.Version, err)
	}
	blob := make([]byte, 0, len(modelMagic)+4+len(sc)+len(w))
	blob = append(blob, modelMagic...)
	blob = binary.LittleEndian.AppendUint32(blob, uint32(len(sc)))
	blob = append(append(blob, sc...), w...)
	return blob, nil
}

// decodeModel is the inverse of encodeModel; the model it returns passes Validate.
func decodeModel(blob []byte) (*bnn.Model, error) {
	if !bytes.HasPrefix(blob, modelMagic) || len(blob) < len(modelMagic)+4 {
		return nil, fmt.Errorf("%w: stored posterior has no %q header", ErrCorrupt, modelMagic[:5])
	}
	p := len(modelMagic)
	n := int(binary.LittleEndian.Uint32(blob[p:]))
	p += 4
	if n > len(blob)-p {
		return nil, fmt.Errorf("%w: stored posterior sidecar length %d exceeds blob", ErrCorrupt, n)
	}
	m, err := bnn.Decode(blob[p:p+n], blob[p+n:])
	if err != nil {
		return nil, fmt.Errorf("%w: stored posterior: %w", ErrCorrupt, err)
	}
	return m, nil
}

// fingerprint identifies a posterior by its encoding.
func fingerprint(blob []byte) [32]byte { return sha256.Sum256(blob) }
