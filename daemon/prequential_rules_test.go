package daemon

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/quality"
)

// scoredModel is the bundled breast-cancer model, briefly trained, at version 7, with its rows
// and labels.
func scoredModel(t *testing.T) (*bnn.Model, [][]float64, []int) {
	t.Helper()
	m, _, X := testPool(t)
	m.Version = 7
	set, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	return m, X, set.Y
}

// Before any record is scored, the prequential block and metrics report nothing scored, the
// default change detector's threshold, and no change.
func TestPrequentialBeforeAnyRecord(t *testing.T) {
	reg := prometheus.NewRegistry()
	p := newPrequential(alerts.NewQualityMetrics(reg))
	r := p.report()
	want := quality.NewDetector().Lambda
	if r["records"] != int64(0) || r["window_records"] != 0 || r["changes"] != int64(0) || r["change_threshold"] != want ||
		r["scored_under_version"] != uint64(0) {
		t.Fatalf("report %v, want nothing scored and threshold %v", r, want)
	}
	if _, ok := r["last_change"]; ok {
		t.Fatalf("report %v has a last change before any", r)
	}
	if got := daemontest.GatherCounter(reg, alerts.NamePrequentialThreshold); got != want {
		t.Fatalf("%s %v, want %v", alerts.NamePrequentialThreshold, got, want)
	}
	if got := daemontest.GatherCounter(reg, alerts.NamePrequentialLastChange); got != 0 {
		t.Fatalf("%s %v, want 0", alerts.NamePrequentialLastChange, got)
	}
}

// Scoring an increment changes nothing reported until it is committed; its record is scored
// under the posterior before the increment, counts every record scored since the ledger began,
// and keeps the newest change's time unless the increment's records raise an alarm, which
// dates the change at the increment. Committing it moves the window, the counts and the metrics.
func TestPrequentialScoreThenCommit(t *testing.T) {
	m, X, y := scoredModel(t)
	reg := prometheus.NewRegistry()
	p := newPrequential(alerts.NewQualityMetrics(reg))
	p.last.Records, p.last.LastChange = 5, 12345

	q, data, err := p.score(m, X[:10], y[:10], 8, 1, time.Unix(0, 999))
	if err != nil {
		t.Fatal(err)
	}
	if q.Version != m.Version || q.Records != 15 || q.Batch.Records != 10 || q.LastChange != 12345 || q.Detector.Changes != 0 || len(data) == 0 {
		t.Fatalf("record %+v, want version %d, 15 records, 10 in the batch, the last change kept", q, m.Version)
	}
	if r := p.report(); r["records"] != int64(5) || r["window_records"] != 0 {
		t.Fatalf("report %v after a score alone, want it unchanged", r)
	}
	p.commit(q)
	if r := p.report(); r["records"] != int64(15) || r["window_records"] != 10 || r["scored_under_version"] != m.Version ||
		r["last_change"] != time.Unix(0, 12345).UTC() {
		t.Fatalf("report %v after the commit, want 15 records, 10 in the window, version %d", r, m.Version)
	}
	if got := daemontest.GatherCounter(reg, alerts.NamePrequentialRecords); got != 15 {
		t.Fatalf("%s %v, want 15", alerts.NamePrequentialRecords, got)
	}
	if got := daemontest.GatherCounter(reg, alerts.NamePrequentialWindow); got != 10 {
		t.Fatalf("%s %v, want 10", alerts.NamePrequentialWindow, got)
	}

	// A detector that has seen many perfect records alarms at the first wrong one.
	p.last.Detector = quality.Detector{Delta: 0.005, Lambda: 0.01, Count: 1 << 20}
	flipped := make([]int, 5)
	for i := range flipped {
		flipped[i] = 1 - y[20+i]
	}
	now := time.Unix(1700000000, 5)
	q, _, err = p.score(m, X[20:25], flipped, 8, 2, now)
	if err != nil {
		t.Fatal(err)
	}
	if q.LastChange != now.UnixNano() || q.Detector.Changes == 0 || q.Records != 20 {
		t.Fatalf("record %+v, want an alarm dated %d and 20 records", q, now.UnixNano())
	}
	p.commit(q)
	if r := p.report(); r["last_change"] != now.UTC() || r["changes"] != int64(q.Detector.Changes) || r["window_records"] != 15 {
		t.Fatalf("report %v, want the change at %v", r, now.UTC())
	}
	if got := daemontest.GatherCounter(reg, alerts.NamePrequentialLastChange); got != float64(now.UnixNano())/1e9 {
		t.Fatalf("%s %v, want %v", alerts.NamePrequentialLastChange, got, float64(now.UnixNano())/1e9)
	}
	p.commit(nil) // an increment with nothing scored
	if r := p.report(); r["records"] != int64(20) || r["window_records"] != 15 {
		t.Fatalf("report %v after an increment with nothing scored, want it unchanged", r)
	}
}

