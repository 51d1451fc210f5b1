package safetensors

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"strings"
	"testing"
)

// handMade builds a safetensors file byte by byte, as torch would write a float32 tensor.
func handMade(header string, data []byte) []byte {
	b := make([]byte, 8, 8+len(header)+len(data))
	binary.LittleEndian.PutUint64(b, uint64(len(header)))
	return append(append(b, header...), data...)
}

func TestDecodeF32FromTorch(t *testing.T) {
	data := make([]byte, 12)
	for i, v := range []float32{1.5, -2.25, 0.1} {
		binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(v))
	}
	b := handMade(`{"__metadata__":{"format":"pt"},"fc1.weight_mu":{"dtype":"F32","shape":[1,3],"data_offsets":[0,12]}}`, data)
	ts, meta, err := Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	got := ts["fc1.weight_mu"]
	if meta["format"] != "pt" || len(got.Data) != 3 || got.Data[0] != 1.5 || got.Data[1] != -2.25 || got.Data[2] != float64(float32(0.1)) {
		t.Fatalf("decoded %+v %v", got, meta)
	}
}

func TestRoundTripAndRejections(t *testing.T) {
	enc, err := Encode(map[string]Tensor{"a": {Shape: []int{2}, Data: []float64{1, math.Pi}}, "b": {Shape: []int{}, Data: []float64{7}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ts, _, err := Decode(enc)
	if err != nil || ts["a"].Data[1] != math.Pi || ts["b"].Data[0] != 7 {
		t.Fatalf("round trip: %v %v", ts, err)
	}
	if _, err := Encode(map[string]Tensor{"x": {Shape: []int{3}, Data: []float64{1}}}, nil); err == nil {
		t.Fatal("shape/data mismatch accepted")
	}
	bad := map[string][]byte{
		"short":        {1, 2, 3},
		"huge header":  handMade("", nil)[:8],
		"bad json":     handMade(`{"a":`, nil),
		"dtype":        handMade(`{"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}}`, []byte{1}),
		"out of range": handMade(`{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}`, []byte{1, 2}),
		"shape":        handMade(`{"a":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}}`, make([]byte, 8)),
		"gap":          handMade(`{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}`, make([]byte, 16)),
		// Two tensors on the same 8 bytes and 8 bytes of no tensor: the lengths add up to the section.
		"overlap":   handMade(`{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"b":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}`, make([]byte, 16)),
		"inner gap": handMade(`{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"b":{"dtype":"F64","shape":[1],"data_offsets":[16,24]}}`, make([]byte, 24)),
		// 2^61 + 1 elements: count*8 wraps to 8 in int arithmetic (found by FuzzDecode).
		"shape overflow":     handMade(`{"a":{"dtype":"F64","shape":[2305843009213693953],"data_offsets":[0,8]}}`, make([]byte, 8)),
		"product overflow":   handMade(`{"a":{"dtype":"F64","shape":[4294967297,4294967297],"data_offsets":[0,8]}}`, make([]byte, 8)),
		"negative dimension": handMade(`{"a":{"dtype":"F64","shape":[-1,-1],"data_offsets":[0,8]}}`, make([]byte, 8)),
	}
	binary.LittleEndian.PutUint64(bad["huge header"], 1<<40)
	for name, b := range bad {
		if _, _, err := Decode(b); err == nil || !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: got %v, want ErrCorrupt", name, err)
		}
	}
}

// TestDecodeRejectsMalformedInput pins each validation of untrusted bytes on its own: every file
// here breaks exactly one rule, and Decode must refuse it with ErrCorrupt (never panic, never
// accept).
func TestDecodeRejectsMalformedInput(t *testing.T) {
	for _, tc := range []struct {
		name string
		b    []byte
	}{
		// 4 to 7 bytes: too short for the length prefix itself.
		{"7 bytes", make([]byte, 7)},
		// A header length below maxHeader but past the end of the file: 100 bytes promised, none there.
		{"header past end", binary.LittleEndian.AppendUint64(nil, 100)},
		// Metadata must map strings to strings.
		{"metadata not strings", handMade(`{"__metadata__":{"format":5}}`, nil)},
		// An unsupported dtype with an empty range: no byte count can give it away.
		{"dtype, empty range", handMade(`{"a":{"dtype":"I64","shape":[1],"data_offsets":[0,0]},"b":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}`, make([]byte, 8))},
		// A range starting before the data section (it would read the header).
		{"negative offset", handMade(`{"a":{"dtype":"F64","shape":[1],"data_offsets":[-8,0]},"b":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}`, make([]byte, 8))},
		// A negative dimension beside a zero one: zero elements, zero bytes, still no shape.
		{"negative and zero dimension", handMade(`{"a":{"dtype":"F64","shape":[-1,0],"data_offsets":[0,0]}}`, nil)},
		// b lies inside a: the ranges reach the section's end with no gap, but overlap.
		{"overlap covering the section", handMade(`{"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},"b":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}}`, make([]byte, 16))},
		// A header length one past the end of the file.
		{"header one byte past end", func() []byte {
			b := handMade(`{}`, nil)
			binary.LittleEndian.PutUint64(b, 3)
			return b
		}()},
		// A dimension that is no integer: the entry does not parse, whatever the rest of it says.
		{"fractional dimension", handMade(`{"a":{"dtype":"F64","shape":[0.5],"data_offsets":[0,0]}}`, nil)},
		// Sixteen dimensions of 16, each no larger than the data section: their product, 2^64, is 0
		// in int arithmetic, which would pass for an empty tensor.
		{"product wrapping to zero", handMade(`{"a":{"dtype":"F64","shape":[16,16,16,16,16,16,16,16,16,16,16,16,16,16,16,16],"data_offsets":[16,16]},`+
			`"b":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}}`, make([]byte, 16))},
		// data_offsets is a pair: a third number, or a lone one, is a damaged header.
		{"three data offsets", handMade(`{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8,16]}}`, make([]byte, 8))},
		{"one data offset", handMade(`{"a":{"dtype":"F64","shape":[0],"data_offsets":[0]}}`, nil)},
		// The header is an object: null is not an empty file.
		{"null header", handMade(`null`, nil)},
		// Every field as the specification spells it: none missing, null, or in another case.
		{"no shape", handMade(`{"a":{"dtype":"F64","data_offsets":[0,8]}}`, make([]byte, 8))},
		{"null shape", handMade(`{"a":{"dtype":"F64","shape":null,"data_offsets":[0,8]}}`, make([]byte, 8))},
		{"shape in upper case", handMade(`{"a":{"dtype":"F64","SHAPE":[],"data_offsets":[0,8]}}`, make([]byte, 8))},
		{"no data offsets", handMade(`{"a":{"dtype":"F64","shape":[0]}}`, nil)},
		// A range longer than its shape needs: the bytes past the shape's would belong to no tensor.
		{"range longer than the shape", handMade(`{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,16]}}`, make([]byte, 16))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, _, err := Decode(tc.b); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("got %v, want ErrCorrupt", err)
			}
		})
	}
}

