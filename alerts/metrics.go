// Package alerts is cfguard's Prometheus metrics and the alerting rules written against them:
// every cfguard_ metric the daemon exports is defined here and nowhere else.
//
// The metrics live in the package of the rules, rather than in a package of their own, because
// the two change together: an alert is only as good as the name it queries, and a rename is safe
// only when the same change moves rules.yml, its promtool tests and the registry. Here one
// package's tests hold all three (every rule's metric is registered, every name follows the
// naming rule, promtool runs the rules' unit tests).
//
// The constructors register on the Registerer they are given (never the default registry; the
// caller registers NewStateCollector's collector) and create every label value of the bounded
// label sets up front, so series exist at 0 from the first scrape and alerts that compare
// against them work before the first event:
//
//   - NewMetrics: what happens (updates, records, events, audits, renewals, checkpoints,
//     exports, registrations) and what only the running process knows (consumer lag);
//   - NewStateCollector: the gauges of the ledger's state, read at each scrape;
//   - RegisterDamaged: damaged counterfactual records, read from the ledger at each scrape;
//   - RegisterLedgerWriteFailures, RegisterEmbeddedBrokerWrites: commits to the ledger and writes
//     of the embedded broker that failed, read at each scrape;
//   - RegisterEmbeddedBrokerConnections: the embedded broker's connections, read at each scrape;
//   - NewHTTPMetrics: the API server's connections, answered requests and shed requests;
//   - NewReplicaMetrics: a replica's place in the posterior log and its share of the CEs;
//   - NewQualityMetrics: the served model's prequential quality and its change detector;
//   - NewRequestMetrics: requests applied before (request ids), skipped and answered from their
//     outcome.
//
// Naming (tested): every name starts with cfguard_; counters, and only they, end in _total; a
// unit, when there is one, is the last word (before _total on a counter: _seconds, _records);
// failed attempts are failures; everything about stored counterfactual explanations is under
// cfguard_counterfactuals.
package alerts

import (
	"fmt"
	"slices"
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
	RecordFailed       RecordResult = "failed"        // in an increment whose update failed
	RecordHeld         RecordResult = "held"          // in an increment whose update was rejected
)

// RecordResults lists every result (the label values created up front).
func RecordResults() []RecordResult {
	return []RecordResult{RecordApplied, RecordDeadLettered, RecordFailed, RecordHeld}
}

// Names of the metrics of NewMetrics and NewStateCollector.
const (
	NamePosteriorKL            = "cfguard_posterior_kl"
	NamePosteriorKLMaxAnchor   = "cfguard_posterior_kl_max_anchor"
	NameKLBudget               = "cfguard_kl_budget"
	NameKLOverBudget           = "cfguard_kl_over_budget"
	NameKLBreachLast           = "cfguard_kl_breach_last_timestamp_seconds"
	NameUpdateFailedLast       = "cfguard_update_failed_last_timestamp_seconds"
	NameCounterfactuals        = "cfguard_counterfactuals"
	NameCounterfactualsDecided = "cfguard_counterfactuals_decided"
	NameBoundMin               = "cfguard_counterfactuals_bound_min"
	NameUpdates                = "cfguard_updates_total"
	NameRecords                = "cfguard_records_total"
	NameRecordsLost            = "cfguard_records_lost_total"
	NameRecordsLostLast        = "cfguard_records_lost_last_timestamp_seconds"
	NameRecertDuration         = "cfguard_recertification_duration_seconds"
	NameConsumerLag            = "cfguard_consumer_lag_records"
	NameConsumerOffsetsRead    = "cfguard_consumer_offsets_read_timestamp_seconds"
	NameLastIngest             = "cfguard_last_ingest_timestamp_seconds"
	NamePosteriorVersion       = "cfguard_posterior_version"
	NameEventsPending          = "cfguard_events_pending"
	NameCheckpointFailures     = "cfguard_checkpoint_failures_total"
	NameCheckpointFailing      = "cfguard_checkpoint_failing"
	NameUnconfirmed            = "cfguard_counterfactuals_unconfirmed"
	NameRenewed                = "cfguard_counterfactuals_renewed_total"
	NameRenewalPending         = "cfguard_counterfactuals_renewal_pending"
	NameMeasured               = "cfguard_counterfactuals_measured_total"
	NameBuildInfo              = "cfguard_build_info"
	NameTopicMismatch          = "cfguard_consumer_topic_mismatch"
	NameEvents                 = "cfguard_events_total"
	NameAudits                 = "cfguard_audits_total"
	NameExportVersion          = "cfguard_export_posterior_version"
	NameExportFailures         = "cfguard_export_failures_total"
	NameRegistrationBatch      = "cfguard_counterfactuals_registration_batch_size"
)

