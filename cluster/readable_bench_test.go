package cluster

import (
	"encoding/json"
	"testing"

	"github.com/cfguard/cfguard/ceshare"
)

// BenchmarkReadable measures what the strict check of a registration's CE (readable, on every
// registration an owner reads) costs, on a CE of the bundled data set's size (30 features), against
// the decode that Apply makes of the same bytes. Compare with daemon's BenchmarkRegisterAtReplica:
//
//	go test ./cluster ./daemon -run '^$' -bench 'Readable|RegisterAtReplica/own' -benchtime 100x -count 6
func BenchmarkReadable(b *testing.B) {
	x := make([]float64, 30)
	for i := range x {
		x[i] = 0.1234567 * float64(i+1)
	}
	raw, err := json.Marshal(Measured{X: x, XCF: x, Target: 1, AnchorVersion: 1234, P1: 0.93, Var1: 0.004, Samples: 1000, Delta: 0.5, Epsilon: 0.1})
	if err != nil {
		b.Fatal(err)
	}
	r := ceshare.Request{Kind: ceshare.KindRegister, ID: "ce-1", CE: raw}
	b.Run("readable", func(b *testing.B) {
		for b.Loop() {
			if err := readable(r); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("apply-decode", func(b *testing.B) {
		for b.Loop() {
			var ce Measured
			if err := json.Unmarshal(r.CE, &ce); err != nil {
				b.Fatal(err)
			}
		}
	})
}