// A daemon that starts on a ledger reports the prequential scores its increments stored, as the
// daemon that scored them did, in the block and the metrics; a stored record whose detector
// is not valid stops the load.
func TestPrequentialLoadsTheLedgersRecords(t *testing.T) {
	m, X, y := scoredModel(t)
	l := openLedger(t)
	if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
		t.Fatal(err)
	}
	scorer := newPrequential(alerts.NewQualityMetrics(prometheus.NewRegistry()))
	prev := m
	for i, n := range []int{7, 9, 4} {
		q, data, err := scorer.score(prev, X[i*10:i*10+n], y[i*10:i*10+n], 8, uint64(i), time.Unix(0, 1))
		if err != nil {
			t.Fatal(err)
		}
		next := prev.Clone()
		next.Version++
		up := &ledger.UpdateRecord{Version: next.Version, KL: 1e-6, Outcome: certify.OutcomePromoted, Quality: data}
		if _, _, err := l.Commit(context.Background(), &ledger.Checkpoint{Model: next, Update: up}); err != nil {
			t.Fatal(err)
		}
		scorer.commit(q)
		prev = next
	}
	reg := prometheus.NewRegistry()
	loaded := newPrequential(alerts.NewQualityMetrics(reg))
	if err := loaded.load(l); err != nil {
		t.Fatal(err)
	}
	want, got := scorer.report(), loaded.report()
	if len(got) != len(want) {
		t.Fatalf("loaded report %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("loaded report's %s %v, want %v (report %v)", k, got[k], v, got)
		}
	}
	if got["records"] != int64(20) || got["window_records"] != 20 || got["scored_under_version"] != m.Version+2 {
		t.Fatalf("loaded report %v, want 20 records, all in the window, the last scored under version %d", got, m.Version+2)
	}
	if g := daemontest.GatherCounter(reg, alerts.NamePrequentialRecords); g != 20 {
		t.Fatalf("%s %v after the load, want 20", alerts.NamePrequentialRecords, g)
	}
	if g := daemontest.GatherCounter(reg, alerts.NamePrequentialWindow); g != 20 {
		t.Fatalf("%s %v after the load, want 20", alerts.NamePrequentialWindow, g)
	}

	next := prev.Clone()
	next.Version++
	bad := &ledger.UpdateRecord{Version: next.Version, KL: 1e-6, Outcome: certify.OutcomePromoted,
		Quality: []byte(`{"posterior_version":1,"detector":{"delta":0,"lambda":50},"records":3}`)}
	if _, _, err := l.Commit(context.Background(), &ledger.Checkpoint{Model: next, Update: bad}); err != nil {
		t.Fatal(err)
	}
	if err := newPrequential(alerts.NewQualityMetrics(prometheus.NewRegistry())).load(l); err == nil {
		t.Fatal("a stored record with a detector of delta 0 was loaded")
	}
}
