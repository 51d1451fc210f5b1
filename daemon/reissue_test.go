package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestReissueQueueFullFailsInOneWrite: status changes beyond the reissue queue are not reissued;
// each gets a counterfactual_reissue_failed event, all of one call in one line of the log and
// one outbox transaction, without waiting for the queue.
func TestReissueQueueFullFailsInOneWrite(t *testing.T) {
	r := startDaemon(t, nil)
	logs := &tooltest.Output{}
	re := newReissuer(r.D, "invalidated", slog.New(slog.NewTextHandler(logs, nil))) // nothing takes from its queue
	const over = 3
	changes := make([]ledger.StatusChange, reissueQueue+over)
	for i := range changes {
		changes[i] = ledger.StatusChange{ID: fmt.Sprintf("full-%d", i), From: certify.Certified, To: certify.Invalidated, PosteriorVersion: 1}
	}
	re.notify(changes)
	if n := len(re.queue); n != reissueQueue {
		t.Fatalf("%d CEs queued, want the queue's %d", n, reissueQueue)
	}
	if n := strings.Count(logs.String(), "reissue queue full"); n != 1 || !strings.Contains(logs.String(), fmt.Sprintf("count=%d", over)) {
		t.Fatalf("the log said %d times that the queue is full, want once with count=%d:\n%s", n, over, logs.String())
	}
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: r.D.BrokerAddrs(), Topic: r.D.cfg.Kafka.EventsTopic, MaxWait: kafkatest.MaxWait})
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	failed := map[string]bool{}
	for len(failed) < over {
		m, err := rd.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("events: %d of %d reissue failures: %v", len(failed), over, err)
		}
		var e Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type == "counterfactual_reissue_failed" {
			failed[e.ID] = true
		}
	}
	for i := reissueQueue; i < len(changes); i++ {
		if !failed[changes[i].ID] {
			t.Errorf("no counterfactual_reissue_failed for %s (got %v)", changes[i].ID, failed)
		}
	}
}

// reissueDrift is the configuration of the reissue tests' daemons: explain.reissue invalidated,
// one generation at a time, and a drift (a strong one, one increment) that invalidates CEs.
func reissueDrift(c *config.Config) {
	daemontest.PaperLearner(c, 1e-2)
	c.Explain.Reissue = "invalidated"
	c.Explain.Concurrency = 1
	c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog = 96, 96
}

// heldAfterDrift starts a daemon with reissueDrift and mutate whose reissuer is held before its
// first generation until the daemon stops, registers 6 CEs and drifts until several are
// invalidated; it returns the daemon, once its reissuer holds one, and the CEs invalidated, all
// waiting for their reissue (the held one and those in the queue).
func heldAfterDrift(t *testing.T, mutate func(c *config.Config)) (*running, []string) {
	t.Helper()
	held := make(chan string, 1)
	r := startDaemonWith(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		reissueDrift(c)
		if mutate != nil {
			mutate(c)
		}
	}), func(o *Options) {
		o.Hooks.Reissue = holdReissues(held)
	}, nil).WaitReady(t, "readyz", 20*time.Second)
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 6, "")
	r.Produce(t, daemontest.Flipped(data, 96)...)
	waitfor.Cond(t, 60*time.Second, "the drift applied and judged", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == 96 && r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 &&
			r.Metric(t, "cfguard_counterfactuals", "status", "invalidated") > 2
	})
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("the reissuer took no invalidated CE within 30 s")
	}
	var invalidated []string
	for _, id := range ids {
		if ce, err := r.D.ledger.Get(id); err != nil {
			t.Fatal(err)
		} else if ce.Status == certify.Invalidated {
			invalidated = append(invalidated, id)
		}
	}
	return r, invalidated
}

// holdReissues is a hooks.Reissue that holds each generation until the daemon stops, and sends
// the first CE it holds to held.
func holdReissues(held chan<- string) func(ctx context.Context, id string) {
	return func(ctx context.Context, id string) {
		select {
		case held <- id:
		default:
		}
		<-ctx.Done()
	}
}

