package serving

import (
	"fmt"
	"testing"
	"time"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
)

// TestModelIsOneSnapshot: GET /v1/model, read while increments are promoted, reports the
// posterior version of the checkpoint whose applied count and offsets it reports (each increment
// of 32 records is one version), never the ledger's new state beside the previous posterior.
func TestModelIsOneSnapshot(t *testing.T) {
	r := launch.Daemon(t, nil)
	v0 := r.Model(t)
	if v0.Applied != 0 {
		t.Fatalf("a fresh daemon reports %d applied records", v0.Applied)
	}
	data := daemontest.Bundled(t)
	const increments = 12
	var recs [][]byte
	for i := 0; i < increments*32; i++ {
		recs = append(recs, daemontest.Record(fmt.Sprintf("s%d", i), data.X[i%len(data.X)], data.Y[i%len(data.Y)]))
	}
	r.Produce(t, recs...)
	deadline := time.Now().Add(60 * time.Second)
	reads := 0
	for {
		v := r.Model(t)
		reads++
		if want := v0.Version + uint64(v.Applied/32); v.Version != want || v.Offsets["0"] != v.Applied {
			t.Fatalf("read %d: posterior version %d with %d records applied up to offset %d; want version %d (one per increment of 32)",
				reads, v.Version, v.Applied, v.Offsets["0"], want)
		}
		if n := len(v.History); n > 0 && v.History[n-1].Version != v.Version {
			t.Fatalf("read %d: posterior version %d, but the last KL history entry is version %d", reads, v.Version, v.History[n-1].Version)
		}
		if v.Applied == increments*32 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d records applied within 60 s", v.Applied, increments*32)
		}
	}
	t.Logf("%d consistent reads while %d increments were promoted", reads, increments)
}
