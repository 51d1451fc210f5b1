package replicalog

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/replica"
	"github.com/cfguard/cfguard/stream"
)

// TestPosteriorLogRecreatedStopsTheReplicas deletes and recreates the posterior topic under a
// running replica while records stream: the log now ends before what the replica has read, and
// what it will hold is another history. The replica stops following within resetAfter (plus a
// tick), names the reset in /readyz and cfguard_posterior_log_stopped (CfguardPosteriorLogStopped),
// keeps serving the posterior it had, applies nothing more, and its updater writes no entry
// it calls a bug; restarted, it refuses to start. A replica that starts on the recreated topic, which holds an entry of the
// cluster and no genesis, refuses to write a genesis of its own (it would follow a history no
// other replica does) and names the topic and the recovery.
func TestPosteriorLogRecreatedStopsTheReplicas(t *testing.T) {
	t.Parallel() // most of it waits for resetAfter
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r := launch.ReplicaKey(t, b, "r1", key)
	data := daemontest.Bundled(t)
	n := daemontest.ProduceRows(t, r, data, 0, 64)
	waitfor.Cond(t, 60*time.Second, "the log covers the 64 records", func() bool { return r.Model(t).Replication.Covers[0] == int64(n) })
	before := r.Model(t)

	generations := r.Metric(t, "cfguard_updater_group_generations_total")
	kafkatest.RecreateTopic(t, b.Addrs(), "cfguard.posterior", 1)
	daemontest.ProduceRows(t, r, data, n, 64)
	waitfor.Cond(t, 60*time.Second, "the replica stops following the recreated log", func() bool {
		code, body := r.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "posterior log reset") &&
			r.Metric(t, "cfguard_posterior_log_stopped") == 1
	})
	// While the log is short and after, the updater waits in its generation: one that ended at
	// once would be joined again at once, thousands of times in the 10 s before the halt. A few
	// are allowed: a process starved past its session timeout rejoins.
	if g := r.Metric(t, "cfguard_updater_group_generations_total") - generations; g > 10 {
		t.Errorf("the updater group went through %v generations while the log was short; want the updater to keep its own", g)
	}
	after := r.Model(t)
	if after.Version != before.Version || after.Replication.Entry != before.Replication.Entry || after.Replication.SHA != before.Replication.SHA {
		t.Errorf("after the reset the replica serves version %d entry %d (%s); want what it had: version %d entry %d (%s)",
			after.Version, after.Replication.Entry, after.Replication.SHA, before.Version, before.Replication.Entry, before.Replication.SHA)
	}
	if logs := r.Logs.String(); strings.Contains(logs, "a bug") || !strings.Contains(logs, "stopped following the posterior log") {
		t.Errorf("the replica's log after the reset:\n%s", logs)
	}

	// The recreated topic holds an entry of the cluster (the updater may have appended one before
	// it read the log's end; this one is certain) and no genesis.
	daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, r), daemontest.ClaimOn(r.D.Replica().Head(), "r9/1"))
	err := runReplicaOnce(t, b, "r2", t.TempDir(), key)
	if err == nil || !strings.Contains(err.Error(), "no genesis") || !strings.Contains(err.Error(), "cfguard.posterior") ||
		!strings.Contains(err.Error(), "lost its start") {
		t.Errorf("a replica starting on the recreated log: Run = %v; want a refusal naming the topic and its lost start", err)
	}
	if r.Model(t).Replication.Entry != before.Replication.Entry {
		t.Error("the stopped replica applied an entry of the recreated log")
	}

	// A new epoch begins the recreated log from the replica's head, as cfguard new-epoch
	// --head-from writes it, with the settings of an operator's file whose certify.delta
	// differs (the log lost the genesis that recorded the cluster's). The stopped replica names
	// the key and the recovery that works: a replica rebuilt from an empty state_dir with the
	// epoch's settings follows the new log.
	h := r.D.Replica().Head()
	epochCfg := *r.Config
	epochCfg.Certify.Delta = 0.1
	settings, err := replica.ClusterSettings(&epochCfg)
	if err != nil {
		t.Fatal(err)
	}
	daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, r), epochOn(t, r, h, settings))
	waitfor.Cond(t, 60*time.Second, "the replica naming the epoch's settings and the rebuild", func() bool {
		code, body := r.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "certify.delta: this replica 0.05, the cluster's log 0.1") &&
			strings.Contains(string(body), "the log was recreated: set these keys to the log's values in the file") &&
			strings.Contains(string(body), "move this replica's state_dir aside and restart it")
	})

	// Restarted, the replica finds the entry it applied last gone and refuses, ledger unchanged.
	dir := r.Config.StateDir
	r.Stop(t)
	err = runReplicaOnce(t, b, "r1", dir, key)
	if err == nil || !strings.Contains(err.Error(), "posterior log reset") || !strings.Contains(err.Error(), "no longer holds it") ||
		!strings.Contains(err.Error(), "new-epoch --head-from") {
		t.Errorf("the replica restarted on the recreated log: Run = %v; want a refusal naming the reset and the recovery", err)
	}
	rebuilt := launch.With(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", key)
		c.Certify.Delta = 0.1
	}, nil, nil)
	waitfor.Cond(t, 60*time.Second, "the rebuilt replica following the new log", func() bool {
		code, _ := rebuilt.Get(t, "/readyz")
		return code == http.StatusOK && rebuilt.D.Replica().Head().Epoch == h.Epoch+1
	})
}

