package alerts

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/cfguard/cfguard/certify"
)

// sample is the value of the one series of name with the given label pairs in reg's gather (a
// gauge's, a counter's, or a histogram's sum), and whether there is one.
func sample(t *testing.T, reg prometheus.Gatherer, name string, labels ...string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				if !slices.ContainsFunc(m.GetLabel(), func(lp *dto.LabelPair) bool {
					return lp.GetName() == labels[i] && lp.GetValue() == labels[i+1]
				}) {
					continue metrics
				}
			}
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				return m.GetCounter().GetValue(), true
			case dto.MetricType_HISTOGRAM:
				return m.GetHistogram().GetSampleSum(), true
			default:
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

// want checks name{labels} == v in reg.
func want(t *testing.T, reg prometheus.Gatherer, v float64, name string, labels ...string) {
	t.Helper()
	if got, ok := sample(t, reg, name, labels...); !ok || got != v {
		t.Errorf("%s%v = %v (present %v), want %v", name, labels, got, ok, v)
	}
}

// Every bounded label value the alert rules and dashboards compare against exists at 0 from the
// start (cfguard_events_total{result="failed"} feeds CfguardOutboxBacklog), not only those
// TestLabelValuesPrecreated covers.
func TestEveryBoundedLabelValueStartsAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	NewMetrics(reg)
	NewHTTPMetrics(reg, 8)
	NewReplicaMetrics(reg, []string{"not_successor", "invalid"}, "cfguard.posterior", "cfguard.ces")
	for _, c := range []struct{ name, label, value string }{
		{NameEvents, "result", "published"}, {NameEvents, "result", "failed"},
		{NameMeasured, "result", "kept"}, {NameMeasured, "result", "superseded"}, {NameMeasured, "result", "discarded"},
		{NameRecords, "result", "dead_lettered"}, {NameRecords, "result", "applied"},
		{NameHTTPRejected, "route", "predict"}, {NameHTTPRejected, "route", "explain"},
		{NameLogIgnored, "reason", "not_successor"}, {NameLogIgnored, "reason", "invalid"},
		{NameUnauthenticated, "topic", "cfguard.posterior"}, {NameUnauthenticated, "topic", "cfguard.ces"},
		{NameCEStates, "result", "written"}, {NameCEStates, "result", "restored"}, {NameCEStates, "result", "not_used"},
		{NameCEStates, "result", "invalid"}, {NameCEStates, "result", "too_large"}, {NameCEStates, "result", "fenced"},
	} {
		want(t, reg, 0, c.name, c.label, c.value)
	}
	want(t, reg, 8, NameHTTPMaxConnections)
	for _, name := range []string{NameCEPartitions, NameCERebuilding, NameCEBlocked} {
		want(t, reg, 0, name)
	}
}

// The methods of Metrics move exactly the series they name, by what they are given.
func TestMetricsMethodsMoveTheirSeries(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	m.SetTopicReset(true)
	want(t, reg, 1, NameTopicMismatch)
	m.SetTopicReset(false)
	want(t, reg, 0, NameTopicMismatch)
	m.CheckpointFailed()
	m.CheckpointFailed()
	want(t, reg, 2, NameCheckpointFailures)
	want(t, reg, 1, NameCheckpointFailing)
	m.CheckpointRecovered()
	want(t, reg, 0, NameCheckpointFailing)
	want(t, reg, 2, NameCheckpointFailures)
	m.EventsPublished(3)
	m.PublishFailed(2)
	want(t, reg, 3, NameEvents, "result", "published")
	want(t, reg, 2, NameEvents, "result", "failed")
	m.IncAudits()
	want(t, reg, 1, NameAudits)
	want(t, reg, 0, NameExportFailures)
	m.IncExportFailures()
	m.IncExportFailures()
	want(t, reg, 2, NameExportFailures)
	want(t, reg, 1, NameAudits)
	m.Exported(42)
	m.Exported(43)
	want(t, reg, 43, NameExportVersion)
	m.ObserveRegistrationBatch(5)
	m.ObserveRegistrationBatch(7)
	want(t, reg, 12, NameRegistrationBatch) // the histogram's sum
	m.ObserveRecertification(1500 * time.Millisecond)
	want(t, reg, 1.5, NameRecertDuration) // seconds
	if err := m.AddRecords(RecordHeld, 0); err != nil {
		t.Errorf("AddRecords(held, 0) = %v, want nil: zero records is a count", err)
	}
	want(t, reg, 0, NameRecords, "result", "held")
}

