package explain

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/safetensors"
)

func TestVAEFileRoundTrip(t *testing.T) {
	m, v, set := blobFixture(t)
	dir := t.TempDir()
	if err := bnn.Save(dir, m); err != nil {
		t.Fatal(err)
	}
	if err := SaveVAE(dir, v); err != nil {
		t.Fatal(err)
	}
	got, err := LoadVAE(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got.Inputs != v.Inputs || got.Hidden != v.Hidden || got.Latent != v.Latent || got.ObsVar != v.ObsVar {
		t.Fatalf("architecture %d/%d/%d/%v, want %d/%d/%d/%v", got.Inputs, got.Hidden, got.Latent, got.ObsVar, v.Inputs, v.Hidden, v.Latent, v.ObsVar)
	}
	for i, nl := range v.layers() {
		gl := got.layers()[i]
		if !equalFloats(gl.l.W, nl.l.W) || !equalFloats(gl.l.B, nl.l.B) {
			t.Errorf("layer %s differs after the round trip", nl.name)
		}
	}
	// The loaded VAE still fits the (reloaded) model it was saved beside.
	m2, err := bnn.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := got.Compatible(m2); err != nil {
		t.Error(err)
	}
	z, _ := standardize(m, set.X[:1])
	e := []float64{0.3, -1.2}
	if a, b := v.ELBOWith(z[0], e), got.ELBOWith(z[0], e); a != b {
		t.Errorf("ELBO %v before, %v after", a, b)
	}
}

// TestVAELoadRejects corrupts a saved VAE in every way we know and checks that LoadVAE refuses
// with an error wrapping ErrVAEFile (or the os error for a missing file) that says what is wrong.
func TestVAELoadRejects(t *testing.T) {
	_, v, _ := blobFixture(t)
	js, w, err := EncodeVAE(v)
	if err != nil {
		t.Fatal(err)
	}
	resum := func(sc map[string]any, weights []byte) []byte {
		sum := sha256.Sum256(weights)
		sc["weights_sha256"] = hex.EncodeToString(sum[:])
		b, _ := json.Marshal(sc)
		return b
	}
	sidecar := func(edit func(map[string]any)) []byte {
		var sc map[string]any
		if err := json.Unmarshal(js, &sc); err != nil {
			t.Fatal(err)
		}
		edit(sc)
		b, _ := json.Marshal(sc)
		return b
	}
	// Weights re-encoded with a change, with a sidecar whose checksum matches them, so that the
	// structural checks behind the checksum are exercised too.
	reencode := func(edit func(map[string]safetensors.Tensor)) (sc, weights []byte) {
		ts, _, err := safetensors.Decode(w)
		if err != nil {
			t.Fatal(err)
		}
		edit(ts)
		weights, err = safetensors.Encode(ts, nil)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		json.Unmarshal(js, &m)
		return resum(m, weights), weights
	}
	flipped := append([]byte(nil), w...)
	flipped[len(flipped)-3] ^= 0x40
	nanSC, nanW := reencode(func(ts map[string]safetensors.Tensor) { ts["decoder.out.bias"].Data[1] = math.NaN() })
	extraSC, extraW := reencode(func(ts map[string]safetensors.Tensor) {
		ts["decoder.extra"] = safetensors.Tensor{Shape: []int{1}, Data: []float64{1}}
	})
	missSC, missW := reencode(func(ts map[string]safetensors.Tensor) { delete(ts, "encoder.mu.bias") })
	shapeSC, shapeW := reencode(func(ts map[string]safetensors.Tensor) {
		ts["encoder.mu.weight"] = safetensors.Tensor{Shape: []int{v.Hidden, v.Latent}, Data: ts["encoder.mu.weight"].Data}
	})
	for _, tc := range []struct {
		name     string
		sc, w    []byte
		want     string
		notVAEFE bool
	}{
		{"truncated weights", js, w[:len(w)-16], "sha256", false},
		{"flipped byte", js, flipped, "sha256", false},
		{"empty weights", js, nil, "sha256", false},
		{"sidecar not json", []byte("{"), w, "vae.json", false},
		{"wrong format", sidecar(func(m map[string]any) { m["format"] = "cfguard-bnn" }), w, `format "cfguard-bnn"`, false},
		{"wrong version", sidecar(func(m map[string]any) { m["format_version"] = 2 }), w, "version 2", false},
		{"latent mismatch", sidecar(func(m map[string]any) { m["latent"] = v.Latent + 1 }), w, "shape", false},
		{"zero obs var", sidecar(func(m map[string]any) { m["obs_var"] = 0 }), w, "obs_var 0", false},
		{"short scaler", sidecar(func(m map[string]any) {
			m["scaler"] = map[string]any{"mean": []float64{0}, "std": []float64{1}}
		}), w, "scaler has 1/1 entries", false},
		{"nan weight", nanSC, nanW, "decoder.out: bias[1] = NaN", false},
		{"extra tensor", extraSC, extraW, "decoder.extra", false},
		{"missing tensor", missSC, missW, `no tensor "encoder.mu.bias"`, false},
		{"transposed tensor", shapeSC, shapeW, `"encoder.mu.weight" has shape`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			os.WriteFile(filepath.Join(dir, VAESidecarFile), tc.sc, 0o644)
			os.WriteFile(filepath.Join(dir, VAEWeightsFile), tc.w, 0o644)
			got, err := LoadVAE(dir)
			if got != nil || !errors.Is(err, ErrVAEFile) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got (%v, %v), want ErrVAEFile containing %q", got != nil, err, tc.want)
			}
		})
	}
	t.Run("missing file", func(t *testing.T) {
		dir := t.TempDir()
		os.WriteFile(filepath.Join(dir, VAESidecarFile), js, 0o644)
		if _, err := LoadVAE(dir); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("got %v, want a not-exist error", err)
		}
	})
	t.Run("save refuses nan", func(t *testing.T) {
		bad := *v
		bad.out.B = append([]float64(nil), v.out.B...)
		bad.out.B[0] = math.Inf(1)
		if err := SaveVAE(t.TempDir(), &bad); err == nil || !strings.Contains(err.Error(), "+Inf") {
			t.Fatalf("got %v", err)
		}
	})
}

