package replicas

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestReplicasShareOnePosterior runs three replicas in one process against one broker: exactly
// one of them is the updater, all apply the same entries to the same posterior bit for bit, the
// log covers every record produced once, and when the updater leaves another takes over where
// the log's head says, without waiting for the leaver's session: the replicas' session timeout
// is the longest the configuration allows (5 minutes), past every wait of the test.
func TestReplicasShareOnePosterior(t *testing.T) {
	if testing.Short() {
		t.Skip("three daemons and a takeover: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b := daemontest.StartCluster(t, 2)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	start := func(id string) *launch.Running {
		r := launch.With(t, func(c *config.Config) {
			daemontest.ReplicaConfig(c, b.Addrs(), id, key)
			c.Replication.SessionTimeout = 5 * time.Minute
		}, nil, nil)
		waitfor.Cond(t, 60*time.Second, id+" ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
		return r
	}
	reps := []*launch.Running{start("r1"), start("r2"), start("r3")}
	data := daemontest.Bundled(t)
	produced := 0
	produce := func(n int) { produced = daemontest.ProduceRows(t, reps[0], data, produced, n) }
	agree := func(live []*launch.Running) daemontest.ModelView {
		var first daemontest.ModelView
		waitfor.Cond(t, 90*time.Second, "replicas agree on a head covering every record", func() bool {
			first = live[0].Model(t)
			covered := int64(0)
			for _, to := range first.Replication.Covers {
				covered += to
			}
			if covered != int64(produced) {
				return false
			}
			for _, r := range live[1:] {
				v := r.Model(t)
				if v.Replication.Entry != first.Replication.Entry || v.Replication.SHA != first.Replication.SHA || v.Version != first.Version {
					return false
				}
			}
			return true
		})
		updaters := 0
		for _, r := range live {
			if r.Model(t).Replication.Updater {
				updaters++
			}
		}
		if updaters != 1 {
			t.Errorf("%d updaters among %d replicas, want 1", updaters, len(live))
		}
		return first
	}
	produce(200)
	v1 := agree(reps)
	// The replicas' gauges count every CE partition once, each replica some.
	waitfor.Cond(t, 30*time.Second, "cfguard_counterfactuals_partitions_owned: 12 in all, some at each replica", func() bool {
		sum := 0
		for _, r := range reps {
			owned := int(r.Metric(t, "cfguard_counterfactuals_partitions_owned"))
			if owned == 0 {
				return false
			}
			sum += owned
		}
		return sum == reps[0].Config.Replication.CEPartitions
	})
	// The web UI's overview shows each replica's place in the cluster as GET /v1/model does.
	for _, r := range reps {
		v := r.Model(t)
		_, page := r.Get(t, "/ui/")
		for _, want := range []string{"<dt>this replica</dt><dd>" + v.Replication.Writer + "</dd>",
			fmt.Sprintf("<dt>the updater (writes the posterior log)</dt><dd>%v</dd>", v.Replication.Updater),
			fmt.Sprintf("<dt>posterior log entry</dt><dd>%d</dd>", v.Replication.Entry),
			"<dt>posterior SHA-256</dt><dd>" + v.Replication.SHA + "</dd>"} {
			if !strings.Contains(string(page), want) {
				t.Errorf("%s: the UI's overview lacks %q", v.Replication.Writer, want)
			}
		}
	}

	// CEs registered round-robin at the three are each stored by their owner and readable at
	// every replica; the owners together hold each once.
	_, xs, cfs := daemontest.CandidatePairs(t, reps[0].D.Posterior(), data, 400, 1)
	const n = 12
	if len(xs) < n || len(cfs) < n {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	for k := range n {
		code, body := reps[k%3].Do(t, "POST", "/v1/counterfactuals", "", map[string]any{"id": fmt.Sprintf("ce-%d", k),
			"x": data.X[xs[k]], "x_cf": data.X[cfs[k]], "target": "benign"})
		if code != http.StatusCreated {
			t.Fatalf("register ce-%d at replica %d: %d %s", k, k%3, code, body)
		}
	}
	held := 0
	owners := map[string]string{}
	for _, r := range reps {
		for k := range n {
			id := fmt.Sprintf("ce-%d", k)
			resp, err := http.Get(r.Base + "/v1/counterfactuals/" + id)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("GET %s: %d", id, resp.StatusCode)
			}
			// Every replica names the same owner, and the owner holds the CE in its ledger.
			owner := resp.Header.Get("Cfguard-Replica")
			if o, ok := owners[id]; ok && o != owner {
				t.Errorf("%s: owner %q at one replica, %q at another", id, o, owner)
			}
			owners[id] = owner
		}
		held += r.HeldCEs(t)
	}
	if held != n {
		t.Errorf("the replicas' ledgers hold %d CEs in all, want %d (each once, at its owner)", held, n)
	}
	for id, owner := range owners {
		var at *launch.Running
		for i, r := range reps {
			if fmt.Sprintf("r%d", i+1) == owner {
				at = r
			}
		}
		if at == nil {
			t.Errorf("%s: Cfguard-Replica %q names no replica", id, owner)
		} else if _, err := at.D.Ledger().Get(id); err != nil {
			t.Errorf("%s: its named owner %s does not hold it: %v", id, owner, err)
		}
	}
	if code, body := reps[1].Do(t, "DELETE", "/v1/counterfactuals/ce-0", "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE ce-0: %d %s", code, body)
	}
	waitfor.Cond(t, 10*time.Second, "ce-0 deleted at its owner", func() bool {
		code, _ := reps[2].Get(t, "/v1/counterfactuals/ce-0")
		return code == http.StatusNotFound
	})
	if v1.Version == 0 {
		t.Fatalf("no version promoted after %d records: %+v", produced, v1)
	}
	// The updater leaves (SIGTERM's path): another claims the next term and goes on.
	var updater int
	for i, r := range reps {
		if r.Model(t).Replication.Updater {
			updater = i
		}
	}
	reps[updater].Stop(t)
	live := append(append([]*launch.Running(nil), reps[:updater]...), reps[updater+1:]...)
	produce(200)
	v2 := agree(live)
	if v2.Replication.Term <= v1.Replication.Term || v2.Version <= v1.Version {
		t.Errorf("after the updater left: term %d -> %d, version %d -> %d; want both to grow", v1.Replication.Term, v2.Replication.Term, v1.Version, v2.Version)
	}
	// The leaver's CE partitions moved to the others, which rebuilt them from the CE topic.
	waitfor.Cond(t, 30*time.Second, "every CE readable at the live replicas, held once", func() bool {
		held := 0
		for _, r := range live {
			for k := 1; k < n; k++ {
				if code, _ := r.Get(t, fmt.Sprintf("/v1/counterfactuals/ce-%d", k)); code != http.StatusOK {
					return false
				}
			}
			held += r.HeldCEs(t)
		}
		return held == n-1
	})
	for _, r := range live {
		if n := r.Metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "malformed"); n != 0 {
			t.Errorf("malformed records in the log: %v", n)
		}
	}
}

