package daemon

import (
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

// recent keeps the last keep versions it was given, and forgets the older ones.
func TestRecentKeepsTheLastVersions(t *testing.T) {
	r := newRecent(3)
	for v := range uint64(6) {
		r.add(&bnn.Model{Version: v})
	}
	for v, kept := range []bool{false, false, false, true, true, true, false} {
		if got := r.at(uint64(v)); (got != nil) != kept || got != nil && got.Version != uint64(v) {
			t.Errorf("version %d: %v, want kept %v", v, got, kept)
		}
	}
	var none *recent
	none.add(&bnn.Model{Version: 1})
	if none.at(1) != nil {
		t.Error("a nil recent gave a posterior")
	}
}

// A kept posterior is the one served, parameter for parameter, and its layers that equal the
// previous version's share their arrays: only a changed layer costs memory.
func TestRecentSharesUnchangedLayers(t *testing.T) {
	r := newRecent(4)
	m0 := bnn.New(3, []int{4}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	m1 := m0.Clone()
	m1.Version++
	m1.Last().BiasMu[0] += 0.5
	r.add(m0)
	r.add(m1)
	got := r.at(m1.Version)
	for i := range m1.Layers {
		if !bnn.LayersEqual(&got.Layers[i], &m1.Layers[i]) {
			t.Fatalf("layer %d of the kept posterior differs from the served one", i)
		}
	}
	if &got.Layers[0].WeightMu[0] != &m0.Layers[0].WeightMu[0] {
		t.Error("the unchanged first layer was kept again instead of shared")
	}
	if &got.Last().BiasMu[0] == &m0.Last().BiasMu[0] {
		t.Error("the changed last layer shares the previous version's arrays")
	}
}
