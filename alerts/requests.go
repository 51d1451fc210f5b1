package alerts

import (
	"slices"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// Names of the metrics of requests applied once (request ids, Idempotency-Key): a single
// daemon's and a replica's.
const (
	NameRequestsSkipped  = "cfguard_requests_skipped_total"
	NameRequestsReplayed = "cfguard_requests_replayed_total"
)

// RequestKinds are the kind label values of cfguard_requests_skipped_total.
func RequestKinds() []string { return []string{"register", "delete"} }

// RequestResults are the result label values of cfguard_requests_replayed_total: the outcomes
// a ledger records for a request (ledger.Outcome*).
func RequestResults() []string {
	return []string{"stored", "same", "exists", "refused", "deleted", "absent"}
}

// RequestMetrics count the requests that were applied before: those not applied again, and the
// answers taken from the outcome recorded for them.
type RequestMetrics struct {
	skipped, replayed *prometheus.CounterVec
}

// NewRequestMetrics registers the request metrics on reg, every label value at 0.
func NewRequestMetrics(reg prometheus.Registerer) *RequestMetrics {
	f := promauto.With(reg)
	m := &RequestMetrics{
		skipped: f.NewCounterVec(prometheus.CounterOpts{Name: NameRequestsSkipped,
			Help: "Registration and deletion requests not applied because their request id has an outcome already " +
				"(a client's retry with its Idempotency-Key, a producer's retry on the CE topic), by kind (register, delete); " +
				"counted where they are applied: a single daemon, or the owner of the CE's partition."}, []string{"kind"}),
		replayed: f.NewCounterVec(prometheus.CounterOpts{Name: NameRequestsReplayed,
			Help: "Answers to registrations and deletions taken from the outcome recorded for an earlier attempt of the same request " +
				"(nothing applied again), by the outcome's result; counted where the request was answered."}, []string{"result"}),
	}
	for _, k := range RequestKinds() {
		m.skipped.WithLabelValues(k)
	}
	for _, r := range RequestResults() {
		m.replayed.WithLabelValues(r)
	}
	return m
}

// Skipped counts n requests of kind not applied because they were applied before. A kind
// outside RequestKinds counts nothing.
func (m *RequestMetrics) Skipped(kind string, n int) {
	if n > 0 && slices.Contains(RequestKinds(), kind) {
		m.skipped.WithLabelValues(kind).Add(float64(n))
	}
}

// Replayed counts one answer taken from an earlier attempt's outcome with result. A result
// outside RequestResults counts nothing.
func (m *RequestMetrics) Replayed(result string) {
	if slices.Contains(RequestResults(), result) {
		m.replayed.WithLabelValues(result).Inc()
	}
}