// Names returns every metric name package alerts defines, sorted: the only cfguard_ names a
// daemon's registry holds.
func Names() []string {
	names := []string{
		NamePosteriorKL, NamePosteriorKLMaxAnchor, NameKLBudget, NameKLOverBudget, NameKLBreachLast, NameUpdateFailedLast, NameCounterfactuals, NameCounterfactualsDecided, NameBoundMin,
		NameUpdates, NameRecords, NameRecordsLost, NameRecordsLostLast, NameRecertDuration, NameConsumerLag, NameConsumerOffsetsRead, NameLastIngest, NamePosteriorVersion,
		NameEventsPending, NameCheckpointFailures, NameCheckpointFailing, NameUnconfirmed, NameRenewed,
		NameRenewalPending, NameMeasured, NameBuildInfo, NameTopicMismatch, NameEvents, NameAudits, NameExportVersion,
		NameExportFailures, NameRegistrationBatch, NameDamaged, NameLedgerWriteFailures, NameLedgerWriteFailureLast, NameLedgerWriteFailing, NameBrokerWriteFailing,
		NameBrokerConnections, NameBrokerMaxConnections, NameBrokerConnsClosed,
		NameHTTPConnections, NameHTTPMaxConnections, NameHTTPRequests, NameHTTPRejected,
		NameLogEntry, NameLogTerm, NameLogLag, NameLogStopped, NameLogIgnored, NameLogAppendsLost, NameGenerations, NameEventsRepublish, NameCERepaired,
		NameReplicaUpdater, NameCEPartitions, NameCERebuilding, NameCEBlocked, NameCERequestsApply, NameCERequestsSkip, NameUnauthenticated, NameSettingsDiffer, NameCEStates,
		NameRequestsSkipped, NameRequestsReplayed,
		NamePrequentialRecords, NamePrequentialLogLoss, NamePrequentialBrier, NamePrequentialAccuracy, NamePrequentialECE,
		NamePrequentialWindow, NamePrequentialStatistic, NamePrequentialThreshold, NamePrequentialChanges, NamePrequentialLastChange,
	}
	slices.Sort(names)
	return names
}

// Metrics are one daemon's metrics. Label values come only from certify.Statuses,
// certify.Outcomes and RecordResults, all created at 0 by NewMetrics; the methods refuse others.
// Methods are safe for concurrent use.
//
// The gauges of the ledger's state (posterior version, KL, counts by status, bounds, renewal
// backlog, unconfirmed counterfactuals, pending events, last ingest) are not here:
// StateCollector computes them at each scrape from one consistent snapshot. Metrics holds what
// happens (counters, histograms) and what only the running process knows (consumer lag, a
// failing checkpoint, a reset topic, the exported version).
type Metrics struct {
	updates, records            *prometheus.CounterVec
	recertDuration              prometheus.Histogram
	checkpointFailing           prometheus.Gauge
	checkpointFailures, renewed prometheus.Counter
	topicMismatch               prometheus.Gauge
	events                      *prometheus.CounterVec
	audits, exportFailures      prometheus.Counter
	exportVersion               prometheus.Gauge
	registrationBatch           prometheus.Histogram
	measured                    *prometheus.CounterVec
}

