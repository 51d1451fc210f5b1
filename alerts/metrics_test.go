package alerts

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// gathered returns the metric families a fresh registry exposes with every constructor of the
// package, the state collector reading a state that has every optional gauge.
func gathered(t *testing.T) []*dto.MetricFamily {
	t.Helper()
	reg := prometheus.NewRegistry()
	NewMetrics(reg)
	NewReplicaMetrics(reg, []string{"not_successor"}, "cfguard.posterior")
	NewQualityMetrics(reg)
	// Requests' series appear with a route's first answer.
	NewHTTPMetrics(reg, 1).Requests("GET /healthz").WithLabelValues("200").Inc()
	NewRequestMetrics(reg)
	RegisterDamaged(reg, func() int { return 0 })
	RegisterLedgerWriteFailures(reg, func() (uint64, time.Time) { return 0, time.Time{} }, func() bool { return false })
	RegisterEmbeddedBrokerWrites(reg, func() bool { return false })
	RegisterEmbeddedBrokerConnections(reg, func() BrokerConns { return BrokerConns{} })
	reg.MustRegister(NewStateCollector(0.1, func() (State, error) {
		return State{HasUpdate: true, HasBound: true, MinBound: 0.9, HasWaiting: true, Lost: map[string]int64{"cfguard.records": 0}}, nil
	}))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return mfs
}

// gatheredNames is the set of names of gathered.
func gatheredNames(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	for _, mf := range gathered(t) {
		names[mf.GetName()] = true
	}
	return names
}

// Names lists exactly what the constructors register: the daemon's tests rely on it to find a
// metric registered outside this package.
func TestNamesAreWhatIsRegistered(t *testing.T) {
	registered := gatheredNames(t)
	for _, n := range Names() {
		if !registered[n] {
			t.Errorf("Names() lists %s, which no constructor registers", n)
		}
		delete(registered, n)
	}
	for n := range registered {
		t.Errorf("%s is registered but not listed by Names()", n)
	}
}

// namingProblems says how a metric name breaks cfguard's naming rule (see the package doc):
// the cfguard_ prefix, lower snake case, Prometheus' suffixes (_total on counters and only on
// them, no reserved series suffix), base units as the last word, time and lag with their unit,
// and one noun per thing: stored counterfactual explanations are "counterfactuals", first after
// the prefix; failed attempts are "failures".
func namingProblems(name string, typ dto.MetricType) []string {
	var out []string
	bad := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	if !strings.HasPrefix(name, "cfguard_") {
		bad("does not start with cfguard_")
	}
	if !regexp.MustCompile(`^[a-z][a-z0-9]*(_[a-z0-9]+)*$`).MatchString(name) {
		bad("is not lower snake case")
	}
	words := strings.Split(name, "_")[1:]
	if len(words) == 0 {
		return append(out, "has no words after the prefix")
	}
	last := words[len(words)-1]
	switch counter := typ == dto.MetricType_COUNTER; {
	case counter && last != "total":
		bad("is a counter: it must end in _total")
	case !counter && last == "total":
		bad("ends in _total but is a %s", typ)
	}
	if slices.Contains([]string{"bucket", "sum", "count", "created"}, last) {
		bad("ends in _%s, a suffix Prometheus reserves for series of histograms and summaries", last)
	}
	// The unit is the last word, before _total on a counter.
	unitAt := len(words) - 1
	if last == "total" {
		unitAt--
	}
	unit := ""
	if unitAt >= 0 {
		unit = words[unitAt]
	}
	for i, w := range words {
		switch {
		case slices.Contains([]string{"ms", "milliseconds", "us", "microseconds", "ns", "nanoseconds", "minutes", "hours", "days",
			"kb", "kilobytes", "mb", "megabytes", "percent"}, w):
			bad("uses the unit %q: use base units (seconds, bytes, ratio)", w)
		case slices.Contains([]string{"seconds", "bytes", "ratio"}, w) && i != unitAt:
			bad("has the unit %q before the end: a unit is the suffix", w)
		case slices.Contains([]string{"timestamp", "duration", "latency", "age"}, w) && unit != "seconds":
			bad("measures time (%q) without the suffix _seconds", w)
		case w == "lag" && (i == unitAt || !slices.Contains([]string{"records", "seconds", "versions", "bytes"}, unit)):
			bad("is a lag without its unit as the suffix (_records, _seconds, _versions)")
		case slices.Contains([]string{"ce", "ces", "counterfactual", "certificate", "certificates", "explanation", "explanations"}, w):
			bad("says %q: a metric of stored counterfactual explanations says counterfactuals", w)
		case w == "counterfactuals" && i != 0:
			bad("has counterfactuals after another word: it is the subsystem, first after cfguard_")
		case w == "error" || w == "errors":
			bad("says %q: failed attempts are failures", w)
		}
	}
	return out
}

