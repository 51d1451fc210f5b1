package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// startLearningReplica starts replica id of the cluster on b with the paper's learner at a
// learning rate that a drift of 96 flipped labels moves far, with Options set by opts (nil:
// none), and waits until it is ready.
func startLearningReplica(t *testing.T, b *broker.Broker, id, keyFile string, opts func(o *Options)) *running {
	t.Helper()
	return startReadyReplica(t, b, id, keyFile, func(c *config.Config) { daemontest.PaperLearner(c, 3e-3) }, opts)
}

// startReadyReplica starts replica id of the cluster on b, its configuration changed by cfg and
// its Options by opts (either nil: none), and waits until it is ready.
func startReadyReplica(t *testing.T, b *broker.Broker, id, keyFile string, cfg func(c *config.Config), opts func(o *Options)) *running {
	t.Helper()
	r := startDaemonWith(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), id, keyFile)
		if cfg != nil {
			cfg(c)
		}
	}, opts, nil)
	waitfor.Cond(t, 60*time.Second, id+" ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	return r
}

// A CE whose partition moves to another replica keeps what its previous owner learnt of it:
// after a drift renewed certificates and gave verdicts at the first replica, the replica that
// takes its partitions over (one joining, then the first leaving) serves every CE with the same
// status, certificate, verdict and history, read back from the CE state topic.
func TestMovedCEKeepsItsState(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas and a drift: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := startLearningReplica(t, b, "r1", key, nil)
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r1, data, 10, "")
	// 32 benign rows labelled malignant (a drift), then clean records. Every CE is judged under
	// the drifted posterior before the clean records come, so that r1 gives verdicts whenever its
	// confirmer gets to them: measured only once the clean records have taken the posterior back,
	// the certificates would be renewed, and no status would change.
	drift := daemontest.FlippedThenClean(data, 32, 96)
	produceJudged(t, r1, drift[:32], drift[32:])
	was := map[string]*ledger.CE{}
	changed := 0
	for _, id := range ids {
		ce, err := r1.D.ledger.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		was[id] = ce
		if len(ce.History) > 0 {
			changed++
		}
	}
	if changed == 0 {
		t.Fatal("the drift changed no CE: this test shows nothing")
	}
	statuses, carried := map[string]int{}, 0
	for _, ce := range was {
		statuses[ce.Status.String()]++
		if ce.ConfirmedVersion != nil && *ce.ConfirmedVersion < r1.D.current().Version && ce.Decided {
			carried++
		}
	}
	t.Logf("at r1 after the drift (posterior version %d): %v; %d CEs with a history, %d with a verdict carried from an earlier version",
		r1.D.current().Version, statuses, changed, carried)
	size, hist := 0, 0
	for _, ce := range was {
		e, err := r1.D.states.Encode(ce)
		if err != nil {
			t.Fatal(err)
		}
		size, hist = size+len(e.Key)+len(e.Value), hist+len(ce.History)
	}
	t.Logf("a state record of the bundled model's CEs: %d bytes on average, with %.1f history entries", size/len(was), float64(hist)/float64(len(was)))
	if w := r1.Metric(t, alerts.NameCEStates, "result", alerts.StateWritten); w < float64(changed) {
		t.Fatalf("r1 wrote %v states for %d changed CEs", w, changed)
	}

	// r2 joins and takes some partitions; r1 leaves and r2 takes the rest. r2's follower, which
	// plays the log while its member joins, is held before its first increment until the member
	// applies its first batch of registrations, as a starved follower would be: the batch must
	// wait for the versions the states refer to, not find their verdicts ahead of r2's posterior.
	followed := make(chan struct{})
	var release sync.Once
	awaited := make(chan uint64, 1)
	r2 := startLearningReplica(t, b, "r2", key, func(o *Options) {
		o.Hooks.FollowCommit = func(ctx context.Context, _ uint64) {
			select {
			case <-followed:
			case <-ctx.Done():
			}
		}
		o.Hooks.ShareAwait = func(v uint64) {
			release.Do(func() {
				awaited <- v
				close(followed)
			})
		}
	})
	r1.Stop(t)
	waitfor.Cond(t, 60*time.Second, "r2 holding every CE, ready", func() bool {
		held := r2.HeldCEs(t)
		code, _ := r2.Get(t, "/readyz")
		// The log ends at r1's last entry: r2 judges at the posterior r1 judged at.
		return held == len(ids) && code == 200 && r2.D.current().Version == r1.D.current().Version
	})
	t.Logf("r2's first batch of registrations waited for posterior version %d, its follower held at version 0 until then", <-awaited)
	for _, id := range ids {
		got, err := r2.D.ledger.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		w := *was[id]
		w.UpdatedAt, got.UpdatedAt = time.Time{}, time.Time{}
		if !reflect.DeepEqual(&w, got) {
			t.Errorf("%s moved from r1 to r2:\n r1 %+v\n r2 %+v", id, &w, got)
		}
	}
	if n := r2.Metric(t, alerts.NameCEStates, "result", alerts.StateRestored); n != float64(changed) {
		t.Errorf("r2 restored %v states, want the %d of the CEs that changed at r1", n, changed)
	}
	// r2 publishes no status change of the CEs it restored: r1 published every change their
	// states record before it wrote them (its outbox writes a batch's events, then its states).
	waitfor.Cond(t, 30*time.Second, "r2's outbox drained", func() bool { return r2.Metric(t, "cfguard_events_pending") == 0 })
	byR1 := 0
	for _, m := range kafkatest.ReadPartition(t, b.Addrs(), "cfguard.events", 0) {
		var e Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if _, ok := was[e.ID]; !ok || e.Type != "status_changed" {
			continue
		}
		switch kafkatest.Header(m, ReplicaHeader) {
		case "r1":
			byR1++
		case "r2":
			t.Errorf("r2 published %s -> %s at %d for %s, which it restored unchanged", e.From, e.To, e.PosteriorVersion, e.ID)
		}
	}
	if byR1 == 0 {
		t.Error("r1 published no status change: the test shows nothing")
	}
}

