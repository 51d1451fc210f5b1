package ui

import (
	"os"
	"regexp"
	"slices"
	"testing"
	"time"
)

// The conditions are the alerts' instant parts: each names an alert of alerts/rules.yml with
// the same ui_path, and holds exactly when the rule's expression would on these gauges (a gauge
// missing from a case is a series Prometheus does not have).
func TestConditionsFollowTheRules(t *testing.T) {
	rules, err := os.ReadFile("../alerts/rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	paths := map[string]string{}
	for _, m := range regexp.MustCompile(`(?s)- alert: (\w+).*?ui_path: "([^"]+)"`).FindAllStringSubmatch(string(rules), -1) {
		paths[m[1]] = m[2]
	}
	for _, c := range conditions {
		if p, ok := paths[c.Alert]; !ok || p != c.Path {
			t.Errorf("condition %s: alerts/rules.yml has ui_path %q (found %v), the condition %q", c.Alert, p, ok, c.Path)
		}
	}
	now := time.Unix(1_800_000_000, 0)
	at := func(ago time.Duration) float64 { return float64(now.Add(-ago).Unix()) }
	for _, tc := range []struct {
		name   string
		gauges map[string]float64
		want   []string
	}{
		{"healthy", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(time.Minute), `cfguard_counterfactuals{status="certified"}`: 10}, nil},
		{"a breach 14 minutes ago", map[string]float64{"cfguard_kl_breach_last_timestamp_seconds": at(14 * time.Minute), "cfguard_last_ingest_timestamp_seconds": at(0)}, []string{"CfguardKLOverBudget"}},
		{"a breach 16 minutes ago", map[string]float64{"cfguard_kl_breach_last_timestamp_seconds": at(16 * time.Minute), "cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
		{"a failed update 14 minutes ago", map[string]float64{"cfguard_update_failed_last_timestamp_seconds": at(14 * time.Minute), "cfguard_last_ingest_timestamp_seconds": at(0)}, []string{"CfguardUpdatesFailing"}},
		{"a failed update 16 minutes ago", map[string]float64{"cfguard_update_failed_last_timestamp_seconds": at(16 * time.Minute), "cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
		{"statuses", map[string]float64{`cfguard_counterfactuals{status="invalidated"}`: 1, `cfguard_counterfactuals{status="at_risk"}`: 2,
			"cfguard_counterfactuals_renewal_pending": 3, "cfguard_last_ingest_timestamp_seconds": at(0)},
			[]string{"CfguardCounterfactualsInvalidated", "CfguardCounterfactualsAtRisk", "CfguardRenewalBehind"}},
		{"stalled with records waiting", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(16 * time.Minute), "cfguard_consumer_lag_records": 5,
			"cfguard_consumer_offsets_read_timestamp_seconds": at(0)}, []string{"CfguardIngestStalled"}},
		{"quiet, nothing waiting", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(time.Hour), "cfguard_consumer_offsets_read_timestamp_seconds": at(0)}, nil},
		{"quiet, the offsets unread for 16 minutes", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(time.Hour),
			"cfguard_consumer_offsets_read_timestamp_seconds": at(16 * time.Minute)}, []string{"CfguardIngestStalled"}},
		{"a fresh ledger, started 16 minutes ago, records waiting", map[string]float64{"cfguard_last_ingest_timestamp_seconds": 0,
			"process_start_time_seconds": at(16 * time.Minute), "cfguard_consumer_lag_records": 5, "cfguard_consumer_offsets_read_timestamp_seconds": at(0)},
			[]string{"CfguardIngestStalled"}},
		{"a replica that refused to join, started an hour ago", map[string]float64{"cfguard_replication_settings_differ": 1, "cfguard_last_ingest_timestamp_seconds": 0,
			"process_start_time_seconds": at(time.Hour), "cfguard_consumer_offsets_read_timestamp_seconds": 0}, nil},
		{"restarted 10 minutes ago with the broker down, records last applied an hour ago", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(time.Hour),
			"process_start_time_seconds": at(10 * time.Minute), "cfguard_consumer_offsets_read_timestamp_seconds": 0}, nil},
		{"restarted 16 minutes ago with the broker down, records last applied an hour ago", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(time.Hour),
			"process_start_time_seconds": at(16 * time.Minute), "cfguard_consumer_offsets_read_timestamp_seconds": 0}, []string{"CfguardIngestStalled"}},
		{"no offsets gauge, started 16 minutes ago, records last applied an hour ago", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(time.Hour),
			"process_start_time_seconds": at(16 * time.Minute)}, []string{"CfguardIngestStalled"}},
		{"no start time, restarted with the broker down, records last applied an hour ago", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(time.Hour),
			"cfguard_consumer_offsets_read_timestamp_seconds": 0}, []string{"CfguardIngestStalled"}},
		{"a fresh ledger, started 14 minutes ago, records waiting", map[string]float64{"cfguard_last_ingest_timestamp_seconds": 0,
			"process_start_time_seconds": at(14 * time.Minute), "cfguard_consumer_lag_records": 5, "cfguard_consumer_offsets_read_timestamp_seconds": at(0)}, nil},
		{"failures", map[string]float64{"cfguard_checkpoint_failing": 1, "cfguard_consumer_topic_mismatch": 1, "cfguard_events_pending": 10001,
			"cfguard_posterior_log_stopped": 1, "cfguard_posterior_log_lag_records": 1, "cfguard_counterfactuals_partitions_rebuilding": 2,
			"cfguard_last_ingest_timestamp_seconds": at(0)},
			[]string{"CfguardCheckpointFailing", "CfguardTopicReset", "CfguardOutboxBacklog", "CfguardPosteriorLogStopped", "CfguardPosteriorLogBehind",
				"CfguardCounterfactualsNotCaughtUp"}},
		{"a registration failed to commit 50 s ago, no checkpoint tried", map[string]float64{"cfguard_ledger_write_failing": 1,
			"cfguard_ledger_write_failure_last_timestamp_seconds": at(50 * time.Second), "cfguard_checkpoint_failing": 0,
			"cfguard_last_ingest_timestamp_seconds": at(0)}, []string{"CfguardCheckpointFailing"}},
		{"the embedded broker cannot write", map[string]float64{"cfguard_embedded_broker_write_failing": 1, "cfguard_ledger_write_failing": 0,
			"cfguard_checkpoint_failing": 0, "cfguard_last_ingest_timestamp_seconds": at(0)}, []string{"CfguardCheckpointFailing"}},
		{"a registration failed to commit 70 s ago", map[string]float64{"cfguard_ledger_write_failing": 0,
			"cfguard_ledger_write_failure_last_timestamp_seconds": at(70 * time.Second), "cfguard_checkpoint_failing": 0,
			"cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
		{"records lost 59 minutes ago", map[string]float64{`cfguard_records_lost_last_timestamp_seconds{topic="cfguard.records"}`: at(59 * time.Minute),
			`cfguard_records_lost_last_timestamp_seconds{topic="cfguard.ce"}`: 0, "cfguard_last_ingest_timestamp_seconds": at(0)}, []string{"CfguardRecordsLost"}},
		{"records lost 61 minutes ago", map[string]float64{`cfguard_records_lost_last_timestamp_seconds{topic="cfguard.records"}`: at(61 * time.Minute),
			"cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
		{"quality dropped 59 minutes ago", map[string]float64{"cfguard_prequential_last_change_timestamp_seconds": at(59 * time.Minute), "cfguard_last_ingest_timestamp_seconds": at(0)}, []string{"CfguardModelQualityDegraded"}},
		{"quality dropped 61 minutes ago", map[string]float64{"cfguard_prequential_last_change_timestamp_seconds": at(61 * time.Minute), "cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, r := range holding(tc.gauges, now) {
				got = append(got, r.Alert)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("holding %v, want %v", got, tc.want)
			}
		})
	}
}

// A partition blocked at a request this build cannot read is a partition not caught up, and
// the condition says what to do.
func TestNotCaughtUpSaysWhenBlocked(t *testing.T) {
	for _, tc := range []struct {
		blocked float64
		says    string
	}{
		{0, "2 CE partitions of this replica are not caught up (the alert waits for 15 minutes of it)"},
		{1, "2 CE partitions of this replica are not caught up (the alert waits for 15 minutes of it); 1 of them blocked at a request this build cannot read: upgrade this replica, or skip it (runbook)"},
	} {
		rows := holding(map[string]float64{"cfguard_counterfactuals_partitions_rebuilding": 2, "cfguard_counterfactuals_partitions_blocked": tc.blocked,
			"cfguard_last_ingest_timestamp_seconds": float64(time.Now().Unix())}, time.Now())
		if len(rows) != 1 || rows[0].Alert != "CfguardCounterfactualsNotCaughtUp" || rows[0].Says != tc.says {
			t.Errorf("blocked %v: holding %+v, want CfguardCounterfactualsNotCaughtUp saying %q", tc.blocked, rows, tc.says)
		}
	}
}

// Records lost are said by topic, each with its time, in topic order.
func TestRecordsLostNamesTheTopics(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	rows := holding(map[string]float64{
		`cfguard_records_lost_last_timestamp_seconds{topic="cfguard.records"}`: float64(now.Add(-time.Minute).Unix()),
		`cfguard_records_lost_last_timestamp_seconds{topic="cfguard.ce"}`:      float64(now.Add(-2 * time.Minute).Unix()),
		`cfguard_records_lost_last_timestamp_seconds{topic="old"}`:             float64(now.Add(-2 * time.Hour).Unix()),
		`cfguard_records_lost_total{topic="cfguard.records"}`:                  float64(now.Unix()), // not a time
		"cfguard_last_ingest_timestamp_seconds":                                float64(now.Unix()),
	}, now)
	want := "the broker deleted records before they were read (cfguard.ce at 2026-12-01 11:58:00 UTC; cfguard.records at 2026-12-01 11:59:00 UTC)"
	if len(rows) != 1 || rows[0].Alert != "CfguardRecordsLost" || rows[0].Says != want {
		t.Errorf("holding %+v, want CfguardRecordsLost saying %q", rows, want)
	}
}