// Every name registered follows the naming rule.
func TestMetricNamesFollowTheNamingRule(t *testing.T) {
	for _, mf := range gathered(t) {
		for _, p := range namingProblems(mf.GetName(), mf.GetType()) {
			t.Errorf("%s %s", mf.GetName(), p)
		}
	}
}

// The naming rule refuses each kind of bad name (so that the test above can fail).
func TestNamingRuleRefusesBadNames(t *testing.T) {
	gauge, counter, histogram := dto.MetricType_GAUGE, dto.MetricType_COUNTER, dto.MetricType_HISTOGRAM
	for _, c := range []struct {
		name string
		typ  dto.MetricType
		want string
	}{
		{"ce_share_lag_versions", gauge, "cfguard_"},
		{"cfguard_Posterior_version", gauge, "snake case"},
		{"cfguard_audits", counter, "must end in _total"},
		{"cfguard_posterior_kl_total", gauge, "ends in _total"},
		{"cfguard_recertification_duration_count", histogram, "reserves"},
		{"cfguard_restore_milliseconds", histogram, "base units"},
		{"cfguard_seconds_behind", gauge, "before the end"},
		{"cfguard_last_ingest_timestamp", gauge, "_seconds"},
		{"cfguard_consumer_lag", gauge, "lag"},
		{"cfguard_posterior_log_lag_entries", gauge, "lag"},
		{"cfguard_ces_unconfirmed", gauge, "counterfactuals"},
		{"cfguard_counterfactual_bound_min", gauge, "counterfactuals"},
		{"cfguard_certificates_renewed_total", counter, "counterfactuals"},
		{"cfguard_ledger_counterfactuals_damaged", gauge, "subsystem"},
		{"cfguard_export_errors_total", counter, "failures"},
	} {
		got := namingProblems(c.name, c.typ)
		if !slices.ContainsFunc(got, func(p string) bool { return strings.Contains(p, c.want) }) {
			t.Errorf("%s (%s): problems %q, want one saying %q", c.name, c.typ, got, c.want)
		}
	}
}

