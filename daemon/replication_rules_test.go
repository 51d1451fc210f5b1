package daemon

import (
	"encoding/json"
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// On a replica, the updater counts what it ingested as a single daemon does: the records its
// step applied as applied, and the records it could not decode, set aside on the dead-letter
// topic, as dead_lettered (cfguard_records_total), each once and none as held or failed.
func TestReplicaCountsItsRecordsByResult(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica: not with -short")
	}
	t.Parallel() // a replica mostly waits for its group
	b := daemontest.StartCluster(t, 1)
	r := daemontest.StartReplica(t, startNoWait, b.Addrs(), "r1", daemontest.WriteKeyFile(t, daemontest.ClusterKey))
	data := daemontest.Bundled(t)
	var vals [][]byte
	for i := range 6 {
		vals = append(vals, daemontest.Record(fmt.Sprintf("rec-%d", i), data.X[i], data.Y[i]))
	}
	vals = append(vals, []byte("not json"), daemontest.Record("short", []float64{1, 2}, 0), []byte("{"))
	r.Produce(t, vals...)
	count := func(result string) float64 { return r.Metric(t, "cfguard_records_total", "result", result) }
	waitfor.Cond(t, time.Minute, "6 records applied and 3 dead-lettered", func() bool {
		return count("applied") == 6 && count("dead_lettered") == 3
	})
	for _, result := range []string{"held", "failed"} {
		if got := count(result); got != 0 {
			t.Errorf("cfguard_records_total{result=%q} %v, want 0", result, got)
		}
	}
}

// On a replica, an update over the KL budget is recorded as its entry in the posterior log
// decided it, as a single daemon records it: clipped (certify.on_breach: clip), its records
// applied; rejected (reject), its records held, the posterior kept, and each rejected update in
// the KL history under the version it proposed, the one after the posterior it started from.
func TestReplicaRecordsUpdatesOverTheBudgetByOutcome(t *testing.T) {
	if testing.Short() {
		t.Skip("replicas: not with -short")
	}
	t.Parallel()
	for _, c := range []struct {
		onBreach certify.OnBreach
		learner  func(c *config.Config)
		outcome  certify.Outcome
		result   string // of the 64 records (cfguard_records_total)
	}{
		{"clip", func(*config.Config) {}, certify.OutcomeClipped, "applied"},
		{"reject", func(c *config.Config) { daemontest.PaperLearner(c, 1e-3) }, certify.OutcomeRejected, "held"},
	} {
		t.Run(string(c.onBreach), func(t *testing.T) {
			t.Parallel() // a replica mostly waits for its group
			b := daemontest.StartCluster(t, 1)
			start := func(t testing.TB, mutate func(*config.Config)) *running {
				return startNoWait(t, func(cfg *config.Config) { mutate(cfg); c.learner(cfg); cfg.Certify.OnBreach = c.onBreach })
			}
			r := daemontest.StartReplica(t, start, b.Addrs(), "r1", daemontest.WriteKeyFile(t, daemontest.ClusterKey))
			before := r.D.current().Version
			r.Produce(t, daemontest.Flipped(daemontest.Bundled(t), 64)...)
			count := func(result string) float64 { return r.Metric(t, "cfguard_records_total", "result", result) }
			waitfor.Cond(t, time.Minute, "64 records "+c.result, func() bool { return count(c.result) == 64 })
			if count("applied")+count("held")+count("failed") != 64 {
				t.Errorf("records applied %v, held %v, failed %v; want 64 %s", count("applied"), count("held"), count("failed"), c.result)
			}
			if got := r.Metric(t, "cfguard_updates_total", "outcome", string(c.outcome)); got == 0 {
				t.Errorf("cfguard_updates_total{outcome=%q} is 0 after 64 flipped records", c.outcome)
			}
			if c.outcome != certify.OutcomeRejected {
				return
			}
			if v := r.D.current().Version; v != before {
				t.Errorf("posterior version %d after rejected updates, want %d", v, before)
			}
			hist, err := r.D.Ledger().KLHistory(0)
			if err != nil || len(hist) == 0 {
				t.Fatalf("KL history: %v, %v", hist, err)
			}
			for _, h := range hist {
				if h.Outcome != certify.OutcomeRejected || h.PosteriorVersion != before+1 || h.KL <= certify.KLBudget(r.Config.Certify.Delta) {
					t.Errorf("KL history entry %+v; want rejected, version %d, KL over the budget %v", h, before+1, certify.KLBudget(r.Config.Certify.Delta))
				}
			}
		})
	}
}

