package daemon

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// daemonMetrics are the daemon's own counters, beside alerts.Metrics on the same registry.
type daemonMetrics struct {
	events *prometheus.CounterVec // cfguard_events_total{result="published"|"failed"}
	audits prometheus.Counter     // cfguard_audits_total

	exportVersion prometheus.Gauge   // cfguard_export_posterior_version
	exportErrors  prometheus.Counter // cfguard_export_errors_total

	registerBatch prometheus.Histogram // cfguard_registration_batch_size
}

func newDaemonMetrics(reg prometheus.Registerer) *daemonMetrics {
	f := promauto.With(reg)
	m := &daemonMetrics{
		events: f.NewCounterVec(prometheus.CounterOpts{Name: "cfguard_events_total",
			Help: "Outbox events by result of their publish attempt (published; failed: retried from the outbox)."}, []string{"result"}),
		audits: f.NewCounter(prometheus.CounterOpts{Name: "cfguard_audits_total", Help: "Full audits completed."}),
		exportVersion: f.NewGauge(prometheus.GaugeOpts{Name: "cfguard_export_posterior_version",
			Help: "Posterior version last written to model.export_dir."}),
		exportErrors: f.NewCounter(prometheus.CounterOpts{Name: "cfguard_export_errors_total",
			Help: "Failed writes of the posterior export (retried)."}),
		registerBatch: f.NewHistogram(prometheus.HistogramOpts{Name: "cfguard_registration_batch_size",
			Help:    "Counterfactuals stored by one ledger write (one fsync) of registrations: concurrent registrations share one.",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128, 256, 512}}),
	}
	m.events.WithLabelValues("published")
	m.events.WithLabelValues("failed")
	return m
}
