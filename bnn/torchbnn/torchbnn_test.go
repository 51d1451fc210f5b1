package torchbnn

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/update"
)

// tensor is one entry of a test state_dict; dtype is F32, F64 or I64.
type tensor struct {
	dtype string
	shape []int
	data  []float64
}

// encode writes a safetensors file with per-tensor dtypes, as torch's safetensors does (our
// internal writer only writes F64).
func encode(t *testing.T, tensors map[string]tensor) []byte {
	t.Helper()
	names := make([]string, 0, len(tensors))
	for n := range tensors {
		names = append(names, n)
	}
	sort.Strings(names)
	header := map[string]any{"__metadata__": map[string]string{"format": "pt"}}
	var data []byte
	for _, n := range names {
		tt := tensors[n]
		start := len(data)
		for _, v := range tt.data {
			switch tt.dtype {
			case "F32":
				data = binary.LittleEndian.AppendUint32(data, math.Float32bits(float32(v)))
			case "F64":
				data = binary.LittleEndian.AppendUint64(data, math.Float64bits(v))
			case "I64":
				data = binary.LittleEndian.AppendUint64(data, uint64(int64(v)))
			default:
				t.Fatalf("dtype %s", tt.dtype)
			}
		}
		header[n] = map[string]any{"dtype": tt.dtype, "shape": tt.shape, "data_offsets": []int{start, len(data)}}
	}
	hj, err := json.Marshal(header)
	if err != nil {
		t.Fatal(err)
	}
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(hj)))
	return append(append(out, hj...), data...)
}

// stateDict is m's posterior under the given layer prefixes, as torchbnn's state_dict() holds it.
func stateDict(m *bnn.Model, prefixes []string, dtype string) map[string]tensor {
	sd := map[string]tensor{}
	for k, l := range m.Layers {
		p := prefixes[k] + "."
		sd[p+"weight_mu"] = tensor{dtype, []int{l.Out, l.In}, l.WeightMu}
		sd[p+"weight_log_sigma"] = tensor{dtype, []int{l.Out, l.In}, l.WeightLogSigma}
		sd[p+"bias_mu"] = tensor{dtype, []int{l.Out}, l.BiasMu}
		sd[p+"bias_log_sigma"] = tensor{dtype, []int{l.Out}, l.BiasLogSigma}
	}
	return sd
}

// testModel is a 5 -> hidden... -> 2 posterior with spread-out log-sigmas and a non-trivial scaler.
func testModel(hidden ...int) *bnn.Model {
	rng := rand.New(rand.NewPCG(7, 8))
	m := bnn.New(5, hidden, []string{"no", "yes"}, 0.1, rng)
	for k := range m.Layers {
		for i := range m.Layers[k].WeightLogSigma {
			m.Layers[k].WeightLogSigma[i] = -4 + rng.Float64()
		}
	}
	for j := range m.Scaler.Mean {
		m.Scaler.Mean[j], m.Scaler.Std[j] = float64(j), 1+float64(j)/2
	}
	return m
}

func opts(m *bnn.Model) Options {
	return Options{Classes: m.Classes, Scaler: &m.Scaler}
}

// TestImportSequentialIsExact: an nn.Sequential state_dict in float64 imports bit for bit, in
// the Sequential's order (index 10 after 2: numeric, not lexical), and bnn.Save / bnn.Load keep it.
func TestImportSequentialIsExact(t *testing.T) {
	m := testModel(4, 3)
	w := encode(t, stateDict(m, []string{"0", "2", "10"}, "F64"))
	got, err := Import(w, opts(m))
	if err != nil {
		t.Fatal(err)
	}
	if names := []string{got.Layers[0].Name, got.Layers[1].Name, got.Layers[2].Name}; strings.Join(names, ",") != "0,2,10" {
		t.Fatalf("layer order %v", names)
	}
	for k := range m.Layers {
		if !bnn.LayersEqual(&m.Layers[k], &got.Layers[k]) {
			t.Errorf("layer %d differs after import", k)
		}
	}
	if got.PriorSigma != bnn.DefaultPriorSigma || got.Version != 0 || got.Scaler.Std[4] != 3 {
		t.Errorf("prior sigma %v version %d scaler %v", got.PriorSigma, got.Version, got.Scaler)
	}
	dir := t.TempDir()
	if err := bnn.Save(dir, got); err != nil {
		t.Fatal(err)
	}
	back, err := bnn.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	x := [][]float64{{1, 2, 3, 4, 5}, {-3, 0, 7, 1, 2}}
	p1, _ := m.Predict(x, 200, 3)
	p2, _ := back.Predict(x, 200, 3)
	for i := range p1.Mean {
		if p1.Mean[i] != p2.Mean[i] {
			t.Fatalf("predictive differs after import and Save/Load: %v vs %v", p1.Mean, p2.Mean)
		}
	}
}

