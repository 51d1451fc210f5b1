package answers

import (
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestKeyReusedOnAnotherPartitionIsAnotherRequest: on replicas an Idempotency-Key names one
// request per CE partition (cluster.Share's partitionRID). Reused for a CE of the same partition
// it is the key reused (422, nothing stored); reused for a CE of another partition it is another
// request, stored, whether one replica owns both partitions or two do; and once one replica owns
// every partition, rebuilding those it took over, each CE it answered 201 for is still there
// (not taken for a retry of the key's first request).
func TestKeyReusedOnAnotherPartitionIsAnotherRequest(t *testing.T) {
	if testing.Short() {
		t.Skip("three replicas: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b, reps := daemontest.StartThreeReplicas(t, launch.NoWait)
	owner := map[int]int{} // CE partition -> index of its owner in reps
	for i, r := range reps {
		for _, p := range r.D.Share().Member().Owned() {
			owner[p] = i
		}
	}
	parts := reps[0].D.Share().Partitions()
	// first: an id of a partition r1 owns; twin: another id of first's partition; same: an id of
	// another partition r1 owns; other: an id of a partition r2 owns.
	var first, twin, same, other string
	for n := 0; first == "" || twin == "" || same == "" || other == ""; n++ {
		id := fmt.Sprintf("reuse-%d", n)
		p := ceshare.Partition(id, parts)
		switch {
		case first == "" && owner[p] == 0:
			first = id
		case twin == "" && first != "" && p == ceshare.Partition(first, parts):
			twin = id
		case same == "" && owner[p] == 0 && first != "" && p != ceshare.Partition(first, parts):
			same = id
		case other == "" && owner[p] == 1:
			other = id
		}
		if n > 10000 {
			t.Fatalf("no ids found for the owners %v", owner)
		}
	}
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, reps[0].D.Posterior(), data, 400, 1)
	ce := func(id string) map[string]any {
		return map[string]any{"id": id, "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
	}
	const key = "reused-key"
	if code, body := reps[2].KeyedDo(t, "/v1/counterfactuals", key, ce(first)); code != http.StatusCreated {
		t.Fatalf("POST %s with a key at r3: %d %s", first, code, body)
	}
	if code, body := reps[2].KeyedDo(t, "/v1/counterfactuals", key, ce(twin)); code != http.StatusUnprocessableEntity {
		t.Errorf("the key again for %s, of %s's partition: %d %s; want 422, the key reused", twin, first, code, body)
	}
	if got := daemontest.Settled(t, b, reps, twin); got != nil {
		t.Errorf("the key reused in %s's partition registered %s", first, twin)
	}
	for _, id := range []string{same, other} {
		if code, body := reps[2].KeyedDo(t, "/v1/counterfactuals", key, ce(id)); code != http.StatusCreated {
			t.Errorf("the key again for %s, of another partition (owner r%d): %d %s; want 201, another request", id,
				owner[ceshare.Partition(id, parts)]+1, code, body)
		}
		if got := daemontest.Settled(t, b, reps, id); got == nil {
			t.Errorf("the key reused for %s, of another partition, did not register it", id)
		}
	}
	if o := reps[0].D.Share().Member().Owned(); !slices.Contains(o, ceshare.Partition(same, parts)) {
		t.Fatalf("the CE partitions moved during the test (r1 owns %v): the answers above are not about one owner", o)
	}

	// r1 takes every partition over: it rebuilds other's partition from the CE topic, where
	// other's request carries the same key as first's, whose outcome r1 keeps.
	reps[1].Stop(t)
	reps[2].Stop(t)
	waitfor.Cond(t, 90*time.Second, "r1 owning and having read every CE partition", func() bool {
		return daemontest.ShareReady(reps[0]) && len(reps[0].D.Share().Member().Owned()) == parts
	})
	for _, id := range []string{first, same, other} {
		if _, err := reps[0].D.Ledger().Get(id); err != nil {
			t.Errorf("%s, answered 201, is not stored at r1 once r1 owns every partition: %v", id, err)
		}
	}
}