// TestPosteriorLogRegrownStopsTheReplica recreates the posterior topic under a running replica
// and writes records into it past the replica's head before the replica could see it short: the
// log's end never falls below what the replica has read, but the entry it applied last is gone.
// The replica finds its head missing within resetAfter (plus a tick) and stops as on a short log,
// naming the entry and the record in its place.
func TestPosteriorLogRegrownStopsTheReplica(t *testing.T) {
	t.Parallel() // mostly waits for the check of the head
	b := daemontest.StartCluster(t, 1)
	r := launch.Replica(t, b, "r1")
	n := daemontest.ProduceRows(t, r, daemontest.Bundled(t), 0, 64)
	waitfor.Cond(t, 60*time.Second, "the log covers the 64 records", func() bool { return r.Model(t).Replication.Covers[0] == int64(n) })
	head := r.D.Replica().Head()
	kafkatest.RecreateTopic(t, b.Addrs(), "cfguard.posterior", 1)
	for i := int64(0); i <= head.Offset+2; i++ {
		daemontest.RawProduce(t, b, "cfguard.posterior", 0, "junk", []byte(`{"not":"an entry"}`))
	}
	waitfor.Cond(t, 60*time.Second, "the replica stops following the regrown log", func() bool {
		code, body := r.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "no longer holds entry") &&
			r.Metric(t, "cfguard_posterior_log_stopped") == 1
	})
	if got := r.D.Replica().Head(); got.Seq != head.Seq || got.Hash != head.Hash {
		t.Errorf("after the reset the replica's head is entry %d (%s); want entry %d (%s) it had", got.Seq, got.Hash, head.Seq, head.Hash)
	}

	// An epoch with the cluster's settings begins the log again from the replica's head, and it
	// resumes. A later, hand-written epoch that changes a setting the log recorded is no reset:
	// the replica says that no replica can follow it, not to rebuild from the log.
	plog := daemontest.KeyHolderLog(t, r)
	settings, err := replica.ClusterSettings(r.Config)
	if err != nil {
		t.Fatal(err)
	}
	daemontest.AppendEntry(t, plog, epochOn(t, r, head, settings))
	waitfor.Cond(t, 60*time.Second, "the replica resumed at the epoch", func() bool {
		return r.Metric(t, "cfguard_posterior_log_stopped") == 0 && r.D.Replica().Head().Epoch == head.Epoch+1
	})
	changed := *r.Config
	changed.Certify.Delta = 0.1
	if settings, err = replica.ClusterSettings(&changed); err != nil {
		t.Fatal(err)
	}
	daemontest.AppendEntry(t, plog, epochOn(t, r, r.D.Replica().Head(), settings))
	var body string
	waitfor.Cond(t, 60*time.Second, "the replica stopped at the epoch that changes a setting", func() bool {
		code, b := r.Get(t, "/readyz")
		body = string(b)
		return code == http.StatusServiceUnavailable && r.Metric(t, "cfguard_posterior_log_stopped") == 1
	})
	if !strings.Contains(body, "the epoch changes settings that the log recorded before it, which no replica can follow") ||
		strings.Contains(body, "recreated") || strings.Contains(body, "follow on") {
		t.Errorf("/readyz at an epoch that changes a recorded setting, after a reset an epoch healed: %s", body)
	}
}

