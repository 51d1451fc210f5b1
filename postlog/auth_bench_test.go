package postlog

import (
	"encoding/hex"
	"testing"

	"github.com/cfguard/cfguard/internal/clusterkey"
)

// benchRecords are a chain's records for the benchmarks: the genesis, a claim and a promoted
// increment of the test model, each authenticated, the claim and the increment naming the
// genesis as the updater writes them (Head.Lineage).
func benchRecords(b *testing.B) (setup []Record, inc Record) {
	t := &testing.T{}
	l, g := newTestLog(t)
	gv := l.value(g)
	gh := Hash(gv)
	head := &Head{GenesisHash: hex.EncodeToString(gh[:])}
	c1 := l.claim(gv, g, 1, "a/1")
	head.Lineage(c1)
	c1v := l.value(c1)
	i1 := l.increment(c1v, c1, 1, "a/1", 10, 0.1)
	head.Lineage(i1)
	iv := l.value(i1)
	if t.Failed() {
		b.Fatal("building the records failed")
	}
	return []Record{signed(0, gv), signed(1, c1v)}, signed(2, iv)
}

// BenchmarkOfferIncrement is the follower's judgement of one increment, with its authentication
// (Offer) and without it (the acceptance rule alone); BenchmarkSignIncrement the updater's cost.
// The bytes per entry an authenticator adds are reported as auth-bytes/op.
func BenchmarkOfferIncrement(b *testing.B) {
	setup, inc := benchRecords(b)
	keys := testKeys()
	for _, bc := range []struct {
		name string
		auth bool
	}{{"authenticated", true}, {"unauthenticated", false}} {
		b.Run(bc.name, func(b *testing.B) {
			c := NewChain(keys)
			for _, r := range setup {
				if _, r, _ := c.Offer(r); r != Accepted {
					b.Fatal(r)
				}
			}
			b.SetBytes(int64(len(inc.Value)))
			b.ReportAllocs()
			for b.Loop() {
				f := c.Fork()
				var reason Reason
				if bc.auth {
					_, reason, _ = f.Offer(inc)
				} else {
					_, reason, _ = f.offer(inc.Offset, inc.Value)
				}
				if reason != Accepted {
					b.Fatal(reason)
				}
			}
			b.ReportMetric(float64(len(inc.Value)), "entry-bytes/op")
			b.ReportMetric(float64(len(clusterkey.Header)+len(inc.Auth)), "auth-bytes/op")
		})
	}
}

func BenchmarkSignIncrement(b *testing.B) {
	_, inc := benchRecords(b)
	keys := testKeys()
	b.SetBytes(int64(len(inc.Value)))
	for b.Loop() {
		Sign(keys, inc.Value)
	}
}