// A replica records an increment entry of the posterior log as the step its updater decided:
// the outcome, the records counted under it (applied, held or failed), the KL history's entry
// (the new version, or the one a kept posterior's update proposed; a failed update has no KL),
// the entry's non-zero counters, and its prequential record when it is a valid one. An entry of
// records that were all dead-lettered or lost records no update.
func TestStepOfAnEntryIsWhatItDecided(t *testing.T) {
	prev, next := &bnn.Model{Version: 6}, &bnn.Model{Version: 7}
	counts := &postlog.Counts{Applied: 5, DeadLettered: 2, Lost: 0, Failed: 3, Held: 4}
	valid := json.RawMessage(`{"posterior_version":6,"detector":{"delta":0.005,"lambda":50,"min_records":30},"records":5}`)
	for _, c := range []struct {
		name     string
		e        postlog.Entry
		outcome  certify.Outcome
		next     *bnn.Model
		records  int
		metric   alerts.RecordResult
		update   *ledger.UpdateRecord
		counters map[string]int64
		quality  bool // the entry's prequential record kept
	}{
		{"promoted", postlog.Entry{Outcome: postlog.Promoted, Version: 7, ParentVersion: 6, KL: 0.02, Seed: 9, Counts: counts, Quality: valid},
			certify.OutcomePromoted, next, 5, alerts.RecordApplied, &ledger.UpdateRecord{Version: 7, KL: 0.02, Outcome: certify.OutcomePromoted},
			map[string]int64{"dead_lettered": 2, "failed": 3, "held": 4}, true},
		{"clipped", postlog.Entry{Outcome: postlog.Clipped, Version: 7, ParentVersion: 6, KL: 0.1, Counts: counts},
			certify.OutcomeClipped, next, 5, alerts.RecordApplied, &ledger.UpdateRecord{Version: 7, KL: 0.1, Outcome: certify.OutcomeClipped},
			map[string]int64{"dead_lettered": 2, "failed": 3, "held": 4}, false},
		{"rejected", postlog.Entry{Outcome: postlog.Rejected, Version: 6, ParentVersion: 6, KL: 5, Counts: &postlog.Counts{Held: 4}},
			certify.OutcomeRejected, nil, 4, alerts.RecordHeld, &ledger.UpdateRecord{Version: 7, KL: 5, Outcome: certify.OutcomeRejected},
			map[string]int64{"held": 4}, false},
		{"failed", postlog.Entry{Outcome: postlog.Failed, Version: 6, ParentVersion: 6, KL: 5, Counts: &postlog.Counts{Failed: 3}},
			certify.OutcomeFailed, nil, 3, alerts.RecordFailed, &ledger.UpdateRecord{Version: 7, KL: 0, Outcome: certify.OutcomeFailed},
			map[string]int64{"failed": 3}, false},
		{"skipped", postlog.Entry{Outcome: postlog.Skipped, Version: 6, ParentVersion: 6, Counts: &postlog.Counts{DeadLettered: 2}, Quality: valid},
			"", nil, 0, "", nil, map[string]int64{"dead_lettered": 2}, false},
		{"an invalid detector", postlog.Entry{Outcome: postlog.Promoted, Version: 7, ParentVersion: 6, KL: 0.02, Counts: &postlog.Counts{Applied: 5},
			Quality: json.RawMessage(`{"posterior_version":6,"detector":{"delta":0,"lambda":50}}`)},
			certify.OutcomePromoted, next, 5, alerts.RecordApplied, &ledger.UpdateRecord{Version: 7, KL: 0.02, Outcome: certify.OutcomePromoted},
			map[string]int64{}, false},
		{"a record that is not JSON", postlog.Entry{Outcome: postlog.Promoted, Version: 7, ParentVersion: 6, KL: 0.02, Counts: &postlog.Counts{Applied: 5},
			Quality: json.RawMessage(`{"detector":`)},
			certify.OutcomePromoted, next, 5, alerts.RecordApplied, &ledger.UpdateRecord{Version: 7, KL: 0.02, Outcome: certify.OutcomePromoted},
			map[string]int64{}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := stepOf(&c.e, prev, next)
			if s.outcome != c.outcome || s.next != c.next || s.prev != prev || s.records != c.records || s.metric != c.metric || s.seed != c.e.Seed {
				t.Errorf("outcome %q, next %v, records %d %q, seed %d; want %q, %v, %d %q, %d", s.outcome, s.next, s.records, s.metric, s.seed,
					c.outcome, c.next, c.records, c.metric, c.e.Seed)
			}
			if !maps.Equal(s.counters, c.counters) {
				t.Errorf("counters %v, want %v", s.counters, c.counters)
			}
			switch {
			case c.update == nil:
				if s.update != nil || s.quality != nil {
					t.Errorf("update %+v, quality %+v; want none", s.update, s.quality)
				}
				return
			case s.update == nil:
				t.Fatalf("no update, want %+v", c.update)
			}
			if got := *s.update; got.Version != c.update.Version || got.KL != c.update.KL || got.Outcome != c.update.Outcome {
				t.Errorf("update version %d, KL %v, %q; want %d, %v, %q", got.Version, got.KL, got.Outcome, c.update.Version, c.update.KL, c.update.Outcome)
			}
			if kept := s.quality != nil; kept != c.quality || kept != (len(s.update.Quality) > 0) {
				t.Errorf("quality kept %v, in the update %q; want kept %v", kept, s.update.Quality, c.quality)
			}
			if c.quality && (s.quality.Version != 6 || s.quality.Records != 5 || string(s.update.Quality) != string(c.e.Quality)) {
				t.Errorf("quality %+v (%s), want the entry's", s.quality, s.update.Quality)
			}
		})
	}
}