// TestImportFloat32: torch's default dtype; values are the float32 roundings, widened exactly.
func TestImportFloat32(t *testing.T) {
	m := testModel(4)
	got, err := Import(encode(t, stateDict(m, []string{"net.0", "net.2"}, "F32")), opts(m))
	if err != nil {
		t.Fatal(err)
	}
	for k := range m.Layers {
		for i, v := range m.Layers[k].WeightMu {
			if got.Layers[k].WeightMu[i] != float64(float32(v)) {
				t.Fatalf("layer %d weight_mu[%d] = %v, want float32(%v)", k, i, got.Layers[k].WeightMu[i], v)
			}
		}
	}
}

// TestImportOrderFromShapes: named layers are ordered by the chain of their shapes, whatever
// their names' lexical order says.
func TestImportOrderFromShapes(t *testing.T) {
	m := testModel(4, 3)
	got, err := Import(encode(t, stateDict(m, []string{"z_in", "a_hidden", "m_out"}, "F32")), opts(m))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range got.Layers {
		names = append(names, l.Name)
	}
	if strings.Join(names, ",") != "z_in,a_hidden,m_out" {
		t.Fatalf("order %v", names)
	}
	// Without a scaler the input size is unknown; the chain to 2 outputs is still unique.
	if _, err := Import(encode(t, stateDict(m, []string{"z_in", "a_hidden", "m_out"}, "F32")), Options{Classes: m.Classes}); err != nil {
		t.Fatal(err)
	}
}

// TestImportAmbiguousOrderIsRefused: two 4 x 4 hidden layers chain either way; Import names both
// orders and asks for Layers, which then decides.
func TestImportAmbiguousOrderIsRefused(t *testing.T) {
	m := testModel(4, 4, 4)
	w := encode(t, stateDict(m, []string{"fc1", "fc2", "fc3", "fc4"}, "F32"))
	_, err := Import(w, opts(m))
	var oe *OptionError
	if !errors.As(err, &oe) || oe.Option != "Layers" || !strings.Contains(err.Error(), "ambiguous") ||
		!strings.Contains(err.Error(), "fc1,fc2,fc3,fc4") || !strings.Contains(err.Error(), "fc1,fc3,fc2,fc4") {
		t.Fatalf("got %v, want an ambiguity naming both orders", err)
	}
	o := opts(m)
	o.Layers = []string{"fc1", "fc3", "fc2", "fc4"}
	got, err := Import(w, o)
	if err != nil {
		t.Fatal(err)
	}
	if got.Layers[1].Name != "fc3" || !bnn.LayersEqual(&got.Layers[1], float32Layer(m.Layers[2])) {
		t.Fatalf("explicit order not followed: %s", got.Layers[1].Name)
	}
}

func float32Layer(l bnn.Layer) *bnn.Layer {
	r := func(x []float64) []float64 {
		out := make([]float64, len(x))
		for i, v := range x {
			out[i] = float64(float32(v))
		}
		return out
	}
	return &bnn.Layer{Name: l.Name, In: l.In, Out: l.Out, WeightMu: r(l.WeightMu), WeightLogSigma: r(l.WeightLogSigma),
		BiasMu: r(l.BiasMu), BiasLogSigma: r(l.BiasLogSigma)}
}