// A CE waiting for its reissue when its partition moves is reissued by its new owner: the wait
// goes with its state (ledger.CE.ReissuePendingSince). r1's reissuer is held while a drift
// invalidates CEs; r2 takes every partition over as r1 leaves, and publishes one outcome for
// each CE r1 left waiting (explain.timeout 1 ns at r2: each generation fails at once), leaving
// none waiting.
func TestMovedCEKeepsItsReissue(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas and a drift: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1, invalidated := heldAfterDrift(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r1", key) })
	waitfor.Cond(t, 30*time.Second, "r1's outbox drained (its states written)", func() bool { return r1.Metric(t, "cfguard_events_pending") == 0 })
	waiting, err := r1.D.ledger.PendingReissues("", 100)
	if err != nil || len(waiting) != len(invalidated) {
		t.Fatalf("r1 holds %+v (%v) as waiting for a reissue, want the %d CEs invalidated", waiting, err, len(invalidated))
	}
	held := r1.HeldCEs(t)

	logs := &tooltest.Output{}
	r2 := startDaemonWith(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		reissueDrift(c)
		daemontest.ReplicaConfig(c, b.Addrs(), "r2", key)
		c.Explain.Timeout = time.Nanosecond
	}), func(o *Options) { o.Logger = slog.New(slog.NewTextHandler(logs, nil)) }, nil)
	r1.Stop(t)
	waitfor.Cond(t, 60*time.Second, "r2 holding every CE, ready", func() bool {
		code, _ := r2.Get(t, "/readyz")
		return code == 200 && r2.HeldCEs(t) == held
	})
	outcomes := reissueOutcomes(t, b.Addrs(), r2.D.cfg.Kafka.EventsTopic, invalidated)
	for _, id := range invalidated {
		if len(outcomes[id]) != 1 || outcomes[id][0].Type != "counterfactual_reissue_failed" {
			t.Errorf("%s: reissue outcomes %+v, want r2's one failure (explain.timeout 1 ns)", id, outcomes[id])
		}
	}
	waitfor.Cond(t, 10*time.Second, "no CE waiting for a reissue at r2", func() bool {
		w, err := r2.D.ledger.PendingReissues("", 100)
		return err == nil && len(w) == 0
	})
	// Queued as r2 took them over, not left for a sweep.
	if want := "counterfactuals a previous owner left waiting for a reissue queued"; !strings.Contains(logs.String(), want) {
		t.Errorf("r2's log does not say %q:\n%s", want, logs.String())
	}
}

