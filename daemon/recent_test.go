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

// Posteriors recalled after a start (older than the first served) are kept below the newest,
// newest first, sharing the unchanged layers of the version after them; a version held already
// or keep or more below the newest is not.
func TestRecentRecallsOlderVersions(t *testing.T) {
	r := newRecent(4)
	m := bnn.New(3, []int{4}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	m.Version = 10
	var older []*bnn.Model // versions 10 down to 5, each with its own last layer
	for v := 10; v >= 5; v-- {
		c := m.Clone()
		c.Version = uint64(v)
		c.Last().BiasMu[0] = float64(v)
		older = append(older, c)
	}
	r.recall(older[0]) // nothing served yet: nothing to keep it below
	if r.at(10) != nil {
		t.Fatal("a posterior recalled before any was served was kept")
	}
	r.add(older[0])
	for _, c := range older[1:] {
		r.recall(c.Clone())
	}
	r.recall(m.Clone()) // version 10 again
	for v := uint64(5); v <= 10; v++ {
		got := r.at(v)
		if kept := v > 6; (got != nil) != kept {
			t.Fatalf("version %d: kept %v, want %v", v, got != nil, kept)
		}
		if got == nil {
			continue
		}
		if got.Last().BiasMu[0] != float64(v) {
			t.Errorf("version %d holds the last layer of version %v", v, got.Last().BiasMu[0])
		}
		if v < 10 && &got.Layers[0].WeightMu[0] != &r.at(v + 1).Layers[0].WeightMu[0] {
			t.Errorf("version %d: its unchanged first layer is not shared with version %d", v, v+1)
		}
	}
	r.add(&bnn.Model{Version: 11, Layers: m.Layers})
	if r.at(7) != nil || r.at(8) == nil {
		t.Error("a version served after the recall did not push the oldest recalled one out")
	}
}
