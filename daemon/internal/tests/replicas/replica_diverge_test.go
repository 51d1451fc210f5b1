package replicas

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/replica"
)

// TestReplicaOffAnEntryTheLogExtendsStops: a replica refuses an increment that covers input
// records past the topic's end; when the log then holds an entry built on that increment, its
// writer accepted what this replica refused, and the replica's head is one the log has left. It
// stops following (/readyz 503 naming the entry and the recovery, cfguard_posterior_log_stopped 1,
// CfguardPosteriorLogStopped) instead of ignoring every later entry while ready, and keeps
// serving the posterior it verified until a new epoch moves past the entry.
func TestReplicaOffAnEntryTheLogExtendsStops(t *testing.T) {
	t.Parallel() // mostly waits for its replica
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r := launch.ReplicaKey(t, b, "r1", key)
	n := daemontest.ProduceRows(t, r, daemontest.Bundled(t), 0, 64)
	waitfor.Cond(t, 60*time.Second, "the log covers the 64 records", func() bool { return r.Model(t).Replication.Covers[0] == int64(n) })
	before := r.Model(t)

	h := r.D.Replica().Head()
	skipped := func(seq uint64, parent string) *postlog.Entry {
		return &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: seq, Parent: parent, Term: h.Term, Writer: h.Writer,
			Version: h.Version, ParentVersion: h.Version, InputTopic: "cfguard.records", Covers: map[int]int64{0: h.Covers[0] + 32},
			Outcome: postlog.Skipped, Counts: &postlog.Counts{}, PosteriorSHA256: h.PosteriorSHA256}
	}
	plog := daemontest.KeyHolderLog(t, r)
	past := daemontest.AppendEntry(t, plog, skipped(h.Seq+1, h.Hash))
	waitfor.Cond(t, 60*time.Second, "the entry past the input's end refused", func() bool {
		return r.Metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "coverage_past_end") == 1
	})
	if code, body := r.Get(t, "/readyz"); code != http.StatusOK {
		t.Fatalf("after one refused entry: /readyz %d %s; want ready (the updater's next entry takes its place)", code, body)
	}
	child := skipped(h.Seq+2, past)
	childHash := daemontest.AppendEntry(t, plog, child)
	childOffset, err := plog.End(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	childOffset-- // the updater appends nothing meanwhile: no record waits
	waitfor.Cond(t, 60*time.Second, "the replica stops following", func() bool {
		code, body := r.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "extends an entry this chain does not have") &&
			r.Metric(t, "cfguard_posterior_log_stopped") == 1
	})
	_, body := r.Get(t, "/readyz")
	for _, want := range []string{fmt.Sprintf("entry %d (", h.Seq+2), fmt.Sprintf("head, entry %d,", h.Seq), "move its state_dir aside", "cfguard new-epoch moves the log past them"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/readyz does not say %q: %s", want, body)
		}
	}
	if after := r.Model(t); after.Version != before.Version || after.Replication.Entry != before.Replication.Entry {
		t.Errorf("the stopped replica serves version %d entry %d; want what it verified: version %d entry %d",
			after.Version, after.Replication.Entry, before.Version, before.Replication.Entry)
	}

	// The recovery when every replica stopped there: a new epoch after the head they kept, moving
	// past the entry they stopped at, as cfguard new-epoch writes it (cmd/cfguard
	// TestNewEpochMovesPastAnEntryBuiltOnARefusedOne).
	eb, err := postlog.NewBody(r.D.Posterior())
	if err != nil {
		t.Fatal(err)
	}
	settings, err := replica.ClusterSettings(r.Config)
	if err != nil {
		t.Fatal(err)
	}
	daemontest.AppendEntry(t, plog, &postlog.Entry{Format: postlog.Format, Kind: postlog.Genesis, Seq: h.Seq + 1, Parent: h.Hash, Term: h.Term,
		Writer: "new-epoch@test/1", Version: h.Version, ParentVersion: h.Version, InputTopic: "cfguard.records", Covers: h.Covers,
		PosteriorSHA256: h.PosteriorSHA256, Body: eb, Settings: settings, Epoch: h.Epoch + 1,
		Past: &postlog.Past{Offset: childOffset, SHA256: childHash}})
	waitfor.Cond(t, 60*time.Second, "the replica resumed from the epoch", func() bool {
		code, _ := r.Get(t, "/readyz")
		return code == http.StatusOK && r.Metric(t, "cfguard_posterior_log_stopped") == 0 && r.Model(t).Replication.Entry == h.Seq+1
	})
}