// TestDecodeRejectsRepeatedName: a header that names a tensor twice is refused, and the error
// names it, even when both entries describe the same bytes (one reader would take the first
// entry, another the last: here an F64 scalar or two F32 values).
func TestDecodeRejectsRepeatedName(t *testing.T) {
	for _, header := range []string{
		`{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`,
		`{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}`,
		`{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"b":{"dtype":"F64","shape":[0],"data_offsets":[8,8]},"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}`,
	} {
		_, _, err := Decode(handMade(header, make([]byte, 8)))
		if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), `tensor "a" is named twice`) {
			t.Errorf("%s: got %v, want ErrCorrupt naming tensor \"a\" twice", header, err)
		}
	}
}

// TestDecodeRejectsHeaderOverMaxHeader: a header longer than maxHeader is refused from its
// length alone, even when the file holds it whole and it parses.
func TestDecodeRejectsHeaderOverMaxHeader(t *testing.T) {
	header := append([]byte(`{}`), bytes.Repeat([]byte{' '}, maxHeader-1)...)
	if _, _, err := Decode(handMade(string(header), nil)); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a %d-byte header: got %v, want ErrCorrupt", len(header), err)
	}
}

// TestDecodeHeaderOfMaxHeaderIsWithinTheLimit: a header of exactly maxHeader bytes is read, not
// refused from its length (here its first byte is not JSON, which is what the error says).
func TestDecodeHeaderOfMaxHeaderIsWithinTheLimit(t *testing.T) {
	b := make([]byte, 8+maxHeader)
	binary.LittleEndian.PutUint64(b, maxHeader)
	_, _, err := Decode(b)
	if !errors.Is(err, ErrCorrupt) || strings.Contains(err.Error(), "exceeds") || !strings.Contains(err.Error(), "header: invalid character") {
		t.Fatalf("a %d-byte header of zero bytes: got %v, want a JSON error", maxHeader, err)
	}
}

