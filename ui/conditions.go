package ui

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// condition is the instant part of an alert of alerts/rules.yml, evaluated on the daemon's own
// gauges (Snapshot.Gauges, read from its metrics registry): what Prometheus would see if it
// scraped now. An alert fires once its condition has held for the rule's `for` time (and, for
// the rate rules, over its window), which the daemon does not wait for: the overview says so.
type condition struct {
	Alert string
	// holds reports whether the condition holds and, when it does, what it shows in words.
	holds func(g map[string]float64, now time.Time) (bool, string)
	Path  string // the alert's ui_path
}

// lately reports whether the event of Unix time t (0: none) happened within the 15 minutes an
// alert on an event fires for (the rules' time() - t < 900).
func lately(t float64, now time.Time) bool { return t > 0 && float64(now.Unix())-t < 900 }

// conditions are the alerts whose condition the daemon's gauges decide at an instant. The rate
// rule (CfguardDeadLetterRateHigh) and the counter rules (CfguardReplicationUnauthenticated,
// CfguardPosteriorLogRefused) and CfguardOutboxBacklog's branch for failed publishing need a
// window of samples and are not here; nor is CfguardDown, a failed scrape of this daemon, or
// CfguardReplicaSettingsDiffer, whose replica serves no page (503 but for health and metrics).
var conditions = []condition{
	{"CfguardKLOverBudget", func(g map[string]float64, now time.Time) (bool, string) {
		t := g["cfguard_kl_breach_last_timestamp_seconds"]
		return lately(t, now), "an update exceeded the KL budget at " + unix(t)
	}, "/ui/"},
	{"CfguardUpdatesFailing", func(g map[string]float64, now time.Time) (bool, string) {
		t := g["cfguard_update_failed_last_timestamp_seconds"]
		return lately(t, now), "an update failed at " + unix(t) + "; its records were not learned"
	}, "/ui/"},
	{"CfguardCounterfactualsInvalidated", func(g map[string]float64, _ time.Time) (bool, string) {
		n := g[`cfguard_counterfactuals{status="invalidated"}`]
		return n > 0, counted(n, "counterfactual is", "counterfactuals are") + " invalidated"
	}, "/ui/counterfactuals?status=invalidated"},
	{"CfguardCounterfactualsAtRisk", func(g map[string]float64, _ time.Time) (bool, string) {
		n := g[`cfguard_counterfactuals{status="at_risk"}`]
		return n > 0, counted(n, "counterfactual is", "counterfactuals are") + " at risk (the alert waits for 30 minutes of it)"
	}, "/ui/counterfactuals?status=at_risk"},
	{"CfguardRenewalBehind", func(g map[string]float64, _ time.Time) (bool, string) {
		n := g["cfguard_counterfactuals_renewal_pending"]
		return n > 0, counted(n, "certificate waits", "certificates wait") + " for renewal (the alert waits for 30 minutes of it)"
	}, "/ui/counterfactuals?status=certified&decided=no"},
	{"CfguardIngestStalled", func(g map[string]float64, now time.Time) (bool, string) {
		if g["cfguard_replication_settings_differ"] > 0 {
			return false, "" // a replica that refused to join reads nothing
		}
		// since is a gauge's time, or the process's start while it is 0 (never since the start),
		// or the gauge's 0 without a start time, as the rule falls back.
		since := func(name string) (float64, bool) {
			t, ok := g[name]
			if ok && t > 0 {
				return t, true
			}
			if p, known := g["process_start_time_seconds"]; known {
				return p, true
			}
			return t, ok
		}
		applied, ok := since("cfguard_last_ingest_timestamp_seconds")
		if !ok || float64(now.Unix())-applied <= 900 {
			return false, ""
		}
		last := "the last were applied at " + unix(g["cfguard_last_ingest_timestamp_seconds"])
		if lag := g["cfguard_consumer_lag_records"]; lag > 0 {
			return true, counted(lag, "record waits", "records wait") + "; " + last
		}
		if read, ok := since("cfguard_consumer_offsets_read_timestamp_seconds"); ok && float64(now.Unix())-read > 900 {
			when := "were last read at " + unix(g["cfguard_consumer_offsets_read_timestamp_seconds"])
			if g["cfguard_consumer_offsets_read_timestamp_seconds"] <= 0 {
				when = "have not been read since the start"
			}
			return true, "the input topic's offsets " + when + ", so whether records wait is unknown; " + last
		}
		return false, ""
	}, "/ui/"},
	{"CfguardCheckpointFailing", func(g map[string]float64, _ time.Time) (bool, string) {
		if g["cfguard_checkpoint_failing"] > 0 {
			return true, "a checkpoint, or on a replica a write of its CE share, is failing: what it writes waits until it succeeds"
		}
		if g["cfguard_ledger_write_failing"] > 0 {
			return true, "a commit to the ledger failed at " + unix(g["cfguard_ledger_write_failure_last_timestamp_seconds"]) +
				": the writes that fail are answered 503 or retried"
		}
		if g["cfguard_embedded_broker_write_failing"] > 0 {
			return true, "the embedded broker cannot write its data directory (state_dir/broker): it refuses the records produced; /readyz names the error"
		}
		return false, ""
	}, "/ui/"},
	{"CfguardTopicReset", func(g map[string]float64, _ time.Time) (bool, string) {
		return g["cfguard_consumer_topic_mismatch"] > 0, "the input topic no longer holds the offsets the ledger read up to"
	}, "/ui/"},
	{"CfguardRecordsLost", func(g map[string]float64, now time.Time) (bool, string) {
		var lost []string // "<topic> at <time>", of each topic that lost records within the hour
		for k, t := range g {
			labels, ok := strings.CutPrefix(k, `cfguard_records_lost_last_timestamp_seconds{topic="`)
			if !ok {
				continue
			}
			if topic, ok := strings.CutSuffix(labels, `"}`); ok && t > 0 && float64(now.Unix())-t < 3600 {
				lost = append(lost, topic+" at "+unix(t))
			}
		}
		if len(lost) == 0 {
			return false, ""
		}
		slices.Sort(lost)
		return true, "the broker deleted records before they were read (" + strings.Join(lost, "; ") + ")"
	}, "/ui/"},
	{"CfguardOutboxBacklog", func(g map[string]float64, _ time.Time) (bool, string) {
		n := g["cfguard_events_pending"]
		return n > 10000, fmt.Sprintf("%s events wait to be published", count(n))
	}, "/ui/events"},
	{"CfguardPosteriorLogStopped", func(g map[string]float64, _ time.Time) (bool, string) {
		return g["cfguard_posterior_log_stopped"] > 0, "this replica stopped following the posterior log"
	}, "/ui/"},
	{"CfguardPosteriorLogBehind", func(g map[string]float64, _ time.Time) (bool, string) {
		n := g["cfguard_posterior_log_lag_records"]
		return n > 0, "this replica is " + counted(n, "entry", "entries") + " behind the posterior log (the alert waits for 20 minutes of it)"
	}, "/ui/"},
	{"CfguardCounterfactualsNotCaughtUp", func(g map[string]float64, _ time.Time) (bool, string) {
		n := g["cfguard_counterfactuals_partitions_rebuilding"]
		says := counted(n, "CE partition of this replica is", "CE partitions of this replica are") + " not caught up (the alert fires after 15 to 20 minutes of it)"
		if b := g["cfguard_counterfactuals_partitions_blocked"]; b > 0 {
			says += fmt.Sprintf("; %s of them blocked at a request this build cannot read: upgrade this replica, or skip it (runbook)", count(b))
		}
		return n > 0, says
	}, "/ui/"},
	{"CfguardModelQualityDegraded", func(g map[string]float64, now time.Time) (bool, string) {
		t := g["cfguard_prequential_last_change_timestamp_seconds"]
		return t > 0 && float64(now.Unix())-t < 3600, "the served model's quality dropped (change detected at " + unix(t) + ")"
	}, "/ui/"},
}

