package replicalog

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/replica"
)

// TestInputTopicRecreatedUnderReplicas deletes and recreates the input topic under a replica whose
// posterior log covers 64 records of it, and writes 96 records to the new topic: the updater finds the
// reset (the record the log's marks name is not there any more) and stops ingesting rather than read
// on from offset 64 and skip the new log's first 64 records. It keeps serving its posterior, /readyz
// names the reset and says that replicas cannot confirm it, cfguard_consumer_topic_mismatch is 1
// (CfguardTopicReset), and the new log's 96 records wait (cfguard_consumer_lag_records). Restarted, a
// new updater (whose consumer never read the old topic) finds it from the log's marks alone: the log
// still covers 64. A new epoch written meanwhile moves the log on, and the updater, keeping its
// role, claims a term on it and stops again at the same reset: an epoch keeps the marks, so it
// confirms no reset.
func TestInputTopicRecreatedUnderReplicas(t *testing.T) {
	t.Parallel() // replicas mostly wait for their group and for each other
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	dir := t.TempDir()
	cfg := func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r1", key); c.StateDir = dir }
	start := func() *launch.Running {
		r := launch.With(t, cfg, nil, nil)
		waitfor.Cond(t, 60*time.Second, "r1 answers", func() bool { code, _ := r.Get(t, "/healthz"); return code == 200 })
		return r
	}
	r := start()
	data := daemontest.Bundled(t)
	daemontest.ProduceRows(t, r, data, 0, 64)
	waitfor.Cond(t, 60*time.Second, "the log covers 64 records", func() bool { return r.Model(t).Replication.Covers[0] == 64 })
	before := r.Model(t)

	kafkatest.RecreateTopic(t, b.Addrs(), "cfguard.records", 1)
	daemontest.ProduceRows(t, r, data, 64, 96)
	stopped := func(r *launch.Running, what string) {
		t.Helper()
		read := func() {
			t.Helper()
			if v := r.Model(t); v.Replication.Covers[0] != 64 || v.Version != before.Version {
				t.Fatalf("%s: the log covers %v at version %d; want 64 at version %d: records of the new topic were read past its start",
					what, v.Replication.Covers, v.Version, before.Version)
			}
		}
		waitfor.Cond(t, 60*time.Second, what, func() bool {
			read()
			code, body := r.Get(t, "/readyz")
			return code == http.StatusServiceUnavailable && strings.Contains(string(body), "was reset") &&
				strings.Contains(string(body), "replicas cannot confirm a topic reset") &&
				r.Metric(t, "cfguard_consumer_topic_mismatch") == 1 && r.Metric(t, "cfguard_consumer_lag_records") == 96
		})
		read()
	}
	stopped(r, "the updater stops on the reset topic")

	// A new epoch (cfguard new-epoch) moves the log on under the stopped updater: it keeps its
	// role, claims the next term on the epoch, and finds the reset again from the marks the epoch
	// keeps; the epoch confirms nothing, so no record of the new topic is skipped.
	h := r.D.Replica().Head()
	settings, err := replica.ClusterSettings(r.Config)
	if err != nil {
		t.Fatal(err)
	}
	generations := r.Metric(t, "cfguard_updater_group_generations_total")
	daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, r), epochOn(t, r, h, settings))
	waitfor.Cond(t, 60*time.Second, "the updater claims a term on the epoch", func() bool {
		now := r.D.Replica().Head()
		return now.Epoch == h.Epoch+1 && now.Term == h.Term+1 && now.Writer != "" && now.Writer == h.Writer
	})
	if u, g := r.Metric(t, "cfguard_replication_updater"), r.Metric(t, "cfguard_updater_group_generations_total"); u != 1 || g != generations {
		t.Errorf("after the epoch: cfguard_replication_updater %v, %v generations of the updater group; want 1 and %v (the role kept)", u, g, generations)
	}
	stopped(r, "the updater stops again on the reset topic after the epoch")

	r.Stop(t)
	r = start()
	stopped(r, "the restarted updater finds the reset from the log's marks")
}

