package bnn

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"
)

// A WeightsHasher's Sum is WeightsSHA256 for every model: along versions that change the last
// layer only (hashed from the kept prefix: its state is not replaced), after a change of another
// layer (by a value, or by 0 becoming -0, which encodes differently), of the last layer's shape
// alone, or of a layer's name (hashed whole, the prefix kept again), for a network whose last
// layer's tensors are not the file's last (eleven layers: "fc11" sorts before "fc2"; nothing
// kept), and for the models Encode refuses, which it refuses too.
func TestWeightsHasherSumsAsWeightsSHA256(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	var h WeightsHasher
	same := func(m *Model, what string) {
		t.Helper()
		want, werr := WeightsSHA256(m)
		got, err := h.Sum(m)
		if got != want || (err == nil) != (werr == nil) {
			t.Fatalf("%s: Sum = %q, %v; WeightsSHA256 = %q, %v", what, got, err, want, werr)
		}
	}
	kept := func() *byte {
		if h.state == nil {
			return nil
		}
		return &h.state[0]
	}
	m := New(30, DefaultHidden, []string{"a", "b"}, 0.1, rng)
	same(m, "a first model")
	state := kept()
	if state == nil {
		t.Fatal("nothing kept for a network whose last layer's tensors end its file")
	}
	for v := range 20 {
		next := m.Clone()
		l := next.Last()
		for _, s := range [][]float64{l.WeightMu, l.WeightLogSigma, l.BiasMu, l.BiasLogSigma} {
			s[rng.IntN(len(s))] += rng.NormFloat64() * 0.01
		}
		next.Version = uint64(v + 1)
		same(next, "a version with another last layer")
		if kept() != state {
			t.Fatalf("version %d: the prefix was hashed again, though only the last layer changed", v+1)
		}
		m = next
	}
	for _, c := range []struct {
		what          string
		before, after func(m *Model)
	}{
		{"another first-layer weight", nil, func(m *Model) { m.Layers[0].WeightMu[3] += 1e-9 }},
		{"0 made -0 in a hidden bias", func(m *Model) { m.Layers[1].BiasMu[0] = 0 }, func(m *Model) { m.Layers[1].BiasMu[0] = math.Copysign(0, -1) }},
		{"another last-layer shape, the same body", nil, func(m *Model) {
			l := m.Last()
			wider := New(l.In, nil, []string{"a", "b", "c"}, 0.1, rand.New(rand.NewPCG(1, 1))).Layers[0]
			wider.Name = l.Name
			*l = wider
			m.Classes = []string{"a", "b", "c"}
		}},
		{"a hidden layer renamed", nil, func(m *Model) { m.Layers[0].Name = "fc0" }},
		{"the last layer renamed", nil, func(m *Model) { m.Last().Name = "fc9" }},
	} {
		if c.before != nil {
			c.before(m)
			same(m, c.what+", before")
			state = kept()
		}
		next := m.Clone()
		c.after(next)
		same(next, c.what)
		if kept() == state {
			t.Fatalf("%s: hashed from the prefix of another body", c.what)
		}
		state = kept()
		m = next
	}
	deep := New(3, []int{4, 4, 4, 4, 4, 4, 4, 4, 4, 4}, []string{"a", "b"}, 0.1, rng)
	same(deep, "eleven layers")
	if h.state != nil {
		t.Fatal("a prefix kept for a file whose last tensors are not the last layer's")
	}
	same(deep, "eleven layers again")
	drop := m.Clone()
	drop.Dropout = 0.2
	if _, err := h.Sum(drop); !errors.Is(err, ErrInvalidModel) {
		t.Errorf("an MC Dropout network: %v, want ErrInvalidModel", err)
	}
	bad := m.Clone()
	bad.Last().BiasMu = bad.Last().BiasMu[:1]
	if _, err := h.Sum(bad); err == nil {
		t.Error("a model whose last layer has the wrong shape: no error")
	}
}
