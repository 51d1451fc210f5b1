// Package safetensors reads and writes the safetensors format: an 8-byte little-endian header
// length N, N bytes of JSON header mapping tensor names to {dtype, shape, data_offsets}, then the
// raw little-endian tensor bytes. Only F64 and F32 tensors are supported; F32 is widened to
// float64 on read so that torch-exported (float32) posteriors load.
package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
)

// Tensor is a named dense array.
type Tensor struct {
	Shape []int
	Data  []float64
}

// ErrCorrupt is wrapped by every decoding error.
var ErrCorrupt = errors.New("corrupt safetensors data")

type entry struct {
	Dtype       string `json:"dtype"`
	Shape       []int  `json:"shape"`
	DataOffsets []int  `json:"data_offsets"`
}

// maxHeader bounds the JSON header so that a garbage length cannot make us allocate gigabytes.
const maxHeader = 100 << 20

// Encode serialises tensors as F64 with the given metadata (may be nil). Names are written in
// sorted order, so the encoding is deterministic.
func Encode(tensors map[string]Tensor, metadata map[string]string) ([]byte, error) {
	names := make([]string, 0, len(tensors))
	for n := range tensors {
		names = append(names, n)
	}
	sort.Strings(names)
	header := map[string]any{}
	if len(metadata) > 0 {
		header["__metadata__"] = metadata
	}
	off := 0
	for _, n := range names {
		t := tensors[n]
		if prod(t.Shape) != len(t.Data) {
			return nil, fmt.Errorf("tensor %q: shape %v holds %d values, data has %d", n, t.Shape, prod(t.Shape), len(t.Data))
		}
		header[n] = entry{Dtype: "F64", Shape: t.Shape, DataOffsets: []int{off, off + 8*len(t.Data)}}
		off += 8 * len(t.Data)
	}
	hj, err := json.Marshal(header)
	if err != nil {
		return nil, err
	}
	for len(hj)%8 != 0 { // align the data section, as the reference writer does
		hj = append(hj, ' ')
	}
	buf := make([]byte, 8+len(hj)+off)
	binary.LittleEndian.PutUint64(buf, uint64(len(hj)))
	copy(buf[8:], hj)
	p := 8 + len(hj)
	for _, n := range names {
		for _, v := range tensors[n].Data {
			binary.LittleEndian.PutUint64(buf[p:], math.Float64bits(v))
			p += 8
		}
	}
	return buf, nil
}

