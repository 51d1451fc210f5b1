package sidecar

import (
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
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

// TestChecksumIsHexSHA256 pins weights_sha256 to the full hex SHA-256 of the weights (FIPS 180-2
// test vectors), so that a sidecar can be checked with sha256sum.
func TestChecksumIsHexSHA256(t *testing.T) {
	for in, want := range map[string]string{
		"":    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
		"abc": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
	} {
		if got := Checksum([]byte(in)); got != want {
			t.Errorf("Checksum(%q) = %s, want %s", in, got, want)
		}
	}
}

// TestEncodeWeights pins that the weights carry the metadata {"format": k.Format} and that
// tensors that cannot be encoded (a shape that does not match the data) are an error naming the
// weights file, not an empty file with a checksum.
func TestEncodeWeights(t *testing.T) {
	w, sum, err := kind.EncodeWeights(map[string]safetensors.Tensor{"a": {Shape: []int{2}, Data: []float64{1, 2}}})
	if err != nil {
		t.Fatal(err)
	}
	if sum != Checksum(w) {
		t.Fatalf("sum %s, want the checksum of the weights %s", sum, Checksum(w))
	}
	_, meta, err := safetensors.Decode(w)
	if err != nil {
		t.Fatal(err)
	}
	if len(meta) != 1 || meta["format"] != kind.Format {
		t.Fatalf("metadata %v, want format %s", meta, kind.Format)
	}
	w, sum, err = kind.EncodeWeights(map[string]safetensors.Tensor{"a": {Shape: []int{3}, Data: []float64{1, 2}}})
	if err == nil || !strings.Contains(err.Error(), kind.Weights) || w != nil || sum != "" {
		t.Fatalf("a shape that does not match the data: %d bytes, sum %q, %v; want an error naming %s", len(w), sum, err, kind.Weights)
	}
}

// TestMarshalSidecarLayout pins the sidecar's text: JSON indented by two spaces, in the struct's
// field order, with a final newline.
func TestMarshalSidecarLayout(t *testing.T) {
	got, err := kind.MarshalSidecar(thingSidecar{Format: kind.Format, FormatVersion: kind.Version, Size: 4, WeightsSHA256: "abc"}, "abc")
	if err != nil {
		t.Fatal(err)
	}
	want := `{
  "format": "test-thing",
  "format_version": 3,
  "size": 4,
  "weights_sha256": "abc"
}
`
	if string(got) != want {
		t.Fatalf("sidecar\n%s\nwant\n%s", got, want)
	}
}

// TestMarshalSidecarReportsJSONErrors pins that a value JSON cannot marshal, or that marshals to
// something other than an object, is refused with json's own error (wrapped), naming the sidecar.
func TestMarshalSidecarReportsJSONErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		v      any
		target any // a pointer to the json error type the error must wrap
	}{
		{"unsupported type", func() {}, new(*json.UnsupportedTypeError)},
		{"not an object", []int{1}, new(*json.UnmarshalTypeError)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := kind.MarshalSidecar(tc.v, "")
			if !errors.As(err, tc.target) || !strings.Contains(err.Error(), kind.Sidecar) {
				t.Fatalf("got %v, want a %T naming %s", err, tc.target, kind.Sidecar)
			}
		})
	}
}

// TestSaveWritesTheSidecarLast pins the order of Save: weights first, then the sidecar that
// vouches for them. When the weights cannot be written (their name is taken by a non-empty
// directory), no sidecar is written either.
func TestSaveWritesTheSidecarLast(t *testing.T) {
	js, w := encodeThing(t, 4)
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, kind.Weights, "child"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := kind.Save(dir, js, w); err == nil || !strings.Contains(err.Error(), kind.Weights) {
		t.Fatalf("got %v, want an error naming %s", err, kind.Weights)
	}
	if _, err := os.Stat(filepath.Join(dir, kind.Sidecar)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a sidecar was written for weights that were not: %v", err)
	}
}

// TestReadNeedsBothFiles pins that Read fails, with the os error naming the file, when either
// file is missing or cannot be read (a directory in its place), and then returns neither file's
// bytes.
func TestReadNeedsBothFiles(t *testing.T) {
	js, w := encodeThing(t, 4)
	for _, tc := range []struct {
		name string
		file string
		dir  bool // replace file by a directory rather than remove it
		want error
	}{
		{"no sidecar", kind.Sidecar, false, fs.ErrNotExist},
		{"no weights", kind.Weights, false, fs.ErrNotExist},
		{"sidecar is a directory", kind.Sidecar, true, syscall.EISDIR},
		{"weights are a directory", kind.Weights, true, syscall.EISDIR},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := kind.Save(dir, js, w); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(dir, tc.file)
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			if tc.dir {
				if err := os.Mkdir(path, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			sc, ws, err := kind.Read(dir)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.file) {
				t.Fatalf("got %v, want %v naming %s", err, tc.want, tc.file)
			}
			if sc != nil || ws != nil {
				t.Fatalf("Read returned %d and %d bytes with its error", len(sc), len(ws))
			}
		})
	}
}

// TestDecodeRejectsMalformedChecksums pins that weights_sha256 is compared whole and checked for
// its type: a prefix of the right checksum is a mismatch, a checksum too short to quote is an
// error (not a panic), and a weights_sha256 that is not a string is an error even where the
// checksum is optional and v has no such field (it is not taken for an absent checksum).
func TestDecodeRejectsMalformedChecksums(t *testing.T) {
	js, w := encodeThing(t, 4)
	withSum := func(sum any) []byte {
		var m map[string]any
		if err := json.Unmarshal(js, &m); err != nil {
			t.Fatal(err)
		}
		m["weights_sha256"] = sum
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	opt := kind
	opt.ChecksumOptional = true
	for _, tc := range []struct {
		name string
		k    Kind
		js   []byte
		v    any
	}{
		{"prefix of the checksum", kind, withSum(Checksum(w)[:12]), new(thingSidecar)},
		{"longer than the checksum", kind, withSum(Checksum(w) + "00"), new(thingSidecar)},
		{"short checksum", kind, withSum("abc"), new(thingSidecar)},
		{"checksum not a string", opt, withSum(5), new(struct{ Size int })},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tc.k.Decode(tc.js, w, tc.v); !errors.Is(err, errThing) || !strings.Contains(err.Error(), kind.Sidecar) {
				t.Fatalf("got %v, want %v naming %s", err, errThing, kind.Sidecar)
			}
		})
	}
}

// TestTakeShapeErrorAndNoneLeftOrder pins that a shape mismatch wraps k.Err like every content
// error, and that NoneLeft lists the unclaimed tensors sorted by name (the map's order is random).
func TestTakeShapeErrorAndNoneLeftOrder(t *testing.T) {
	ts := map[string]safetensors.Tensor{}
	for _, n := range []string{"f", "d", "b", "a", "e", "c"} {
		ts[n] = safetensors.Tensor{Shape: []int{1}, Data: []float64{1}}
	}
	if _, err := kind.Take(ts, "a", 2); !errors.Is(err, errThing) {
		t.Fatalf("shape mismatch: %v, want %v", err, errThing)
	}
	if err := kind.NoneLeft(ts); err == nil || !strings.Contains(err.Error(), "6 tensors thing.json does not describe: [a b c d e f]") {
		t.Fatalf("got %v, want the six names sorted", err)
	}
}