// TestDecodeAcceptsEmptyTensors: what the format allows at its edges decodes. A file of no
// tensor (a header and no data section), and zero-element tensors, whose empty ranges may share
// an offset with a non-empty tensor (the order of such ranges must not depend on the header's
// map order, hence the repetitions).
func TestDecodeAcceptsEmptyTensors(t *testing.T) {
	enc, err := Encode(map[string]Tensor{}, map[string]string{"format": "pt"})
	if err != nil {
		t.Fatal(err)
	}
	if ts, meta, err := Decode(enc); err != nil || len(ts) != 0 || meta["format"] != "pt" {
		t.Fatalf("no tensors: %v %v %v", ts, meta, err)
	}
	b := handMade(`{"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]},`+
		`"e0":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},`+
		`"e1":{"dtype":"F64","shape":[0],"data_offsets":[16,16]},`+
		`"e2":{"dtype":"F64","shape":[3,0],"data_offsets":[16,16]}}`, make([]byte, 16))
	for range 64 {
		ts, _, err := Decode(b)
		if err != nil {
			t.Fatal(err)
		}
		if len(ts) != 4 || len(ts["a"].Data) != 2 || len(ts["e0"].Data) != 0 || len(ts["e2"].Data) != 0 {
			t.Fatalf("decoded %v", ts)
		}
	}
}

// TestEncodeFormat pins what Encode writes beyond a round trip: metadata, a header padded to a
// multiple of 8 bytes, bytes that do not depend on map order (tensors in name order), and no
// negative dimension.
func TestEncodeFormat(t *testing.T) {
	tensors := map[string]Tensor{}
	for i, name := range []string{"e", "dd", "c", "bbbb", "a", "fffff", "g"} {
		tensors[name] = Tensor{Shape: []int{i + 1}, Data: make([]float64, i+1)}
		tensors[name].Data[0] = float64(i)
	}
	enc, err := Encode(tensors, map[string]string{"format": "pt"})
	if err != nil {
		t.Fatal(err)
	}
	if n := binary.LittleEndian.Uint64(enc); n%8 != 0 {
		t.Errorf("header of %d bytes, want a multiple of 8", n)
	}
	// Names of 1 to 8 bytes give headers of eight consecutive lengths: every remainder mod 8 is padded.
	for k := 1; k <= 8; k++ {
		enc, err := Encode(map[string]Tensor{strings.Repeat("n", k): {Shape: []int{1}, Data: []float64{1}}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if n := binary.LittleEndian.Uint64(enc); n%8 != 0 {
			t.Errorf("a %d-byte name: header of %d bytes, want a multiple of 8", k, n)
		}
		if _, _, err := Decode(enc); err != nil {
			t.Errorf("a %d-byte name: %v", k, err)
		}
	}
	ts, meta, err := Decode(enc)
	if err != nil || meta["format"] != "pt" || ts["g"].Data[0] != 6 {
		t.Fatalf("round trip: %v %v %v", ts, meta, err)
	}
	for range 16 {
		again, err := Encode(tensors, map[string]string{"format": "pt"})
		if err != nil || !bytes.Equal(again, enc) {
			t.Fatalf("encodings differ: %v", err)
		}
	}
	if _, err := Encode(map[string]Tensor{"x": {Shape: []int{-1, -1}, Data: []float64{1}}}, nil); err == nil {
		t.Error("negative dimensions accepted")
	}
}
