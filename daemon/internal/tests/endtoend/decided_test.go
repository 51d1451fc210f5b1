package endtoend

import (
	"context"
	"encoding/json"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestDriftStatusesSayWhatTheyKnow: a drift lapses the certificates of stored CEs and the
// confirmer judges them at_risk or invalidated. Once the daemon is quiet (ingest done, nothing
// waits for a measurement, every event published):
//   - cfguard_counterfactuals_decided{status} is, for each status, the number of CEs the ledger
//     returns with that status and decided: true, and cfguard_counterfactuals the number of CEs;
//   - every status_changed event carries decided, and verdict_pending or renewal_pending exactly
//     when it is false (a certified status that is undecided is a lapsed certificate, an
//     at_risk or invalidated one a verdict that is);
//   - each CE's last event names the status the ledger holds, and a CE that is not certified has
//     one; a last event written under the posterior that is still current agrees with the CE
//     the ledger returns now in decided and its pending flags too (nothing has moved it since).
func TestDriftStatusesSayWhatTheyKnow(t *testing.T) {
	r := launch.Daemon(t, func(c *config.Config) { daemontest.PaperLearner(c, 1e-3) })
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 8, "")
	r.Produce(t, daemontest.Flipped(data, 96)...)
	waitfor.Cond(t, 60*time.Second, "96 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 96 })
	waitfor.Cond(t, 60*time.Second, "every CE judged or renewed under the last posterior, every event published", func() bool {
		return r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 && r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0 &&
			r.Metric(t, "cfguard_events_pending") == 0
	})

	// The ledger's CEs, decided or not, against the gauges.
	ces := map[string]*ledger.CE{}
	decided, all := map[certify.Status]int{}, map[certify.Status]int{}
	daemontest.EachCE(t, r.D.Ledger(), func(ce *ledger.CE) {
		ces[ce.ID] = ce
		all[ce.Status]++
		if ce.Decided {
			decided[ce.Status]++
		}
		if ce.Decided == (ce.VerdictPending || ce.RenewalPending) {
			t.Errorf("%s: %v, decided %v, verdict_pending %v, renewal_pending %v: want exactly one of decided and a pending flag",
				ce.ID, ce.Status, ce.Decided, ce.VerdictPending, ce.RenewalPending)
		}
	})
	if len(ces) != len(ids) {
		t.Fatalf("%d CEs stored, want %d", len(ces), len(ids))
	}
	if all[certify.AtRisk]+all[certify.Invalidated] == 0 {
		t.Fatalf("the drift left no CE at_risk or invalidated (%v): this test shows nothing", all)
	}
	for _, st := range certify.Statuses() {
		if got := r.Metric(t, "cfguard_counterfactuals_decided", "status", st.String()); got != float64(decided[st]) {
			t.Errorf("cfguard_counterfactuals_decided{status=%q} = %v, the ledger returns %d %s CEs with decided: true", st, got, decided[st], st)
		}
		if got := r.Metric(t, "cfguard_counterfactuals", "status", st.String()); got != float64(all[st]) {
			t.Errorf("cfguard_counterfactuals{status=%q} = %v, the ledger holds %d", st, got, all[st])
		}
	}

	// Every event the outbox published, in order.
	published := int(r.Metric(t, "cfguard_events_total", "result", "published"))
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: r.D.BrokerAddrs(), Topic: r.Config.Kafka.EventsTopic, MaxWait: kafkatest.MaxWait})
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	last := map[string]daemon.Event{}
	var seen, undecided int
	for range published {
		m, err := rd.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("events: read %d of %d published: %v", seen, published, err)
		}
		var e daemon.Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type != "status_changed" {
			continue
		}
		seen++
		if e.Decided == nil || e.KL == nil {
			t.Fatalf("status_changed event without decided or kl: %s", m.Value)
		}
		d := *e.Decided
		switch {
		case d && (e.VerdictPending || e.RenewalPending):
			t.Errorf("event %s: decided with a pending flag", m.Value)
		case !d && e.To == "certified" && !(e.RenewalPending && !e.VerdictPending):
			t.Errorf("event %s: an undecided certified status is a lapsed certificate (renewal_pending alone)", m.Value)
		case !d && (e.To == "at_risk" || e.To == "invalidated") && !(e.VerdictPending && !e.RenewalPending):
			t.Errorf("event %s: an undecided verdict is verdict_pending alone", m.Value)
		}
		if !d {
			undecided++
		}
		last[e.ID] = e
	}
	if seen == 0 {
		t.Fatal("no status_changed event published after the drift")
	}
	// Every status change was published: a CE's last event names the status the ledger holds,
	// and a CE the drift moved off certified has one.
	for id, ce := range ces {
		e, ok := last[id]
		switch {
		case !ok && ce.Status != certify.Certified:
			t.Errorf("%s is %s and no status_changed event says so", id, ce.Status)
		case ok && e.To != ce.Status.String():
			t.Errorf("%s is %s; its last status_changed event says %s", id, ce.Status, e.To)
		}
	}
	v := r.D.Posterior().Version
	compared := 0
	for id, e := range last {
		ce := ces[id]
		if ce == nil || e.PosteriorVersion != v || e.To != ce.Status.String() {
			continue // changed under an older posterior: the current one may have moved its decided
		}
		compared++
		if *e.Decided != ce.Decided || e.VerdictPending != ce.VerdictPending || e.RenewalPending != ce.RenewalPending {
			t.Errorf("%s: the last event says %s decided %v (verdict_pending %v, renewal_pending %v) under version %d; the ledger returns decided %v (verdict_pending %v, renewal_pending %v)",
				id, e.To, *e.Decided, e.VerdictPending, e.RenewalPending, v, ce.Decided, ce.VerdictPending, ce.RenewalPending)
		}
	}
	t.Logf("statuses %v, decided %v; %d status_changed events (%d undecided), %d compared with the ledger under version %d",
		all, decided, seen, undecided, compared, v)
}