// A replica restarted on a log that was recreated and has grown past the entry its ledger applied
// last finds another record at that offset: it refuses to start, naming the reset and the
// record's hash, and the ledger keeps its head.
func TestRestartOnARegrownLogIsRefused(t *testing.T) {
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r := launch.ReplicaKey(t, b, "r1", key)
	n := daemontest.ProduceRows(t, r, daemontest.Bundled(t), 0, 64)
	waitfor.Cond(t, 60*time.Second, "the log covers the 64 records", func() bool { return r.Model(t).Replication.Covers[0] == int64(n) })
	head := r.D.Replica().Head()
	dir := r.Config.StateDir
	r.Stop(t)
	kafkatest.RecreateTopic(t, b.Addrs(), "cfguard.posterior", 1)
	for i := int64(0); i <= head.Offset+2; i++ {
		daemontest.RawProduce(t, b, "cfguard.posterior", 0, "junk", []byte(`{"not":"an entry"}`))
	}
	err := runReplicaOnce(t, b, "r1", dir, key)
	want := fmt.Sprintf("the record at offset %d hashes to", head.Offset)
	if err == nil || !strings.Contains(err.Error(), "posterior log reset") || !strings.Contains(err.Error(), want) {
		t.Errorf("restarted on the regrown log: Run = %v; want the reset named, with %q", err, want)
	}
}

// epochOn is a new epoch on h, as cfguard new-epoch writes it from a head (the entry it moves
// past is h), carrying r's posterior and recording settings.
func epochOn(t *testing.T, r *launch.Running, h *postlog.Head, settings map[string]string) *postlog.Entry {
	t.Helper()
	body, err := postlog.NewBody(r.D.Posterior())
	if err != nil {
		t.Fatal(err)
	}
	return &postlog.Entry{Format: postlog.Format, Kind: postlog.Genesis, Seq: h.Seq + 1, Parent: h.Hash, Term: h.Term,
		Writer: "new-epoch@test/1", Version: h.Version, ParentVersion: h.Version, InputTopic: "cfguard.records", Covers: h.Covers,
		PosteriorSHA256: h.PosteriorSHA256, Body: body, Settings: settings, Epoch: h.Epoch + 1, Past: &postlog.Past{Offset: h.Offset, SHA256: h.Hash}}
}

// TestStoppedReplicaSeesItsLogRecreated stops a replica at an entry it cannot read, then
// recreates the posterior topic under it, leaving it short or writing it past the replica's
// head before the replica could see it short. Either way the reset supersedes the earlier stop:
// the replica names the reset and its recovery instead of the entry that is gone, and reads the
// new log from its start, where a new epoch from its head (cfguard new-epoch --head-from) lets
// it follow on.
func TestStoppedReplicaSeesItsLogRecreated(t *testing.T) {
	t.Parallel() // mostly waits for resetAfter
	for _, regrown := range []bool{false, true} {
		t.Run(map[bool]string{false: "short", true: "regrown"}[regrown], func(t *testing.T) {
			t.Parallel()
			b := daemontest.StartCluster(t, 1)
			r := launch.Replica(t, b, "r1")
			n := daemontest.ProduceRows(t, r, daemontest.Bundled(t), 0, 64)
			waitfor.Cond(t, 60*time.Second, "the log covers the 64 records", func() bool { return r.Model(t).Replication.Covers[0] == int64(n) })
			head := r.D.Replica().Head()
			newer := daemontest.ClaimOn(head, "r9/newer")
			newer.Format = postlog.Format + 1
			daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, r), newer)
			waitfor.Cond(t, 60*time.Second, "the replica stopped at the entry of a newer format", func() bool {
				code, body := r.Get(t, "/readyz")
				return code == http.StatusServiceUnavailable && strings.Contains(string(body), "upgrade cfguard")
			})

			kafkatest.RecreateTopic(t, b.Addrs(), "cfguard.posterior", 1)
			if regrown { // past what the replica has read (the newer entry's offset + 1)
				for i := int64(0); i <= head.Offset+3; i++ {
					daemontest.RawProduce(t, b, "cfguard.posterior", 0, "junk", []byte(`{"not":"an entry"}`))
				}
			}
			var body string
			waitfor.Cond(t, 60*time.Second, "the replica naming the reset", func() bool {
				code, b := r.Get(t, "/readyz")
				body = string(b)
				return code == http.StatusServiceUnavailable && strings.Contains(body, "posterior log reset")
			})
			if !strings.Contains(body, "new-epoch --head-from") || strings.Contains(body, "upgrade cfguard") {
				t.Errorf("/readyz of a stopped replica whose log was recreated: %s; want the reset's recovery alone", body)
			}
			settings, err := replica.ClusterSettings(r.Config)
			if err != nil {
				t.Fatal(err)
			}
			daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, r), epochOn(t, r, head, settings))
			waitfor.Cond(t, 60*time.Second, "the replica following the new log from the epoch", func() bool {
				code, _ := r.Get(t, "/readyz")
				return code == http.StatusOK && r.Metric(t, "cfguard_posterior_log_stopped") == 0 && r.D.Replica().Head().Epoch == head.Epoch+1
			})
		})
	}
}