// conditionRow is one condition that holds now.
type conditionRow struct{ Alert, Says, Path, Runbook string }

// holding lists the conditions that hold on gauges g at now.
func holding(g map[string]float64, now time.Time) []conditionRow {
	var out []conditionRow
	for _, c := range conditions {
		if ok, says := c.holds(g, now); ok {
			out = append(out, conditionRow{Alert: c.Alert, Says: says, Path: c.Path,
				Runbook: runbookLink(c.Alert)})
		}
	}
	return out
}

func unix(t float64) string {
	if t <= 0 {
		return "never"
	}
	return time.Unix(int64(t), 0).UTC().Format("2006-01-02 15:04:05 UTC")
}

// counted is count(v) and then one, the singular (with its verb, as "counterfactual is"), when v
// is exactly 1, else many: a page that says "1 counterfactuals" reads as a slip.
func counted(v float64, one, many string) string {
	if v == 1 {
		return count(v) + " " + one
	}
	return count(v) + " " + many
}

// count prints a gauge that counts things as a whole number with thousands separated
// (1234567 as "1,234,567"), never in exponent notation.
func count(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) || v != math.Trunc(v) || math.Abs(v) >= 1e15 {
		return strconv.FormatFloat(v, 'f', -1, 64)
	}
	digits := strconv.FormatInt(int64(math.Abs(v)), 10)
	var b strings.Builder
	if v < 0 {
		b.WriteByte('-')
	}
	for i, d := range digits {
		if i > 0 && (len(digits)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(d)
	}
	return b.String()
}