// TestVerdictThatStoppedCarryingSaysSinceWhen: a drift gives stored CEs verdicts; the confirmer
// is then held, as a starved CPU holds it, while more flipped records move the posterior past
// what those verdicts carry. Read through the API, every CE whose decided verdict no longer
// carries says since which version (verdict_pending_since: after its confirmed_version, at most
// the version it was read at), since the daemon served every posterior since it started; no
// other CE says one. The ledger's tests check the version itself against the KL at every version
// (ledger.TestVerdictPendingSinceIsTheVersionTheVerdictStoppedCarrying).
func TestVerdictThatStoppedCarryingSaysSinceWhen(t *testing.T) {
	var hold atomic.Bool
	held := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(held) }) }
	t.Cleanup(release)
	r := launch.With(t, func(c *config.Config) { daemontest.PaperLearner(c, 1e-3) }, func(o *daemon.Options) {
		o.Hooks.ConfirmRound = func(ctx context.Context) {
			if !hold.Load() {
				return
			}
			select {
			case <-held:
			case <-ctx.Done():
			}
		}
	}, nil)
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 8, "")
	flipped := daemontest.Flipped(data, 192)
	r.Produce(t, flipped[:64]...)
	waitfor.Cond(t, 60*time.Second, "64 applied records, every CE judged or renewed under the last posterior", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == 64 &&
			r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 && r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0
	})
	hold.Store(true)
	r.Produce(t, flipped[64:]...)
	waitfor.Cond(t, 60*time.Second, "192 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 192 })

	var pending, undecided int
	for _, id := range ids {
		code, body := r.Get(t, "/v1/counterfactuals/"+id)
		if code != http.StatusOK {
			t.Fatalf("GET %s: %d %s", id, code, body)
		}
		var ce ledger.CE
		if err := json.Unmarshal(body, &ce); err != nil {
			t.Fatal(err)
		}
		stopped := ce.VerdictPending && ce.VerdictBound != nil && ce.ConfirmedVersion != nil
		switch s := ce.VerdictPendingSince; {
		case stopped && s == nil:
			t.Errorf("%s: %s, its verdict of version %d no longer carries to version %d, and it does not say since when: %s",
				id, ce.Status, *ce.ConfirmedVersion, ce.PosteriorVersion, body)
		case stopped && (*s <= *ce.ConfirmedVersion || *s > ce.PosteriorVersion):
			t.Errorf("%s: verdict of version %d pending since %d, read at %d: want a version after the verdict's, at most the one read at",
				id, *ce.ConfirmedVersion, *s, ce.PosteriorVersion)
		case !stopped && s != nil:
			t.Errorf("%s: %s, verdict pending %v, verdict bound %v: pending since %d, want none", id, ce.Status, ce.VerdictPending, ce.VerdictBound, *s)
		}
		if stopped {
			pending++
		} else if ce.VerdictPending {
			undecided++
		}
	}
	t.Logf("%d of %d CEs with a verdict that stopped carrying, %d with one that decided nothing", pending, len(ids), undecided)
	if pending == 0 {
		t.Fatal("no verdict stopped carrying: the test shows nothing")
	}
}
