package bnn

import (
	"crypto/sha256"
	"encoding"
	"encoding/binary"
	"encoding/hex"
	"hash"
	"maps"
	"math"
	"slices"
)

// WeightsHasher computes WeightsSHA256 for posteriors that differ from one another in their last
// layer only, as the versions of a posterior log do, hashing the rest of the weights file once.
// The file holds its tensors in name order, the last layer's four last when its name sorts after
// the others' (model.0 ... model.9); the hasher keeps the SHA-256 state after the bytes before
// them (the header and the other layers' data), with a copy of the layers those bytes encode.
// For a posterior whose other layers equal that copy bit for bit, and whose last layer has the
// same name and shape, it hashes only the last layer's bytes; any other posterior is hashed
// whole, and its prefix kept for the next. Sum equals WeightsSHA256 for every model. The zero
// value is ready; a WeightsHasher is not safe for concurrent use.
type WeightsHasher struct {
	body  []Layer // copies of the layers before the last, as state encodes them
	last  Layer   // the last layer's name and shape (no values)
	state []byte  // the SHA-256 state after the prefix; nil when none is kept
}

// Sum is WeightsSHA256(m).
func (h *WeightsHasher) Sum(m *Model) (string, error) {
	if err := checkFile(m); err != nil {
		return "", err
	}
	if h.state != nil && h.holds(m) {
		d := sha256.New()
		if err := d.(encoding.BinaryUnmarshaler).UnmarshalBinary(h.state); err == nil {
			writeLayerData(d, m.Last())
			return hex.EncodeToString(d.Sum(nil)), nil
		}
	}
	tensors := tensorsOf(m)
	weights, sum, err := modelFiles.EncodeWeights(tensors)
	if err != nil {
		return "", err
	}
	h.keep(m, slices.Sorted(maps.Keys(tensors)), weights)
	return sum, nil
}

// keep keeps the prefix of m's weights file before its last layer's tensors, when they are the
// file's last (names: the file's tensor names, in its order); else nothing.
func (h *WeightsHasher) keep(m *Model, names []string, weights []byte) {
	h.state, h.body = nil, nil
	last := m.Last()
	tail := []string{last.Name + ".bias_log_sigma", last.Name + ".bias_mu", last.Name + ".weight_log_sigma", last.Name + ".weight_mu"}
	n := 8 * 2 * last.NumParams()
	if !slices.Equal(names[len(names)-4:], tail) || n > len(weights) {
		return
	}
	d := sha256.New()
	d.Write(weights[:len(weights)-n])
	state, err := d.(encoding.BinaryMarshaler).MarshalBinary()
	if err != nil {
		return
	}
	h.state, h.last = state, Layer{Name: last.Name, In: last.In, Out: last.Out}
	for _, l := range m.Layers[:len(m.Layers)-1] {
		h.body = append(h.body, Layer{Name: l.Name, In: l.In, Out: l.Out, WeightMu: slices.Clone(l.WeightMu),
			WeightLogSigma: slices.Clone(l.WeightLogSigma), BiasMu: slices.Clone(l.BiasMu), BiasLogSigma: slices.Clone(l.BiasLogSigma)})
	}
}

// holds reports whether m's layers before the last are the kept copy, bit for bit, and its last
// layer has the kept name and shape: then the kept prefix is m's.
func (h *WeightsHasher) holds(m *Model) bool {
	if len(m.Layers) != len(h.body)+1 {
		return false
	}
	if l := m.Last(); l.Name != h.last.Name || l.In != h.last.In || l.Out != h.last.Out {
		return false
	}
	for i := range h.body {
		if l, k := &m.Layers[i], &h.body[i]; l.Name != k.Name || !LayersEqual(l, k) { // 0 and -0 differ, as their bytes do
			return false
		}
	}
	return true
}

// writeLayerData writes l's tensors to d as the weights file holds them: in name order
// (bias_log_sigma, bias_mu, weight_log_sigma, weight_mu), each value's float64 bits little-endian.
func writeLayerData(d hash.Hash, l *Layer) {
	b := make([]byte, 0, 8*2*l.NumParams())
	for _, t := range [][]float64{l.BiasLogSigma, l.BiasMu, l.WeightLogSigma, l.WeightMu} {
		for _, v := range t {
			b = binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
		}
	}
	d.Write(b)
}