// TestReplicaStartedAfterAShorterInputIsNotReady: the input topic recreated with fewer records
// than the posterior log covers (40 of 64), a replica that then starts on an empty state_dir
// accepts the entry covering 32 records and refuses the last one, covering 64 records the topic
// no longer has. It serves an older posterior than the updater's, so it does not say it is
// ready, and /readyz says why. (Had a later entry extended the refused one, it would stop
// following.)
func TestReplicaStartedAfterAShorterInputIsNotReady(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b, key, r1, data := replicaCovering64(t)
	v1 := r1.Model(t)

	kafkatest.RecreateTopic(t, b.Addrs(), "cfguard.records", 1)
	daemontest.ProduceRows(t, r1, data, 64, 40)
	r2 := launch.With(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r2", key) }, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r2 to refuse the last entry and say so", func() bool {
		code, body := r2.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "the posterior log's newest entry past this replica's head is refused") &&
			strings.Contains(string(body), "it covers partition 0 to offset 64, and the partition ends at 40")
	})
	if v := r2.Model(t); v.Version >= v1.Version || v.Replication.Covers[0] != 32 {
		t.Errorf("r2 serves version %d covering %v, want a version older than r1's %d, covering 32", v.Version, v.Replication.Covers, v1.Version)
	}
}

// TestReplicaStartedAfterARefusedEntryIsReadyAtTheNext: an increment a holder of the cluster key
// wrote past the input's end is the log's last entry. The running replica refused it live and
// stays ready; a replica that starts then reads it while catching up, cannot tell it from an
// entry the others applied before the input lost records, and is not ready, until the updater's
// next entry (at the next input record) takes its place: then both are ready on one head.
func TestReplicaStartedAfterARefusedEntryIsReadyAtTheNext(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b, key, r1, data := replicaCovering64(t)
	n := 64
	h := r1.D.Replica().Head()
	daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, r1), &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: h.Seq + 1, Parent: h.Hash,
		Term: h.Term, Writer: h.Writer, Version: h.Version, ParentVersion: h.Version, InputTopic: "cfguard.records",
		Covers: map[int]int64{0: h.Covers[0] + 500}, Outcome: postlog.Skipped, Counts: &postlog.Counts{}, PosteriorSHA256: h.PosteriorSHA256})
	waitfor.Cond(t, 30*time.Second, "r1 to refuse the entry", func() bool {
		return r1.Metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "coverage_past_end") == 1
	})
	if code, body := r1.Get(t, "/readyz"); code != http.StatusOK {
		t.Fatalf("r1, which refused the entry live: /readyz %d %s", code, body)
	}

	r2 := launch.With(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r2", key) }, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r2 to refuse the entry and say so", func() bool {
		code, body := r2.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "the posterior log's newest entry past this replica's head is refused") &&
			strings.Contains(string(body), "a holder of the cluster key wrote it")
	})
	n = daemontest.ProduceRows(t, r1, data, n, 32)
	waitfor.Cond(t, 60*time.Second, "r2 ready at the updater's next entry", func() bool {
		code, _ := r2.Get(t, "/readyz")
		return code == http.StatusOK
	})
	// Each replica's follower applies the updater's entries on its own: r2 may be ahead of r1,
	// the updater, which trusts its entry once its own follower read it back, or both may be at
	// an entry before the one that covers the last record.
	var v1, v2 daemontest.ModelView
	waitfor.Cond(t, 60*time.Second, "r1 and r2 on one head covering every record produced", func() bool {
		v1, v2 = r1.Model(t), r2.Model(t)
		return v1.Replication.Covers[0] == int64(n) && v2.Replication.Covers[0] == int64(n)
	})
	if v2.Replication.SHA != v1.Replication.SHA || v2.Replication.Entry != v1.Replication.Entry {
		t.Errorf("r2 at entry %d covering %v (%s), r1 at entry %d (%s): want one head covering %d",
			v2.Replication.Entry, v2.Replication.Covers, v2.Replication.SHA, v1.Replication.Entry, v1.Replication.SHA, n)
	}
}

// replicaCovering64 starts a broker and replica r1 with a key file, produces 64 rows of the
// bundled data set and waits until the posterior log covers them.
func replicaCovering64(t *testing.T) (*broker.Broker, string, *launch.Running, *dataset.Set) {
	t.Helper()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := launch.ReplicaKey(t, b, "r1", key)
	data := daemontest.Bundled(t)
	daemontest.ProduceRows(t, r1, data, 0, 64)
	waitfor.Cond(t, 60*time.Second, "the log covers 64 records", func() bool { return r1.Model(t).Replication.Covers[0] == 64 })
	return b, key, r1, data
}
