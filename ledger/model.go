package ledger

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/cfguard/cfguard/bnn"
)

// modelMagic starts every stored posterior. The value is the model file pair of bnn.Save in one
// blob: magic, sidecar length (u32 LE), sidecar JSON, safetensors weights. The blob is stored
// sealed (store.Seal), and bnn.Decode also checks the weights' SHA-256 recorded in the sidecar.
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

// blobWords renames bnn's file names in its decode errors to the parts of a stored blob: a
// damaged posterior in the ledger is not a "bad model file: model.json".
var blobWords = strings.NewReplacer(bnn.ErrModelFile.Error()+": ", "", bnn.SidecarFile, "its sidecar JSON",
	bnn.WeightsFile, "its safetensors weights")

// decodeModel is the inverse of encodeModel; the model it returns passes Validate. Errors are
// corrupt-record errors (corruptf) that say what part of the blob is wrong.
func decodeModel(blob []byte) (*bnn.Model, error) {
	if !bytes.HasPrefix(blob, modelMagic) || len(blob) < len(modelMagic)+4 {
		return nil, corruptf("stored posterior (%d bytes) has no %q header", len(blob), modelMagic[:5])
	}
	p := len(modelMagic)
	n := int(binary.LittleEndian.Uint32(blob[p:]))
	p += 4
	if n > len(blob)-p {
		return nil, corruptf("stored posterior's sidecar length %d exceeds the blob (%d bytes)", n, len(blob))
	}
	m, err := bnn.Decode(blob[p:p+n], blob[p+n:])
	if err != nil {
		return nil, corruptf("stored posterior (%d bytes): %s", len(blob), blobWords.Replace(err.Error()))
	}
	return m, nil
}

// fingerprint identifies a posterior by its encoding.
func fingerprint(blob []byte) [32]byte { return sha256.Sum256(blob) }
