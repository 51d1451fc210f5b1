package alerts

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// Names of the prequential metrics (QualityMetrics).
const (
	NamePrequentialRecords    = "cfguard_prequential_records_total"
	NamePrequentialLogLoss    = "cfguard_prequential_log_loss"
	NamePrequentialBrier      = "cfguard_prequential_brier_score"
	NamePrequentialAccuracy   = "cfguard_prequential_accuracy_ratio"
	NamePrequentialECE        = "cfguard_prequential_expected_calibration"
	NamePrequentialWindow     = "cfguard_prequential_window_records"
	NamePrequentialStatistic  = "cfguard_prequential_change_statistic"
	NamePrequentialThreshold  = "cfguard_prequential_change_threshold"
	NamePrequentialChanges    = "cfguard_prequential_changes_total"
	NamePrequentialLastChange = "cfguard_prequential_last_change_timestamp_seconds"
)

// Prequential is the served model's quality as the daemon last computed it: scores of records
// under the posterior that was current before they were applied (test, then train), over the
// newest Window records, and the change detector's state. Every field is persisted in the
// ledger, so a restart reports the same values.
type Prequential struct {
	Records                       int64 // scored since the ledger was created
	Window                        int   // records in the window
	LogLoss, Brier, Accuracy, ECE float64
	Statistic, Threshold          float64
	Changes                       int64   // alarms of the detector
	LastChange                    float64 // Unix seconds of the newest alarm, 0: none
}

// QualityMetrics exports a Prequential, read at each scrape.
type QualityMetrics struct {
	mu sync.Mutex
	p  Prequential
}

// NewQualityMetrics registers the prequential metrics on reg.
func NewQualityMetrics(reg prometheus.Registerer) *QualityMetrics {
	q := &QualityMetrics{}
	get := func(f func(p *Prequential) float64) func() float64 {
		return func() float64 {
			q.mu.Lock()
			defer q.mu.Unlock()
			return f(&q.p)
		}
	}
	gauge := func(name, help string, f func(p *Prequential) float64) {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, get(f)))
	}
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: NamePrequentialRecords,
		Help: "Records scored under the posterior that was current before they were applied (test, then train), each exactly once."},
		get(func(p *Prequential) float64 { return float64(p.Records) })))
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: NamePrequentialChanges,
		Help: "Rises of the prequential Brier score detected by the Page-Hinkley test (false-alarm rate <= 1e-6 per record)."},
		get(func(p *Prequential) float64 { return float64(p.Changes) })))
	gauge(NamePrequentialLogLoss, "Mean log loss of the newest scored records (the window), under the posterior before each record was applied.",
		func(p *Prequential) float64 { return p.LogLoss })
	gauge(NamePrequentialBrier, "Mean Brier score of the window's records.", func(p *Prequential) float64 { return p.Brier })
	gauge(NamePrequentialAccuracy, "Fraction of the window's records whose label the model predicted.", func(p *Prequential) float64 { return p.Accuracy })
	gauge(NamePrequentialECE, "Expected calibration error of the window's records (10 equal-width bins of the top class's probability).",
		func(p *Prequential) float64 { return p.ECE })
	gauge(NamePrequentialWindow, "Records in the prequential window.", func(p *Prequential) float64 { return float64(p.Window) })
	gauge(NamePrequentialStatistic, "The Page-Hinkley statistic on the per-record Brier score since the detector's last reset.",
		func(p *Prequential) float64 { return p.Statistic })
	gauge(NamePrequentialThreshold, "The Page-Hinkley threshold: the detector alarms when the statistic exceeds it.",
		func(p *Prequential) float64 { return p.Threshold })
	gauge(NamePrequentialLastChange, "Unix time of the newest detected rise of the prequential Brier score; 0: none.",
		func(p *Prequential) float64 { return p.LastChange })
	return q
}

// Set replaces the exported values.
func (q *QualityMetrics) Set(p Prequential) {
	q.mu.Lock()
	q.p = p
	q.mu.Unlock()
}