// reissueOutcomes reads the events topic from its start until each of ids has a reissue outcome,
// and returns the distinct outcome events of each (a value published again counts once).
func reissueOutcomes(t *testing.T, brokers []string, topic string, ids []string) map[string][]Event {
	t.Helper()
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, MaxWait: kafkatest.MaxWait})
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	seen, out := map[string]bool{}, map[string][]Event{}
	missing := func() int {
		n := 0
		for _, id := range ids {
			if len(out[id]) == 0 {
				n++
			}
		}
		return n
	}
	for missing() > 0 {
		m, err := rd.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("events: no reissue outcome for %d of %v: %v", missing(), ids, err)
		}
		var e Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if (e.Type != "counterfactual_reissued" && e.Type != "counterfactual_reissue_failed") || seen[string(m.Value)] {
			continue
		}
		seen[string(m.Value)] = true
		out[e.ID] = append(out[e.ID], e)
	}
	return out
}

// TestReissueResumesAfterStop: CEs queued for a reissue when the daemon stops are queued again at
// the next start on the same ledger, each reissued once or failed once: a drift invalidates
// several CEs, the reissuer is held at the first of them while the others wait in its queue, the
// daemon stops, and a daemon on the same state directory and broker publishes one outcome for
// every one of them (explain.timeout 1 ns: each generation fails at once) and leaves none
// waiting. Its log says how many it queued again.
func TestReissueResumesAfterStop(t *testing.T) {
	b := daemontest.StartCluster(t, 1)
	dir := t.TempDir()
	mutate := func(c *config.Config) {
		c.StateDir, c.Kafka.Brokers = dir, b.Addrs()
		c.Explain.Timeout = time.Nanosecond
	}
	r, invalidated := heldAfterDrift(t, mutate)
	r.Stop(t)

	logs := &tooltest.Output{}
	r = startDaemonWith(t, func(c *config.Config) { reissueDrift(c); mutate(c) }, func(o *Options) { o.Logger = slog.New(slog.NewTextHandler(logs, nil)) }, nil).
		WaitReady(t, "readyz", 20*time.Second)
	outcomes := reissueOutcomes(t, b.Addrs(), r.D.cfg.Kafka.EventsTopic, invalidated)
	for _, id := range invalidated {
		if len(outcomes[id]) != 1 {
			t.Errorf("%s: %d reissue outcomes, want 1: %+v", id, len(outcomes[id]), outcomes[id])
		}
	}
	waitfor.Cond(t, 10*time.Second, "no CE waiting for a reissue", func() bool {
		waiting, err := r.D.ledger.PendingReissues("", 100)
		return err == nil && len(waiting) == 0
	})
	if want := fmt.Sprintf("queued again at start\" component=reissue queued=%d failed=0", len(invalidated)); !strings.Contains(logs.String(), want) {
		t.Errorf("the restart's log does not say %q:\n%s", want, logs.String())
	}
}

// TestReissueResumeBoundsTheQueue: the CEs waiting in the ledger at start beyond the room left in
// the queue get their counterfactual_reissue_failed events, as notify's do, and are no longer
// waiting; the others are queued, and the queue holds no more than its bound.
func TestReissueResumeBoundsTheQueue(t *testing.T) {
	r, invalidated := heldAfterDrift(t, nil)
	const room = 2
	logs := &tooltest.Output{}
	re := newReissuer(r.D, "invalidated", slog.New(slog.NewTextHandler(logs, nil))) // nothing takes from its queue
	for i := range reissueQueue - room {
		re.queue <- fmt.Sprintf("filler-%d", i)
	}
	re.resume(context.Background())
	if n := len(re.queue); n != reissueQueue {
		t.Fatalf("%d CEs queued, want the queue's %d", n, reissueQueue)
	}
	if want := fmt.Sprintf("queued=%d failed=%d", room, len(invalidated)-room); !strings.Contains(logs.String(), want) {
		t.Fatalf("the log does not say %q:\n%s", want, logs.String())
	}
	// resume reads in id order: the first ones fit.
	failed := invalidated[room:]
	outcomes := reissueOutcomes(t, r.D.BrokerAddrs(), r.D.cfg.Kafka.EventsTopic, failed)
	for _, id := range failed {
		if es := outcomes[id]; len(es) != 1 || es[0].Type != "counterfactual_reissue_failed" || es[0].Error != queueFull {
			t.Errorf("%s: outcomes %+v, want one failure saying %q", id, es, queueFull)
		}
	}
	waiting, err := r.D.ledger.PendingReissues("", 100)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, w := range waiting {
		ids = append(ids, w.ID)
	}
	if !slices.Equal(ids, invalidated[:room]) {
		t.Fatalf("waiting for a reissue: %v, want the %d queued %v", ids, room, invalidated[:room])
	}
}

