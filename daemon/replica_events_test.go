package daemon

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
)

// TestEventsOfADeadWritersEntryArePublishedByTheNextClaimant: an updater's posterior events
// ride in its entries (each naming its entry), and each entry vouches for the events of the one
// before, so the log's head owes only the last entry's. A writer that died between its append
// and its own apply (simulated: a claim and an increment appended under the cluster key by a
// writer that then says nothing) leaves its events owed; the next claimant publishes them,
// exactly those, and the events topic holds them as the entry carries them.
func TestEventsOfADeadWritersEntryArePublishedByTheNextClaimant(t *testing.T) {
	t.Parallel() // replicas mostly wait for their group and for each other
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	dir := t.TempDir()
	cfg := func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", key)
		c.StateDir = dir
		daemontest.PaperLearner(c, 1e-3)
		c.Certify.OnBreach = "reject" // every increment of flipped labels: kl_over_budget and increment_held
	}
	r := startDaemonWith(t, cfg, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	data := daemontest.Bundled(t)
	r.Produce(t, daemontest.Flipped(data, 64)...)
	waitfor.Cond(t, 60*time.Second, "two held increments in the log", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "held") == 64 && r.Metric(t, "cfguard_events_pending") == 0
	})
	h := r.D.rep.Head()
	// The second increment vouches for the first: only the last entry's events are owed.
	if len(h.Unpublished) != 1 || h.Unpublished[0].Seq != h.Seq || len(h.Unpublished[0].Events) != 2 {
		t.Fatalf("head %d owes %+v; want the 2 events of entry %d alone", h.Seq, h.Unpublished, h.Seq)
	}
	own := map[uint64]int{} // this writer's posterior events by log entry
	for _, m := range kafkatest.ReadPartition(t, b.Addrs(), "cfguard.events", 0) {
		var e Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type == "kl_over_budget" || e.Type == "increment_held" {
			if e.LogEntry == 0 {
				t.Errorf("a replica's %s event names no log entry: %s", e.Type, m.Value)
			}
			own[e.LogEntry]++
		}
		if got := kafkatest.Header(m, ReplicaHeader); got != "r1" {
			t.Errorf("an event of replica r1 carries %s %q", ReplicaHeader, got)
		}
	}
	if len(own) != 2 || own[h.Seq] < 2 || own[h.Seq-1] < 2 {
		t.Fatalf("posterior events by log entry %v; want 2 each for entries %d and %d", own, h.Seq-1, h.Seq)
	}
	r.Stop(t)

	// A writer claims, appends an increment with an event, and dies before publishing it. It
	// holds the cluster key: this is a replica that died, not a forgery. Its increment vouches
	// for what came before its claim (its claim would have published it).
	plog := daemontest.KeyHolderLog(t, r)
	claimHash := daemontest.AppendEntry(t, plog, daemontest.ClaimOn(h, "dead/1"))
	lost := Event{Type: "update_failed", At: time.Now().UTC(), PosteriorVersion: h.Version, LogEntry: h.Seq + 2, Error: "the writer died before publishing this"}.entry(time.Time{})
	daemontest.AppendEntry(t, plog, &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: h.Seq + 2, Parent: claimHash, Term: h.Term + 1,
		Writer: "dead/1", Version: h.Version, ParentVersion: h.Version, Covers: h.Covers, PosteriorSHA256: h.PosteriorSHA256,
		Outcome: postlog.Failed, Counts: &postlog.Counts{}, Events: []postlog.Event{{Key: lost.Key, Value: lost.Value}}, EventsThrough: h.Seq + 1})

	// r1 again: a new writer, which applies the dead writer's entries and claims after them.
	r = startDaemonWith(t, cfg, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 claims after the dead writer and publishes its event", func() bool {
		v := r.Model(t)
		return v.Replication.Updater && v.Replication.Term == h.Term+2 && r.Metric(t, "cfguard_events_pending") == 0 &&
			r.Metric(t, "cfguard_posterior_events_republished_total") > 0
	})
	if n := r.Metric(t, "cfguard_posterior_events_republished_total"); n != 1 {
		t.Errorf("%v events published again; want 1, the dead writer's (r1's own were vouched for)", n)
	}
	got := 0
	for _, m := range kafkatest.ReadPartition(t, b.Addrs(), "cfguard.events", 0) {
		if string(m.Value) == string(lost.Value) && string(m.Key) == lost.Key {
			got++
		}
	}
	if got < 1 {
		t.Errorf("the dead writer's event is not on the events topic")
	}
	if h2 := r.D.rep.Head(); len(h2.Unpublished) != 1 || h2.Unpublished[0].Seq != h.Seq+2 {
		t.Errorf("after the claim the head owes %+v; still the dead writer's entry until r1's first increment vouches for it", h2.Unpublished)
	}
	// r1's next increment vouches for everything up to its claim.
	r.Produce(t, daemontest.Flipped(data, 96)[64:]...)
	waitfor.Cond(t, 60*time.Second, "r1's next increment", func() bool { return r.D.rep.Head().Seq > h.Seq+3 })
	if h3 := r.D.rep.Head(); len(h3.Unpublished) != 1 || h3.Unpublished[0].Seq != h3.Seq {
		t.Errorf("head %d owes %+v; want its own events alone", h3.Seq, h3.Unpublished)
	}
}
