package ui

import (
	"os"
	"regexp"
	"slices"
	"strings"
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
		{"a breach 15 minutes ago to the second", map[string]float64{"cfguard_kl_breach_last_timestamp_seconds": at(15 * time.Minute), "cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
		{"a failed update 15 minutes ago to the second", map[string]float64{"cfguard_update_failed_last_timestamp_seconds": at(15 * time.Minute), "cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
		{"one of each status", map[string]float64{`cfguard_counterfactuals{status="invalidated"}`: 1, `cfguard_counterfactuals{status="at_risk"}`: 1,
			"cfguard_counterfactuals_renewal_pending": 1, "cfguard_last_ingest_timestamp_seconds": at(0)},
			[]string{"CfguardCounterfactualsInvalidated", "CfguardCounterfactualsAtRisk", "CfguardRenewalBehind"}},
		{"at_risk only", map[string]float64{`cfguard_counterfactuals{status="at_risk"}`: 2, `cfguard_counterfactuals{status="invalidated"}`: 0,
			"cfguard_last_ingest_timestamp_seconds": at(0)}, []string{"CfguardCounterfactualsAtRisk"}},
		{"applied 15 minutes ago to the second, records waiting", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(15 * time.Minute), "cfguard_consumer_lag_records": 5,
			"cfguard_consumer_offsets_read_timestamp_seconds": at(0)}, nil},
		{"applied 15 minutes and a second ago, one record waiting", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(15*time.Minute + time.Second),
			"cfguard_consumer_lag_records": 1, "cfguard_consumer_offsets_read_timestamp_seconds": at(0)}, []string{"CfguardIngestStalled"}},
		{"quiet, the offsets unread for 15 minutes to the second", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(time.Hour),
			"cfguard_consumer_offsets_read_timestamp_seconds": at(15 * time.Minute)}, nil},
		{"no ingest gauge, no start time, records waiting", map[string]float64{"cfguard_consumer_lag_records": 5, "cfguard_consumer_offsets_read_timestamp_seconds": at(0)}, nil},
		{"no offsets gauge, no start time, records last applied an hour ago", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(time.Hour)}, nil},
		{"records lost 60 minutes ago to the second", map[string]float64{`cfguard_records_lost_last_timestamp_seconds{topic="cfguard.records"}`: at(time.Hour),
			"cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
		{"10,000 events waiting", map[string]float64{"cfguard_events_pending": 10000, "cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
		{"one partition not caught up", map[string]float64{"cfguard_counterfactuals_partitions_rebuilding": 1, "cfguard_last_ingest_timestamp_seconds": at(0)},
			[]string{"CfguardCounterfactualsNotCaughtUp"}},
		{"a blocked gauge, no partition rebuilding", map[string]float64{"cfguard_counterfactuals_partitions_rebuilding": 0, "cfguard_counterfactuals_partitions_blocked": 1,
			"cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
		{"quality dropped 60 minutes ago to the second", map[string]float64{"cfguard_prequential_last_change_timestamp_seconds": at(time.Hour), "cfguard_last_ingest_timestamp_seconds": at(0)}, nil},
		{"no gauges", nil, nil},
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
		{0, "2 CE partitions of this replica are not caught up (the alert fires after 15 to 20 minutes of it)"},
		{1, "2 CE partitions of this replica are not caught up (the alert fires after 15 to 20 minutes of it); 1 of them blocked at a request this build cannot read: upgrade this replica, or skip it (runbook)"},
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

// What each condition says names the gauges' figures and times (in UTC, whatever the local time
// zone), a gauge's time of 0 as never, and its row links the alert's runbook_url of
// alerts/rules.yml.
func TestConditionsSayWhatTheGaugesShow(t *testing.T) {
	local := time.Local
	time.Local = time.FixedZone("UTC+1", 3600)
	t.Cleanup(func() { time.Local = local })
	rules, err := os.ReadFile("../alerts/rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	runbooks := map[string]string{}
	for _, m := range regexp.MustCompile(`(?s)- alert: (\w+).*?runbook_url: "([^"]+)"`).FindAllStringSubmatch(string(rules), -1) {
		runbooks[m[1]] = m[2]
	}
	now := time.Unix(1_800_000_000, 0) // 2027-01-15 08:00:00 UTC
	at := func(ago time.Duration) float64 { return float64(now.Add(-ago).Unix()) }
	for _, tc := range []struct {
		name   string
		gauges map[string]float64
		says   map[string]string // by alert, of every condition that holds
	}{
		{"every condition", map[string]float64{"cfguard_kl_breach_last_timestamp_seconds": at(time.Minute), "cfguard_update_failed_last_timestamp_seconds": at(2 * time.Minute),
			`cfguard_counterfactuals{status="invalidated"}`: 1234, `cfguard_counterfactuals{status="at_risk"}`: 1, "cfguard_counterfactuals_renewal_pending": 2,
			"cfguard_last_ingest_timestamp_seconds": at(20 * time.Minute), "cfguard_consumer_lag_records": 5, "cfguard_consumer_offsets_read_timestamp_seconds": at(0),
			"cfguard_checkpoint_failing": 1, "cfguard_consumer_topic_mismatch": 1, `cfguard_records_lost_last_timestamp_seconds{topic="cfguard.records"}`: at(3 * time.Minute),
			"cfguard_events_pending": 10001, "cfguard_posterior_log_stopped": 1, "cfguard_posterior_log_lag_records": 3,
			"cfguard_counterfactuals_partitions_rebuilding": 1, "cfguard_prequential_last_change_timestamp_seconds": at(4 * time.Minute)}, map[string]string{
			"CfguardKLOverBudget":               "an update exceeded the KL budget at 2027-01-15 07:59:00 UTC",
			"CfguardUpdatesFailing":             "an update failed at 2027-01-15 07:58:00 UTC; its records were not learned",
			"CfguardCounterfactualsInvalidated": "1,234 counterfactuals are invalidated",
			"CfguardCounterfactualsAtRisk":      "1 counterfactual is at risk (the alert waits for 30 minutes of it)",
			"CfguardRenewalBehind":              "2 certificates wait for renewal (the alert waits for 30 minutes of it)",
			"CfguardIngestStalled":              "5 records wait; the last were applied at 2027-01-15 07:40:00 UTC",
			"CfguardCheckpointFailing":          "a checkpoint, or on a replica a write of its CE share, is failing: what it writes waits until it succeeds",
			"CfguardTopicReset":                 "the input topic no longer holds the offsets the ledger read up to",
			"CfguardRecordsLost":                "the broker deleted records before they were read (cfguard.records at 2027-01-15 07:57:00 UTC)",
			"CfguardOutboxBacklog":              "10,001 events wait to be published",
			"CfguardPosteriorLogStopped":        "this replica stopped following the posterior log",
			"CfguardPosteriorLogBehind":         "this replica is 3 entries behind the posterior log (the alert waits for 20 minutes of it)",
			"CfguardCounterfactualsNotCaughtUp": "1 CE partition of this replica is not caught up (the alert fires after 15 to 20 minutes of it)",
			"CfguardModelQualityDegraded":       "the served model's quality dropped (change detected at 2027-01-15 07:56:00 UTC)",
		}},
		{"a commit to the ledger failed", map[string]float64{"cfguard_ledger_write_failing": 1, "cfguard_ledger_write_failure_last_timestamp_seconds": at(50 * time.Second),
			"cfguard_last_ingest_timestamp_seconds": at(0)}, map[string]string{
			"CfguardCheckpointFailing": "a commit to the ledger failed at 2027-01-15 07:59:10 UTC: the writes that fail are answered 503 or retried"}},
		{"the embedded broker cannot write", map[string]float64{"cfguard_embedded_broker_write_failing": 1, "cfguard_last_ingest_timestamp_seconds": at(0)}, map[string]string{
			"CfguardCheckpointFailing": "the embedded broker cannot write its data directory (state_dir/broker): it refuses the records produced; /readyz names the error"}},
		{"a fresh ledger whose offsets were never read", map[string]float64{"cfguard_last_ingest_timestamp_seconds": 0, "process_start_time_seconds": at(time.Hour),
			"cfguard_consumer_offsets_read_timestamp_seconds": 0}, map[string]string{
			"CfguardIngestStalled": "the input topic's offsets have not been read since the start, so whether records wait is unknown; the last were applied at never"}},
		{"the offsets last read 20 minutes ago", map[string]float64{"cfguard_last_ingest_timestamp_seconds": at(time.Hour),
			"cfguard_consumer_offsets_read_timestamp_seconds": at(20 * time.Minute)}, map[string]string{
			"CfguardIngestStalled": "the input topic's offsets were last read at 2027-01-15 07:40:00 UTC, so whether records wait is unknown; the last were applied at 2027-01-15 07:00:00 UTC"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rows := holding(tc.gauges, now)
			if len(rows) != len(tc.says) {
				t.Errorf("%d conditions hold, want %d: %+v", len(rows), len(tc.says), rows)
			}
			for _, r := range rows {
				if want, ok := tc.says[r.Alert]; !ok || r.Says != want {
					t.Errorf("%s says %q, want %q", r.Alert, r.Says, want)
				}
				// The UI links the section the alert's runbook_url names, in the runbook it serves.
				_, frag, _ := strings.Cut(runbooks[r.Alert], "#")
				if want := runbookPath + "#" + frag; frag == "" || r.Runbook != want {
					t.Errorf("%s links the runbook %q, want %q (alerts/rules.yml has %q)", r.Alert, r.Runbook, want, runbooks[r.Alert])
				}
			}
		})
	}
}