// TestVAELearnsTheData checks that training does what the ELBO says: the trained VAE's ELBO is
// higher on held-out breast-cancer rows than on the same rows with every feature independently
// shuffled across rows (same marginals, correlations destroyed), and its training loss beats the
// best "null" model with independent N(0, 1) features, (D/2)(log 2 pi + 1) per row.
func TestVAELearnsTheData(t *testing.T) {
	set, ds, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	train, test := set.Split(0.8, 2)
	m := bnn.New(len(set.Features), []int{4}, ds.Classes, 0.1, rand.New(rand.NewPCG(1, 1)))
	m.Scaler = bnn.FitScaler(train.X)
	epochs := 60
	if testing.Short() {
		epochs = 25
	}
	v, st, err := TrainVAE(context.Background(), m, train.X, TrainConfig{Seed: 3, Epochs: epochs})
	if err != nil {
		t.Fatal(err)
	}
	d := float64(len(set.Features))
	null := d / 2 * (math.Log(2*math.Pi) + 1)
	if st.Loss > null-5 {
		t.Errorf("training -ELBO %v per row, null model %v", st.Loss, null)
	}
	Z, _ := standardize(m, test.X)
	rng := rand.New(rand.NewPCG(4, 4))
	shuffled := make([][]float64, len(Z))
	for i := range shuffled {
		shuffled[i] = make([]float64, len(Z[0]))
	}
	for j := range Z[0] {
		p := rng.Perm(len(Z))
		for i := range Z {
			shuffled[i][j] = Z[p[i]][j]
		}
	}
	real, shuf := 0.0, 0.0
	for i := range Z {
		real += v.ELBO(Z[i], 20, rng) / float64(len(Z))
		shuf += v.ELBO(shuffled[i], 20, rng) / float64(len(Z))
	}
	t.Logf("loss %.2f (null %.2f); held-out ELBO %.2f, shuffled %.2f", st.Loss, null, real, shuf)
	if real < shuf+5 {
		t.Errorf("held-out ELBO %v not clearly above shuffled rows' %v", real, shuf)
	}
}

