package alerts

import (
	"runtime"
	"runtime/debug"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/certify"
)

// State is what the state gauges report. Every field comes from one consistent snapshot of the
// ledger, so that one scrape never mixes two posterior versions.
type State struct {
	PosteriorVersion uint64
	// UpdateKL is the last update's KL(q_new || q_prev) (HasUpdate false before the first);
	// UpdateClipped says it was clipped to the budget (certify.on_breach: clip), a breach whose
	// recorded KL is within the budget.
	UpdateKL      float64
	HasUpdate     bool
	UpdateClipped bool
	// MaxAnchorKL is the largest KL(q_now || q_anchor) over anchors stored CEs refer to.
	MaxAnchorKL float64
	Counts      map[certify.Status]int
	// Decided counts, by status, the CEs whose status is decided under the current posterior
	// (backed by a bound that holds: a certificate that has not lapsed, a verdict that carries);
	// Counts minus Decided are undecided.
	Decided map[certify.Status]int
	// Pending is the renewal backlog: certified CEs whose bound has lapsed.
	Pending int
	// Unconfirmed: CEs waiting for a measurement under the current posterior; OutboxPending:
	// events written to the ledger's outbox and not yet acknowledged by the events topic.
	Unconfirmed, OutboxPending int
	// MinBound is the smallest Theorem 1 bound that holds (>= 1/2) over certified CEs; HasBound is
	// false when there is none (the gauge then has no sample).
	MinBound float64
	HasBound bool
	// LastIngest is when records were last applied (zero before the first: the gauge reads 0).
	LastIngest time.Time
	// LastBreach is when an update last exceeded the KL budget, whatever certify.on_breach did
	// with it (zero when none is known: the gauge reads 0). A breach is an event: this time, not
	// the last update's KL, is what says whether one happened lately.
	LastBreach time.Time
	// LastFailed is when an update last failed (a loss that is not finite, an update the solver
	// refused; zero when the ledger knows none: the gauge reads 0; it keeps the newest beyond its
	// KL history), dated as the KL history dates it: a replica replaying the log dates it by the
	// entry's record, not by when it replayed it.
	LastFailed time.Time
	// Waiting is the number of records in the input topic not yet applied: the topic's high
	// watermarks, as last read, past the ledger's offsets (stream.Waiting). HasWaiting is false
	// until the topic's offsets have been read once (the gauge then has no sample).
	Waiting    int64
	HasWaiting bool
	// WaitingAt is when the input topic's offsets were last read (zero before the first: the
	// gauge reads 0). While reads fail Waiting keeps the last count, which says nothing new.
	WaitingAt time.Time
	// Lost counts, by topic, the records the broker deleted (its retention) before cfguard read
	// them, as the ledger keeps the count: the input topic's that this daemon's consumer read
	// past, and on a replica the CE topic's. Stored with the offsets that pass them, they
	// survive restarts.
	Lost map[string]int64
	// LostAt is, by topic, when the ledger last counted such records (a topic with none has
	// none): a loss is an event with a time, which CfguardRecordsLost pages on for an hour
	// whether it was found at a start after a long outage or while running.
	LostAt map[string]time.Time
}

// StateCollector is a prometheus.Collector that reads State at each scrape, as Prometheus' own
// collectors read the process they describe: the state gauges are true from the first scrape
// after a start and right after any change, with no bookkeeping to go stale. A failed read makes
// the scrape fail (an invalid metric), which Prometheus reports as the target being down, rather
// than serving numbers that are not known.
type StateCollector struct {
	read   func() (State, error)
	budget float64

	version, updateKL, maxAnchorKL, klBudget, overBudget, boundMin, lastIngest, backlog, build *prometheus.Desc
	unconfirmed, outbox, lastBreach, lastFailed, waiting, waitingAt, lost, lostAt              *prometheus.Desc
	counts, decided                                                                            *prometheus.Desc
	buildLabels                                                                                []string
}