// TestImportAcceptsTorchbnnExtras: frozen-noise buffers and prior buffers are checked and left
// out of the model.
func TestImportAcceptsTorchbnnExtras(t *testing.T) {
	m := testModel(4)
	sd := stateDict(m, []string{"0", "2"}, "F32")
	sd["0.weight_eps"] = tensor{"F32", []int{4, 5}, make([]float64, 20)}
	sd["0.bias_eps"] = tensor{"F32", []int{4}, make([]float64, 4)}
	sd["0.prior_mu"] = tensor{"F32", []int{}, []float64{0}}
	sd["0.prior_sigma"] = tensor{"F32", []int{}, []float64{0.1}}
	sd["2.prior_log_sigma"] = tensor{"F32", []int{1}, []float64{math.Log(0.1)}}
	got, err := Import(encode(t, sd), opts(m))
	if err != nil {
		t.Fatal(err)
	}
	_, weights, err := bnn.Encode(got)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(weights), "eps") || strings.Contains(string(weights), "prior") {
		t.Error("extras were written to the model")
	}
}

func TestImportErrors(t *testing.T) {
	m := testModel(4)
	base := func() map[string]tensor { return stateDict(m, []string{"fc1", "fc2"}, "F32") }
	type edit func(sd map[string]tensor, o *Options)
	for _, tc := range []struct {
		name   string
		edit   edit
		option string // "" for a state_dict error
		want   string
	}{
		{"nn.Linear", func(sd map[string]tensor, _ *Options) {
			sd["fc3.weight"] = tensor{"F32", []int{2, 2}, make([]float64, 4)}
		}, "", `tensor "fc3.weight" is not a torchbnn BayesLinear tensor (a deterministic nn.Linear`},
		{"other library", func(sd map[string]tensor, _ *Options) {
			sd["fc1.weight_rho"] = tensor{"F32", []int{4, 5}, make([]float64, 20)}
		}, "", `"fc1.weight_rho" is not a torchbnn`},
		{"no prefix", func(sd map[string]tensor, _ *Options) { sd["weight_mu"] = tensor{"F32", []int{1}, []float64{1}} }, "", `tensor "weight_mu" is not`},
		{"integer buffer", func(sd map[string]tensor, _ *Options) { sd["fc1.prior_mu"] = tensor{"I64", []int{}, []float64{0}} }, "", `tensor "fc1.prior_mu" has unsupported dtype "I64"`},
		{"bias=False", func(sd map[string]tensor, _ *Options) { delete(sd, "fc2.bias_mu"); delete(sd, "fc2.bias_log_sigma") }, "", `layer "fc2" has no tensor "fc2.bias_mu" (a BayesLinear with bias=False`},
		{"log sigma shape", func(sd map[string]tensor, _ *Options) {
			sd["fc1.weight_log_sigma"] = tensor{"F32", []int{5, 4}, make([]float64, 20)}
		}, "", `tensor "fc1.weight_log_sigma" has shape [5 4], want [4 5]`},
		{"eps shape", func(sd map[string]tensor, _ *Options) {
			sd["fc1.bias_eps"] = tensor{"F32", []int{5}, make([]float64, 5)}
		}, "", `"fc1.bias_eps" has shape [5], want [4]`},
		{"weight rank", func(sd map[string]tensor, _ *Options) {
			sd["fc1.weight_mu"] = tensor{"F32", []int{20}, make([]float64, 20)}
		}, "", `"fc1.weight_mu" has shape [20], want (out, in)`},
		{"prior mean", func(sd map[string]tensor, _ *Options) { sd["fc1.prior_mu"] = tensor{"F32", []int{}, []float64{0.5}} }, "", `"fc1.prior_mu" = 0.5`},
		{"prior shape", func(sd map[string]tensor, _ *Options) {
			sd["fc1.prior_sigma"] = tensor{"F32", []int{2}, []float64{0.1, 0.1}}
		}, "", `"fc1.prior_sigma" has shape [2], want a scalar`},
		{"prior sigma", func(sd map[string]tensor, _ *Options) { sd["fc2.prior_sigma"] = tensor{"F32", []int{}, []float64{0.2}} }, "PriorSigma", `"fc2.prior_sigma" says the prior sigma is 0.2`},
		{"prior sigma option", func(_ map[string]tensor, o *Options) { o.PriorSigma = -1 }, "PriorSigma", "prior sigma -1"},
		{"NaN", func(sd map[string]tensor, _ *Options) {
			v := append([]float64(nil), m.Layers[1].BiasMu...)
			v[1] = math.NaN()
			sd["fc2.bias_mu"] = tensor{"F32", []int{2}, v}
		}, "", "fc2.bias_mu[1] = NaN"},
		{"classes", func(_ map[string]tensor, o *Options) { o.Classes = []string{"a", "b", "c"} }, "Classes", `3 class names, but the last layer "fc2" has 2 outputs (tensor "fc2.weight_mu" has shape [2 4])`},
		{"duplicate classes", func(_ map[string]tensor, o *Options) { o.Classes = []string{"a", "a"} }, "Classes", "distinct"},
		{"scaler", func(_ map[string]tensor, o *Options) {
			o.Scaler = &bnn.Scaler{Mean: make([]float64, 3), Std: []float64{1, 1, 1}}
		}, "Scaler", `the scaler has 3 features, but the first layer "fc1" takes 5 inputs`},
		{"scaler std", func(_ map[string]tensor, o *Options) {
			o.Scaler = &bnn.Scaler{Mean: make([]float64, 5), Std: []float64{1, 1, 0, 1, 1}}
		}, "Scaler", "scaler feature 2 has mean 0 and standard deviation 0"},
		{"features", func(_ map[string]tensor, o *Options) { o.Features = []string{"a"} }, "Features", "1 feature names"},
		{"gelu", func(_ map[string]tensor, o *Options) { o.Activation = "gelu" }, "Activation", `unknown activation "gelu" (want relu, tanh or sigmoid)`},
		{"layers unknown", func(_ map[string]tensor, o *Options) { o.Layers = []string{"fc1", "fc9"} }, "Layers", `"fc9" is not a layer of the file`},
		{"layers partial", func(_ map[string]tensor, o *Options) { o.Layers = []string{"fc1"} }, "Layers", "lists 1 of the file's 2 layers"},
		{"layers do not chain", func(_ map[string]tensor, o *Options) { o.Layers = []string{"fc2", "fc1"} }, "", `layer "fc1" (5 -> 4) follows layer "fc2" (4 -> 2) but takes 5 inputs, not 2`},
		// The rules below are pinned one by one.
		{"one class", func(_ map[string]tensor, o *Options) { o.Classes = []string{"yes"} }, "Classes", "1 class names, want one per output logit (at least 2)"},
		{"empty class", func(_ map[string]tensor, o *Options) { o.Classes = []string{"", "b"} }, "Classes", "non-empty"},
		{"prior sigma NaN", func(_ map[string]tensor, o *Options) { o.PriorSigma = math.NaN() }, "PriorSigma", "prior sigma NaN"},
		{"prior sigma Inf", func(_ map[string]tensor, o *Options) { o.PriorSigma = math.Inf(1) }, "PriorSigma", "prior sigma +Inf"},
		{"scaler lengths", func(_ map[string]tensor, o *Options) {
			o.Scaler = &bnn.Scaler{Mean: make([]float64, 5), Std: []float64{1, 1, 1, 1}}
		}, "Scaler", "scaler has 5 means and 4 standard deviations"},
		{"scaler mean NaN", func(_ map[string]tensor, o *Options) {
			o.Scaler = &bnn.Scaler{Mean: []float64{0, math.NaN(), 0, 0, 0}, Std: []float64{1, 1, 1, 1, 1}}
		}, "Scaler", "scaler feature 1 has mean NaN"},
		{"scaler mean Inf", func(_ map[string]tensor, o *Options) {
			o.Scaler = &bnn.Scaler{Mean: []float64{0, 0, math.Inf(-1), 0, 0}, Std: []float64{1, 1, 1, 1, 1}}
		}, "Scaler", "scaler feature 2 has mean -Inf"},
		{"scaler std Inf", func(_ map[string]tensor, o *Options) {
			o.Scaler = &bnn.Scaler{Mean: make([]float64, 5), Std: []float64{1, 1, 1, math.Inf(1), 1}}
		}, "Scaler", "scaler feature 3 has mean 0 and standard deviation +Inf"},
		{"weight zero dimension", func(sd map[string]tensor, _ *Options) { sd["fc1.weight_mu"] = tensor{"F32", []int{0, 5}, nil} }, "", `"fc1.weight_mu" has shape [0 5], want (out, in)`},
		{"weight eps shape", func(sd map[string]tensor, _ *Options) {
			sd["fc1.weight_eps"] = tensor{"F32", []int{5, 4}, make([]float64, 20)}
		}, "", `"fc1.weight_eps" has shape [5 4], want [4 5]`},
		{"no bias_log_sigma", func(sd map[string]tensor, _ *Options) { delete(sd, "fc2.bias_log_sigma") }, "", `layer "fc2" has no tensor "fc2.bias_log_sigma" (a BayesLinear with bias=False`},
		{"nn.Linear bias", func(sd map[string]tensor, _ *Options) {
			sd["fc3.bias"] = tensor{"F32", []int{2}, make([]float64, 2)}
		}, "", `tensor "fc3.bias" is not a torchbnn BayesLinear tensor (a deterministic nn.Linear`},
		{"no tensors", func(sd map[string]tensor, _ *Options) { clear(sd) }, "", "no tensors"},
		{"empty prior", func(sd map[string]tensor, _ *Options) { sd["fc1.prior_sigma"] = tensor{"F32", []int{0}, nil} }, "", `"fc1.prior_sigma" has shape [0], want a scalar`},
		{"negative prior mean", func(sd map[string]tensor, _ *Options) { sd["fc1.prior_mu"] = tensor{"F32", []int{}, []float64{-0.5}} }, "", `"fc1.prior_mu" = -0.5`},
		// 0.10005 is 5e-4 away from 0.1: far beyond float32 rounding.
		{"prior sigma near", func(sd map[string]tensor, _ *Options) {
			sd["fc2.prior_sigma"] = tensor{"F64", []int{}, []float64{0.10005}}
		}, "PriorSigma", `"fc2.prior_sigma" says the prior sigma is 0.10005`},
		{"layers twice", func(_ map[string]tensor, o *Options) { o.Layers = []string{"fc1", "fc1"} }, "Layers", `"fc1" is not a layer of the file, or is listed twice`},
		// Ten 4 x 4 layers, none with 2 outputs, any input size: 10! orders to try, none complete. The
		// search gives up at maxSearch and says so, rather than blaming the classes.
		{"search bound", func(sd map[string]tensor, o *Options) {
			clear(sd)
			o.Scaler = nil // any input size
			for k := range 10 {
				p := fmt.Sprintf("h%d.", k)
				sd[p+"weight_mu"] = tensor{"F32", []int{4, 4}, make([]float64, 16)}
				sd[p+"weight_log_sigma"] = tensor{"F32", []int{4, 4}, make([]float64, 16)}
				sd[p+"bias_mu"] = tensor{"F32", []int{4}, make([]float64, 4)}
				sd[p+"bias_log_sigma"] = tensor{"F32", []int{4}, make([]float64, 4)}
			}
		}, "Layers", "too many candidate orders"},
		// A thousand 1 x 1 layers: the search's work is bounded, not its partial orders (each of
		// which considers every layer), and the error lists 16 layers, not a thousand.
		{"a thousand square layers", func(sd map[string]tensor, o *Options) {
			clear(sd)
			o.Scaler = nil
			for k := range 1000 {
				p := fmt.Sprintf("h%d.", k)
				sd[p+"weight_mu"] = tensor{"F32", []int{1, 1}, []float64{0}}
				sd[p+"weight_log_sigma"] = tensor{"F32", []int{1, 1}, []float64{0}}
				sd[p+"bias_mu"] = tensor{"F32", []int{1}, []float64{0}}
				sd[p+"bias_log_sigma"] = tensor{"F32", []int{1}, []float64{0}}
			}
		}, "Layers", "(1 -> 1), and 984 more to search"},
		{"no weight_mu", func(sd map[string]tensor, _ *Options) { delete(sd, "fc1.weight_mu") }, "", `layer "fc1" has no tensor "fc1.weight_mu"`},
		{"no weight_log_sigma", func(sd map[string]tensor, _ *Options) { delete(sd, "fc1.weight_log_sigma") }, "", `layer "fc1" has no tensor "fc1.weight_log_sigma"`},
		{"weight zero inputs", func(sd map[string]tensor, _ *Options) { sd["fc1.weight_mu"] = tensor{"F32", []int{4, 0}, nil} }, "", `"fc1.weight_mu" has shape [4 0], want (out, in)`},
		{"bias_mu shape", func(sd map[string]tensor, _ *Options) {
			sd["fc2.bias_mu"] = tensor{"F32", []int{1, 2}, make([]float64, 2)}
		}, "", `"fc2.bias_mu" has shape [1 2], want [2]`},
		{"bias_log_sigma shape", func(sd map[string]tensor, _ *Options) {
			sd["fc2.bias_log_sigma"] = tensor{"F32", []int{3}, make([]float64, 3)}
		}, "", `"fc2.bias_log_sigma" has shape [3], want [2]`},
		// 0.1000005 is 5e-6 (relative) from 0.1, some 80 float32 roundings.
		{"prior sigma beyond float32 rounding", func(sd map[string]tensor, _ *Options) {
			sd["fc2.prior_sigma"] = tensor{"F64", []int{}, []float64{0.1000005}}
		}, "PriorSigma", `"fc2.prior_sigma" says the prior sigma is 0.1000005`},
		{"no chain", func(sd map[string]tensor, _ *Options) {
			sd["fc2.weight_mu"] = tensor{"F32", []int{2, 3}, make([]float64, 6)}
			sd["fc2.weight_log_sigma"] = tensor{"F32", []int{2, 3}, make([]float64, 6)}
		}, "", "form no chain from 5 inputs to 2 outputs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sd, o := base(), opts(m)
			tc.edit(sd, &o)
			_, err := Import(encode(t, sd), o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want %q", err, tc.want)
			}
			var oe *OptionError
			switch {
			case tc.option == "" && !errors.Is(err, ErrStateDict):
				t.Errorf("%v does not wrap ErrStateDict", err)
			case tc.option != "" && (!errors.As(err, &oe) || oe.Option != tc.option):
				t.Errorf("%v is not an OptionError for %s", err, tc.option)
			}
		})
	}
	// Sequential indices fix the order, so a Sequential whose indices do not chain is refused
	// even though another order would.
	sd := stateDict(m, []string{"4", "2"}, "F32")
	if _, err := Import(encode(t, sd), opts(m)); err == nil || !strings.Contains(err.Error(), `layer "4" (5 -> 4) follows layer "2" (4 -> 2)`) {
		t.Errorf("non-chaining Sequential: %v", err)
	}
	if _, err := Import([]byte("not safetensors"), opts(m)); !errors.Is(err, ErrStateDict) {
		t.Errorf("garbage: %v", err)
	}
}

