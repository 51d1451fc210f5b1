package sidecar

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/internal/safetensors"
)

var errThing = errors.New("bad thing file")

var kind = Kind{Format: "test-thing", Version: 3, Sidecar: "thing.json", Weights: "thing.safetensors", Err: errThing}

type thingSidecar struct {
	Format        string `json:"format"`
	FormatVersion int    `json:"format_version"`
	Size          int    `json:"size"`
	WeightsSHA256 string `json:"weights_sha256"`
}

func encodeThing(t *testing.T, size int) (js, w []byte) {
	t.Helper()
	w, sum, err := kind.EncodeWeights(map[string]safetensors.Tensor{"a": {Shape: []int{size}, Data: make([]float64, size)}})
	if err != nil {
		t.Fatal(err)
	}
	js, err = kind.MarshalSidecar(thingSidecar{Format: kind.Format, FormatVersion: kind.Version, Size: size, WeightsSHA256: sum}, sum)
	if err != nil {
		t.Fatal(err)
	}
	return js, w
}

func TestRoundTripThroughDisk(t *testing.T) {
	js, w := encodeThing(t, 4)
	dir := filepath.Join(t.TempDir(), "sub")
	if err := kind.Save(dir, js, w); err != nil {
		t.Fatal(err)
	}
	rjs, rw, err := kind.Read(dir)
	if err != nil {
		t.Fatal(err)
	}
	var sc thingSidecar
	ts, err := kind.Decode(rjs, rw, &sc)
	if err != nil {
		t.Fatal(err)
	}
	if sc.Size != 4 || sc.WeightsSHA256 != Checksum(w) {
		t.Fatalf("sidecar %+v", sc)
	}
	if _, err := kind.Take(ts, "a", 4); err != nil {
		t.Fatal(err)
	}
	if err := kind.NoneLeft(ts); err != nil {
		t.Fatal(err)
	}
	if _, _, err := kind.Read(t.TempDir()); !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "thing.json") {
		t.Fatalf("reading an empty directory: %v", err)
	}
}

func TestDecodeRejects(t *testing.T) {
	js, w := encodeThing(t, 4)
	otherJS, otherW := encodeThing(t, 5)
	edit := func(f func(m map[string]any)) []byte {
		var m map[string]any
		json.Unmarshal(js, &m)
		f(m)
		b, _ := json.Marshal(m)
		return b
	}
	for _, tc := range []struct {
		name  string
		js, w []byte
		want  string
	}{
		{"weights from another save", js, otherW, "thing.safetensors has sha256"},
		{"sidecar from another save", otherJS, w, "thing.json expects"},
		{"truncated weights", js, w[:len(w)-3], "sha256"},
		{"not json", []byte("{"), w, "thing.json"},
		{"other format", edit(func(m map[string]any) { m["format"] = "x" }), w, `format "x" version 3, want test-thing version 3`},
		{"other version", edit(func(m map[string]any) { m["format_version"] = 2 }), w, "version 2"},
		{"no checksum", edit(func(m map[string]any) { delete(m, "weights_sha256") }), w, "no weights_sha256"},
		{"field of the wrong type", edit(func(m map[string]any) { m["size"] = "four" }), w, "thing.json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var sc thingSidecar
			_, err := kind.Decode(tc.js, tc.w, &sc)
			if !errors.Is(err, errThing) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want %v containing %q", err, errThing, tc.want)
			}
		})
	}
	// With an optional checksum, a sidecar without one is accepted but the weights must still
	// parse, and a present checksum is still verified.
	opt := kind
	opt.ChecksumOptional = true
	noSum := edit(func(m map[string]any) { delete(m, "weights_sha256") })
	var sc thingSidecar
	if _, err := opt.Decode(noSum, w, &sc); err != nil {
		t.Fatalf("optional checksum: %v", err)
	}
	if _, err := opt.Decode(noSum, w[:len(w)-3], &sc); !errors.Is(err, errThing) || !strings.Contains(err.Error(), "thing.safetensors") {
		t.Fatalf("truncated weights without a checksum: %v", err)
	}
	if _, err := opt.Decode(js, otherW, &sc); !errors.Is(err, errThing) {
		t.Fatalf("a present checksum must be verified: %v", err)
	}
}

func TestTakeAndNoneLeft(t *testing.T) {
	ts := map[string]safetensors.Tensor{"w": {Shape: []int{2, 3}, Data: make([]float64, 6)}, "extra": {Shape: []int{1}, Data: []float64{1}}}
	if _, err := kind.Take(ts, "w", 3, 2); err == nil || !strings.Contains(err.Error(), `"w" has shape [2 3], thing.json says [3 2]`) {
		t.Fatalf("transposed shape: %v", err)
	}
	if _, err := kind.Take(ts, "b", 2); !errors.Is(err, errThing) || !strings.Contains(err.Error(), `no tensor "b"`) {
		t.Fatalf("missing tensor: %v", err)
	}
	if d, err := kind.Take(ts, "w", 2, 3); err != nil || len(d) != 6 {
		t.Fatalf("Take: %v", err)
	}
	if err := kind.NoneLeft(ts); !errors.Is(err, errThing) || !strings.Contains(err.Error(), "[extra]") {
		t.Fatalf("extra tensor: %v", err)
	}
}

func TestMarshalSidecarRefusesAMismatch(t *testing.T) {
	for name, sc := range map[string]thingSidecar{
		"format":   {Format: "other", FormatVersion: 3, WeightsSHA256: "abc"},
		"version":  {Format: "test-thing", FormatVersion: 1, WeightsSHA256: "abc"},
		"checksum": {Format: "test-thing", FormatVersion: 3, WeightsSHA256: "abd"},
	} {
		if _, err := kind.MarshalSidecar(sc, "abc"); err == nil {
			t.Errorf("%s: a sidecar that does not match its kind and weights was marshalled", name)
		}
	}
}
