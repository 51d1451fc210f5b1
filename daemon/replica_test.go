package daemon

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
)

// replicaView is what GET /v1/model says of a replica's place in the posterior log.
type replicaView struct {
	Version     uint64 `json:"posterior_version"`
	Replication struct {
		Writer  string        `json:"writer"`
		Updater bool          `json:"updater"`
		Entry   uint64        `json:"entry"`
		Term    uint64        `json:"term"`
		SHA     string        `json:"posterior_sha256"`
		Covers  map[int]int64 `json:"covers"`
	} `json:"replication"`
}

// produceRows produces n labelled records through r's broker, rows of data from the one after
// the from records already produced (cycling), and returns how many are produced then.
func produceRows(t testing.TB, r *running, data *dataset.Set, from, n int) int {
	t.Helper()
	vals := make([][]byte, n)
	for i := range vals {
		k := (from + i) % data.Len()
		vals[i] = record(fmt.Sprintf("rec-%d", from+i), data.X[k], data.Y[k])
	}
	r.produce(t, vals...)
	return from + n
}

// view reads GET /v1/model.
func (r *running) view(t *testing.T) replicaView {
	t.Helper()
	code, body := r.get(t, "/v1/model")
	if code != http.StatusOK {
		t.Fatalf("GET /v1/model: %d %s", code, body)
	}
	var v replicaView
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// views reads GET /v1/model of each replica.
func views(t *testing.T, reps []*running) []replicaView {
	t.Helper()
	vs := make([]replicaView, len(reps))
	for i, r := range reps {
		vs[i] = r.view(t)
	}
	return vs
}

// progressOf says where each replica is: what a wait on their work (waitfor.Progress) watches.
func progressOf(vs []replicaView) string {
	var b strings.Builder
	for _, v := range vs {
		fmt.Fprintf(&b, "updater %v, term %d, entry %d, version %d; ", v.Replication.Updater, v.Replication.Term, v.Replication.Entry, v.Version)
	}
	return b.String()
}

// startCluster starts a broker on loopback, in memory, stopped at the test's end: the input
// topic with partitions partitions, the dead-letter and events topics, for replicas or for a
// daemon given an external broker.
func startCluster(t testing.TB, partitions int) *broker.Broker {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Partitions: partitions,
		Topics: []string{"cfguard.records", "cfguard.records.dlq", "cfguard.events"}}, nil)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close(); cancel() })
	return b
}

// testClusterKey is the key file line of the replicas of these tests.
const testClusterKey = "k1:5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"

// writeKeyFile writes a key file holding lines, one key each, and returns its path.
func writeKeyFile(t testing.TB, lines ...string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "cluster.key")
	if err := os.WriteFile(p, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// replicaConfig makes c a replica id of the cluster on b, with the key file keyFile.
func replicaConfig(c *config.Config, b *broker.Broker, id, keyFile string) {
	replicaConfigAt(c, b.Addrs(), id, keyFile)
}

// replicaConfigAt is replicaConfig for a cluster on the brokers at addrs.
func replicaConfigAt(c *config.Config, addrs []string, id, keyFile string) {
	c.Kafka.Brokers = addrs
	c.Replication.Enabled = true
	c.Replication.ReplicaID = id
	c.Replication.SessionTimeout = 6 * time.Second // kfake's group.min.session.timeout.ms
	c.Replication.HeartbeatInterval = 500 * time.Millisecond
	c.Replication.KeyFile = keyFile
}

func startReplica(t testing.TB, b *broker.Broker, id string) *running {
	t.Helper()
	return startReplicaKey(t, b, id, writeKeyFile(t, testClusterKey))
}

// startReplicaKey starts replica id with the key file keyFile and waits until it is ready.
func startReplicaKey(t testing.TB, b *broker.Broker, id, keyFile string) *running {
	t.Helper()
	return startReplicaAt(t, b.Addrs(), id, keyFile)
}

// startReplicaAt is startReplicaKey for a cluster on the brokers at addrs.
func startReplicaAt(t testing.TB, addrs []string, id, keyFile string) *running {
	t.Helper()
	r := startDaemonWith(t, func(c *config.Config) { replicaConfigAt(c, addrs, id, keyFile) }, nil, nil)
	waitfor.Cond(t, 60*time.Second, id+" ready", func() bool { code, _ := r.get(t, "/readyz"); return code == 200 })
	return r
}

// keyHolderLog opens r's posterior log with r's cluster key, as a writer holding the key would;
// it is closed when the test ends.
func keyHolderLog(t testing.TB, r *running) *postlog.Log {
	t.Helper()
	plog, err := postlog.Open(context.Background(), r.d.conn, "cfguard.posterior", r.d.rep.Keys(), r.d.log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plog.Close() })
	return plog
}

