package daemon

import (
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/quality"
	"github.com/cfguard/cfguard/update"
)

// prequentialWindow is the number of newest scored records the exported means cover (at least;
// whole increments are kept).
const prequentialWindow = 1000

// qualityRecord is an increment's prequential record, stored in the ledger beside its KL history
// entry (ledger.UpdateRecord.Quality) and carried by the posterior log, so that every record is
// scored exactly once and every replica reports the same figures.
type qualityRecord struct {
	// Version is the posterior the records were scored under (the one before the increment).
	Version  uint64           `json:"posterior_version"`
	Batch    quality.Batch    `json:"batch"`
	Detector quality.Detector `json:"detector"` // after the batch
	// Records counts the records scored since the ledger began, this batch's included.
	Records int64 `json:"records"`
	// LastChange is the Unix time in nanoseconds of the newest alarm (0: none yet).
	LastChange int64 `json:"last_change,omitempty"`
}

// prequential keeps the served model's test-then-train quality: the window of the newest
// increments' scores and the change detector. score computes an increment's record without
// changing anything; commit makes it current once its checkpoint is durable.
type prequential struct {
	mu      sync.Mutex
	window  quality.Window
	last    qualityRecord
	metrics *alerts.QualityMetrics
}

func newPrequential(m *alerts.QualityMetrics) *prequential {
	p := &prequential{window: quality.Window{Size: prequentialWindow}, metrics: m}
	p.last.Detector = quality.NewDetector()
	p.publish()
	return p
}

// load restores the window and the detector from the ledger's newest records.
func (p *prequential) load(l *ledger.Ledger) error {
	recs, err := l.Quality(0)
	if err != nil {
		return fmt.Errorf("prequential scores: %w", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range recs {
		var q qualityRecord
		if err := json.Unmarshal(r.Data, &q); err != nil {
			return fmt.Errorf("prequential scores: record %d: %w", r.Seq, err)
		}
		if err := q.Detector.Validate(); err != nil {
			return fmt.Errorf("prequential scores: record %d: %w", r.Seq, err)
		}
		p.window.Push(q.Batch)
		p.last = q
	}
	p.publishLocked()
	return nil
}

// score scores the records (X, y) under prev, the posterior before they are applied, and returns
// the record that commit will make current: the detector fed with them, the counts moved on.
func (p *prequential) score(prev *bnn.Model, X [][]float64, y []int, draws int, seed uint64, now time.Time) (*qualityRecord, []byte, error) {
	probs, err := update.Predictive(prev, X, update.ScoringDraws(len(X), draws), seed)
	if err != nil {
		return nil, nil, err
	}
	b, err := quality.Score(probs, y)
	if err != nil {
		return nil, nil, err
	}
	p.mu.Lock()
	q := qualityRecord{Version: prev.Version, Detector: p.last.Detector, Records: p.last.Records + int64(b.Records), LastChange: p.last.LastChange}
	p.mu.Unlock()
	if q.Detector.Observe(b) > 0 {
		q.LastChange = now.UnixNano()
	}
	q.Batch = b
	data, err := json.Marshal(q)
	if err != nil {
		return nil, nil, err
	}
	return &q, data, nil
}

// commit makes q current (after its checkpoint is durable).
func (p *prequential) commit(q *qualityRecord) {
	if q == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.window.Push(q.Batch)
	p.last = *q
	p.publishLocked()
}

func (p *prequential) publish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.publishLocked()
}

func (p *prequential) publishLocked() {
	p.metrics.Set(p.snapshotLocked())
}

func (p *prequential) snapshotLocked() alerts.Prequential {
	s := p.window.Sum()
	ll, br, acc, ece := s.Means()
	out := alerts.Prequential{Records: p.last.Records, Window: s.Records, LogLoss: ll, Brier: br, Accuracy: acc, ECE: ece,
		Statistic: p.last.Detector.Statistic(), Threshold: p.last.Detector.Lambda, Changes: int64(p.last.Detector.Changes)}
	if p.last.LastChange > 0 {
		out.LastChange = float64(p.last.LastChange) / 1e9
	}
	return out
}

// report is GET /v1/model's "prequential" block.
func (p *prequential) report() map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.snapshotLocked()
	out := map[string]any{"records": s.Records, "window_records": s.Window, "log_loss": s.LogLoss, "brier_score": s.Brier,
		"accuracy": s.Accuracy, "calibration_error": s.ECE, "change_statistic": s.Statistic, "change_threshold": s.Threshold,
		"changes": s.Changes, "scored_under_version": p.last.Version}
	if p.last.LastChange > 0 {
		out["last_change"] = time.Unix(0, p.last.LastChange).UTC()
	}
	return out
}

// prequential is GET /v1/model's prequential block.
func (d *Daemon) prequential() map[string]any { return d.quality.report() }