// The scrape-time functions report what their sources say when scraped: counts, a time in Unix
// seconds with its fraction (0 when there is none), and 1 or 0 for a failing flag.
func TestScrapeTimeFunctions(t *testing.T) {
	var (
		damaged  = 3
		failures uint64
		at       time.Time
		failing  bool
		broker   bool
	)
	reg := prometheus.NewRegistry()
	RegisterDamaged(reg, func() int { return damaged })
	RegisterLedgerWriteFailures(reg, func() (uint64, time.Time) { return failures, at }, func() bool { return failing })
	RegisterEmbeddedBrokerWrites(reg, func() bool { return broker })
	want(t, reg, 3, NameDamaged)
	want(t, reg, 0, NameLedgerWriteFailures)
	want(t, reg, 0, NameLedgerWriteFailureLast)
	want(t, reg, 0, NameLedgerWriteFailing)
	want(t, reg, 0, NameBrokerWriteFailing)
	damaged, failures, at, failing, broker = 5, 7, time.Unix(1700000000, 500_000_000), true, true
	want(t, reg, 5, NameDamaged)
	want(t, reg, 7, NameLedgerWriteFailures)
	want(t, reg, 1700000000.5, NameLedgerWriteFailureLast)
	want(t, reg, 1, NameLedgerWriteFailing)
	want(t, reg, 1, NameBrokerWriteFailing)
}

// Each of the embedded broker's connection series reads its own counter: every counter gets a
// value no other has.
func TestBrokerConnectionSeriesReadTheirOwnCounter(t *testing.T) {
	c := BrokerConns{Open: 3, Max: 1024, Limit: 5, Idle: 6, Partial: 7, Oversized: 8, Invalid: 9}
	reg := prometheus.NewRegistry()
	RegisterEmbeddedBrokerConnections(reg, func() BrokerConns { return c })
	want(t, reg, 3, NameBrokerConnections)
	want(t, reg, 1024, NameBrokerMaxConnections)
	for reason, v := range map[string]float64{BrokerClosedLimit: 5, BrokerClosedIdle: 6, BrokerClosedPartial: 7, BrokerClosedOversized: 8, BrokerClosedInvalid: 9} {
		want(t, reg, v, NameBrokerConnsClosed, "reason", reason)
	}
	c.Open, c.Limit = 4, 50
	want(t, reg, 4, NameBrokerConnections)
	want(t, reg, 50, NameBrokerConnsClosed, "reason", BrokerClosedLimit)
}

// Each state gauge reads its own field of State: every field gets a value no other has.
func TestStateGaugesReadTheirOwnField(t *testing.T) {
	budget := 0.2
	st := State{PosteriorVersion: 11, UpdateKL: 0.1, HasUpdate: true, MaxAnchorKL: 3,
		Counts:  map[certify.Status]int{certify.Certified: 20, certify.AtRisk: 21, certify.Invalidated: 22, certify.Uncertified: 23},
		Decided: map[certify.Status]int{certify.Certified: 10, certify.AtRisk: 11, certify.Invalidated: 12},
		Pending: 4, Unconfirmed: 5, OutboxPending: 6, MinBound: 0.75, HasBound: true,
		LastIngest: time.Unix(1700000001, 0), LastBreach: time.Unix(1700000002, 0), LastFailed: time.Unix(1700000003, 500_000_000),
		Waiting: 64, HasWaiting: true, WaitingAt: time.Unix(1700000004, 0),
		Lost:   map[string]int64{"cfguard.records": 9, "cfguard.ces": 0},
		LostAt: map[string]time.Time{"cfguard.records": time.Unix(1700000005, 0)},
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(NewStateCollector(budget, func() (State, error) { return st, nil }))
	for name, v := range map[string]float64{NamePosteriorVersion: 11, NamePosteriorKL: 0.1, NamePosteriorKLMaxAnchor: 3, NameKLOverBudget: 0,
		NameRenewalPending: 4, NameUnconfirmed: 5, NameEventsPending: 6, NameBoundMin: 0.75, NameLastIngest: 1700000001,
		NameKLBreachLast: 1700000002, NameUpdateFailedLast: 1700000003.5, NameConsumerLag: 64, NameConsumerOffsetsRead: 1700000004} {
		want(t, reg, v, name)
	}
	for status, v := range map[string]float64{"certified": 20, "at_risk": 21, "invalidated": 22, "uncertified": 23} {
		want(t, reg, v, NameCounterfactuals, "status", status)
	}
	for status, v := range map[string]float64{"certified": 10, "at_risk": 11, "invalidated": 12, "uncertified": 0} {
		want(t, reg, v, NameCounterfactualsDecided, "status", status)
	}
	want(t, reg, 9, NameRecordsLost, "topic", "cfguard.records")
	want(t, reg, 0, NameRecordsLost, "topic", "cfguard.ces")
	want(t, reg, 1700000005, NameRecordsLostLast, "topic", "cfguard.records")
	want(t, reg, 0, NameRecordsLostLast, "topic", "cfguard.ces")
	// cfguard_records_lost_total is a counter (rate() and increase() apply to it).
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == NameRecordsLost && mf.GetType() != dto.MetricType_COUNTER {
			t.Errorf("%s is a %s, want a counter", NameRecordsLost, mf.GetType())
		}
	}
	// Before the first update there is no breach, whatever UpdateKL holds.
	st = State{UpdateKL: 1, UpdateClipped: true}
	want(t, reg, 0, NameKLOverBudget)
}

