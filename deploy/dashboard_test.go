package deploy

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/deploy/internal/deploytest"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// alertsWithoutPanel lists the alerts of rules (alert -> the metrics its expression queries)
// that no panel of d shows: a panel shows an alert when its description names the alert and
// its queries use every metric the alert's expression does.
func alertsWithoutPanel(d deploytest.Dashboard, rules map[string][]string) []string {
	known := map[string]bool{}
	for _, n := range alerts.Names() {
		known[n] = true
	}
	var missing []string
	for alert, metrics := range rules {
		shown := slices.ContainsFunc(d.FlatPanels(), func(p deploytest.Panel) bool {
			uses := map[string]bool{}
			for _, tg := range p.Targets {
				for _, r := range metricName.FindAllString(tg.Expr, -1) {
					uses[familyOf(r, known)] = true
				}
			}
			return strings.Contains(p.Description, alert) && !slices.ContainsFunc(metrics, func(m string) bool { return !uses[m] })
		})
		if !shown {
			missing = append(missing, fmt.Sprintf("%s (%s)", alert, strings.Join(metrics, ", ")))
		}
	}
	slices.Sort(missing)
	return missing
}

// Every alert of alerts/rules.yml has a panel that names it and queries what it queries, so
// that an operator paged by an alert finds its history on the dashboard.
func TestDashboardHasAPanelPerAlert(t *testing.T) {
	d := deploytest.LoadDashboard(t)
	rules, err := alerts.RuleMetrics()
	if err != nil {
		t.Fatal(err)
	}
	if len(rules) < 11 {
		t.Fatalf("alerts.RuleMetrics found %d alerts", len(rules))
	}
	for _, m := range alertsWithoutPanel(d, rules) {
		t.Errorf("no panel of deploy/grafana/cfguard.json names alert %s in its description and queries its metrics", m)
	}
	// The check can fail: without the renewal panel, CfguardRenewalBehind has none.
	var cut deploytest.Dashboard
	cut.Panels = slices.DeleteFunc(slices.Clone(d.Panels), func(p deploytest.Panel) bool { return strings.Contains(p.Description, "CfguardRenewalBehind") })
	if got := alertsWithoutPanel(cut, rules); len(got) != 1 || !strings.HasPrefix(got[0], "CfguardRenewalBehind (") {
		t.Errorf("without the renewal backlog panel, alerts without a panel: %v; want CfguardRenewalBehind", got)
	}
}

// healthyStates are series of one instance in states that are not failures, 40 one-minute
// samples each (promtool's series notation): the dashboard must show a number, never NaN, for
// each, and something in every panel that does not say what its absence means (noValue).
var healthyStates = map[string][]string{
	// Records applied a while ago, nothing since; three certified counterfactuals.
	"idle": healthy(nil),
	// Records and updates flowing; every counterfactual at_risk, so no certificate and no bound.
	"busy, every counterfactual at_risk": healthy(map[string]string{
		`cfguard_counterfactuals{status="certified"}`: "0x40", `cfguard_counterfactuals{status="at_risk"}`: "5x40",
		`cfguard_counterfactuals_bound_min`: "", `cfguard_counterfactuals_unconfirmed`: "0x40",
		`cfguard_records_total{result="applied"}`: "0+32x40", `cfguard_updates_total{outcome="promoted"}`: "0+1x40",
		`cfguard_recertification_duration_seconds_bucket{le="0.1"}`: "0+1x40", `cfguard_recertification_duration_seconds_bucket{le="+Inf"}`: "0+1x40",
		`cfguard_recertification_duration_seconds_count`: "0+1x40", `cfguard_recertification_duration_seconds_sum`: "0+0.05x40",
		`cfguard_last_ingest_timestamp_seconds`: "0+60x40", `cfguard_posterior_version`: "1+1x40", `cfguard_export_posterior_version`: "1+1x40",
		`cfguard_events_total{result="published"}`: "0+5x40",
	}),
	// Just started: nothing stored, nothing consumed, no update yet.
	"fresh": healthy(map[string]string{
		`cfguard_counterfactuals{status="certified"}`: "0x40", `cfguard_counterfactuals_bound_min`: "",
		`cfguard_records_total{result="applied"}`: "0x40", `cfguard_updates_total{outcome="promoted"}`: "0x40",
		`cfguard_recertification_duration_seconds_bucket{le="0.1"}`: "0x40", `cfguard_recertification_duration_seconds_bucket{le="+Inf"}`: "0x40",
		`cfguard_recertification_duration_seconds_count`: "0x40", `cfguard_recertification_duration_seconds_sum`: "0x40",
		`cfguard_last_ingest_timestamp_seconds`: "0x40", `cfguard_posterior_kl`: "0x40", `cfguard_posterior_kl_max_anchor`: "0x40",
		`cfguard_counterfactuals_renewed_total`: "0x40", `cfguard_events_total{result="published"}`: "0x40",
		`cfguard_prequential_records_total`: "0x40", `cfguard_prequential_window_records`: "0x40", `cfguard_prequential_change_statistic`: "0x40",
	}),
	// A replica following the posterior log to its end.
	"replica": healthy(map[string]string{`cfguard_posterior_log_stopped`: "0x40", `cfguard_posterior_log_lag_records`: "0x40"}),
}