// emptyLog starts a broker with an empty posterior log, and returns it, the cluster's key file
// and the log opened as a holder of that key writes it.
func emptyLog(t *testing.T) (*broker.Broker, string, *postlog.Log) {
	t.Helper()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	keys, err := clusterkey.Load(key)
	if err != nil {
		t.Fatal(err)
	}
	plog, err := postlog.Open(context.Background(), stream.ConnConfig{Brokers: b.Addrs()}, "cfguard.posterior", keys, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plog.Close() })
	return b, key, plog
}

// A replica starting on a log that holds a single record and no genesis writes no genesis of its
// own (it would follow a history of its own): one record that does not authenticate makes a log
// of another key or a forger's, one entry of the cluster a log that lost its start. Each
// refusal names the topic.
func TestOneRecordAndNoGenesisRefusesAStart(t *testing.T) {
	for _, tc := range []struct {
		name string
		sign bool
		want string
	}{
		{"one record that does not authenticate", false, "none authenticates"},
		{"one entry of the cluster", true, "lost its start"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, key, plog := emptyLog(t)
			e := &postlog.Entry{Format: postlog.Format, Kind: postlog.Claim, Seq: 5, Parent: strings.Repeat("ab", 32), Term: 3, Writer: "r9/1",
				Version: 2, ParentVersion: 2, PosteriorSHA256: strings.Repeat("cd", 32)}
			if tc.sign {
				daemontest.AppendEntry(t, plog, e)
			} else {
				v, err := e.Encode()
				if err != nil {
					t.Fatal(err)
				}
				daemontest.RawProduce(t, b, "cfguard.posterior", 0, "e/5", v)
			}
			err := runReplicaOnce(t, b, "r1", t.TempDir(), key)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "cfguard.posterior") {
				t.Errorf("Run = %v; want a refusal naming cfguard.posterior and saying %q", err, tc.want)
			}
		})
	}
}

// A genesis whose body is not the posterior its hash names (a writer's bug: the record
// authenticates) is no start: a replica refuses it, naming the genesis's offset.
func TestGenesisWhoseBodyIsNotItsPosteriorIsRefused(t *testing.T) {
	b, key, plog := emptyLog(t)
	m, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	body, err := postlog.NewBody(m)
	if err != nil {
		t.Fatal(err)
	}
	daemontest.AppendEntry(t, plog, &postlog.Entry{Format: postlog.Format, Kind: postlog.Genesis, Writer: "r9/1", InputTopic: "cfguard.records",
		Body: body, PosteriorSHA256: strings.Repeat("cd", 32)})
	err = runReplicaOnce(t, b, "r1", t.TempDir(), key)
	if err == nil || !strings.Contains(err.Error(), "genesis (offset 0)") || !strings.Contains(err.Error(), "does not match") {
		t.Errorf("Run = %v; want the genesis at offset 0 refused for its body", err)
	}
}