// While a replica's updater holds a reset of the input topic, cfguard_consumer_topic_mismatch
// is 1 and cfguard_consumer_lag_records counts the reset partition's log whole (the log's
// coverage counts records of the old one); once the reset is no longer held (the log moved on,
// or the updater's role ended), both say so again: 0, and the records waiting past the coverage.
func TestReplicaTopicResetIsClearedWhenItEnds(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica: not with -short")
	}
	t.Parallel() // a replica mostly waits for its group
	b := daemontest.StartCluster(t, 1)
	r := daemontest.StartReplica(t, startNoWait, b.Addrs(), "r1", daemontest.WriteKeyFile(t, daemontest.ClusterKey))
	daemontest.ProduceRows(t, r, daemontest.Bundled(t), 0, 8)
	mismatch := func() float64 { return r.Metric(t, "cfguard_consumer_topic_mismatch") }
	waiting := func() float64 { return r.Metric(t, "cfguard_consumer_lag_records") }
	waitfor.Cond(t, time.Minute, "8 records applied, none waiting, as the topic's last watermarks read say", func() bool {
		w, _, _, ok := r.D.ends.get()
		return ok && w[0].End == 8 && r.Metric(t, "cfguard_records_total", "result", "applied") == 8 && waiting() == 0
	})
	host := replicaHost{r.D}
	host.TopicReset(&stream.TopicResetError{Topic: r.Config.Kafka.Topic, Partition: 0})
	if m, w := mismatch(), waiting(); m != 1 || w != 8 {
		t.Errorf("while the reset is held: topic mismatch %v, records waiting %v; want 1 and the whole log, 8", m, w)
	}
	host.TopicReset(nil)
	if m, w := mismatch(), waiting(); m != 0 || w != 0 {
		t.Errorf("once the reset is no longer held: topic mismatch %v, records waiting %v; want 0 and 0", m, w)
	}
}
