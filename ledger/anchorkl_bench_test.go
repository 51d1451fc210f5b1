package ledger

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/certify"
)

// BenchmarkCommitAnchors is one increment's checkpoint with many live anchors (one CE each,
// registered one version apart) while the posterior moves away from all of them: every anchor's
// KL rises at every version, the worst case for the anchors' KL histories (each entry is kept,
// up to their horizon). Warmed past that horizon, so that what is timed is the steady state.
func BenchmarkCommitAnchors(b *testing.B) {
	for _, n := range []int{16, 256} {
		b.Run(fmt.Sprintf("anchors=%d", n), func(b *testing.B) {
			l, _ := openTest(b, Options{Policy: testPolicy()})
			cur := testModel(4)
			install(b, l, cur)
			rng := rand.New(rand.NewPCG(1, 2))
			step := func() {
				cur = drift(cur, 1e-6)
				if _, _, err := l.Commit(bg, &Checkpoint{Model: cur, Update: &UpdateRecord{Version: cur.Version, KL: 5e-11,
					Outcome: certify.OutcomePromoted}}); err != nil {
					b.Fatal(err)
				}
			}
			for range n {
				if err := l.Put(bg, newCE(b, cur, rng)); err != nil {
					b.Fatal(err)
				}
				step()
			}
			for range 1124 { // past the KL histories' horizon (anchorKLHorizon)
				step()
			}
			b.ResetTimer()
			for range b.N {
				step()
			}
		})
	}
}
