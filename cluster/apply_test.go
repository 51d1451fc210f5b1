package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// pastVersions names the versions before the current one that a batch's judgement needs and
// the ledger does not keep: anchors of new registrations and of their states, not live anchors;
// the versions of restored verdicts, live or not; none for deletions and ids already stored.
func TestPastVersions(t *testing.T) {
	v := func(n uint64) *uint64 { return &n }
	ops := []ledger.ShareOp{
		{ID: "a", CE: &ledger.CE{AnchorVersion: 7}},
		{ID: "b", CE: &ledger.CE{AnchorVersion: 3}, State: &ledger.CE{AnchorVersion: 9, ConfirmedVersion: v(12)}},
		{ID: "c", CE: &ledger.CE{AnchorVersion: 5}, State: &ledger.CE{AnchorVersion: 5, ConfirmedVersion: v(5)}},
		{ID: "d"}, // a deletion
		{ID: "e", CE: &ledger.CE{AnchorVersion: 2}},        // stored already
		{ID: "f", CE: &ledger.CE{AnchorVersion: 7}},        // the same version as a's, once
		{ID: "g", CE: &ledger.CE{AnchorVersion: 20}},       // the current version
		{ID: "h", CE: &ledger.CE{AnchorVersion: 4, P1: 1}}, // 4 is a live anchor
		// a state at a live anchor, without a verdict: nothing
		{ID: "i", CE: &ledger.CE{AnchorVersion: 4}, State: &ledger.CE{AnchorVersion: 4}},
	}
	live := map[uint64]bool{4: true, 5: true}
	stored := func(id string) bool { return id == "e" }
	got := pastVersions(ops, 20, live, stored)
	if want := []uint64{3, 5, 7, 9, 12}; !slices.Equal(got, want) {
		t.Errorf("pastVersions = %v, want %v", got, want)
	}
}

// A state read from the state topic is used only for the registration of its id created at its
// creation time: a state of another id is invalid (counted), one of another registration of the
// id is not used. A registration restored from its state alone takes the state's CE, creation
// time and state; one whose state does not decode is refused.
func TestStatesOfRegistrations(t *testing.T) {
	reg := prometheus.NewRegistry()
	s := &Share{lg: slog.New(slog.DiscardHandler), metrics: alerts.NewReplicaMetrics(reg, nil)}
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	state := func(ce any) *ceshare.State {
		raw, err := json.Marshal(ce)
		if err != nil {
			t.Fatal(err)
		}
		return &ceshare.State{ID: "ce-1", Replica: "r2", CE: raw}
	}
	own := state(&ledger.CE{ID: "ce-1", X: []float64{1}, XCF: []float64{2}, Target: 1, AnchorVersion: 6, Status: certify.Certified, CreatedAt: at})
	for _, c := range []struct {
		name    string
		state   *ceshare.State
		at      time.Time
		used    bool
		invalid float64
	}{
		{"the state of the registration", own, at, true, 0},
		{"the state of another registration of the id", own, at.Add(time.Second), false, 0},
		{"the state of another id", state(&ledger.CE{ID: "ce-2", Status: certify.Certified, CreatedAt: at}), at, false, 1},
		{"a state that does not decode", &ceshare.State{ID: "ce-1", CE: json.RawMessage(`[`)}, at, false, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			invalid := s.metrics.CEStates.WithLabelValues(alerts.StateInvalid)
			before := testutil.ToFloat64(invalid)
			got := s.stateOf(0, ceshare.Request{Kind: ceshare.KindRegister, ID: "ce-1", At: c.at, State: c.state})
			if (got != nil) != c.used || got != nil && (got.ID != "ce-1" || got.AnchorVersion != 6) {
				t.Errorf("stateOf = %+v, want used %v", got, c.used)
			}
			if n := testutil.ToFloat64(invalid) - before; n != c.invalid {
				t.Errorf("invalid states counted %v, want %v", n, c.invalid)
			}
		})
	}

	op := s.restoredOp(0, ceshare.Request{ID: "ce-1", Offset: 7, At: at.Add(time.Hour), State: own, Restored: true})
	if op.Refuse != "" || op.CE == nil || op.State == nil || op.Offset != 7 || !op.CE.CreatedAt.Equal(at) || op.CE.AnchorVersion != 6 ||
		op.State.AnchorVersion != 6 {
		t.Errorf("restoredOp = %+v; want the state's CE created at %v, with the state", op, at)
	}
	op = s.restoredOp(0, ceshare.Request{ID: "ce-1", Offset: 7, State: &ceshare.State{ID: "ce-1", CE: json.RawMessage(`[`)}, Restored: true})
	if op.Refuse == "" || op.CE != nil || op.State != nil {
		t.Errorf("restoredOp of a state that does not decode = %+v, want refused", op)
	}
}

// An owner's outcome of a request is the ledger's, with the partition's offset applied before
// it was read; a request the ledger has not applied has none (ok false), even when the ledger
// holds nothing else. With replication.register_wait 0 a request is answered pending at once,
// naming where it landed, and nobody is asked.
func TestOutcomes(t *testing.T) {
	l, err := ledger.Open(t.TempDir(), ledger.Options{Policy: certify.DefaultPolicy(), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	s := &Share{partitions: 4, ledger: l}
	p := ceshare.Partition("ce-1", s.partitions)
	if _, err := l.ApplyShare(p, []ledger.ShareOp{{RID: "rid-1", Offset: 5, ID: "ce-1"}}, 6, nil, nil); err != nil {
		t.Fatal(err)
	}
	ro, ok, err := s.LocalOutcome("ce-1", "rid-1")
	if err != nil || !ok || ro.Outcome.Result != ledger.OutcomeAbsent || ro.Counterfactual != nil || ro.Applied != 6 {
		t.Errorf("LocalOutcome = %+v, %v, %v; want absent, applied 6", ro, ok, err)
	}
	if ro, ok, err := s.LocalOutcome("ce-1", "rid-2"); err != nil || ok {
		t.Errorf("LocalOutcome of a request not applied = %+v, %v, %v; want none", ro, ok, err)
	}

	s.wait = 0
	_, err = s.AwaitOutcome(context.Background(), "ce-1", ledger.RequestRef{RID: "rid-3"}, 9)
	var pe *PendingError
	if !errors.As(err, &pe) || !errors.Is(err, ErrPending) || pe.Partition != p || pe.Offset != 9 {
		t.Errorf("AwaitOutcome without a wait = %v; want pending at partition %d offset 9", err, p)
	}
}

// broadcast (Share.applied) wakes every waiter of a signal at once, and a wait begun after a
// signal waits for the next one.
func TestBroadcast(t *testing.T) {
	var b broadcast
	b.signal() // nobody waits: nothing to close
	w1 := b.wait()
	if w2 := b.wait(); w1 != w2 {
		t.Fatal("two waiters of one signal wait on different channels")
	}
	select {
	case <-w1:
		t.Fatal("woken before a signal")
	default:
	}
	b.signal()
	select {
	case <-w1:
	default:
		t.Fatal("not woken by the signal")
	}
	w3 := b.wait()
	select {
	case <-w3:
		t.Fatal("a wait after the signal is woken by it")
	default:
	}
	b.signal()
	<-w3
}