// NewStateCollector reads the state with read; budget is the update KL budget (0.5 - delta)^2 / 2.
func NewStateCollector(budget float64, read func() (State, error)) *StateCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, nil)
	}
	return &StateCollector{read: read, budget: budget,
		version:     d(NamePosteriorVersion, "Version of the current posterior."),
		updateKL:    d(NamePosteriorKL, "KL(q_new || q_prev) of the last posterior update (nats, summed over parameters)."),
		maxAnchorKL: d(NamePosteriorKLMaxAnchor, "Largest KL(q_now || q_anchor) over anchor posteriors that stored counterfactuals refer to (renewals keep it small; not an alert by itself)."),
		klBudget:    d(NameKLBudget, "KL budget (0.5 - delta)^2 / 2 of one update, under which Theorem 1 keeps a delta-safe counterfactual valid."),
		overBudget:  d(NameKLOverBudget, "1 while the last update breached the KL budget (its KL over it, or clipped to it: certify.on_breach says what was done), else 0."),
		lastBreach:  d(NameKLBreachLast, "Unix time of the last update whose KL exceeded the KL budget, promoted, clipped or rejected (0 when the ledger knows none: it keeps the newest breach beyond its KL history)."),
		lastFailed:  d(NameUpdateFailedLast, "Unix time of the last update that failed, its records consumed and not learned (0 when the ledger knows none: it keeps the newest failure beyond its KL history)."),
		boundMin:    d(NameBoundMin, "Smallest Theorem 1 lower bound on p(y'|x') that holds (>= 1/2) over certified counterfactuals (no sample when there is none)."),
		lastIngest:  d(NameLastIngest, "Unix time at which records were last applied (0 until the first)."),
		waiting: d(NameConsumerLag, "Records in the input topic not yet applied, summed over partitions: the topic's high watermarks, as last read, "+
			"past the offsets the ledger has checkpointed (no sample until the topic's offsets have been read once)."),
		waitingAt: d(NameConsumerOffsetsRead, "Unix time at which the input topic's offsets were last read (0 until the first): "+
			"while reads fail, cfguard_consumer_lag_records keeps the last count."),
		backlog:     d(NameRenewalPending, "Certified counterfactuals whose bound has lapsed, waiting to be renewed or judged by Monte-Carlo."),
		unconfirmed: d(NameUnconfirmed, "Counterfactuals waiting for a Monte-Carlo measurement under the current posterior (lapsed certificates, and at_risk or invalidated ones whose last verdict is older)."),
		outbox: d(NameEventsPending, "Events written to the ledger's outbox and not yet acknowledged by the events topic; on a replica, also the CE states "+
			"waiting for the CE state topic."),
		counts: d(NameCounterfactuals, "Stored counterfactuals by status (certified, at_risk, invalidated, uncertified), decided or not.", "status"),
		decided: d(NameCounterfactualsDecided, "Stored counterfactuals whose status is decided under the current posterior, by status: certified with a bound that holds, "+
			"at_risk or invalidated with a Monte-Carlo verdict that carries to it (the API's decided: true; uncertified is never decided). "+
			"cfguard_counterfactuals minus this gauge are the undecided ones: lapsed certificates, verdicts kept by hysteresis or that no longer carry.", "status"),
		lost: d(NameRecordsLost, "Records the broker deleted (the topic's retention) before cfguard read them, by topic: the input topic's were never learned from, "+
			"the CE topic's registrations and deletions were never applied (CfguardRecordsLost). Kept in the ledger: a restart does not reset it.", "topic"),
		lostAt: d(NameRecordsLostLast, "Unix time at which the ledger last counted records of the topic lost (cfguard_records_lost_total; 0 when it never did). "+
			"Kept in the ledger: CfguardRecordsLost fires for an hour after it.", "topic"),
		build:       d(NameBuildInfo, "Always 1: the cfguard build (module version, VCS revision, Go version).", "version", "revision", "goversion"),
		buildLabels: buildLabels(),
	}
}

func buildLabels() []string {
	version, revision := "unknown", "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		if bi.Main.Version != "" {
			version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				revision = s.Value
			}
		}
	}
	return []string{version, revision, runtime.Version()}
}

// Describe implements prometheus.Collector.
func (c *StateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.version, c.updateKL, c.maxAnchorKL, c.klBudget, c.overBudget, c.boundMin, c.lastIngest, c.backlog, c.counts, c.build, c.unconfirmed, c.outbox, c.lastBreach, c.lastFailed, c.decided, c.waiting, c.waitingAt, c.lost, c.lostAt} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: one read of the state, every gauge from it.
func (c *StateCollector) Collect(ch chan<- prometheus.Metric) {
	g := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	g(c.build, 1, c.buildLabels...)
	g(c.klBudget, c.budget)
	s, err := c.read()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.version, err)
		return
	}
	g(c.version, float64(s.PosteriorVersion))
	over := 0.0
	if s.HasUpdate && (s.UpdateKL > c.budget || s.UpdateClipped) {
		over = 1
	}
	g(c.updateKL, s.UpdateKL)
	g(c.overBudget, over)
	g(c.maxAnchorKL, s.MaxAnchorKL)
	for _, st := range certify.Statuses() {
		g(c.counts, float64(s.Counts[st]), st.String())
		g(c.decided, float64(s.Decided[st]), st.String())
	}
	g(c.backlog, float64(s.Pending))
	g(c.unconfirmed, float64(s.Unconfirmed))
	g(c.outbox, float64(s.OutboxPending))
	if s.HasBound {
		g(c.boundMin, s.MinBound)
	}
	unix := func(t time.Time) float64 {
		if t.IsZero() {
			return 0
		}
		return float64(t.UnixNano()) / 1e9
	}
	g(c.lastIngest, unix(s.LastIngest))
	if s.HasWaiting {
		g(c.waiting, float64(s.Waiting))
	}
	g(c.waitingAt, unix(s.WaitingAt))
	g(c.lastBreach, unix(s.LastBreach))
	g(c.lastFailed, unix(s.LastFailed))
	for topic, n := range s.Lost {
		ch <- prometheus.MustNewConstMetric(c.lost, prometheus.CounterValue, float64(n), topic)
		g(c.lostAt, unix(s.LostAt[topic]), topic)
	}
}