// TestReissueAnnouncesAStoredReplacement: a CE waiting for its reissue whose replacement is
// stored already (the daemon stopped after storing it, before its event) gets its
// counterfactual_reissued event naming that replacement and nothing generated; queued again, it
// is passed over.
func TestReissueAnnouncesAStoredReplacement(t *testing.T) {
	r, invalidated := heldAfterDrift(t, nil)
	id := invalidated[len(invalidated)-1] // in the daemon's queue, behind the held one
	newID := storeReplacement(t, r, id)
	logs := &tooltest.Output{}
	re := newReissuer(r.D, "invalidated", slog.New(slog.NewTextHandler(logs, nil)))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // the hook holds a generation until then
	defer cancel()
	re.reissue(ctx, id)
	re.reissue(ctx, id)
	if ctx.Err() != nil {
		t.Fatalf("the reissuer went on to generate a replacement:\n%s", logs.String())
	}
	es := reissueOutcomes(t, r.D.BrokerAddrs(), r.D.cfg.Kafka.EventsTopic, []string{id})[id]
	if len(es) != 1 || es[0].Type != "counterfactual_reissued" || es[0].NewID != newID {
		t.Fatalf("outcomes of %s: %+v, want one counterfactual_reissued naming %s", id, es, newID)
	}
	if _, waits, err := r.D.ledger.PendingReissue(id); err != nil || waits {
		t.Fatalf("%s still waits for a reissue (%v)", id, err)
	}
	if n := strings.Count(logs.String(), "announcing it"); n != 1 {
		t.Fatalf("the log announced %d replacements, want 1:\n%s", n, logs.String())
	}
}

// TestReissueResumeAnnouncesAStoredReplacement: a CE waiting for its reissue at start that resume
// does not queue (explain.reissue off, or no room left in the queue) but whose replacement an
// earlier run stored before its event gets counterfactual_reissued naming that replacement, not a
// failure that would leave the stored replacement unannounced; the others get their failures.
func TestReissueResumeAnnouncesAStoredReplacement(t *testing.T) {
	for _, tc := range []struct {
		name, rule, why string
		fill            int // CEs already in the queue
	}{
		{name: "off", rule: "", why: "explain.reissue is off"},
		{name: "queue full", rule: "invalidated", why: queueFull, fill: reissueQueue},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, invalidated := heldAfterDrift(t, nil)
			id := invalidated[len(invalidated)-1]
			newID := storeReplacement(t, r, id)
			re := newReissuer(r.D, tc.rule, slog.New(slog.NewTextHandler(&tooltest.Output{}, nil))) // nothing takes from its queue
			for i := range tc.fill {
				re.queue <- fmt.Sprintf("filler-%d", i)
			}
			re.resume(context.Background())
			outcomes := reissueOutcomes(t, r.D.BrokerAddrs(), r.D.cfg.Kafka.EventsTopic, invalidated)
			if es := outcomes[id]; len(es) != 1 || es[0].Type != "counterfactual_reissued" || es[0].NewID != newID {
				t.Errorf("outcomes of %s: %+v, want one counterfactual_reissued naming its stored replacement %s", id, es, newID)
			}
			for _, other := range invalidated[:len(invalidated)-1] {
				if es := outcomes[other]; len(es) != 1 || es[0].Type != "counterfactual_reissue_failed" || es[0].Error != tc.why {
					t.Errorf("outcomes of %s: %+v, want one failure saying %q", other, es, tc.why)
				}
			}
			if waiting, err := r.D.ledger.PendingReissues("", 100); err != nil || len(waiting) != 0 {
				t.Fatalf("waiting for a reissue after resume: %+v (%v), want none", waiting, err)
			}
		})
	}
}

