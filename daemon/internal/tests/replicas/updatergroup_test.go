package replicas

import (
	"encoding/json"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestUpdaterGroupMembersClaimOnlyTheGenerationsTheyLed: in the updater group, a member says in
// its UserData the latest generation that gave it the role, and a member that generation did not
// assign the role says none: at each join, at most one member names a given generation, so the
// balancer's choice of the last holder does not fall to a tie between members.
func TestUpdaterGroupMembersClaimOnlyTheGenerationsTheyLed(t *testing.T) {
	if testing.Short() {
		t.Skip("three replicas and two joins: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "cfguard.records", "cfguard.records.dlq", "cfguard.events"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the replicas' cleanups
	var mu sync.Mutex
	named := map[int32]map[string]bool{} // generation named in UserData -> member ids that named it
	kc.ControlKey(int16(kmsg.JoinGroup), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		jr := req.(*kmsg.JoinGroupRequest)
		if !strings.HasSuffix(jr.Group, ".updater") || jr.MemberID == "" {
			return nil, nil, false
		}
		for _, p := range jr.Protocols {
			var md kmsg.ConsumerMemberMetadata
			var d struct {
				Led int32 `json:"led"`
			}
			_ = md.ReadFrom(p.Metadata) // kafka-go writes fewer fields than kmsg reads: its error comes after UserData
			if p.Name != "cfguard-updater-sticky-v1" || json.Unmarshal(md.UserData, &d) != nil || d.Led == 0 {
				continue
			}
			mu.Lock()
			if named[d.Led] == nil {
				named[d.Led] = map[string]bool{}
			}
			named[d.Led][jr.MemberID] = true
			mu.Unlock()
		}
		return nil, nil, false
	})
	addrs, key := kc.ListenAddrs(), daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := launch.ReplicaAt(t, addrs, "r1", key)
	waitfor.Cond(t, 30*time.Second, "r1 the updater", r1.D.Replica().Updater)
	gens := func(r *launch.Running) float64 { return r.Metric(t, alerts.NameGenerations) }
	reps := []*launch.Running{r1}
	for _, id := range []string{"r2", "r3"} {
		before := gens(r1)
		r := launch.ReplicaAt(t, addrs, id, key)
		reps = append(reps, r)
		waitfor.Cond(t, 60*time.Second, id+"'s join through the updater group", func() bool { return gens(r) >= 1 && gens(r1) > before })
	}
	waitfor.Cond(t, 60*time.Second, "an updater after the joins", func() bool {
		n := 0
		for _, r := range reps {
			if r.D.Replica().Updater() {
				n++
			}
		}
		return n == 1
	})
	mu.Lock()
	defer mu.Unlock()
	if len(named) == 0 {
		t.Fatal("no member of the updater group named a generation it led at a join")
	}
	for gen, members := range named {
		if len(members) > 1 {
			t.Errorf("generation %d is named as led by %d members of the updater group: %v", gen, len(members), members)
		}
	}
}

// A replica whose replication.session_timeout the broker refuses fails every join of the updater
// group, retried every second: it logs one WARN naming the key and the broker's floor, then one
// in 30 attempts, not one a second (the broker counts the attempts).
func TestUpdaterGroupJoinThatKeepsFailingWarnsOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("waits through failed joins: not with -short")
	}
	t.Parallel()
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "cfguard.records", "cfguard.records.dlq", "cfguard.events"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)    // after the replica's cleanup
	var joins atomic.Int64 // JoinGroup requests of the updater group (kfake's floor refuses each: 6 s)
	kc.ControlKey(int16(kmsg.JoinGroup), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		if strings.HasSuffix(req.(*kmsg.JoinGroupRequest).Group, ".updater") {
			joins.Add(1)
		}
		return nil, nil, false
	})
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r := launch.With(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, kc.ListenAddrs(), "r-short", key)
		c.Replication.SessionTimeout, c.Replication.HeartbeatInterval = time.Second, 300*time.Millisecond
	}, nil, nil)
	waitfor.Cond(t, 60*time.Second, "five refused joins of the updater group", func() bool { return joins.Load() >= 5 })
	logs := r.Logs.String()
	if n := strings.Count(logs, `level=WARN msg="updater group: joining"`); n != 1 ||
		!strings.Contains(logs, "replication.session_timeout 1s is outside the broker's group.min.session.timeout.ms") {
		t.Fatalf("%d WARN lines over %d refused joins, want 1 naming replication.session_timeout:\n%s", n, joins.Load(), logs)
	}
}
