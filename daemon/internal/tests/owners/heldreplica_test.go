package owners

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// The group's directory shows a new generation's assignment as soon as the group completes it,
// before each member takes its share up. A list in that window must not pass off a replica's
// ledger as the whole of partitions it does not hold yet: here r2 joins and is held before it
// takes up its partitions; a list at r1 (which asks r2 for r2's partitions) and one at r2 answer
// a complete page or 503 naming the wait, never a page without r2's partitions' CEs; once r2
// goes on, both list every CE.
func TestListWhileAReplicaTakesUpItsPartitions(t *testing.T) {
	b, key, r1 := daemontest.FirstOfTwoReplicas(t, launch.NoWait, "two replicas")
	ids := daemontest.RegisterCEs(t, r1, daemontest.Bundled(t), 8, "")
	r2, mine, release := startHeldReplica(t, b, "r2", key)
	defer release()
	missing := 0 // CEs of the partitions r2 is held before
	for _, id := range ids {
		if slices.Contains(mine, ceshare.Partition(id, r1.D.Share().Partitions())) {
			missing++
		}
	}
	if missing == 0 {
		t.Fatalf("none of the %d CEs is in r2's partitions %v: the test shows nothing", len(ids), mine)
	}
	// r1 sees the new assignment once its directory reads it; until then it lists its own
	// ledger, which still holds every CE.
	waitfor.Cond(t, 30*time.Second, "a list at r1 waiting for r2", func() bool {
		code, body, n := r1.Listed(t)
		switch {
		case code == http.StatusOK && n != len(ids):
			t.Fatalf("a list at r1 while r2 has not taken up %v: 200 with %d CEs of %d", mine, n, len(ids))
		case code == http.StatusServiceUnavailable && strings.Contains(string(body), "between two generations"):
			return true
		}
		return false
	})
	if code, body, n := r2.Listed(t); code != http.StatusServiceUnavailable || !strings.Contains(string(body), "between two generations") {
		t.Errorf("a list at r2 while it has not taken up %v: %d, %d CEs: %s", mine, code, n, body)
	}
	release()
	for _, r := range []*launch.Running{r1, r2} {
		waitfor.Cond(t, 60*time.Second, "every CE listed at "+r.Config.Replication.ReplicaID, func() bool {
			code, _, n := r.Listed(t)
			return code == http.StatusOK && n == len(ids)
		})
	}
}

// An explanation asked for at a replica whose CE's owner does not store it within the wait is
// accepted, as a registration is: 202 with the CE's Location and the generated counterfactual,
// not a 500 for a CE that is on the CE topic. r2 is held before it takes up its partitions; the
// CE is then stored once r2 goes on.
func TestExplainWhoseOwnerIsSlowIsAccepted(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := launch.With(t, daemontest.WithSharedVAE(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r1", key) }), nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r1.Get(t, "/readyz"); return code == 200 })
	r2, mine, release := startHeldReplica(t, b, "r2", key)
	defer release()
	id := ""
	for i := 0; id == ""; i++ {
		if c := fmt.Sprintf("slow-%d", i); slices.Contains(mine, ceshare.Partition(c, r1.D.Share().Partitions())) {
			id = c
		}
	}
	data := daemontest.Bundled(t)
	p, _ := r1.D.Posterior().Predict(data.X[:40], 200, 1)
	var x []float64
	for i := range 40 {
		if p.Argmax(i) == 0 && p.P(i, 0) > 0.9 {
			x = data.X[i]
			break
		}
	}
	body, _ := json.Marshal(map[string]any{"id": id, "x": x, "target": "benign"})
	resp, err := r1.Client.Post(r1.Base+"/v1/explain", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var answer struct {
		ID, Status string
		Partition  *int
		Offset     *int64
		Generation *struct {
			XCF []float64 `json:"x_cf"`
		}
	}
	if err := json.Unmarshal(got, &answer); err != nil || resp.StatusCode != http.StatusAccepted || answer.ID != id || answer.Status != "pending" ||
		answer.Generation == nil || len(answer.Generation.XCF) != len(x) || resp.Header.Get("Location") != "/v1/counterfactuals/"+id {
		t.Fatalf("POST /v1/explain at r1 for %s, of r2's held partitions %v: %d (Location %q) %s; want 202 pending with the generation",
			id, mine, resp.StatusCode, resp.Header.Get("Location"), got)
	}
	// The 202 names where the request landed: the id's partition, at an offset it holds.
	topic, parts := r1.Config.Replication.CETopic, r1.Config.Replication.CEPartitions
	if answer.Partition == nil || *answer.Partition != ceshare.Partition(id, parts) || answer.Offset == nil ||
		*answer.Offset < 0 || *answer.Offset >= b.HighWatermarks(topic)[*answer.Partition] {
		t.Errorf("the 202 for %s names partition %v offset %v; want partition %d and an offset of it (its end %d)", id,
			answer.Partition, answer.Offset, ceshare.Partition(id, parts), b.HighWatermarks(topic)[ceshare.Partition(id, parts)])
	}
	release()
	for _, r := range []*launch.Running{r1, r2} {
		waitfor.Cond(t, 60*time.Second, id+" stored, read at "+r.Config.Replication.ReplicaID, func() bool {
			code, _ := r.Get(t, "/v1/counterfactuals/"+id)
			return code == http.StatusOK
		})
	}
}

// startHeldReplica starts replica id on cluster b and holds it in its first CE group generation
// that assigns it partitions, before it takes them up, until release is called (release may be
// called more than once). It returns the partitions it was given.
func startHeldReplica(t *testing.T, b *broker.Broker, id, key string) (r *launch.Running, assigned []int, release func()) {
	t.Helper()
	held, released := make(chan []int, 1), make(chan struct{})
	var hold, free sync.Once
	r = launch.With(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), id, key) }, func(o *daemon.Options) {
		o.Hooks.CEGeneration = func(ctx context.Context, _ int32, assigned []int) {
			if len(assigned) == 0 {
				return
			}
			hold.Do(func() {
				held <- assigned
				select {
				case <-released:
				case <-ctx.Done():
				}
			})
		}
	}, nil)
	release = func() { free.Do(func() { close(released) }) }
	select {
	case assigned = <-held:
	case <-time.After(60 * time.Second):
		release()
		t.Fatalf("%s was given no CE partition within 60 s", id)
	}
	return r, assigned, release
}