// Decode parses a safetensors file, checking that the header names each tensor once and gives it
// one [begin, end) pair of data_offsets, that every byte range lies inside the data section,
// that ranges match shape and dtype, and that the ranges tile the data section: in offset order,
// each starts where the one before it ends, the first at 0, the last at the section's end (no
// gap, no overlap, as the format's specification requires).
func Decode(b []byte) (map[string]Tensor, map[string]string, error) {
	if len(b) < 8 {
		return nil, nil, fmt.Errorf("%w: %d bytes is shorter than the 8-byte header length", ErrCorrupt, len(b))
	}
	n := binary.LittleEndian.Uint64(b)
	if n > maxHeader || n > uint64(len(b)-8) {
		return nil, nil, fmt.Errorf("%w: header length %d exceeds file size %d (truncated?)", ErrCorrupt, n, len(b))
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b[8:8+n], &raw); err != nil {
		return nil, nil, fmt.Errorf("%w: header: %v", ErrCorrupt, err)
	}
	if raw == nil { // encoding/json takes null for a map as no map
		return nil, nil, fmt.Errorf("%w: header is null, want a JSON object", ErrCorrupt)
	}
	if name, ok := repeatedName(b[8 : 8+n]); ok {
		return nil, nil, fmt.Errorf("%w: tensor %q is named twice in the header (re-export the file: a writer names each tensor once)", ErrCorrupt, name)
	}
	data := b[8+n:]
	var meta map[string]string
	out := map[string]Tensor{}
	type span struct {
		name   string
		lo, hi int
	}
	var spans []span
	for name, msg := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(msg, &meta); err != nil {
				return nil, nil, fmt.Errorf("%w: metadata: %v", ErrCorrupt, err)
			}
			continue
		}
		var e entry
		if err := json.Unmarshal(msg, &e); err != nil {
			return nil, nil, fmt.Errorf("%w: tensor %q: %v", ErrCorrupt, name, err)
		}
		if field := missingField(msg); field != "" {
			return nil, nil, fmt.Errorf("%w: tensor %q has no %q (field names are lower case; a scalar's shape is [])", ErrCorrupt, name, field)
		}
		width := map[string]int{"F64": 8, "F32": 4}[e.Dtype]
		if width == 0 {
			return nil, nil, fmt.Errorf("%w: tensor %q has unsupported dtype %q", ErrCorrupt, name, e.Dtype)
		}
		if len(e.DataOffsets) != 2 {
			return nil, nil, fmt.Errorf("%w: tensor %q has data_offsets %v, want [begin, end]", ErrCorrupt, name, e.DataOffsets)
		}
		lo, hi := e.DataOffsets[0], e.DataOffsets[1]
		if lo < 0 || hi < lo || hi > len(data) {
			return nil, nil, fmt.Errorf("%w: tensor %q spans bytes [%d,%d) of a %d-byte data section (truncated?)", ErrCorrupt, name, lo, hi, len(data))
		}
		count, ok := elements(e.Shape, len(data))
		if !ok {
			return nil, nil, fmt.Errorf("%w: tensor %q: shape %v has a negative dimension or more elements than the %d-byte data section holds", ErrCorrupt, name, e.Shape, len(data))
		}
		if hi-lo != count*width {
			return nil, nil, fmt.Errorf("%w: tensor %q: shape %v needs %d bytes, range has %d", ErrCorrupt, name, e.Shape, count*width, hi-lo)
		}
		t := Tensor{Shape: e.Shape, Data: make([]float64, count)}
		for i := range t.Data {
			if width == 8 {
				t.Data[i] = math.Float64frombits(binary.LittleEndian.Uint64(data[lo+8*i:]))
			} else {
				t.Data[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(data[lo+4*i:])))
			}
		}
		out[name] = t
		spans = append(spans, span{name, lo, hi})
	}
	sort.Slice(spans, func(i, j int) bool {
		return spans[i].lo < spans[j].lo || spans[i].lo == spans[j].lo && spans[i].hi < spans[j].hi
	})
	at := 0
	for _, s := range spans {
		if s.lo != at {
			return nil, nil, fmt.Errorf("%w: tensor %q spans bytes [%d,%d), want it to start at byte %d, where the tensor before it ends (a gap or an overlap)", ErrCorrupt, s.name, s.lo, s.hi, at)
		}
		at = s.hi
	}
	if at != len(data) {
		return nil, nil, fmt.Errorf("%w: tensors cover %d of %d data bytes", ErrCorrupt, at, len(data))
	}
	return out, meta, nil
}

// missingField returns the first of a tensor entry's three fields that msg, a JSON object, does
// not give as its specification spells it ("" when it gives all three): encoding/json matches
// names regardless of case and reads a missing or null shape as none, which would make a
// scalar of a damaged entry.
func missingField(msg json.RawMessage) string {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(msg, &fields); err != nil {
		return "dtype"
	}
	for _, f := range []string{"dtype", "shape", "data_offsets"} {
		if v, ok := fields[f]; !ok || string(v) == "null" {
			return f
		}
	}
	return ""
}

// repeatedName returns a name that the header h, valid JSON, gives twice at its top level, if
// any. json.Unmarshal keeps the last entry of a repeated name, where another reader may keep the
// first.
func repeatedName(h []byte) (string, bool) {
	dec := json.NewDecoder(bytes.NewReader(h))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return "", false
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return "", false
		}
		name, _ := tok.(string)
		if seen[name] {
			return name, true
		}
		seen[name] = true
		var value json.RawMessage
		if err := dec.Decode(&value); err != nil {
			return "", false
		}
	}
	return "", false
}

// elements is the number of elements of shape, if no dimension is negative and it is at most
// limit. It never overflows: a product that would pass limit stops early (an element takes at
// least one byte, so limit = the data section's size rejects no valid file).
func elements(shape []int, limit int) (int, bool) {
	n := 1
	for _, s := range shape {
		switch {
		case s < 0:
			return 0, false
		case s == 0:
			n = 0
		}
	}
	if n == 0 {
		return 0, true
	}
	for _, s := range shape {
		if s > limit/n {
			return 0, false
		}
		n *= s
	}
	return n, true
}

func prod(shape []int) int {
	p := 1
	for _, s := range shape {
		if s < 0 {
			return -1
		}
		p *= s
	}
	return p
}
