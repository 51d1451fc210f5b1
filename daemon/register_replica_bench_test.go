package daemon

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
)

// BenchmarkRegisterAtReplica measures one registration's round trip at a replica, from the
// POST to its 201: three replicas run in one process against the in-process broker, and every
// registration is posted to r1, one at a time,
//
//   - own: for an id of a partition r1 owns (r1 measures it, sends it to the CE topic, applies
//     it as the owner and answers the outcome it stored);
//   - other: for an id of a partition another replica owns (the owner applies it, and r1 asks
//     it for the outcome over loopback HTTP).
//
// Run:
//
//	go test ./daemon -run '^$' -bench RegisterAtReplica -benchtime 100x -count 6
//
// cpu-us/op is the CPU time of the whole process per registration. other runs an own
// registration before each of its own, with the timer stopped and timed apart, and reports
// other/own of time and of CPU time (alternate).
func BenchmarkRegisterAtReplica(b *testing.B) {
	_, reps := daemontest.StartThreeReplicas(b, startNoWait)
	r := reps[0]
	data := daemontest.Bundled(b)
	_, xs, cfs := daemontest.CandidatePairs(b, r.D.current(), data, 400, 1)
	if len(xs) == 0 || len(cfs) == 0 {
		b.Fatalf("no candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	owned := r.D.share.Member().Owned()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2}}
	b.Cleanup(client.CloseIdleConnections)
	k := 0
	register := func(own bool) func() error {
		return func() error {
			for {
				k++
				id := fmt.Sprintf("reg-%07d", k)
				if slices.Contains(owned, ceshare.Partition(id, r.D.share.Partitions())) != own {
					continue
				}
				body, err := json.Marshal(map[string]any{"id": id, "x": data.X[xs[k%len(xs)]], "x_cf": data.X[cfs[k%len(cfs)]], "target": "benign"})
				if err != nil {
					return err
				}
				return postCE(client, r.Base, body)
			}
		}
	}
	b.Run("own", func(b *testing.B) { alternate(b, register(true), nil, "") })
	b.Run("other", func(b *testing.B) { alternate(b, register(false), register(true), "other/own") })
}