// healthy is the idle state with the series of change replaced ("" removes one).
func healthy(change map[string]string) []string {
	series := map[string]string{
		`cfguard_kl_breach_last_timestamp_seconds`: "0x40", `cfguard_update_failed_last_timestamp_seconds`: "0x40", `cfguard_kl_over_budget`: "0x40", `cfguard_kl_budget`: "0.10125x40",
		`cfguard_posterior_kl`: "0.001x40", `cfguard_posterior_kl_max_anchor`: "0.01x40",
		`cfguard_counterfactuals{status="certified"}`: "3x40", `cfguard_counterfactuals{status="at_risk"}`: "0x40",
		`cfguard_counterfactuals{status="invalidated"}`: "0x40", `cfguard_counterfactuals{status="uncertified"}`: "0x40",
		`cfguard_counterfactuals_bound_min`: "0.9x40", `cfguard_posterior_version`: "7x40", `cfguard_export_posterior_version`: "7x40",
		`cfguard_consumer_lag_records`: "0x40", `cfguard_last_ingest_timestamp_seconds`: "60x40",
		`cfguard_records_total{result="applied"}`: "64x40", `cfguard_records_total{result="dead_lettered"}`: "0x40",
		`cfguard_records_lost_last_timestamp_seconds{topic="cfguard.records"}`: "0x40", `cfguard_records_total{result="failed"}`: "0x40", `cfguard_records_total{result="held"}`: "0x40",
		`cfguard_updates_total{outcome="promoted"}`: "2x40", `cfguard_updates_total{outcome="clipped"}`: "0x40",
		`cfguard_updates_total{outcome="rejected"}`: "0x40", `cfguard_updates_total{outcome="failed"}`: "0x40",
		`cfguard_recertification_duration_seconds_bucket{le="0.1"}`: "2x40", `cfguard_recertification_duration_seconds_bucket{le="+Inf"}`: "2x40",
		`cfguard_recertification_duration_seconds_count`: "2x40", `cfguard_recertification_duration_seconds_sum`: "0.1x40",
		`cfguard_counterfactuals_renewal_pending`: "0x40", `cfguard_counterfactuals_unconfirmed`: "0x40", `cfguard_counterfactuals_renewed_total`: "1x40",
		`cfguard_checkpoint_failing`: "0x40", `cfguard_ledger_write_failing`: "0x40", `cfguard_ledger_write_failure_last_timestamp_seconds`: "0x40", `cfguard_ledger_write_failures_total`: "0x40", `cfguard_checkpoint_failures_total`: "0x40", `cfguard_consumer_topic_mismatch`: "0x40",
		`cfguard_events_pending`: "0x40", `cfguard_events_total{result="published"}`: "10x40", `cfguard_events_total{result="failed"}`: "0x40",
		`cfguard_prequential_records_total`: "64x40", `cfguard_prequential_window_records`: "64x40", `cfguard_prequential_log_loss`: "0.1x40",
		`cfguard_prequential_brier_score`: "0.05x40", `cfguard_prequential_accuracy_ratio`: "0.96x40", `cfguard_prequential_expected_calibration`: "0.02x40",
		`cfguard_prequential_change_statistic`: "3x40", `cfguard_prequential_change_threshold`: "138.2x40", `cfguard_prequential_changes_total`: "0x40",
		`cfguard_prequential_last_change_timestamp_seconds`: "0x40",
		`up`: "1x40", `cfguard_build_info{version="v",revision="r",goversion="go"}`: "1x40",
	}
	for k, v := range change {
		series[k] = v
	}
	var out []string
	for k, v := range series {
		if v == "" {
			continue
		}
		name, labels, _ := strings.Cut(strings.TrimSuffix(k, "}"), "{")
		if labels != "" {
			labels += ","
		}
		out = append(out, fmt.Sprintf("      - series: '%s{%sjob=\"cfguard\",instance=\"a\"}'\n        values: '%s'\n", name, labels, v))
	}
	slices.Sort(out)
	return out
}

// promQL is a panel query as Grafana sends it, its variables replaced: every job and
// instance, a 5-minute rate interval.
func promQL(expr string) string {
	return strings.NewReplacer("$job", ".*", "$instance", ".*", "$__rate_interval", "5m").Replace(expr)
}

// In every healthy state, no panel query gives NaN (a ratio with nothing to divide, a quantile
// of no observations), and every panel shows something or says why it does not (noValue), as
// promtool evaluates the queries over the state's series.
func TestDashboardShowsNumbersInHealthyStates(t *testing.T) {
	promtool := tooltest.Command(t, "apt-get install prometheus", "promtool")
	d := deploytest.LoadDashboard(t)
	var tests strings.Builder
	for _, p := range d.FlatPanels() {
		var absent []string
		for _, tg := range p.Targets {
			q := promQL(tg.Expr)
			fmt.Fprintf(&tests, "      - expr: '(%s) != (%s)' # panel %q %s: NaN\n        eval_time: 30m\n        exp_samples: []\n",
				strings.ReplaceAll(q, "'", "''"), strings.ReplaceAll(q, "'", "''"), p.Title, tg.RefID)
			absent = append(absent, "absent(("+q+"))")
		}
		if p.FieldConfig.Defaults.NoValue == "" && len(absent) > 0 {
			fmt.Fprintf(&tests, "      - expr: '%s' # panel %q: no data\n        eval_time: 30m\n        exp_samples: []\n",
				strings.ReplaceAll(strings.Join(absent, " and on () "), "'", "''"), p.Title)
		}
	}
	dir := t.TempDir()
	names := slices.Sorted(func(yield func(string) bool) {
		for n := range healthyStates {
			if !yield(n) {
				return
			}
		}
	})
	for _, state := range names {
		file := filepath.Join(dir, strings.NewReplacer(" ", "_", ",", "").Replace(state)+".yml")
		text := "rule_files: []\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n" +
			strings.Join(healthyStates[state], "") + "    promql_expr_test:\n" + tests.String()
		if err := os.WriteFile(file, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(promtool, "test", "rules", file).CombinedOutput(); err != nil {
			t.Errorf("state %q: a panel shows NaN or nothing (promtool test rules: %v):\n%s", state, err, out)
		}
	}
}
