// Package alerts is cfguard's Prometheus metrics and the alerting rules written against them.
//
// NewMetrics registers every metric on the Registerer it is given (never the default registry)
// and creates every label value of the bounded label sets up front, so series exist at 0 from the
// first scrape and alerts that compare against them work before the first event. The rules
// (rules.yml, embedded, see Rules) only reference metrics defined here; a test enforces that, and
// rules_test.yml holds promtool unit tests for every alert.
package alerts

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/cfguard/cfguard/certify"
)

// RecordResult is what became of one consumed record; the label set of cfguard_records_total.
type RecordResult string

// Record results.
const (
	RecordApplied      RecordResult = "applied"       // used in a promoted (or clipped) update
	RecordDeadLettered RecordResult = "dead_lettered" // unparseable or invalid, sent to the dead-letter topic
	RecordSkipped      RecordResult = "skipped"       // deliberately not used (e.g. applied before a restart)
	RecordFailed       RecordResult = "failed"        // in an increment whose update failed
	RecordHeld         RecordResult = "held"          // in an increment whose update was rejected
)

// RecordResults lists every result (the label values created up front).
func RecordResults() []RecordResult {
	return []RecordResult{RecordApplied, RecordDeadLettered, RecordSkipped, RecordFailed, RecordHeld}
}

// Metric names, as the rules reference them.
const (
	NamePosteriorKL          = "cfguard_posterior_kl"
	NamePosteriorKLMaxAnchor = "cfguard_posterior_kl_max_anchor"
	NameKLBudget             = "cfguard_kl_budget"
	NameKLOverBudget         = "cfguard_kl_over_budget"
	NameCounterfactuals      = "cfguard_counterfactuals"
	NameBoundMin             = "cfguard_counterfactual_bound_min"
	NameUpdates              = "cfguard_updates_total"
	NameRecords              = "cfguard_records_total"
	NameRecertDuration       = "cfguard_recertification_duration_seconds"
	NameConsumerLag          = "cfguard_consumer_lag"
	NameLastIngest           = "cfguard_last_ingest_timestamp_seconds"
	NamePosteriorVersion     = "cfguard_posterior_version"
	NameOutboxPending        = "cfguard_outbox_pending"
	NameOutboxPublishErrors  = "cfguard_outbox_publish_errors_total"
	NameCheckpointFailures   = "cfguard_checkpoint_failures_total"
	NameCheckpointFailing    = "cfguard_checkpoint_failing"
	NameUnconfirmed          = "cfguard_ces_unconfirmed"
	NameRenewed              = "cfguard_certificates_renewed_total"
	NameMeasured             = "cfguard_counterfactuals_measured_total"
	NameRenewalBacklog       = "cfguard_renewal_backlog"
	NameBuildInfo            = "cfguard_build_info"
	NameTopicMismatch        = "cfguard_consumer_topic_mismatch"
)

// Metrics are one daemon's metrics. Label values come only from certify.Statuses,
// certify.Outcomes and RecordResults, all created at 0 by NewMetrics; the methods refuse others.
// Methods are safe for concurrent use.
//
// The gauges of the ledger's state (posterior version, KL, counts by status, bounds, renewal
// backlog, last ingest) are not here: StateCollector computes them at each scrape from one
// consistent snapshot. Metrics holds what happens (counters) and what only the running process
// knows (consumer lag, checkpoint failures, outbox).
type Metrics struct {
	consumerLag                               prometheus.Gauge
	updates, records                          *prometheus.CounterVec
	recertDuration                            prometheus.Histogram
	checkpointFailing                         prometheus.Gauge
	outboxErrors, checkpointFailures, renewed prometheus.Counter
	measured                                  *prometheus.CounterVec
	topicMismatch                             prometheus.Gauge
}

