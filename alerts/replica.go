package alerts

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Names of a replica's metrics (replication.enabled): its place in the posterior log and its
// role. A single daemon does not register them.
const (
	NameLogEntry        = "cfguard_posterior_log_entry"
	NameLogTerm         = "cfguard_posterior_log_term"
	NameLogLag          = "cfguard_posterior_log_lag_records"
	NameLogStopped      = "cfguard_posterior_log_stopped"
	NameLogIgnored      = "cfguard_posterior_log_records_ignored_total"
	NameLogAppendsLost  = "cfguard_posterior_log_appends_lost_total"
	NameGenerations     = "cfguard_updater_group_generations_total"
	NameEventsRepublish = "cfguard_posterior_events_republished_total"
	NameCERepaired      = "cfguard_counterfactuals_repaired_total"
	NameReplicaUpdater  = "cfguard_replication_updater"
	NameCEPartitions    = "cfguard_counterfactuals_partitions_owned"
	NameCERebuilding    = "cfguard_counterfactuals_partitions_rebuilding"
	NameCEBlocked       = "cfguard_counterfactuals_partitions_blocked"
	NameCERequestsApply = "cfguard_counterfactuals_requests_applied_total"
	NameCERequestsSkip  = "cfguard_counterfactuals_requests_skipped_total"
	NameUnauthenticated = "cfguard_replication_unauthenticated_total"
	NameSettingsDiffer  = "cfguard_replication_settings_differ"
	NameCEStates        = "cfguard_counterfactuals_states_total"
)

// Results of NameCEStates.
const (
	StateWritten  = "written"   // states this replica wrote to the CE state topic
	StateRestored = "restored"  // moved CEs stored with the state their previous owner left
	StateNotUsed  = "not_used"  // states the ledger did not use (another CE under the id, or not a state a certificate can have)
	StateInvalid  = "invalid"   // authenticated records of the CE state topic that are not a state: left out
	StateTooLarge = "too_large" // states over ceshare.MaxStateBytes: a tombstone written instead
	StateFenced   = "fenced"    // states read that a previous owner wrote after the partition was claimed by another replica
)

// ReplicaMetrics are a replica's gauges and counters of the posterior log and the CE share.
type ReplicaMetrics struct {
	Entry, Term, Lag, Updater, Stopped prometheus.Gauge
	// Ignored counts the log's records the acceptance rule did not accept, by reason (created
	// at 0 for the reasons given to NewReplicaMetrics).
	Ignored     *prometheus.CounterVec
	AppendsLost prometheus.Counter
	// Generations counts the updater group's generations this replica joined: each membership
	// change (a replica joining or leaving, an updater stepping down) makes one.
	Generations prometheus.Counter
	// Republished counts the posterior events of earlier writers' entries this replica
	// published at its claims (their writers may not have).
	Republished prometheus.Counter
	// CERepaired counts the CEs this replica sent to the CE topic again after a partition of it
	// was found reset (the topic deleted and created again).
	CERepaired prometheus.Counter
	// CEApplied counts the requests of the CE topic applied to this replica's ledger.
	CEApplied prometheus.Counter
	// Unauthenticated counts the records of the posterior, CE and CE state topics, and the CE
	// group's members, this replica ignored because their authenticator does not verify under the
	// cluster key, or is not for where the record was written (a copy on the CE topic), by topic
	// (GroupSource for members).
	Unauthenticated *prometheus.CounterVec
	// SettingsDiffer is the number of cluster-wide settings of this replica's file that differ
	// from those its posterior log's genesis records: a replica with any refuses to join.
	SettingsDiffer prometheus.Gauge
	// CEStates counts CE states by result (StateWritten, StateRestored, StateNotUsed,
	// StateInvalid, StateTooLarge, StateFenced); records that do not authenticate count in Unauthenticated.
	CEStates *prometheus.CounterVec
	// CESkipped counts records of the CE topic this replica left out because
	// replication.skip_ce_requests names them (a request no build of the cluster reads): the
	// registration or deletion each held is lost.
	CESkipped prometheus.Counter

	rebuilding atomic.Pointer[func() int] // SetRebuilding's function, read at each scrape
	owned      atomic.Pointer[func() int] // SetPartitionsOwned's
	blocked    atomic.Pointer[func() int] // SetBlocked's
}

// SetRebuilding makes f the count of CE partitions this replica is rebuilding, read at each
// scrape (0 until it is set).
func (m *ReplicaMetrics) SetRebuilding(f func() int) { m.rebuilding.Store(&f) }

// SetBlocked makes f the count of CE partitions this replica owns that are blocked at a request
// it cannot read (ceshare.Blocked), read at each scrape (0 until it is set).
func (m *ReplicaMetrics) SetBlocked(f func() int) { m.blocked.Store(&f) }

// SetPartitionsOwned makes f the count of CE partitions this replica owns, read at each scrape
// (0 until it is set): partitions are acquired concurrently, so no one acquisition knows the
// count.
func (m *ReplicaMetrics) SetPartitionsOwned(f func() int) { m.owned.Store(&f) }