// TestAESeparatesClasses: an AE trained on one class reconstructs held-out rows of that class
// better than rows of the other class, which is what IM1 relies on.
func TestAESeparatesClasses(t *testing.T) {
	set, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	train, test := set.Split(0.8, 3)
	sc := bnn.FitScaler(train.X)
	std := func(X [][]float64) [][]float64 {
		out := make([][]float64, len(X))
		for i, x := range X {
			out[i] = make([]float64, len(x))
			sc.Apply(out[i], x)
		}
		return out
	}
	Ztr, Zte := std(train.X), std(test.X)
	var own [][]float64
	for i, z := range Ztr {
		if train.Y[i] == 0 {
			own = append(own, z)
		}
	}
	epochs := 80
	if testing.Short() {
		epochs = 30
	}
	ae, loss, err := TrainAE(context.Background(), own, TrainConfig{Seed: 1, Epochs: epochs})
	if err != nil {
		t.Fatal(err)
	}
	errs := [2]float64{}
	n := [2]int{}
	for i, z := range Zte {
		errs[test.Y[i]] += ae.Error(z)
		n[test.Y[i]]++
	}
	e0, e1 := errs[0]/float64(n[0]), errs[1]/float64(n[1])
	t.Logf("training loss %.3f; held-out error own class %.3f, other class %.3f", loss, e0, e1)
	if !(e0 < e1) {
		t.Errorf("own-class error %v not below other-class error %v", e0, e1)
	}
	if _, _, err := TrainAE(context.Background(), [][]float64{{1, math.NaN()}}, TrainConfig{}); err == nil || !strings.Contains(err.Error(), "row 0 feature 1 is NaN") {
		t.Errorf("NaN row: %v", err)
	}
}

// TestVAELossIsTheMeanNegativeELBO: the loss the VAE is trained on is, on a batch with given
// noise, the mean over rows of -ELBO (ELBOWith, the plain-Go ELBO PSCE differentiates) without
// its constant (D/2) log(2 pi ObsVar), to rounding: the reconstruction term over 2 ObsVar and
// the KL term (1/2) sum_k (mu^2 + exp(logvar) - logvar - 1), each averaged over the batch.
func TestVAELossIsTheMeanNegativeELBO(t *testing.T) {
	m, v, set := blobFixture(t)
	Z, err := standardize(m, set.X[:5])
	if err != nil {
		t.Fatal(err)
	}
	tr := newTrainer(len(Z), v.Inputs, v.Latent)
	if err := tr.compile(v.lossGraph(tr)); err != nil {
		t.Fatal(err)
	}
	defer tr.vm.Close()
	rng := rand.New(rand.NewPCG(4, 2))
	xb, eb := tr.xv.Data().([]float64), tr.ev.Data().([]float64)
	want := 0.0
	for i, z := range Z {
		copy(xb[i*v.Inputs:], z)
		e := eb[i*v.Latent : (i+1)*v.Latent]
		for k := range e {
			e[k] = 2 * rng.NormFloat64() // wide draws: the latent's variance counts
		}
		want -= v.ELBOWith(z, e) / float64(len(Z))
	}
	want -= float64(v.Inputs) / 2 * math.Log(2*math.Pi*v.ObsVar)
	if err := tr.vm.RunAll(); err != nil {
		t.Fatal(err)
	}
	if got := tr.lossVal.Data().(float64); math.Abs(got-want) > 1e-9*math.Max(1, math.Abs(want)) {
		t.Fatalf("graph loss %.12g, mean -ELBO without its constant %.12g", got, want)
	}
}