// The prequential gauges and counters each export their own field of the last Set, whole.
func TestQualityMetricsExportEachField(t *testing.T) {
	reg := prometheus.NewRegistry()
	q := NewQualityMetrics(reg)
	q.Set(Prequential{Records: 100, Window: 50, LogLoss: 0.5, Brier: 0.25, Accuracy: 0.9, ECE: 0.05,
		Statistic: 1.5, Threshold: 7, Changes: 2, LastChange: 1700000000.5})
	for name, v := range map[string]float64{NamePrequentialRecords: 100, NamePrequentialWindow: 50, NamePrequentialLogLoss: 0.5,
		NamePrequentialBrier: 0.25, NamePrequentialAccuracy: 0.9, NamePrequentialECE: 0.05, NamePrequentialStatistic: 1.5,
		NamePrequentialThreshold: 7, NamePrequentialChanges: 2, NamePrequentialLastChange: 1700000000.5} {
		want(t, reg, v, name)
	}
}

// The HTTP and replica metrics: a route's counter is its own, and each partition gauge reads the
// function set for it.
func TestHTTPAndReplicaSeries(t *testing.T) {
	reg := prometheus.NewRegistry()
	h := NewHTTPMetrics(reg, 3)
	h.Rejected(RouteExplain).Inc()
	want(t, reg, 1, NameHTTPRejected, "route", "explain")
	want(t, reg, 0, NameHTTPRejected, "route", "predict")
	r := NewReplicaMetrics(reg, nil)
	r.SetPartitionsOwned(func() int { return 6 })
	r.SetRebuilding(func() int { return 2 })
	r.SetBlocked(func() int { return 1 })
	want(t, reg, 6, NameCEPartitions)
	want(t, reg, 2, NameCERebuilding)
	want(t, reg, 1, NameCEBlocked)
}

// RuleMetrics lists an alert's metrics once each, in order of first use; family takes a
// histogram's series to the histogram and leaves a name whose base is no metric alone; Rules
// gives the caller a copy.
func TestRuleMetricsAndFamily(t *testing.T) {
	refs, err := RuleMetrics()
	if err != nil {
		t.Fatal(err)
	}
	for alert, w := range map[string][]string{
		"CfguardIngestStalled": {"cfguard_last_ingest_timestamp_seconds", "cfguard_consumer_lag_records",
			"cfguard_consumer_offsets_read_timestamp_seconds", "cfguard_replication_settings_differ"},
		"CfguardOutboxBacklog": {"cfguard_events_pending", "cfguard_events_total"},
	} {
		if !slices.Equal(refs[alert], w) {
			t.Errorf("RuleMetrics()[%s] = %v, want %v", alert, refs[alert], w)
		}
	}
	for in, w := range map[string]string{
		"cfguard_recertification_duration_seconds_bucket": "cfguard_recertification_duration_seconds",
		"cfguard_recertification_duration_seconds_sum":    "cfguard_recertification_duration_seconds",
		"cfguard_recertification_duration_seconds_count":  "cfguard_recertification_duration_seconds",
		"cfguard_no_such_metric_count":                    "cfguard_no_such_metric_count",
	} {
		if got := family(in); got != w {
			t.Errorf("family(%s) = %s, want %s", in, got, w)
		}
	}
	b := Rules()
	orig := string(b)
	clear(b)
	if string(Rules()) != orig || !strings.Contains(orig, "groups:") {
		t.Error("Rules() shares its bytes with the caller")
	}
}

// The request counters: the result values are the ledger's request outcomes (ledger.Outcome*,
// written out here: alerts cannot import ledger), and a count that is not positive counts
// nothing and does not panic (a counter cannot go down).
func TestRequestMetricsValuesAndCounts(t *testing.T) {
	if got, w := RequestResults(), []string{"stored", "same", "exists", "refused", "deleted", "absent"}; !slices.Equal(got, w) {
		t.Errorf("RequestResults() = %v, want %v", got, w)
	}
	reg := prometheus.NewRegistry()
	m := NewRequestMetrics(reg)
	m.Skipped("register", -1)
	m.Skipped("register", 0)
	want(t, reg, 0, NameRequestsSkipped, "kind", "register")
	if n := testutil.CollectAndCount(m.skipped); n != 2 {
		t.Errorf("%s has %d series, want 2", NameRequestsSkipped, n)
	}
}