// funcGauge is a gauge of name read from *p at each scrape (0 while it is nil).
func funcGauge(name, help string, p *atomic.Pointer[func() int]) prometheus.GaugeFunc {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 {
		if f := p.Load(); f != nil {
			return float64((*f)())
		}
		return 0
	})
}

// NewReplicaMetrics registers a replica's metrics on reg; the counters of unauthenticated
// records start at 0 for topics (the posterior and CE topics).
func NewReplicaMetrics(reg prometheus.Registerer, ignoredReasons []string, topics ...string) *ReplicaMetrics {
	g := func(name, help string) prometheus.Gauge {
		return prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	}
	m := &ReplicaMetrics{
		Entry:   g(NameLogEntry, "Sequence number of the last accepted entry of the posterior log this replica applied."),
		Term:    g(NameLogTerm, "Term of the posterior log's head (the fencing token of its updater)."),
		Lag:     g(NameLogLag, "Records of the posterior log this replica has not read yet."),
		Updater: g(NameReplicaUpdater, "1 while this replica is the updater (assigned the posterior log's partition by the updater group)."),
		Stopped: g(NameLogStopped, "1 when this replica stopped following the posterior log (an entry it cannot read or verify, or the log reset); it serves the last verified posterior."),
		Ignored: prometheus.NewCounterVec(prometheus.CounterOpts{Name: NameLogIgnored,
			Help: "Records of the posterior log the acceptance rule did not accept, by reason."}, []string{"reason"}),
		AppendsLost: prometheus.NewCounter(prometheus.CounterOpts{Name: NameLogAppendsLost,
			Help: "Entries this replica appended that lost to another writer's (it stepped down each time)."}),
		Generations: prometheus.NewCounter(prometheus.CounterOpts{Name: NameGenerations,
			Help: "Generations of the updater group this replica joined (one per membership change or updater stepping down)."}),
		Republished: prometheus.NewCounter(prometheus.CounterOpts{Name: NameEventsRepublish,
			Help: "Posterior events of earlier writers' log entries this replica published again when it claimed a term (their writers may have died before publishing them)."}),
		CERepaired: prometheus.NewCounter(prometheus.CounterOpts{Name: NameCERepaired,
			Help: "Counterfactuals this replica sent to the CE topic again after finding a partition of it reset (the topic deleted and created again)."}),
		CEApplied: prometheus.NewCounter(prometheus.CounterOpts{Name: NameCERequestsApply,
			Help: "Registration and deletion requests of the CE topic applied to this replica's ledger."}),
		CESkipped: prometheus.NewCounter(prometheus.CounterOpts{Name: NameCERequestsSkip,
			Help: "Records of the CE topic this replica left out because replication.skip_ce_requests names them (the registration or deletion each held is lost)."}),
		SettingsDiffer: g(NameSettingsDiffer, "Cluster-wide settings of this replica's configuration that differ from those the posterior log's genesis records; "+
			"a replica with any refuses to join (not ready)."),
		Unauthenticated: prometheus.NewCounterVec(prometheus.CounterOpts{Name: NameUnauthenticated,
			Help: "Records of the posterior, CE and CE state topics, and members of the CE group (topic group:<group>), ignored because they do not authenticate under the cluster key (replication.key_file), or, on the CE topic, because they are copies of signed records written elsewhere, by topic."},
			[]string{"topic"}),
		CEStates: prometheus.NewCounterVec(prometheus.CounterOpts{Name: NameCEStates,
			Help: "States of counterfactuals on the CE state topic, by result: written by this replica (tombstones included), restored with a moved CE, not used, invalid, too large to write, fenced (a previous owner's write after another replica claimed the partition)."},
			[]string{"result"}),
	}
	rebuilding := funcGauge(NameCERebuilding, "Partitions of the CE topic this replica owns or was assigned and has not caught up with since it acquired them, "+
		"or that are blocked at a request it cannot read: reads of their CEs not replayed yet, and lists, answer 503 meanwhile.", &m.rebuilding)
	blocked := funcGauge(NameCEBlocked, "Partitions of the CE topic this replica owns that are blocked at a request it cannot read (signed by the cluster, "+
		"in a format this build does not know): nothing at or after it is applied until a cfguard that reads it owns the partition.", &m.blocked)
	owned := funcGauge(NameCEPartitions, "Partitions of the CE topic this replica owns.", &m.owned)
	for _, r := range []string{StateWritten, StateRestored, StateNotUsed, StateInvalid, StateTooLarge, StateFenced} {
		m.CEStates.WithLabelValues(r)
	}
	for _, r := range ignoredReasons {
		m.Ignored.WithLabelValues(r)
	}
	for _, t := range topics {
		m.Unauthenticated.WithLabelValues(t)
	}
	reg.MustRegister(m.Entry, m.Term, m.Lag, m.Updater, m.Stopped, owned, m.Ignored, m.AppendsLost, m.Generations, m.Republished, m.CERepaired, m.CEApplied, m.CESkipped, m.Unauthenticated, m.SettingsDiffer, m.CEStates, rebuilding, blocked)
	return m
}