// NewMetrics creates the metrics and registers them on reg. Like promauto, it panics if reg
// already holds metrics of these names (a programming error).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	f := promauto.With(reg)
	gauge := func(name, help string) prometheus.Gauge {
		return f.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	}
	m := &Metrics{
		updates: f.NewCounterVec(prometheus.CounterOpts{Name: NameUpdates,
			Help: "Posterior updates by outcome (promoted, clipped, rejected, failed)."}, []string{"outcome"}),
		records: f.NewCounterVec(prometheus.CounterOpts{Name: NameRecords,
			Help: "Consumed records by result (applied, dead_lettered, failed, held)."}, []string{"result"}),
		recertDuration: f.NewHistogram(prometheus.HistogramOpts{Name: NameRecertDuration,
			Help:    "Time to re-certify every stored counterfactual after an update.",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)}), // 1 ms .. 262 s
		checkpointFailures: f.NewCounter(prometheus.CounterOpts{Name: NameCheckpointFailures,
			Help: "Checkpoints, and on replicas writes of the CE share, that could not be written (ledger.ErrWrite: no space, file size limit, failed fsync); each is retried."}),
		checkpointFailing: gauge(NameCheckpointFailing, "1 while the daemon cannot write its checkpoint (and has stopped consuming) or, on a replica, a write of its CE share, else 0."),
		topicMismatch: gauge(NameTopicMismatch, "1 while ingest is stopped because kafka.topic no longer holds the ledger's offsets "+
			"(deleted and recreated, or records lost by the broker) until an operator confirms with --accept-topic-reset, else 0."),
		renewed: f.NewCounter(prometheus.CounterOpts{Name: NameRenewed,
			Help: "Certificates renewed by the confirmer (re-anchored to the current posterior after their bound lapsed), plus every counterfactual an audit re-anchors (certified ones whose bound still held, and at_risk, invalidated or uncertified ones that enter the set)."}),
		events: f.NewCounterVec(prometheus.CounterOpts{Name: NameEvents,
			Help: "Outbox entries by result of a publish attempt: events, and on replicas CE states: published (acknowledged by the events topic, or the CE state topic), failed (in an attempt that failed, at either topic; they stay in the outbox and are retried with backoff, and counted again each time)."}, []string{"result"}),
		audits:        f.NewCounter(prometheus.CounterOpts{Name: NameAudits, Help: "Full audits completed."}),
		exportVersion: gauge(NameExportVersion, "Posterior version last written to model.export_dir."),
		exportFailures: f.NewCounter(prometheus.CounterOpts{Name: NameExportFailures,
			Help: "Failed writes of the posterior export (retried)."}),
		registrationBatch: f.NewHistogram(prometheus.HistogramOpts{Name: NameRegistrationBatch,
			Help:    "Counterfactuals stored by one ledger write (one fsync) of registrations: concurrent registrations share one.",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128, 256, 512}}),
		measured: f.NewCounterVec(prometheus.CounterOpts{Name: NameMeasured,
			Help: "Monte-Carlo measurements of counterfactuals by the confirmer, by result: kept (written and in force for the posterior current at the write), " +
				"superseded (written, but measured under an older posterior than the current one, a newer one promoted meanwhile or the version the CE became due at, and the verdict does not carry to it), discarded (not written)."},
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
	m.events.WithLabelValues("published")
	m.events.WithLabelValues("failed")
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

// EventsPublished counts n events acknowledged by the events topic.
func (m *Metrics) EventsPublished(n int) { m.events.WithLabelValues("published").Add(float64(n)) }

// PublishFailed counts one failed attempt to publish n outbox events (they stay in the outbox and
// are retried).
func (m *Metrics) PublishFailed(n int) { m.events.WithLabelValues("failed").Add(float64(n)) }

// IncAudits counts one completed full audit.
func (m *Metrics) IncAudits() { m.audits.Inc() }

// Exported sets the posterior version the export directory holds (once its files are durable).
func (m *Metrics) Exported(version uint64) { m.exportVersion.Set(float64(version)) }

// IncExportFailures counts one failed write of the posterior export.
func (m *Metrics) IncExportFailures() { m.exportFailures.Inc() }

// ObserveRegistrationBatch records how many counterfactuals one ledger write of registrations
// stored.
func (m *Metrics) ObserveRegistrationBatch(n int) { m.registrationBatch.Observe(float64(n)) }

// CheckpointFailed counts one checkpoint that could not be written and marks checkpointing as
// failing; CheckpointRecovered clears the mark once a checkpoint is written again.
func (m *Metrics) CheckpointFailed() {
	m.checkpointFailures.Inc()
	m.checkpointFailing.Set(1)
}

// CheckpointRecovered: checkpoints are written again.
func (m *Metrics) CheckpointRecovered() { m.checkpointFailing.Set(0) }

// NameDamaged is the gauge of damaged counterfactual records (ledger.Ledger.Damaged):
// quarantined at start, or found damaged by a read since.
const NameDamaged = "cfguard_counterfactuals_damaged"

// RegisterDamaged registers cfguard_counterfactuals_damaged on reg, read from damaged at
// each scrape.
func RegisterDamaged(reg prometheus.Registerer, damaged func() int) {
	promauto.With(reg).NewGaugeFunc(prometheus.GaugeOpts{Name: NameDamaged,
		Help: "Counterfactual records found damaged on disk: quarantined at start (GET answers 500 until the CE is deleted or registered again) or skipped by a read since."},
		func() float64 { return float64(damaged()) })
}

// The metrics of the ledger's failed commits (ledger.Ledger.WriteFailures).
const (
	NameLedgerWriteFailures    = "cfguard_ledger_write_failures_total"
	NameLedgerWriteFailureLast = "cfguard_ledger_write_failure_last_timestamp_seconds"
	NameLedgerWriteFailing     = "cfguard_ledger_write_failing"
	NameBrokerWriteFailing     = "cfguard_embedded_broker_write_failing"
)

// RegisterEmbeddedBrokerWrites registers cfguard_embedded_broker_write_failing on reg, read at
// each scrape from failing (whether the embedded broker failed to write its data directory within
// the last minute, as /readyz reports).
func RegisterEmbeddedBrokerWrites(reg prometheus.Registerer, failing func() bool) {
	promauto.With(reg).NewGaugeFunc(prometheus.GaugeOpts{Name: NameBrokerWriteFailing,
		Help: "1 within a minute of a write of the embedded broker to its data directory (state_dir/broker) that failed (no space, a read-only file system, too many open files): it refuses the record batches it cannot write. Judged when scraped; absent with kafka.brokers set."},
		func() float64 {
			if failing() {
				return 1
			}
			return 0
		})
}

// The embedded broker's connections (broker.Broker.Connections).
const (
	NameBrokerConnections    = "cfguard_embedded_broker_connections"
	NameBrokerMaxConnections = "cfguard_embedded_broker_max_connections"
	NameBrokerConnsClosed    = "cfguard_embedded_broker_connections_closed_total"
)

// Reasons of NameBrokerConnsClosed: why the embedded broker closed a connection itself.
const (
	BrokerClosedLimit     = "limit"     // at once: kafka.embedded_max_connections were open
	BrokerClosedIdle      = "idle"      // no request for kafka.embedded_idle_timeout (or no answer for it plus the longest hold)
	BrokerClosedPartial   = "partial"   // a request that took longer than kafka.embedded_request_timeout to arrive
	BrokerClosedOversized = "oversized" // a request larger than the broker takes, or than its buffer had left
	BrokerClosedInvalid   = "invalid"   // a request the broker does not take
)

// BrokerConns are the embedded broker's connection counters (broker.ConnStats): open now, the
// limit, and the connections it closed, by reason.
type BrokerConns struct {
	Open, Max                                int
	Limit, Idle, Partial, Oversized, Invalid int64
}

// RegisterEmbeddedBrokerConnections registers cfguard_embedded_broker_connections,
// cfguard_embedded_broker_max_connections and cfguard_embedded_broker_connections_closed_total
// on reg, read from conns at each scrape.
func RegisterEmbeddedBrokerConnections(reg prometheus.Registerer, conns func() BrokerConns) {
	f := promauto.With(reg)
	f.NewGaugeFunc(prometheus.GaugeOpts{Name: NameBrokerConnections,
		Help: "Connections open to the embedded broker (the daemon's, or cfguard broker's), its own process's clients included. At cfguard_embedded_broker_max_connections it closes every new one at once (the daemon's /readyz says so). Absent with kafka.brokers set."},
		func() float64 { return float64(conns().Open) })
	f.NewGaugeFunc(prometheus.GaugeOpts{Name: NameBrokerMaxConnections,
		Help: "The most connections the embedded broker keeps open at once (kafka.embedded_max_connections; cfguard broker --max-connections)."},
		func() float64 { return float64(conns().Max) })
	for _, r := range []struct {
		reason string
		n      func(BrokerConns) int64
	}{
		{BrokerClosedLimit, func(c BrokerConns) int64 { return c.Limit }},
		{BrokerClosedIdle, func(c BrokerConns) int64 { return c.Idle }},
		{BrokerClosedPartial, func(c BrokerConns) int64 { return c.Partial }},
		{BrokerClosedOversized, func(c BrokerConns) int64 { return c.Oversized }},
		{BrokerClosedInvalid, func(c BrokerConns) int64 { return c.Invalid }},
	} {
		f.NewCounterFunc(prometheus.CounterOpts{Name: NameBrokerConnsClosed, ConstLabels: prometheus.Labels{"reason": r.reason},
			Help: "Connections the embedded broker closed itself, by reason: limit (at once, at its connection limit), idle (kafka.embedded_idle_timeout or cfguard broker --idle-timeout without a request), partial (a request slower than kafka.embedded_request_timeout to arrive), oversized, invalid (a request it does not take)."},
			func() float64 { return float64(r.n(conns())) })
	}
}

// RegisterLedgerWriteFailures registers cfguard_ledger_write_failures_total,
// cfguard_ledger_write_failure_last_timestamp_seconds and cfguard_ledger_write_failing on reg,
// read at each scrape from failures (their count and the latest one's time, zero when none) and
// failing (whether /readyz reports one now).
func RegisterLedgerWriteFailures(reg prometheus.Registerer, failures func() (uint64, time.Time), failing func() bool) {
	f := promauto.With(reg)
	f.NewCounterFunc(prometheus.CounterOpts{Name: NameLedgerWriteFailures,
		Help: "Commits to the ledger that failed (no space, file size limit, failed fsync), whichever write they were: a checkpoint, a registration, a deletion, a batch of verdicts."},
		func() float64 { n, _ := failures(); return float64(n) })
	f.NewGaugeFunc(prometheus.GaugeOpts{Name: NameLedgerWriteFailureLast,
		Help: "Unix time of the latest commit to the ledger that failed since the daemon started, 0 if none. A commit that succeeds does not reset it: on a full disk small commits can succeed while larger ones fail."},
		func() float64 {
			if _, at := failures(); !at.IsZero() {
				return float64(at.UnixNano()) / 1e9
			}
			return 0
		})
	f.NewGaugeFunc(prometheus.GaugeOpts{Name: NameLedgerWriteFailing,
		Help: "1 within a minute of a commit to the ledger that failed (what /readyz reports), else 0, judged when scraped."},
		func() float64 {
			if failing() {
				return 1
			}
			return 0
		})
}
