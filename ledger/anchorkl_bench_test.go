package ledger

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/certify"
)

// BenchmarkCommitAnchors is one increment's checkpoint with many live anchors (one CE each,
// registered one version apart) while the posterior moves away from all of them: every anchor's
// KL rises at every version, no certificate lapses. Warmed by 1,124 commits, so that what is
// timed is the steady state.
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
			for range 1124 {
				step()
			}
			b.ResetTimer()
			for range b.N {
				step()
			}
		})
	}
}

// BenchmarkListLapsed lists 1,000 lapsed certificates under 250 anchors (4 each) whose KL rose
// at every one of 1,124 versions: every CE's renewal_pending_since is read.
func BenchmarkListLapsed(b *testing.B) {
	l, _ := openTest(b, Options{Policy: testPolicy()})
	cur := testModel(4)
	install(b, l, cur)
	rng := rand.New(rand.NewPCG(1, 2))
	step := func(d float64) {
		cur = drift(cur, d)
		if _, _, err := l.Commit(bg, &Checkpoint{Model: cur}); err != nil {
			b.Fatal(err)
		}
	}
	for range 250 {
		for range 4 {
			if err := l.Put(bg, newCE(b, cur, rng)); err != nil {
				b.Fatal(err)
			}
		}
		step(1e-6)
	}
	for range 1124 {
		step(-2.8e-6) // away from every anchor: KL(q_now || q_anchor) rises at every version
	}
	if ces, err := l.List(0, 1000, ""); err != nil || len(ces) != 1000 || !ces[0].RenewalPending || ces[0].RenewalPendingSince == nil {
		b.Fatalf("%d CEs listed (%v), the first lapsed %v: want 1000 lapsed", len(ces), err, len(ces) > 0 && ces[0].RenewalPending)
	}
	b.ResetTimer()
	for range b.N {
		if _, err := l.List(0, 1000, ""); err != nil {
			b.Fatal(err)
		}
	}
}