// Every label value of the bounded sets exists at 0 before anything happens.
func TestLabelValuesPrecreated(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
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

// The state gauges are read at each scrape from one State: they say what the State says, the
// bound has no sample without a certified CE, and a failed read fails the scrape.
func TestStateCollector(t *testing.T) {
	budget := certify.KLBudget(0.05)
	var st State
	var readErr error
	reads := 0
	c := NewStateCollector(budget, func() (State, error) { reads++; return st, readErr })
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	gauge := func(name string, labels ...string) (float64, bool) {
		t.Helper()
		return sample(t, reg, name, labels...)
	}
	// Nothing yet: zeros, no bound, budget.
	if v, ok := gauge(NameKLBreachLast); !ok || v != 0 {
		t.Errorf("%s = %v (present %v) before any breach, want 0", NameKLBreachLast, v, ok)
	}
	if v, ok := gauge(NameBoundMin); ok {
		t.Errorf("%s = %v with no certified counterfactual, want no sample", NameBoundMin, v)
	}
	if v, _ := gauge(NameKLBudget); v != budget {
		t.Errorf("budget %v, want %v", v, budget)
	}
	if v, ok := gauge(NameConsumerLag); ok {
		t.Errorf("%s = %v before the topic's offsets were read, want no sample", NameConsumerLag, v)
	}
	cases := []struct {
		kl      float64
		clipped bool
		over    float64
	}{{0.001, false, 0}, {budget, false, 0}, {budget, true, 1}, {budget * 1.01, false, 1}}
	for _, k := range cases {
		st = State{PosteriorVersion: 7, UpdateKL: k.kl, HasUpdate: true, UpdateClipped: k.clipped, MaxAnchorKL: 3, Pending: 4, MinBound: 0.61, HasBound: true,
			Counts: map[certify.Status]int{certify.Certified: 9, certify.AtRisk: 2}, LastIngest: time.Unix(1700000000, 500_000_000),
			LastBreach: time.Unix(1600000000, 0), Waiting: 64, HasWaiting: true}
		if v, _ := gauge(NameKLOverBudget); v != k.over {
			t.Errorf("update KL %v (clipped %v), budget %v: over budget %v, want %v (the anchor KL 3 must not count)", k.kl, k.clipped, budget, v, k.over)
		}
	}
	for name, want := range map[string]float64{NamePosteriorVersion: 7, NamePosteriorKL: budget * 1.01, NamePosteriorKLMaxAnchor: 3,
		NameRenewalPending: 4, NameBoundMin: 0.61, NameLastIngest: 1700000000.5, NameKLBreachLast: 1600000000, NameConsumerLag: 64} {
		if v, ok := gauge(name); !ok || v != want {
			t.Errorf("%s = %v (present %v), want %v", name, v, ok, want)
		}
	}
	for s, want := range map[string]float64{"certified": 9, "at_risk": 2, "invalidated": 0, "uncertified": 0} {
		if v, ok := gauge(NameCounterfactuals, "status", s); !ok || v != want {
			t.Errorf("counterfactuals{status=%q} = %v (present %v), want %v", s, v, ok, want)
		}
	}
	if v, ok := gauge(NameBuildInfo); !ok || v != 1 {
		t.Errorf("%s = %v (present %v), want 1", NameBuildInfo, v, ok)
	}
	before := reads
	readErr = errors.New("ledger is closed")
	if _, err := reg.Gather(); err == nil || !strings.Contains(err.Error(), "ledger is closed") {
		t.Errorf("a failed state read gave scrape error %v", err)
	}
	if reads != before+1 {
		t.Errorf("one scrape read the state %d times, want once", reads-before)
	}
}

func TestMetricsBehaviour(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	m.ObserveRecertification(1500 * time.Millisecond)
	if err := m.IncUpdate(certify.OutcomePromoted); err != nil {
		t.Fatal(err)
	}
	if err := m.IncUpdate("exploded"); err == nil {
		t.Error("unknown outcome accepted")
	}
	if n := testutil.CollectAndCount(m.updates); n != len(certify.Outcomes()) {
		t.Errorf("unknown outcome created a series: %d series", n)
	}
	for _, r := range []RecordResult{RecordFailed, RecordHeld, RecordDeadLettered, RecordApplied, RecordApplied} {
		if err := m.AddRecords(r, 2); err != nil {
			t.Errorf("%s: %v", r, err)
		}
	}
	if err := m.AddRecords("lost", 1); err == nil {
		t.Error("unknown result accepted")
	}
	if err := m.AddRecords(RecordDeadLettered, -1); err == nil {
		t.Error("negative count accepted")
	}
	if v := testutil.ToFloat64(m.records.WithLabelValues("applied")); v != 4 {
		t.Errorf("applied = %v", v)
	}
	m.AddRenewed(3)
	m.AddRenewed(0)
	if v := testutil.ToFloat64(m.renewed); v != 3 {
		t.Errorf("renewed = %v", v)
	}
	m.AddMeasurements(5, 2, 1)
	m.AddMeasurements(1, 0, -1)
	for r, want := range map[string]float64{"kept": 6, "superseded": 2, "discarded": 1} {
		if v := testutil.ToFloat64(m.measured.WithLabelValues(r)); v != want {
			t.Errorf("measured{result=%q} = %v, want %v", r, v, want)
		}
	}
	if n, err := testutil.GatherAndCount(reg, NameRecertDuration); err != nil || n != 1 {
		t.Errorf("histogram: %d, %v", n, err)
	}
}

// Every cfguard_ metric an alert expression references must exist in this package's registry, so
// a rename cannot silently break an alert (daemon's tests check the same against a running
// daemon's registry).
func TestRulesReferenceExistingMetrics(t *testing.T) {
	refs, err := RuleMetrics()
	if err != nil {
		t.Fatal(err)
	}
	names := gatheredNames(t)
	var alerts []string
	for alert, metrics := range refs {
		if len(metrics) == 0 {
			t.Errorf("alert %s references no cfguard metric", alert)
		}
		for _, ref := range metrics {
			if !names[ref] {
				t.Errorf("alert %s references %s, which package alerts does not register", alert, ref)
			}
		}
		alerts = append(alerts, alert)
	}
	sort.Strings(alerts)
	want := []string{"CfguardCheckpointFailing", "CfguardCounterfactualsAtRisk", "CfguardCounterfactualsInvalidated", "CfguardCounterfactualsNotCaughtUp", "CfguardDeadLetterRateHigh", "CfguardDown",
		"CfguardIngestStalled", "CfguardKLOverBudget", "CfguardModelQualityDegraded", "CfguardOutboxBacklog", "CfguardPosteriorLogBehind", "CfguardPosteriorLogRefused", "CfguardPosteriorLogStopped",
		"CfguardRecordsLost", "CfguardRenewalBehind", "CfguardReplicaSettingsDiffer", "CfguardReplicationUnauthenticated", "CfguardTopicReset",
		"CfguardUpdatesFailing"}
	if strings.Join(alerts, ",") != strings.Join(want, ",") {
		t.Errorf("alerts %v, want %v", alerts, want)
	}
}

// Every alert links a section of docs/RUNBOOK.md that exists, named after the alert.
func TestRunbookSections(t *testing.T) {
	var file struct {
		Groups []struct {
			Rules []struct {
				Alert       string            `yaml:"alert"`
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(Rules(), &file); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile("../docs/RUNBOOK.md")
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, line := range strings.Split(string(doc), "\n") {
		if h, ok := strings.CutPrefix(line, "## "); ok {
			anchors[strings.ToLower(strings.TrimSpace(h))] = true
		}
	}
	const base = "https://github.com/cfguard/cfguard/blob/main/docs/RUNBOOK.md#"
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			url := r.Annotations["runbook_url"]
			anchor, ok := strings.CutPrefix(url, base)
			if !ok || anchor != strings.ToLower(r.Alert) {
				t.Errorf("alert %s: runbook_url %q, want %s%s", r.Alert, url, base, strings.ToLower(r.Alert))
				continue
			}
			if !anchors[anchor] {
				t.Errorf("alert %s: docs/RUNBOOK.md has no section \"## %s\"", r.Alert, r.Alert)
			}
		}
	}
}

// grepAlternation is several metric names written as one grep -E pattern, cfguard_a_(b|c_total):
// each alternative, after the common prefix, must name a whole metric.
var grepAlternation = regexp.MustCompile(`\b(cfguard_[a-z0-9_]*)\(([a-z0-9_|]+)\)`)

// metricMentions returns, in order, the cfguard_ names text mentions that are not metrics in
// known (a histogram's series, _bucket, _sum or _count, count as the histogram), with the line
// each is on. A grep alternation is expanded into the names it stands for.
func metricMentions(text string, known map[string]bool) []string {
	var out []string
	for i, line := range strings.Split(text, "\n") {
		var refs []string
		for _, m := range grepAlternation.FindAllStringSubmatch(line, -1) {
			for _, alt := range strings.Split(m[2], "|") {
				refs = append(refs, m[1]+alt)
			}
		}
		refs = append(refs, metricRef.FindAllString(grepAlternation.ReplaceAllString(line, " "), -1)...)
		for _, ref := range refs {
			if !known[family(ref)] {
				out = append(out, fmt.Sprintf("line %d: %s", i+1, ref))
			}
		}
	}
	return out
}

// Every cfguard_ name that the runbook, the rules file (expressions, descriptions, comments), the
// README, the Grafana dashboard and the docs that describe cfguard as built mention is a metric
// the daemon registers, so that a command an operator copies queries something that exists.
// docs/DESIGN.md is left out: it also names metrics that were designed and not built, as such.
func TestDocsNameOnlyRegisteredMetrics(t *testing.T) {
	known := gatheredNames(t)
	// The check can fail: unknown names whole, in an alternation, and a prefix standing for a
	// name; a histogram's series and an alternation of whole names pass.
	text := "rate(cfguard_recertification_duration_seconds_bucket[5m]) cfguard_ces_unconfirmed\n" +
		"grep -E 'cfguard_(renewal_backlog|events_pending)' | grep -E 'cfguard_counterfactuals_(unconfirmed|renewed_total)'\n" +
		"grep cfguard_consumer_lag"
	if got, want := strings.Join(metricMentions(text, known), ", "), "line 1: cfguard_ces_unconfirmed, line 2: cfguard_renewal_backlog, line 3: cfguard_consumer_lag"; got != want {
		t.Errorf("the check finds %q, want %q", got, want)
	}
	files := []string{"../docs/RUNBOOK.md", "rules.yml", "rules_test.yml", "../README.md", "../docs/GLOSSARY.md", "../docs/MATHS.md",
		"../docs/DEPLOY.md", "../docs/BENCHMARKS.md", "../docs/METRICS.md", "../docs/OPERATIONS.md", "../docs/API.md",
		"../docs/CLI.md", "../docs/CONFIGURATION.md", "../docs/REPLICAS.md", "../docs/DEVELOPMENT.md",
		"../deploy/grafana/cfguard.json"}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if f == "../docs/RUNBOOK.md" && len(metricRef.FindAllString(string(b), -1)) == 0 {
			t.Fatalf("%s mentions no cfguard_ metric", f)
		}
		for _, m := range metricMentions(string(b), known) {
			t.Errorf("%s %s is not a metric the daemon registers (alerts.Names)", f, m)
		}
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
