package ledger

import (
	"maps"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

// A batch measured under a past version v renews certificates to a new anchor v, whose history
// comes from the posteriors past gives: when past no longer holds v itself (the daemon keeps the
// last 256 it served) but holds the versions after it, the renewal is written all the same, with
// the sampled posterior as the anchor's (the history needs KL(q_x || q_v)).
func TestRenewalUnderAPastVersionPastNoLongerHolds(t *testing.T) {
	l, dir, m0, _ := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return spreadCEs(t, m0, rand.New(rand.NewPCG(16, 16)), 40) })
	past := map[uint64]*bnn.Model{m0.Version: m0}
	cur := m0
	for _, d := range []float64{-0.005, -0.004, -0.007, -0.01} {
		cur = driftBy(t, l, cur, d)
		past[cur.Version] = cur
	}
	v := m0.Version + 2
	given := maps.Clone(past)
	delete(given, v) // forgotten: the versions after it are kept
	rep, _, err := l.ConfirmLaneLeaving(bg, posteriorPredictor{NewModelPredictor(past[v], 300, v)}, 1000, 0, 1, pastOf(given), nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Renewed == 0 {
		t.Fatalf("%+v: no renewal under version %d, the test cannot tell anything", rep, v)
	}
	anchors, err := l.Anchors()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(anchors, func(a Anchor) bool { return a.Version == v && a.Refs > 0 }) {
		t.Fatalf("anchors %+v: none at version %d", anchors, v)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := Verify(filepath.Join(dir, FileName)); err != nil {
		t.Fatalf("Verify: %v", err)
	}
}
