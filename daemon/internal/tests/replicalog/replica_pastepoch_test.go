package replicalog

import (
	"context"
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

// TestPastFindsPosteriorsAfterAnEpochPastAnUnreadableEntry: a log that stopped at an entry of a
// newer format and went on from a new epoch moving past it is played for past posteriors as the
// follower played it: the play stops at that entry too, so the epoch that names it is its
// successor, and the versions after the epoch are found. A restarted replica keeps none of them
// in memory but its current one, so each older one is found by playing the log.
func TestPastFindsPosteriorsAfterAnEpochPastAnUnreadableEntry(t *testing.T) {
	t.Parallel() // mostly waits for its replica
	b := daemontest.StartCluster(t, 1)
	start := restartable(t, b)
	r := start()
	data := daemontest.Bundled(t)
	n := daemontest.ProduceRows(t, r, data, 0, 32)
	waitfor.Cond(t, 60*time.Second, "the log covers the first records", func() bool { return r.Model(t).Replication.Covers[0] == int64(n) })
	before := r.D.Replica().Head()

	plog := daemontest.KeyHolderLog(t, r)
	newer := daemontest.ClaimOn(before, "r9/newer")
	newer.Format = postlog.Format + 1
	at, err := plog.End(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	sum := daemontest.AppendEntry(t, plog, newer)
	waitfor.Cond(t, 60*time.Second, "the replica stopped at the entry of a newer format", func() bool {
		code, body := r.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "upgrade cfguard")
	})
	settings, err := replica.ClusterSettings(r.Config)
	if err != nil {
		t.Fatal(err)
	}
	epoch := epochOn(t, r, before, settings)
	epoch.Past = &postlog.Past{Offset: at, SHA256: sum}
	daemontest.AppendEntry(t, plog, epoch)
	waitfor.Cond(t, 60*time.Second, "the replica resumed from the epoch", func() bool {
		code, _ := r.Get(t, "/readyz")
		return code == http.StatusOK && r.D.Replica().Head().Epoch == before.Epoch+1
	})
	findPastAfterTheEpoch(t, r, start, data, n, before)
}

// TestPastFindsPosteriorsOfALogBegunAgain: a posterior topic recreated under a replica and begun
// again by an epoch from the replica's head (as cfguard new-epoch --head-from writes it) holds no
// genesis before the epoch, so a play of the log for past posteriors takes the epoch's posterior
// whole, as its first entry, and finds the versions after it. The replica is restarted so that
// the version asked for is not in memory.
func TestPastFindsPosteriorsOfALogBegunAgain(t *testing.T) {
	t.Parallel() // mostly waits for its replica
	b := daemontest.StartCluster(t, 1)
	start := restartable(t, b)
	r := start()
	data := daemontest.Bundled(t)
	n := daemontest.ProduceRows(t, r, data, 0, 32)
	waitfor.Cond(t, 60*time.Second, "the log covers the first records", func() bool { return r.Model(t).Replication.Covers[0] == int64(n) })
	head := r.D.Replica().Head()

	// The topic recreated and written past the replica's head: the replica stops on its head gone.
	kafkatest.RecreateTopic(t, b.Addrs(), "cfguard.posterior", 1)
	for i := int64(0); i <= head.Offset+2; i++ {
		daemontest.RawProduce(t, b, "cfguard.posterior", 0, "junk", []byte(`{"not":"an entry"}`))
	}
	waitfor.Cond(t, 60*time.Second, "the replica stops following the regrown log", func() bool {
		return r.Metric(t, "cfguard_posterior_log_stopped") == 1
	})
	settings, err := replica.ClusterSettings(r.Config)
	if err != nil {
		t.Fatal(err)
	}
	daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, r), epochOn(t, r, head, settings))
	waitfor.Cond(t, 60*time.Second, "the replica resumed at the epoch", func() bool {
		return r.Metric(t, "cfguard_posterior_log_stopped") == 0 && r.D.Replica().Head().Epoch == head.Epoch+1
	})
	findPastAfterTheEpoch(t, r, start, data, n, head)
}

// restartable returns what starts replica r1 of b, with the cluster key, on a state_dir of its
// own and waits for it to be ready: again on the same state_dir at each call.
func restartable(t *testing.T, b *broker.Broker) func() *launch.Running {
	t.Helper()
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	dir := t.TempDir()
	cfg := func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r1", key); c.StateDir = dir }
	return func() *launch.Running {
		r := launch.With(t, cfg, nil, nil)
		waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == http.StatusOK })
		return r
	}
}

// findPastAfterTheEpoch has r, which resumed from an epoch on head and has read n records of data,
// apply two more increments, restarts it (start) so that it keeps no past posterior in memory,
// and checks that Past finds head's version and the one between the two increments.
func findPastAfterTheEpoch(t *testing.T, r *launch.Running, start func() *launch.Running, data *dataset.Set, n int, head *postlog.Head) {
	t.Helper()
	n = daemontest.ProduceRows(t, r, data, n, 32)
	waitfor.Cond(t, 60*time.Second, "the log covers every record", func() bool { return r.Model(t).Replication.Covers[0] == int64(n) })
	after := r.D.Replica().Head()
	n = daemontest.ProduceRows(t, r, data, n, 32) // so that the version after the epoch is not the current one
	waitfor.Cond(t, 60*time.Second, "the log covers every record", func() bool { return r.Model(t).Replication.Covers[0] == int64(n) })
	if cur := r.D.Replica().Head().Version; after.Version <= head.Version || cur <= after.Version {
		t.Fatalf("versions %d at the epoch's head, %d after it, %d now: no past version to look for after the epoch", head.Version, after.Version, cur)
	}
	r.Stop(t)
	wantPast(t, start(), head, after)
}

// wantPast asks r for the posteriors of the heads' versions (Replica.Past) and checks that each
// hashes to its head's posterior.
func wantPast(t *testing.T, r *launch.Running, heads ...*postlog.Head) {
	t.Helper()
	versions := make([]uint64, len(heads))
	for i, h := range heads {
		versions[i] = h.Version
	}
	got, err := r.D.Replica().Past(context.Background(), versions)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range heads {
		m, ok := got[h.Version]
		if !ok {
			t.Errorf("version %d (epoch %d) not found", h.Version, h.Epoch)
			continue
		}
		if sha, err := postlog.PosteriorHash(m); err != nil || sha != h.PosteriorSHA256 {
			t.Errorf("version %d hashes to %s (%v), want %s", h.Version, sha, err, h.PosteriorSHA256)
		}
	}
}
