package daemon

import (
	"context"
	"encoding/json"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// A replica restarted on the partitions its ledger kept publishes nothing for the CEs of those
// another replica took over while it was away: r1 registers CEs, r2 joins and takes some
// partitions, r1 stops and r2 takes the rest, a drift applied by r2 changes statuses, and r1
// starts again on its ledger. Its follower plays the drift's entries before its first
// generation gives its partitions out; no event of r1's names a CE of a partition that
// generation does not give it.
func TestRestartedReplicaPublishesNothingForPartitionsItLost(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas, a drift and a restart: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	dir := t.TempDir()
	cfg1 := func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", key)
		daemontest.PaperLearner(c, 3e-3)
		c.StateDir = dir
	}
	r1 := startDaemonWith(t, cfg1, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r1.Get(t, "/readyz"); return code == 200 })
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r1, data, 24, "")

	r2 := startLearningReplica(t, b, "r2", key, nil)
	waitfor.Cond(t, 60*time.Second, "the partitions shared by r1 and r2", func() bool {
		return daemontest.ShareReady(r1) && daemontest.ShareReady(r2) &&
			len(r1.D.share.Member().Owned())+len(r2.D.share.Member().Owned()) == r1.D.share.Partitions()
	})
	kept := r1.D.share.Member().Owned()
	r1.Stop(t)
	waitfor.Cond(t, 60*time.Second, "r2 holding every CE, ready", func() bool {
		code, _ := r2.Get(t, "/readyz")
		return code == 200 && r2.HeldCEs(t) == len(ids) && daemontest.ShareReady(r2)
	})

	// 32 benign rows labelled malignant (a drift), then clean records, applied by r2. Every CE is
	// judged under the drifted posterior before the clean records come, so that r2 gives verdicts
	// whenever its confirmer gets to them (measured only once the clean records have taken the
	// posterior back, the certificates would be renewed, and no status would change).
	drift := daemontest.FlippedThenClean(data, 32, 96)
	produceJudged(t, r2, drift[:32], drift[32:])
	before := kafkatest.ReadPartition(t, b.Addrs(), "cfguard.events", 0)
	byR2 := 0
	for _, m := range before {
		var e Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type == "status_changed" && kafkatest.Header(m, ReplicaHeader) == "r2" &&
			slices.Contains(kept, ceshare.Partition(e.ID, r2.D.share.Partitions())) {
			byR2++
		}
	}
	if byR2 == 0 {
		t.Fatal("the drift changed no status of a CE r1 kept: this test shows nothing")
	}

	// r1 again, on its ledger: its first generation's assignment is recorded.
	var (
		mu    sync.Mutex
		first []int
		at    time.Time
		seen  bool
	)
	r1 = startDaemonWith(t, cfg1, func(o *Options) {
		o.Hooks.CEGeneration = func(_ context.Context, _ int32, assigned []int) {
			mu.Lock()
			defer mu.Unlock()
			if !seen {
				first, at, seen = slices.Clone(assigned), time.Now(), true
			}
		}
	}, nil)
	waitfor.Cond(t, 90*time.Second, "r1 ready, its releases ended, its outbox drained", func() bool {
		code, _ := r1.Get(t, "/readyz")
		return code == 200 && len(r1.D.share.Member().Releasing()) == 0 && r1.Metric(t, "cfguard_events_pending") == 0 &&
			r1.D.current().Version == r2.D.current().Version
	})
	mu.Lock()
	gave, gen := first, at
	mu.Unlock()
	parts := r1.D.share.Partitions()
	stale := map[string]int{}
	for _, m := range kafkatest.ReadPartition(t, b.Addrs(), "cfguard.events", 0)[len(before):] {
		var e Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.ID == "" || kafkatest.Header(m, ReplicaHeader) != "r1" {
			continue
		}
		if p := ceshare.Partition(e.ID, parts); !slices.Contains(gave, p) {
			stale[e.Type]++
			t.Errorf("r1 published %s %s -> %s at posterior version %d for %s (partition %d, at %s, %s after its first generation), "+
				"whose partition its first generation gave to another replica",
				e.Type, e.From, e.To, e.PosteriorVersion, e.ID, p, e.At.Format(time.RFC3339Nano), e.At.Sub(gen).Round(time.Millisecond))
		}
	}
	t.Logf("r1 kept partitions %v at its stop; its first generation gave it %v; r2 published %d status changes of r1's CEs; "+
		"r1 published %v for partitions it lost; r1 wrote %v CE states", kept, gave, byR2, stale,
		r1.Metric(t, alerts.NameCEStates, "result", alerts.StateWritten))
}
