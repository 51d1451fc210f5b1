package ledger

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/bnn"
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

// BenchmarkListVerdictsPending lists 1,000 CEs whose verdicts, measured under a few versions of
// a drift, no longer carry after 250 more versions: with the posteriors of every version held
// (Options.Past, as the daemon holds its last 256) each verdict's verdict_pending_since is
// computed (once per verdict version: KL(q_x || q_cv) for every version x since), without them
// it is not. The ratio of the two is what the version costs a list.
//
//	go test -run '^$' -bench ListVerdictsPending ./ledger
func BenchmarkListVerdictsPending(b *testing.B) {
	for _, held := range []bool{true, false} {
		b.Run(fmt.Sprintf("past=%v", held), func(b *testing.B) {
			past := map[uint64]*bnn.Model{}
			opts := Options{Policy: testPolicy()}
			if held {
				opts.Past = pastOf(past)
			}
			l, _ := openTest(b, opts)
			cur := testModel(4)
			install(b, l, cur)
			past[cur.Version] = cur
			if err := l.Put(bg, spreadCEs(b, cur, rand.New(rand.NewPCG(1, 2)), 1000)...); err != nil {
				b.Fatal(err)
			}
			for _, d := range []float64{-0.3, -0.3, -0.3} {
				cur = driftBy(b, l, cur, d)
				past[cur.Version] = cur
				measureDue(b, l, past)
			}
			for range 250 {
				cur = driftBy(b, l, cur, -0.004)
				past[cur.Version] = cur
			}
			ces, err := l.List(0, 1000, "")
			if err != nil {
				b.Fatal(err)
			}
			pending, since := 0, 0
			for _, ce := range ces {
				if ce.VerdictPending && ce.VerdictBound != nil {
					pending++
				}
				if ce.VerdictPendingSince != nil {
					since++
				}
			}
			if pending < 100 || held != (since == pending) || !held && since != 0 {
				b.Fatalf("%d of %d CEs with a verdict that stopped carrying, %d saying since when: want 100 or more, every one of them with the posteriors held, none without",
					pending, len(ces), since)
			}
			b.ResetTimer()
			for range b.N {
				if _, err := l.List(0, 1000, ""); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(pending), "pending-verdicts")
		})
	}
}