// NewMetrics creates the metrics and registers them on reg. Like promauto, it panics if reg
// already holds metrics of these names (a programming error).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	f := promauto.With(reg)
	gauge := func(name, help string) prometheus.Gauge {
		return f.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	}
	m := &Metrics{
		consumerLag: gauge(NameConsumerLag, "Records in the input topic not yet consumed, summed over partitions."),
		updates: f.NewCounterVec(prometheus.CounterOpts{Name: NameUpdates,
			Help: "Posterior updates by outcome (promoted, clipped, rejected, failed)."}, []string{"outcome"}),
		records: f.NewCounterVec(prometheus.CounterOpts{Name: NameRecords,
			Help: "Consumed records by result (applied, dead_lettered, skipped, failed, held)."}, []string{"result"}),
		recertDuration: f.NewHistogram(prometheus.HistogramOpts{Name: NameRecertDuration,
			Help:    "Time to re-certify every stored counterfactual after an update.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)}), // 1 ms .. 262 s
		outboxErrors: f.NewCounter(prometheus.CounterOpts{Name: NameOutboxPublishErrors,
			Help: "Failed attempts to publish outbox events to the events topic (each is retried with backoff)."}),
		checkpointFailures: f.NewCounter(prometheus.CounterOpts{Name: NameCheckpointFailures,
			Help: "Checkpoints that could not be written (ledger.ErrWrite: no space, file size limit, failed fsync); each is retried."}),
		checkpointFailing: gauge(NameCheckpointFailing, "1 while the daemon cannot write its checkpoint and has stopped consuming, else 0."),
		topicMismatch: gauge(NameTopicMismatch, "1 while ingest is stopped because kafka.topic no longer holds the ledger's offsets "+
			"(deleted and recreated, or records lost by the broker) until an operator confirms with --accept-topic-reset, else 0."),
		renewed: f.NewCounter(prometheus.CounterOpts{Name: NameRenewed,
			Help: "Certificates renewed: counterfactuals re-anchored to the current posterior after their bound lapsed, by the confirmer or an audit."}),
		measured: f.NewCounterVec(prometheus.CounterOpts{Name: NameMeasured,
			Help: "Monte-Carlo measurements of counterfactuals by the confirmer, by result: kept (written and in force for the posterior current at the write), " +
				"superseded (written, but a newer posterior was promoted meanwhile and the verdict does not carry to it), discarded (not written)."},
			[]string{"result"}),
	}
	for _, r := range MeasurementResults() {
		m.measured.WithLabelValues(r)
	}
	for _, o := range certify.Outcomes() {
		m.updates.WithLabelValues(string(o))
	}
	for _, r := range RecordResults() {
		m.records.WithLabelValues(string(r))
	}
	return m
}

// SetTopicReset sets cfguard_consumer_topic_mismatch.
func (m *Metrics) SetTopicReset(stopped bool) {
	v := 0.0
	if stopped {
		v = 1
	}
	m.topicMismatch.Set(v)
}

// ObserveRecertification records how long one re-certification took.
func (m *Metrics) ObserveRecertification(took time.Duration) {
	m.recertDuration.Observe(took.Seconds())
}

// AddRenewed counts n renewed certificates.
func (m *Metrics) AddRenewed(n int) { m.renewed.Add(float64(n)) }

// MeasurementResults lists the result label values of cfguard_counterfactuals_measured_total
// (ledger.Measurements): kept / (kept + superseded + discarded) is the fraction of the
// confirmer's Monte-Carlo whose result is not thrown away.
func MeasurementResults() []string { return []string{"kept", "superseded", "discarded"} }

// AddMeasurements counts the confirmer's measurements by what became of them. Negative counts
// are programming errors and count nothing.
func (m *Metrics) AddMeasurements(kept, superseded, discarded int) {
	for i, n := range []int{kept, superseded, discarded} {
		if n > 0 {
			m.measured.WithLabelValues(MeasurementResults()[i]).Add(float64(n))
		}
	}
}

// IncUpdate counts one update outcome. An outcome outside certify.Outcomes is refused and creates
// no series.
func (m *Metrics) IncUpdate(o certify.Outcome) error {
	if !o.Valid() {
		return fmt.Errorf("alerts: unknown update outcome %q", o)
	}
	m.updates.WithLabelValues(string(o)).Inc()
	return nil
}

// AddRecords counts n records with result r. A result outside RecordResults is refused.
func (m *Metrics) AddRecords(r RecordResult, n int) error {
	if n < 0 {
		return fmt.Errorf("alerts: negative record count %d", n)
	}
	for _, known := range RecordResults() {
		if r == known {
			m.records.WithLabelValues(string(r)).Add(float64(n))
			return nil
		}
	}
	return fmt.Errorf("alerts: unknown record result %q", r)
}

// SetConsumerLag sets the total consumer lag in records.
func (m *Metrics) SetConsumerLag(lag int64) { m.consumerLag.Set(float64(lag)) }

// IncOutboxPublishErrors counts one failed attempt to publish outbox events.
func (m *Metrics) IncOutboxPublishErrors() { m.outboxErrors.Inc() }

// CheckpointFailed counts one checkpoint that could not be written and marks checkpointing as
// failing; CheckpointRecovered clears the mark once a checkpoint is written again.
func (m *Metrics) CheckpointFailed() {
	m.checkpointFailures.Inc()
	m.checkpointFailing.Set(1)
}

// CheckpointRecovered: checkpoints are written again.
func (m *Metrics) CheckpointRecovered() { m.checkpointFailing.Set(0) }

// NameLedgerDamaged is the gauge of damaged counterfactual records (ledger.Ledger.Damaged):
// quarantined at start, or found damaged by a read since.
const NameLedgerDamaged = "cfguard_ledger_damaged_records"

// RegisterLedgerDamaged registers cfguard_ledger_damaged_records on reg, read from damaged at
// each scrape.
func RegisterLedgerDamaged(reg prometheus.Registerer, damaged func() int) {
	promauto.With(reg).NewGaugeFunc(prometheus.GaugeOpts{Name: NameLedgerDamaged,
		Help: "Counterfactual records found damaged on disk: quarantined at start (GET answers 500 until the CE is deleted or registered again) or skipped by a read since."},
		func() float64 { return float64(damaged()) })
}
