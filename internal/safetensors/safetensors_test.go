package safetensors

import (
	"encoding/binary"
	"errors"
	"math"
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
