package daemon

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// daemonMetrics are the daemon's own counters, beside alerts.Metrics on the same registry.
type daemonMetrics struct {
	events *prometheus.CounterVec // cfguard_events_total{result="published"|"failed"}
	audits prometheus.Counter     // cfguard_audits_total
}

func newDaemonMetrics(reg prometheus.Registerer) *daemonMetrics {
	f := promauto.With(reg)
	m := &daemonMetrics{
		events: f.NewCounterVec(prometheus.CounterOpts{Name: "cfguard_events_total",
			Help: "Events sent to the events topic, by result (published, failed)."}, []string{"result"}),
		audits: f.NewCounter(prometheus.CounterOpts{Name: "cfguard_audits_total", Help: "Full audits completed."}),
	}
	m.events.WithLabelValues("published")
	m.events.WithLabelValues("failed")
	return m
}