// A lapsed certificate says since which version its bound has failed (renewal_pending_since),
// and its new owner says the same: the replica that takes its partition over computes the
// anchor's KL history from the posteriors it keeps in memory, instead of starting it at the
// take-over. Both replicas' confirmers are held, so that the certificates stay lapsed.
func TestMovedLapsedCEKeepsItsLapseVersion(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas and a drift: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	hold := func(o *Options) { o.Hooks.ConfirmRound = func(ctx context.Context) { <-ctx.Done() } }
	// The default learner, which follows a drift over several versions.
	r1 := startReadyReplica(t, b, "r1", key, nil, hold)
	data := daemontest.Bundled(t)
	// CEs registered before and during a drift lapse at different versions.
	var ids []string
	drift := daemontest.FlippedThenClean(data, 320, 0)
	for i, part := range [][][]byte{drift[:32], drift[32:]} {
		ids = append(ids, daemontest.RegisterCEs(t, r1, data, 10, fmt.Sprint("p", i))...)
		r1.Produce(t, part...)
		applied := float64(32 + i*len(part))
		waitfor.Cond(t, 60*time.Second, "the drift applied", func() bool {
			return r1.Metric(t, "cfguard_records_total", "result", "applied") == applied
		})
	}
	was := map[string]*ledger.CE{}
	since := map[uint64]int{}
	for _, id := range ids {
		ce, err := r1.D.ledger.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		was[id] = ce
		if ce.RenewalPending != (ce.RenewalPendingSince != nil) {
			t.Fatalf("%s at r1: renewal_pending %v, renewal_pending_since %v: r1 held every anchor from its registration on",
				id, ce.RenewalPending, ce.RenewalPendingSince)
		}
		if ce.RenewalPendingSince != nil {
			since[*ce.RenewalPendingSince]++
		}
	}
	t.Logf("at r1 (posterior version %d): lapse versions %v", r1.D.current().Version, since)
	if len(since) < 2 {
		t.Fatal("the drift lapsed certificates at fewer than two versions: this test shows little")
	}

	r2 := startReadyReplica(t, b, "r2", key, nil, hold)
	r1.Stop(t)
	waitfor.Cond(t, 60*time.Second, "r2 holding every CE, ready", func() bool {
		code, _ := r2.Get(t, "/readyz")
		return r2.HeldCEs(t) == len(ids) && code == 200 && r2.D.current().Version == r1.D.current().Version
	})
	for _, id := range ids {
		got, err := r2.D.ledger.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		w := was[id]
		if got.RenewalPending != w.RenewalPending || !reflect.DeepEqual(got.RenewalPendingSince, w.RenewalPendingSince) {
			t.Errorf("%s moved from r1 to r2: renewal_pending %v since %v at r1, %v since %v at r2", id,
				w.RenewalPending, ptrString(w.RenewalPendingSince), got.RenewalPending, ptrString(got.RenewalPendingSince))
		}
	}
}

func ptrString(p *uint64) string {
	if p == nil {
		return "-"
	}
	return fmt.Sprint(*p)
}

// produceJudged produces each part of records to r in turn, and waits after each until r applied
// it, measured every CE that waits for a measurement, and published its events.
func produceJudged(t *testing.T, r *running, parts ...[][]byte) {
	t.Helper()
	for _, part := range parts {
		want := r.Metric(t, "cfguard_records_total", "result", "applied") + float64(len(part))
		r.Produce(t, part...)
		waitfor.Cond(t, 60*time.Second, "the records applied and every CE judged", func() bool {
			return r.Metric(t, "cfguard_records_total", "result", "applied") == want &&
				r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0 && r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 &&
				r.Metric(t, "cfguard_events_pending") == 0
		})
	}
}
