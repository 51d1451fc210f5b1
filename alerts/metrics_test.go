package alerts

import (
	"context"
	"os/exec"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// gatheredNames returns the metric family names a fresh registry exposes after NewMetrics.
func gatheredNames(t *testing.T) map[string]bool {
	t.Helper()
	reg := prometheus.NewRegistry()
	NewMetrics(reg)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, mf := range mfs {
		names[mf.GetName()] = true
	}
	return names
}

func TestMetricNamesExist(t *testing.T) {
	names := gatheredNames(t)
	for _, want := range []string{NamePosteriorKL, NamePosteriorKLMaxAnchor, NameKLBudget, NameKLOverBudget, NameCounterfactuals,
		NameBoundMin, NameUpdates, NameRecords, NameRecertDuration, NameConsumerLag, NameLastIngest, NamePosteriorVersion,
		NameOutboxPending, NameOutboxPublishErrors, NameCheckpointFailures, NameCheckpointFailing, NameUnconfirmed, NameTopicMismatch} {
		if !names[want] {
			t.Errorf("metric %s not exposed", want)
		}
	}
}

// Every label value of the bounded sets exists at 0 before anything happens.
func TestLabelValuesPrecreated(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	if n := testutil.CollectAndCount(m.counterfactuals); n != 4 {
		t.Errorf("%s has %d series, want 4", NameCounterfactuals, n)
	}
	for _, s := range certify.Statuses() {
		if v := testutil.ToFloat64(m.counterfactuals.WithLabelValues(s.String())); v != 0 {
			t.Errorf("counterfactuals{status=%q} = %v", s, v)
		}
	}
	if n := testutil.CollectAndCount(m.updates); n != len(certify.Outcomes()) {
		t.Errorf("%s has %d series", NameUpdates, n)
	}
	if n := testutil.CollectAndCount(m.records); n != len(RecordResults()) {
		t.Errorf("%s has %d series", NameRecords, n)
	}
	want := `
# HELP cfguard_updates_total Posterior updates by outcome (promoted, clipped, rejected, failed).
# TYPE cfguard_updates_total counter
cfguard_updates_total{outcome="clipped"} 0
cfguard_updates_total{outcome="failed"} 0
cfguard_updates_total{outcome="promoted"} 0
cfguard_updates_total{outcome="rejected"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), NameUpdates); err != nil {
		t.Error(err)
	}
}

func TestMetricsBehaviour(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	budget := certify.KLBudget(0.05)
	m.SetKLBudget(budget)
	steps := []struct {
		step, anchor float64
		over         float64
	}{
		{0.001, 0.05, 0}, {0.001, budget, 0}, {0.001, 0.11, 1}, {0.2, 0.01, 1}, {0.01, 0.01, 0},
	}
	for _, s := range steps {
		m.SetUpdateKL(s.step)
		m.SetMaxAnchorKL(s.anchor)
		if got := testutil.ToFloat64(m.klOverBudget); got != s.over {
			t.Errorf("step %v anchor %v budget %v: over_budget = %v, want %v", s.step, s.anchor, budget, got, s.over)
		}
	}
	m.ObserveRecertification(map[certify.Status]int{certify.Certified: 9, certify.AtRisk: 2}, 0.61, 0.004, 1500*time.Millisecond)
	if v := testutil.ToFloat64(m.counterfactuals.WithLabelValues("at_risk")); v != 2 {
		t.Errorf("at_risk = %v", v)
	}
	if v := testutil.ToFloat64(m.counterfactuals.WithLabelValues("invalidated")); v != 0 {
		t.Errorf("invalidated = %v", v)
	}
	if v := testutil.ToFloat64(m.boundMin); v != 0.61 {
		t.Errorf("bound min = %v", v)
	}
	if v := testutil.ToFloat64(m.maxAnchorKL); v != 0.004 {
		t.Errorf("max anchor KL = %v", v)
	}
	at0 := time.Unix(1600000000, 0)
	if err := m.IncUpdate(certify.OutcomePromoted); err != nil {
		t.Fatal(err)
	}
	if err := m.IncUpdate("exploded"); err == nil {
		t.Error("unknown outcome accepted")
	}
	if n := testutil.CollectAndCount(m.updates); n != len(certify.Outcomes()) {
		t.Errorf("unknown outcome created a series: %d series", n)
	}
	for _, r := range []RecordResult{RecordFailed, RecordHeld, RecordSkipped} {
		if err := m.AddRecords(r, 2, at0); err != nil {
			t.Errorf("%s: %v", r, err)
		}
	}
	if v := testutil.ToFloat64(m.lastIngest); v != 0 {
		t.Errorf("last ingest moved to %v without an applied record", v)
	}
	at := time.Unix(1700000000, 500_000_000)
	if err := m.AddRecords(RecordApplied, 3, at); err != nil {
		t.Fatal(err)
	}
	if err := m.AddRecords(RecordDeadLettered, 1, at.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if v := testutil.ToFloat64(m.lastIngest); v != 1700000000.5 {
		t.Errorf("last ingest = %v, want the applied batch's time", v)
	}
	if err := m.AddRecords("lost", 1, at); err == nil {
		t.Error("unknown result accepted")
	}
	if err := m.AddRecords(RecordSkipped, -1, at); err == nil {
		t.Error("negative count accepted")
	}
	if v := testutil.ToFloat64(m.records.WithLabelValues("applied")); v != 3 {
		t.Errorf("applied = %v", v)
	}
	m.SetConsumerLag(42)
	m.SetPosteriorVersion(7)
	if testutil.ToFloat64(m.consumerLag) != 42 || testutil.ToFloat64(m.version) != 7 {
		t.Error("lag or version not set")
	}
	if n, err := testutil.GatherAndCount(reg, NameRecertDuration); err != nil || n != 1 {
		t.Errorf("histogram: %d, %v", n, err)
	}
}

var metricRef = regexp.MustCompile(`\bcfguard_[a-zA-Z0-9_]+`)

// Every cfguard_ metric an alert expression references must exist in NewMetrics' registry, so a
// rename cannot silently break an alert.
func TestRulesReferenceExistingMetrics(t *testing.T) {
	var file struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(Rules(), &file); err != nil {
		t.Fatal(err)
	}
	names := gatheredNames(t)
	var alerts []string
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			refs := metricRef.FindAllString(r.Expr, -1)
			if len(refs) == 0 {
				t.Errorf("alert %s references no cfguard metric", r.Alert)
			}
			for _, ref := range refs {
				base := ref
				for _, suffix := range []string{"_bucket", "_sum", "_count"} {
					if trimmed := strings.TrimSuffix(ref, suffix); trimmed != ref && names[trimmed] {
						base = trimmed
					}
				}
				if !names[base] {
					t.Errorf("alert %s references %s, which NewMetrics does not register", r.Alert, ref)
				}
			}
			alerts = append(alerts, r.Alert)
		}
	}
	sort.Strings(alerts)
	want := []string{"CfguardCheckpointFailing", "CfguardCounterfactualsAtRisk", "CfguardCounterfactualsInvalidated", "CfguardDeadLetterRateHigh", "CfguardIngestStalled", "CfguardKLOverBudget", "CfguardOutboxBacklog", "CfguardTopicReset"}
	if strings.Join(alerts, ",") != strings.Join(want, ",") {
		t.Errorf("alerts %v, want %v", alerts, want)
	}
}

// promtool checks the rules and runs rules_test.yml. Skipped when promtool is not installed,
// unless CFGUARD_REQUIRE_TOOLS=1.
func TestPromtool(t *testing.T) {
	path := tooltest.Command(t, "apt-get install prometheus", "promtool")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, args := range [][]string{{"check", "rules", "rules.yml"}, {"test", "rules", "rules_test.yml"}} {
		out, err := exec.CommandContext(ctx, path, args...).CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}