// TestImportLongNamedChain: a hundred named layers (no Sequential indices) whose sizes decide
// their order, 102 -> 101 -> ... -> 2, import in that order: the search's bound leaves room for
// models far deeper than a BNN's.
func TestImportLongNamedChain(t *testing.T) {
	hidden := make([]int, 0, 99)
	for s := 101; s >= 3; s-- {
		hidden = append(hidden, s)
	}
	m := bnn.New(102, hidden, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	names := make([]string, len(m.Layers))
	for k := range names {
		names[k] = fmt.Sprintf("h%d", (k*37)%len(names)) // names that do not give the order
	}
	got, err := Import(encode(t, stateDict(m, names, "F32")), opts(m))
	if err != nil {
		t.Fatal(err)
	}
	for k, l := range got.Layers {
		if l.Name != names[k] || l.In != m.Layers[k].In {
			t.Fatalf("layer %d is %q (%d -> %d), want %q (%d -> %d)", k, l.Name, l.In, l.Out, names[k], m.Layers[k].In, m.Layers[k].Out)
		}
	}
}

// TestImportedModelUpdates: an imported model, with torch's layer names, is a working cfguard
// posterior: the last-layer update accepts it, changes only that layer, and KL sees the change.
func TestImportedModelUpdates(t *testing.T) {
	m := testModel(4, 3)
	got, err := Import(encode(t, stateDict(m, []string{"0", "2", "4"}, "F32")), opts(m))
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	var X [][]float64
	var y []int
	for i := 0; i < 32; i++ {
		x := make([]float64, 5)
		for j := range x {
			x[j] = rng.NormFloat64() * 3
		}
		X, y = append(X, x), append(y, i%2)
	}
	next, _, err := update.LastLayer(context.Background(), got, X, y, update.Config{LR: 1e-2})
	if err != nil {
		t.Fatal(err)
	}
	kl, _, err := certify.KL(next, got)
	if err != nil || !(kl > 0) || !bnn.SameBody(next, got) || next.Last().Name != "4" || next.Version != 1 {
		t.Fatalf("kl %v (%v), same body %v, last layer %q, version %d", kl, err, bnn.SameBody(next, got), next.Last().Name, next.Version)
	}
}

// TestImportActivation: --activation reaches the model and its model.json, and the predictive
// is the one of that activation (equal to the source model's with the same activation, and not
// to the ReLU one).
func TestImportActivation(t *testing.T) {
	for _, act := range []bnn.Activation{bnn.Tanh, bnn.Sigmoid} {
		m := testModel(4, 3)
		m.Activation = act
		w := encode(t, stateDict(m, []string{"0", "2", "10"}, "F64"))
		o := opts(m)
		o.Activation = act.String()
		got, err := Import(w, o)
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		if err := bnn.Save(dir, got); err != nil {
			t.Fatal(err)
		}
		back, err := bnn.Load(dir)
		if err != nil {
			t.Fatal(err)
		}
		if back.Activation != act {
			t.Fatalf("%v: imported and reloaded as %v", act, back.Activation)
		}
		x := [][]float64{{1, 2, 3, 4, 5}, {-3, 0, 7, 1, 2}}
		want, _ := m.Predict(x, 200, 3)
		got2, _ := back.Predict(x, 200, 3)
		relu := m.Clone()
		relu.Activation = bnn.ReLU
		other, _ := relu.Predict(x, 200, 3)
		same, differs := true, false
		for i := range want.Mean {
			same = same && want.Mean[i] == got2.Mean[i]
			differs = differs || other.Mean[i] != got2.Mean[i]
		}
		if !same || !differs {
			t.Fatalf("%v: predictive equal to the source's: %v, differs from ReLU's: %v", act, same, differs)
		}
	}
}

// TestImportOrderEndsAtTheClasses: without a scaler, the last layer's output size (the number
// of classes) is what picks the order: 3 -> 4 -> 3 and 4 -> 3 -> 4 both chain, only the first
// ends in 3 logits.
func TestImportOrderEndsAtTheClasses(t *testing.T) {
	m := bnn.New(3, []int{4}, []string{"a", "b", "c"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	got, err := Import(encode(t, stateDict(m, []string{"fc1", "fc2"}, "F64")), Options{Classes: m.Classes})
	if err != nil {
		t.Fatal(err)
	}
	if got.Layers[0].Name != "fc1" || got.Layers[1].Name != "fc2" {
		t.Fatalf("order %s, %s", got.Layers[0].Name, got.Layers[1].Name)
	}
}

// TestImportNotSequential: prefixes that are not nn.Sequential indices under one parent (two
// parents; a negative "index"; one past 31 bits) are ordered by their shapes, not by their trailing numbers.
func TestImportNotSequential(t *testing.T) {
	m := testModel(4) // 5 -> 4 -> 2
	// 2147483648 does not fit the 31 bits of an nn.Sequential index.
	for _, prefixes := range [][]string{{"a.1", "b.0"}, {"0", "-1"}, {"2147483648", "0"}} {
		// prefixes[0] is the first layer; its trailing number sorts after prefixes[1]'s.
		got, err := Import(encode(t, stateDict(m, prefixes, "F64")), opts(m))
		if err != nil {
			t.Fatalf("%v: %v", prefixes, err)
		}
		if got.Layers[0].Name != prefixes[0] {
			t.Errorf("%v: order %s, %s", prefixes, got.Layers[0].Name, got.Layers[1].Name)
		}
	}
}

// TestImportCopiesOptions: the model does not share the caller's slices; changing the options
// after Import leaves it as imported.
func TestImportCopiesOptions(t *testing.T) {
	m := testModel(4)
	o := Options{Classes: []string{"no", "yes"}, Scaler: &bnn.Scaler{Mean: append([]float64(nil), m.Scaler.Mean...),
		Std: append([]float64(nil), m.Scaler.Std...)}, Features: []string{"a", "b", "c", "d", "e"}}
	got, err := Import(encode(t, stateDict(m, []string{"0", "2"}, "F64")), o)
	if err != nil {
		t.Fatal(err)
	}
	o.Classes[0], o.Scaler.Mean[0], o.Scaler.Std[0], o.Features[0] = "changed", 99, 99, "changed"
	if got.Classes[0] != "no" || got.Scaler.Mean[0] != m.Scaler.Mean[0] || got.Scaler.Std[0] != m.Scaler.Std[0] || got.Features[0] != "a" {
		t.Fatalf("the model shares the options' slices: %v %v %v", got.Classes, got.Scaler, got.Features)
	}
}