// TestReissueSweepQueuesWhatNotifyMissed: a CE whose status change reached the ledger without
// reaching notify (a replica's takeover judging a CE at another status than its previous owner
// left) waits in the ledger; the sweep queues every such CE not queued yet, in id order, once
// (a second sweep and a notify of the same change add nothing), and a full queue leaves the rest
// waiting for a later sweep, failing none.
func TestReissueSweepQueuesWhatNotifyMissed(t *testing.T) {
	r, invalidated := heldAfterDrift(t, nil)
	logs := &tooltest.Output{}
	re := newReissuer(r.D, "invalidated", slog.New(slog.NewTextHandler(logs, nil))) // notified of nothing
	re.sweep(context.Background())
	var queued []string
	for len(re.queue) > 0 {
		queued = append(queued, <-re.queue)
	}
	if !slices.Equal(queued, invalidated) {
		t.Fatalf("a sweep queued %v, want every CE waiting, in id order: %v", queued, invalidated)
	}
	if want := fmt.Sprintf("queued=%d", len(invalidated)); !strings.Contains(logs.String(), want) {
		t.Fatalf("the log does not say %q:\n%s", want, logs.String())
	}
	for _, id := range queued { // back in the queue, as the sweep left them
		re.queue <- id
	}
	re.sweep(context.Background())
	re.notify([]ledger.StatusChange{{ID: invalidated[0], From: certify.AtRisk, To: certify.Invalidated, PosteriorVersion: 1}})
	if n := len(re.queue); n != len(invalidated) {
		t.Fatalf("%d CEs queued after a second sweep and a notify of a queued CE, want %d: nothing twice", n, len(invalidated))
	}

	full := newReissuer(r.D, "invalidated", slog.New(slog.DiscardHandler))
	for i := range reissueQueue - 1 {
		full.queue <- fmt.Sprintf("filler-%d", i)
	}
	full.sweep(context.Background())
	if n := len(full.queue); n != reissueQueue {
		t.Fatalf("%d CEs queued, want the queue's %d", n, reissueQueue)
	}
	waiting, err := r.D.ledger.PendingReissues("", 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(waiting) != len(invalidated) {
		t.Fatalf("%d CEs waiting after sweeps into a full queue, want all %d: a sweep fails none", len(waiting), len(invalidated))
	}
}

// TestReissueFindsAReplacementStoredAtAnotherReplica: on replicas a replacement is registered at
// the owner of its own id's partition; the owner of the old CE, looking for a replacement an
// earlier run stored but did not announce, finds it there too, not only in its own ledger (which
// would make a restart generate a second replacement, or a failure event).
func TestReissueFindsAReplacementStoredAtAnotherReplica(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := startLearningReplica(t, b, "r1", key, nil)
	r2 := startLearningReplica(t, b, "r2", key, nil)
	n := r1.D.Share().Partitions()
	waitfor.Cond(t, 60*time.Second, "the CE partitions split between the two replicas", func() bool {
		o1, o2 := len(r1.D.Share().Member().Owned()), len(r2.D.Share().Member().Owned())
		return o1 > 0 && o2 > 0 && o1+o2 == n
	})
	atR1, atR2 := map[int]bool{}, map[int]bool{}
	for _, p := range r1.D.Share().Member().Owned() {
		atR1[p] = true
	}
	for _, p := range r2.D.Share().Member().Owned() {
		atR2[p] = true
	}
	prefix := "a"
	for !atR1[ceshare.Partition(prefix+"ce-0", n)] { // RegisterCEs's first id, in a partition of r1's
		prefix += "a"
	}
	ids := daemontest.RegisterCEs(t, r1, daemontest.Bundled(t), 1, prefix)
	old, err := r1.D.ledger.Get(ids[0])
	if err != nil {
		t.Fatalf("%s is not stored at r1, the owner of its partition: %v", ids[0], err)
	}
	v := old.AnchorVersion
	for !atR2[ceshare.Partition(ident.Reissue(old.ID, v), n)] {
		v++
	}
	newID := ident.Reissue(old.ID, v)
	if code, body := r1.Do(t, "POST", "/v1/counterfactuals", "", map[string]any{"id": newID, "x": old.X, "x_cf": old.XCF, "target": "benign"}); code != http.StatusCreated {
		t.Fatalf("register %s: %d %s", newID, code, body)
	}
	if _, err := r2.D.ledger.Get(newID); err != nil {
		t.Fatalf("%s is not stored at r2, the owner of its partition: %v", newID, err)
	}
	re := newReissuer(r1.D, "invalidated", slog.New(slog.DiscardHandler))
	got, err := re.stored(context.Background(), old, ledger.PendingReissue{ID: old.ID, Version: old.AnchorVersion})
	if err != nil || got == nil || got.ID != newID {
		t.Fatalf("the replacement r1 finds for %s: %+v (%v), want %s, stored at r2", old.ID, got, err, newID)
	}
}

// TestReissueOffAdoptsAsAtStart: with explain.reissue off, the CEs a previous owner left waiting
// (adopt) get the outcomes a start gives them, from the ledger and after adopt returns: the one
// whose replacement is stored gets counterfactual_reissued naming it, not a failure leaving it
// unannounced, and each gets one outcome however often it is adopted.
func TestReissueOffAdoptsAsAtStart(t *testing.T) {
	r, invalidated := heldAfterDrift(t, nil)
	id := invalidated[len(invalidated)-1]
	newID := storeReplacement(t, r, id)
	waiting, err := r.D.ledger.PendingReissues("", 100)
	if err != nil || len(waiting) != len(invalidated) {
		t.Fatalf("waiting for a reissue: %+v (%v), want %v", waiting, err, invalidated)
	}
	re := newReissuer(r.D, "", slog.New(slog.NewTextHandler(&tooltest.Output{}, nil)))
	re.adopt(waiting)
	re.adopt(waiting)
	if still, err := r.D.ledger.PendingReissues("", 100); err != nil || len(still) != len(waiting) {
		t.Errorf("waiting for a reissue after adopt: %+v (%v); want all %d, left to run", still, err, len(waiting))
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- re.run(ctx) }()
	defer func() { cancel(); <-done }()
	outcomes := reissueOutcomes(t, r.D.BrokerAddrs(), r.D.cfg.Kafka.EventsTopic, invalidated)
	if es := outcomes[id]; len(es) != 1 || es[0].Type != "counterfactual_reissued" || es[0].NewID != newID {
		t.Errorf("outcomes of %s: %+v, want one counterfactual_reissued naming its stored replacement %s", id, es, newID)
	}
	for _, other := range invalidated[:len(invalidated)-1] {
		if es := outcomes[other]; len(es) != 1 || es[0].Type != "counterfactual_reissue_failed" || es[0].Error != reissueOff {
			t.Errorf("outcomes of %s: %+v, want one failure saying %q", other, es, reissueOff)
		}
	}
	waitfor.Cond(t, 10*time.Second, "no CE waiting", func() bool {
		still, err := r.D.ledger.PendingReissues("", 100)
		return err == nil && len(still) == 0
	})
}

// storeReplacement stores in r's ledger a replacement of CE id, named as the reissuer names one
// under the current posterior, as a run that stopped before announcing it leaves it; it returns
// its id.
func storeReplacement(t *testing.T, r *running, id string) string {
	t.Helper()
	old, err := r.D.ledger.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	m, c := r.D.current(), r.D.cfg.Certify
	newID := ident.Reissue(id, m.Version)
	if err := r.D.ledger.Put(context.Background(), &ledger.CE{ID: newID, X: old.X, XCF: old.XCF, Target: old.Target, AnchorVersion: m.Version,
		P1: 0.2, Var1: 0.01, Samples: c.Samples, Delta: c.Delta, Epsilon: c.Epsilon}); err != nil {
		t.Fatal(err)
	}
	return newID
}

// A replacement is named after the version of the change that made its CE wait, not the
// version it is generated under, so that two owners of the CE (the one it moved from, still
// generating, and the one it moved to) name it alike: when the previous owner stores its
// replacement after this one looked for it (the hook, between the look and the generation, while
// the posterior has moved on since the change), this one's registration finds the name taken,
// and it announces the stored replacement instead of storing a second. One replacement, one
// counterfactual_reissued naming it. When the look for what took the name fails (a peer that
// does not answer), the CE stays waiting for the next sweep rather than being reported failed.
func TestReissueAnnouncesAReplacementStoredWhileItGenerated(t *testing.T) {
	var race atomic.Pointer[func(id string)]
	held := make(chan string, 1)
	r := startDaemonWith(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		daemontest.PaperLearner(c, 1e-3) // a mild drift, which leaves room for replacements
		c.Explain.Reissue = "at_risk"
		c.Explain.Concurrency = 1
		c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog = 96, 96
	}), func(o *Options) {
		hold := holdReissues(held)
		o.Hooks.Reissue = func(ctx context.Context, id string) {
			if f := race.Load(); f != nil {
				(*f)(id)
				return
			}
			hold(ctx, id) // the daemon's own reissuer
		}
	}, nil).WaitReady(t, "readyz", 20*time.Second)
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 6, "")
	drift := daemontest.Flipped(data, 104)
	r.Produce(t, drift[:96]...)
	waitfor.Cond(t, 60*time.Second, "the drift applied and judged", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == 96 && r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 &&
			r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0 &&
			r.Metric(t, "cfguard_counterfactuals", "status", "at_risk")+r.Metric(t, "cfguard_counterfactuals", "status", "invalidated") > 0
	})
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("the reissuer took no CE within 30 s")
	}
	since := r.D.current().Version
	r.Produce(t, drift[96:]...) // the posterior moves on; the drift goes on, so no CE recovers
	waitfor.Cond(t, 60*time.Second, "the posterior moved on, every CE judged", func() bool {
		return r.D.current().Version > since && r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 &&
			r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0
	})
	var (
		id string
		p  ledger.PendingReissue
	)
	for _, c := range ids {
		w, waits, err := r.D.ledger.PendingReissue(c)
		if err != nil {
			t.Fatal(err)
		}
		if ce, err := r.D.ledger.Get(c); err == nil && waits && ce.Status != certify.Certified && w.Version < r.D.current().Version {
			id, p = c, w
			break
		}
	}
	if id == "" {
		t.Fatal("no CE waits for its reissue since a version the posterior has left: this test shows nothing")
	}
	name := ident.Reissue(id, p.Version)
	var lookupFails atomic.Bool // the look for a stored replacement fails (a peer that does not answer)
	storeAt := func(got string) {
		if got != id {
			return
		}
		old, err := r.D.ledger.Get(id)
		if err != nil {
			t.Error(err)
			return
		}
		c := r.D.cfg.Certify
		if err := r.D.ledger.Put(context.Background(), &ledger.CE{ID: name, X: old.X, XCF: old.XCF, Target: old.Target,
			AnchorVersion: r.D.current().Version, P1: 0.2, Var1: 0.01, Samples: c.Samples, Delta: c.Delta, Epsilon: c.Epsilon}); err != nil {
			t.Error(err)
		}
	}
	race.Store(&storeAt)
	logs := &tooltest.Output{}
	re := newReissuer(r.D, "at_risk", slog.New(slog.NewTextHandler(logs, nil)))
	page := re.page
	re.page = func(ctx context.Context, after, auth string) ([]*ledger.CE, error) {
		if lookupFails.Load() {
			return nil, errors.New("the peer did not answer")
		}
		return page(ctx, after, auth)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// The name found taken, and the look for what took it failing: the CE stays waiting for the
	// next sweep (no counterfactual_reissue_failed: the first outcome read below is the reissue).
	failing := func(got string) {
		storeAt(got)
		lookupFails.Store(true)
	}
	race.Store(&failing)
	re.reissue(ctx, id)
	if _, waits, err := r.D.ledger.PendingReissue(id); err != nil || !waits || !strings.Contains(logs.String(), "stays waiting") {
		t.Fatalf("after a failed look for the replacement that took its name, %s waits %v (%v); want it waiting, logged\n%s", id, waits, err, logs.String())
	}
	if err := r.D.ledger.Delete(name); err != nil {
		t.Fatal(err)
	}
	lookupFails.Store(false)
	race.Store(&storeAt)
	re.reissue(ctx, id)
	es := reissueOutcomes(t, r.D.BrokerAddrs(), r.D.cfg.Kafka.EventsTopic, []string{id})[id]
	if len(es) != 1 || es[0].Type != "counterfactual_reissued" || es[0].NewID != name {
		t.Fatalf("outcomes of %s: %+v; want one counterfactual_reissued naming %s, stored while it generated\n%s", id, es, name, logs.String())
	}
	if !strings.Contains(logs.String(), "announcing its replacement, not this one") {
		t.Errorf("the log does not say it announced the replacement stored meanwhile:\n%s", logs.String())
	}
	all, err := r.D.ledger.List(0, 1000, "")
	if err != nil {
		t.Fatal(err)
	}
	prefix := ident.ReissueStem(id) + ".r"
	for _, ce := range all {
		if strings.HasPrefix(ce.ID, prefix) && ce.ID != name {
			t.Errorf("a second replacement of %s stored: %s", id, ce.ID)
		}
	}
	if _, waits, err := r.D.ledger.PendingReissue(id); err != nil || waits {
		t.Errorf("%s still waits for a reissue (%v)", id, err)
	}
}