// TestUpdaterThatLosesStepsDown appends, as a writer outside the group, a claim on the log's
// head while records stream: the updater's next entry names the same parent and loses. The
// updater counts the loss, stops writing in its term, and a replica claims the next term; every
// replica follows the one chain.
func TestUpdaterThatLosesStepsDown(t *testing.T) {
	if testing.Short() {
		t.Skip("three daemons: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b := daemontest.StartCluster(t, 1)
	reps := []*launch.Running{launch.Replica(t, b, "r1"), launch.Replica(t, b, "r2"), launch.Replica(t, b, "r3")}
	data := daemontest.Bundled(t)
	n := 0
	produce := func(k int) { n = daemontest.ProduceRows(t, reps[0], data, n, k) }
	produce(64)
	// Each phase goes at the CPU the replicas get (a twenty-first of a core on a busy machine): a
	// wait fails when no replica moves for 30 s, not after a total time.
	var updater *launch.Running
	waitfor.Progress(t, 30*time.Second, "an updater that applied the records", func() (bool, string) {
		vs := daemontest.Views(t, reps)
		updater = nil
		for i, v := range vs {
			if v.Replication.Updater && v.Version >= 2 {
				updater = reps[i]
			}
		}
		return updater != nil, daemontest.ProgressOf(vs)
	})
	// The rival: a claim of the next term on the head, from a writer no replica knows.
	// It holds the cluster key: this is a writer that loses, not a forgery (see
	// TestForgedRecordsAreRefusedByEveryReplica).
	h := updater.D.Replica().Head()
	daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, updater), daemontest.ClaimOn(h, "rival/1"))
	produce(64)
	waitfor.Progress(t, 30*time.Second, "the old updater counts its lost entry", func() (bool, string) {
		return updater.Metric(t, "cfguard_posterior_log_appends_lost_total") >= 1, daemontest.ProgressOf(daemontest.Views(t, []*launch.Running{updater}))
	})
	produce(64)
	waitfor.Progress(t, 30*time.Second, "a replica claims a term after the rival's and applies every record", func() (bool, string) {
		vs := daemontest.Views(t, reps)
		covered := int64(0)
		for _, to := range vs[0].Replication.Covers {
			covered += to
		}
		done := covered == int64(n) && vs[0].Replication.Term >= h.Term+2
		for _, v := range vs[1:] {
			done = done && v.Replication.Entry == vs[0].Replication.Entry && v.Replication.SHA == vs[0].Replication.SHA
		}
		return done, fmt.Sprintf("covers %d; %s", covered, daemontest.ProgressOf(vs))
	})
	for _, r := range reps {
		if w := r.Model(t).Replication.Writer; w == "rival/1" {
			t.Errorf("a replica reports the rival as its writer")
		}
	}
}

