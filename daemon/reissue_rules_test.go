package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/ledger"
)

// TestReissueTriggers holds which status changes queue a CE for reissue: with explain.reissue
// invalidated, a change into invalidated; with at_risk, a change into at_risk or invalidated;
// never a change from a status that already triggers (the CE was queued then), and nothing when
// explain.reissue is empty.
func TestReissueTriggers(t *testing.T) {
	const (
		U = certify.Uncertified
		C = certify.Certified
		A = certify.AtRisk
		I = certify.Invalidated
	)
	for _, c := range []struct {
		setting  string
		from, to certify.Status
		queued   bool
	}{
		{"", C, I, false},
		{"", C, A, false},
		{"invalidated", C, I, true},
		{"invalidated", A, I, true},
		{"invalidated", U, I, true},
		{"invalidated", C, A, false},
		{"invalidated", I, A, false},
		{"invalidated", A, C, false},
		{"at_risk", C, A, true},
		{"at_risk", C, I, true},
		{"at_risk", U, I, true},
		{"at_risk", A, I, false},
		{"at_risk", I, A, false},
		{"at_risk", A, C, false},
		{"at_risk", C, U, false},
	} {
		re := newReissuer(nil, c.setting, slog.New(slog.NewTextHandler(io.Discard, nil)))
		re.notify([]ledger.StatusChange{{ID: "ce-1", From: c.from, To: c.to, PosteriorVersion: 2}})
		if queued := len(re.queue) == 1; queued != c.queued {
			t.Errorf("explain.reissue %q, %s -> %s: queued %v, want %v", c.setting, c.from, c.to, queued, c.queued)
		}
	}
}

// TestReissueSkipsWhatNeedsNone: a queued CE that is no longer stored, or no longer in a status
// that triggers a reissue when its turn comes, is passed over: nothing is generated, stored,
// published or logged for it.
func TestReissueSkipsWhatNeedsNone(t *testing.T) {
	r := startDaemon(t, nil)
	ids := daemontest.RegisterCEs(t, r, daemontest.Bundled(t), 1, "kept-")
	logs := &tooltest.Output{}
	re := newReissuer(r.D, "invalidated", slog.New(slog.NewTextHandler(logs, nil)))
	v := r.D.current().Version
	for _, id := range []string{ids[0], "never-stored"} {
		re.reissue(context.Background(), id)
		if _, err := r.D.ledger.Get(ident.Reissue(id, v)); err == nil {
			t.Errorf("%s reissued", id)
		}
	}
	if ce, err := r.D.ledger.Get(ids[0]); err != nil || ce.Status == certify.Invalidated || ce.Status == certify.AtRisk {
		t.Fatalf("%s: %+v, %v; want it stored in a status that triggers no reissue", ids[0], ce, err)
	}
	if logs.String() != "" {
		t.Errorf("the reissuer logged:\n%s", logs.String())
	}
}

// TestReissueQueueFullByOne: a single CE beyond a full reissue queue gets its
// counterfactual_reissue_failed event and a WARN line that counts it.
func TestReissueQueueFullByOne(t *testing.T) {
	r := startDaemon(t, nil)
	logs := &tooltest.Output{}
	re := newReissuer(r.D, "at_risk", slog.New(slog.NewTextHandler(logs, nil))) // nothing takes from its queue
	changes := make([]ledger.StatusChange, reissueQueue)
	for i := range changes {
		changes[i] = ledger.StatusChange{ID: fmt.Sprintf("full-%d", i), From: certify.Certified, To: certify.AtRisk, PosteriorVersion: 1}
	}
	re.notify(changes)
	if logs.String() != "" {
		t.Fatalf("a queue filled to its bound logged:\n%s", logs.String())
	}
	re.notify([]ledger.StatusChange{{ID: "one-over", From: certify.Certified, To: certify.Invalidated, PosteriorVersion: 1}})
	if !strings.Contains(logs.String(), "reissue queue full") || !strings.Contains(logs.String(), "count=1 first_id=one-over") {
		t.Fatalf("the log after one CE over the queue:\n%s", logs.String())
	}
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: r.D.BrokerAddrs(), Topic: r.D.cfg.Kafka.EventsTopic, MaxWait: kafkatest.MaxWait})
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for {
		m, err := rd.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("events: no counterfactual_reissue_failed for one-over: %v", err)
		}
		var e Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type == "counterfactual_reissue_failed" {
			if e.ID != "one-over" || !strings.Contains(e.Error, "wait to be reissued") {
				t.Fatalf("reissue failure %+v, want one-over's, saying the queue is full", e)
			}
			return
		}
	}
}

// A reissuer whose gate does not open does not read the ledger (run returns once the gate says
// ctx ended): no CE of a stale copy is reissued or failed.
func TestReissuerWaitsForItsGate(t *testing.T) {
	r := newReissuer(nil, "invalidated", slog.New(slog.DiscardHandler)) // a nil daemon: any read of the ledger panics
	asked := 0
	r.gate = func(ctx context.Context) error { asked++; return context.Canceled }
	if err := r.run(context.Background()); err != nil || asked != 1 {
		t.Fatalf("run = %v after asking the gate %d times; want nil after one", err, asked)
	}
}

// A replacement is named after the version of its CE's wait, which every owner holds alike; a
// wait read as version 0 (a damaged reissue entry written again) after the CE's last change out
// of certified, which its history holds at every owner too and which the web UI links the
// replacement by, else after the current version: never .r0, which the UI links to no CE.
func TestReplacementID(t *testing.T) {
	const C, A, I = certify.Certified, certify.AtRisk, certify.Invalidated
	history := []ledger.StatusChange{{From: C, To: A, PosteriorVersion: 3}, {From: A, To: C, PosteriorVersion: 5},
		{From: C, To: I, PosteriorVersion: 8}, {From: I, To: I, PosteriorVersion: 9}}
	for _, c := range []struct {
		name    string
		version uint64
		history []ledger.StatusChange
		want    string
	}{
		{"the wait's version", 8, history, "a.r8"},
		{"the wait's version, whatever the history", 7, nil, "a.r7"},
		{"version 0: the last change out of certified", 0, history, "a.r8"},
		{"version 0, only renewals", 0, []ledger.StatusChange{{From: C, To: C, PosteriorVersion: 4, Renewal: true}}, "a.r12"},
		{"version 0, no history", 0, nil, "a.r12"},
	} {
		old := &ledger.CE{ID: "a", History: c.history}
		if got := replacementID(old, ledger.PendingReissue{ID: "a", Version: c.version}, 12); got != c.want {
			t.Errorf("%s: %s, want %s", c.name, got, c.want)
		}
	}
}