// claimOn is a claim of the next term on head h by writer.
func claimOn(h *postlog.Head, writer string) *postlog.Entry {
	return &postlog.Entry{Format: postlog.Format, Kind: postlog.Claim, Seq: h.Seq + 1, Parent: h.Hash, Term: h.Term + 1,
		Writer: writer, Version: h.Version, ParentVersion: h.Version, Covers: h.Covers, PosteriorSHA256: h.PosteriorSHA256}
}

// appendEntry writes e to the posterior log plog as a writer holding the cluster key would, and
// returns the hex SHA-256 of its value (the parent hash of its successor).
func appendEntry(t testing.TB, plog *postlog.Log, e *postlog.Entry) string {
	t.Helper()
	v, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if err := plog.Append(context.Background(), fmt.Sprintf("e/%d", e.Seq), v); err != nil {
		t.Fatal(err)
	}
	sum := postlog.Hash(v)
	return hex.EncodeToString(sum[:])
}

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
	b := startCluster(t, 2)
	key := writeKeyFile(t, testClusterKey)
	start := func(id string) *running {
		r := startDaemonWith(t, func(c *config.Config) {
			replicaConfigAt(c, b.Addrs(), id, key)
			c.Replication.SessionTimeout = 5 * time.Minute
		}, nil, nil)
		waitfor.Cond(t, 60*time.Second, id+" ready", func() bool { code, _ := r.get(t, "/readyz"); return code == 200 })
		return r
	}
	reps := []*running{start("r1"), start("r2"), start("r3")}
	data := bundled(t)
	produced := 0
	produce := func(n int) { produced = produceRows(t, reps[0], data, produced, n) }
	agree := func(live []*running) replicaView {
		var first replicaView
		waitfor.Cond(t, 90*time.Second, "replicas agree on a head covering every record", func() bool {
			first = live[0].view(t)
			covered := int64(0)
			for _, to := range first.Replication.Covers {
				covered += to
			}
			if covered != int64(produced) {
				return false
			}
			for _, r := range live[1:] {
				v := r.view(t)
				if v.Replication.Entry != first.Replication.Entry || v.Replication.SHA != first.Replication.SHA || v.Version != first.Version {
					return false
				}
			}
			return true
		})
		updaters := 0
		for _, r := range live {
			if r.view(t).Replication.Updater {
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
			owned := int(r.metric(t, "cfguard_counterfactuals_partitions_owned"))
			if owned == 0 {
				return false
			}
			sum += owned
		}
		return sum == reps[0].d.cfg.Replication.CEPartitions
	})
	// The web UI's overview shows each replica's place in the cluster as GET /v1/model does.
	for _, r := range reps {
		v := r.view(t)
		_, page := r.get(t, "/ui/")
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
	_, xs, cfs := candidatePairs(t, reps[0].d.current(), data, 400, 1)
	const n = 12
	if len(xs) < n || len(cfs) < n {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	for k := range n {
		code, body := reps[k%3].do(t, "POST", "/v1/counterfactuals", "", map[string]any{"id": fmt.Sprintf("ce-%d", k),
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
			resp, err := http.Get(r.base + "/v1/counterfactuals/" + id)
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
		held += r.held(t)
	}
	if held != n {
		t.Errorf("the replicas' ledgers hold %d CEs in all, want %d (each once, at its owner)", held, n)
	}
	for id, owner := range owners {
		var at *running
		for i, r := range reps {
			if fmt.Sprintf("r%d", i+1) == owner {
				at = r
			}
		}
		if at == nil {
			t.Errorf("%s: Cfguard-Replica %q names no replica", id, owner)
		} else if _, err := at.d.ledger.Get(id); err != nil {
			t.Errorf("%s: its named owner %s does not hold it: %v", id, owner, err)
		}
	}
	if code, body := reps[1].do(t, "DELETE", "/v1/counterfactuals/ce-0", "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE ce-0: %d %s", code, body)
	}
	waitfor.Cond(t, 10*time.Second, "ce-0 deleted at its owner", func() bool {
		code, _ := reps[2].get(t, "/v1/counterfactuals/ce-0")
		return code == http.StatusNotFound
	})
	if v1.Version == 0 {
		t.Fatalf("no version promoted after %d records: %+v", produced, v1)
	}
	// The updater leaves (SIGTERM's path): another claims the next term and goes on.
	var updater int
	for i, r := range reps {
		if r.view(t).Replication.Updater {
			updater = i
		}
	}
	reps[updater].stop(t)
	live := append(append([]*running(nil), reps[:updater]...), reps[updater+1:]...)
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
				if code, _ := r.get(t, fmt.Sprintf("/v1/counterfactuals/ce-%d", k)); code != http.StatusOK {
					return false
				}
			}
			held += r.held(t)
		}
		return held == n-1
	})
	for _, r := range live {
		if n := r.metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "malformed"); n != 0 {
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
	b := startCluster(t, 1)
	reps := []*running{startReplica(t, b, "r1"), startReplica(t, b, "r2"), startReplica(t, b, "r3")}
	data := bundled(t)
	n := 0
	produce := func(k int) { n = produceRows(t, reps[0], data, n, k) }
	produce(64)
	// Each phase goes at the CPU the replicas get (a twenty-first of a core on a busy machine): a
	// wait fails when no replica moves for 30 s, not after a total time.
	var updater *running
	waitfor.Progress(t, 30*time.Second, "an updater that applied the records", func() (bool, string) {
		vs := views(t, reps)
		updater = nil
		for i, v := range vs {
			if v.Replication.Updater && v.Version >= 2 {
				updater = reps[i]
			}
		}
		return updater != nil, progressOf(vs)
	})
	// The rival: a claim of the next term on the head, from a writer no replica knows.
	// It holds the cluster key: this is a writer that loses, not a forgery (see
	// TestForgedRecordsAreRefusedByEveryReplica).
	h := updater.d.rep.Head()
	appendEntry(t, keyHolderLog(t, updater), claimOn(h, "rival/1"))
	produce(64)
	waitfor.Progress(t, 30*time.Second, "the old updater counts its lost entry", func() (bool, string) {
		return updater.metric(t, "cfguard_posterior_log_appends_lost_total") >= 1, progressOf(views(t, []*running{updater}))
	})
	produce(64)
	waitfor.Progress(t, 30*time.Second, "a replica claims a term after the rival's and applies every record", func() (bool, string) {
		vs := views(t, reps)
		covered := int64(0)
		for _, to := range vs[0].Replication.Covers {
			covered += to
		}
		done := covered == int64(n) && vs[0].Replication.Term >= h.Term+2
		for _, v := range vs[1:] {
			done = done && v.Replication.Entry == vs[0].Replication.Entry && v.Replication.SHA == vs[0].Replication.SHA
		}
		return done, fmt.Sprintf("covers %d; %s", covered, progressOf(vs))
	})
	for _, r := range reps {
		if w := r.view(t).Replication.Writer; w == "rival/1" {
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
	b := startCluster(t, 1)
	r := startReplica(t, b, "r1")
	s := r.d.share
	id := registerCEs(t, r, bundled(t), 1)[0]
	p := ceshare.Partition(id, s.Partitions())
	waitfor.Cond(t, 10*time.Second, "the registration's offset stored", func() bool {
		off, ok, err := r.d.ledger.ShareOffset(p)
		return err == nil && ok && off > 0
	})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Release(ctx, p); err == nil {
		t.Fatal("Release with an ended context succeeded")
	}
	if _, err := r.d.ledger.Get(id); err != nil {
		t.Fatalf("the release was cut short before deleting %s: %v", id, err)
	}
	if off, ok, err := r.d.ledger.ShareOffset(p); err != nil || !ok || off != 0 {
		t.Fatalf("after a release cut short, partition %d's offset is %d (held %v, %v); want 0", p, off, ok, err)
	}
}

// TestUpdaterRoleStaysThroughJoins: replicas that join do not take the updater role from the
// replica that holds it (the updater group's balancer keeps it where it is): after two joins, r1
// is still the updater, every replica follows its one claim (term 1), and records produced
// after the joins are applied.
func TestUpdaterRoleStaysThroughJoins(t *testing.T) {
	b, key, r1 := firstOfTwoReplicas(t, "three replicas")
	waitfor.Cond(t, 30*time.Second, "r1 the updater", r1.d.rep.Updater)
	gens := func(r *running) float64 { return r.metric(t, alerts.NameGenerations) }
	reps := []*running{r1}
	for _, id := range []string{"r2", "r3"} {
		before := gens(r1)
		r := startReplicaKey(t, b, id, key)
		reps = append(reps, r)
		waitfor.Cond(t, 60*time.Second, id+"'s join through the updater group", func() bool { return gens(r) >= 1 && gens(r1) > before })
	}
	data := bundled(t)
	n := produceRows(t, r1, data, 0, 64)
	for _, r := range reps {
		waitfor.Cond(t, 60*time.Second, "the records applied at every replica", func() bool {
			return r.metric(t, "cfguard_records_total", "result", "applied") == float64(n)
		})
	}
	for i, r := range reps {
		if v := r.view(t); v.Replication.Term != 1 || r.d.rep.Updater() != (i == 0) {
			t.Errorf("r%d: term %d, updater %v; want term 1 (r1's one claim), r1 the updater", i+1, v.Replication.Term, r.d.rep.Updater())
		}
	}
}