// A release of a CE partition cut short (its context ended before any CE was deleted, as the
// shutdown's deadline cuts one) leaves the partition's offset at 0, so that the next acquisition
// reads the partition again from its start instead of reading on without the CEs deleted.
func TestShareReleaseCutShortRestartsThePartition(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b := daemontest.StartCluster(t, 1)
	r := launch.Replica(t, b, "r1")
	s := r.D.Share()
	id := daemontest.RegisterCEs(t, r, daemontest.Bundled(t), 1, "")[0]
	p := ceshare.Partition(id, s.Partitions())
	waitfor.Cond(t, 10*time.Second, "the registration's offset stored", func() bool {
		off, ok, err := r.D.Ledger().ShareOffset(p)
		return err == nil && ok && off > 0
	})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Release(ctx, p); err == nil {
		t.Fatal("Release with an ended context succeeded")
	}
	if _, err := r.D.Ledger().Get(id); err != nil {
		t.Fatalf("the release was cut short before deleting %s: %v", id, err)
	}
	if off, ok, err := r.D.Ledger().ShareOffset(p); err != nil || !ok || off != 0 {
		t.Fatalf("after a release cut short, partition %d's offset is %d (held %v, %v); want 0", p, off, ok, err)
	}
}

// TestUpdaterRoleStaysThroughJoins: replicas that join do not take the updater role from the
// replica that holds it (the updater group's balancer keeps it where it is): after two joins, r1
// is still the updater, every replica follows its one claim (term 1), and records produced
// after the joins are applied.
func TestUpdaterRoleStaysThroughJoins(t *testing.T) {
	b, key, r1 := daemontest.FirstOfTwoReplicas(t, launch.NoWait, "three replicas")
	waitfor.Cond(t, 30*time.Second, "r1 the updater", r1.D.Replica().Updater)
	gens := func(r *launch.Running) float64 { return r.Metric(t, alerts.NameGenerations) }
	reps := []*launch.Running{r1}
	for _, id := range []string{"r2", "r3"} {
		before := gens(r1)
		r := launch.ReplicaKey(t, b, id, key)
		reps = append(reps, r)
		waitfor.Cond(t, 60*time.Second, id+"'s join through the updater group", func() bool { return gens(r) >= 1 && gens(r1) > before })
	}
	data := daemontest.Bundled(t)
	n := daemontest.ProduceRows(t, r1, data, 0, 64)
	for _, r := range reps {
		waitfor.Cond(t, 60*time.Second, "the records applied at every replica", func() bool {
			return r.Metric(t, "cfguard_records_total", "result", "applied") == float64(n)
		})
	}
	for i, r := range reps {
		if v := r.Model(t); v.Replication.Term != 1 || r.D.Replica().Updater() != (i == 0) {
			t.Errorf("r%d: term %d, updater %v; want term 1 (r1's one claim), r1 the updater", i+1, v.Replication.Term, r.D.Replica().Updater())
		}
	}
}

// TestUpdaterThatLosesGivesTheRoleToAnother: an updater whose entry lost (here to a rival's
// claim on its head) says so to the updater group's balancer, which gives the role to another
// member: the other replica claims the next term, and the one that lost follows it.
func TestUpdaterThatLosesGivesTheRoleToAnother(t *testing.T) {
	b, key, r1 := daemontest.FirstOfTwoReplicas(t, launch.NoWait, "two replicas")
	waitfor.Cond(t, 30*time.Second, "r1 the updater", r1.D.Replica().Updater)
	gens := func(r *launch.Running) float64 { return r.Metric(t, alerts.NameGenerations) }
	before := gens(r1)
	r2 := launch.ReplicaKey(t, b, "r2", key)
	waitfor.Cond(t, 60*time.Second, "r2's join through the updater group", func() bool { return gens(r2) >= 1 && gens(r1) > before })
	waitfor.Cond(t, 60*time.Second, "r1 the updater of the new generation", r1.D.Replica().Updater)
	data := daemontest.Bundled(t)
	n := daemontest.ProduceRows(t, r1, data, 0, 32)
	reps := []*launch.Running{r1, r2}
	applied := func(r *launch.Running) bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == float64(n)
	}
	for _, r := range reps {
		waitfor.Cond(t, 60*time.Second, "the records applied at every replica", func() bool { return applied(r) })
	}
	h := r1.D.Replica().Head()
	daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, r1), daemontest.ClaimOn(h, "rival/1"))
	n = daemontest.ProduceRows(t, r1, data, n, 32)
	waitfor.Cond(t, 60*time.Second, "r1 counts its lost entry", func() bool {
		return r1.Metric(t, "cfguard_posterior_log_appends_lost_total") >= 1
	})
	for _, r := range reps {
		waitfor.Cond(t, 60*time.Second, "a term after the rival's that applies every record", func() bool {
			return r.D.Replica().Head().Term >= h.Term+2 && applied(r)
		})
	}
	if !r2.D.Replica().Updater() || r1.D.Replica().Updater() {
		t.Errorf("after r1 lost: r1 updater %v, r2 updater %v; want the role with r2", r1.D.Replica().Updater(), r2.D.Replica().Updater())
	}
	if w := r2.D.Replica().Head().Writer; w == h.Writer || w == "rival/1" {
		t.Errorf("the term after the rival's is written by %q; want r2's", w)
	}
}
