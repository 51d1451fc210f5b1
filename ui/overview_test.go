package ui

import (
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
)

// The overview's ingest row says what the gauges know: a count, a count read a while ago while
// reads fail, or nothing known before the first read.
func TestIngestLagSaysWhatIsKnown(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	at := func(ago time.Duration) float64 { return float64(now.Add(-ago).Unix()) }
	for _, tc := range []struct {
		name   string
		gauges map[string]float64
		want   string
	}{
		{"no registry", nil, ""},
		{"read now", map[string]float64{"cfguard_consumer_lag_records": 5, "cfguard_consumer_offsets_read_timestamp_seconds": at(5 * time.Second)}, "5 records"},
		{"never read", map[string]float64{"cfguard_consumer_offsets_read_timestamp_seconds": 0}, "unknown: the input topic's offsets have not been read"},
		{"read 10 minutes ago", map[string]float64{"cfguard_consumer_lag_records": 0, "cfguard_consumer_offsets_read_timestamp_seconds": at(10 * time.Minute)},
			"0 records as read at " + unix(at(10*time.Minute)) + "; the offsets cannot be read since"},
	} {
		if got := ingestLag(tc.gauges, now); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}

// Before the first scored increment the prequential means are zeros, which are no figures: the
// overview says nothing was scored.
func TestQualityRowsBeforeAnyRecord(t *testing.T) {
	rows := qualityRows(map[string]any{"records": int64(0), "window_records": 0, "log_loss": 0.0, "accuracy": 0.0})
	if len(rows) != 1 || rows[0].Name != "records scored" {
		t.Errorf("rows before any record: %+v, want one saying none was scored", rows)
	}
	rows = qualityRows(map[string]any{"records": int64(64), "window_records": 64, "log_loss": 0.1, "accuracy": 0.98})
	if len(rows) != 4 || rows[0].Name != "log loss" {
		t.Errorf("rows after 64 records: %+v, want the figures", rows)
	}
}

// The timeline says in words which line is which (the picture's desc is for screen readers), and
// names its lowest decade, where a KL of 0 is drawn.
func TestTimelineHasALegend(t *testing.T) {
	h := []ledger.KLEntry{{PosteriorVersion: 1, KL: 0.01, MaxAnchorKL: 0, Outcome: certify.OutcomePromoted},
		{PosteriorVersion: 2, KL: 0.5, MaxAnchorKL: 0.5, Outcome: certify.OutcomePromoted}}
	got := string(timeline(h, 0.10125))
	for _, want := range []string{`<p class="legend" id="tl-legend">`, "Dotted grey line: the largest KL from a live anchor", "Dashed red line: the budget",
		"A KL below 1e-3 (0 included) is drawn on the lowest line", "drawn dotted, after each promoted update, the budget dashed"} {
		if !strings.Contains(got, want) {
			t.Errorf("the timeline lacks %q:\n%s", want, got)
		}
	}
}

// An update that was rejected (or failed) left the posterior where it was and re-certified
// nothing: its entry's largest anchor KL is a placeholder 0 (ledger.KLEntry), which the dotted
// line must not drop to. The line has a point for each promoted or clipped update only.
func TestTimelineDrawsNoAnchorKLForAnUpdateNotPromoted(t *testing.T) {
	h := []ledger.KLEntry{
		{PosteriorVersion: 2, KL: 0.01, MaxAnchorKL: 0.01, Outcome: certify.OutcomePromoted},
		{PosteriorVersion: 3, KL: 0.5, MaxAnchorKL: 0, Outcome: certify.OutcomeRejected},
		{PosteriorVersion: 3, KL: 0.1, MaxAnchorKL: 0.1, Outcome: certify.OutcomeClipped},
		{PosteriorVersion: 4, KL: 0.02, MaxAnchorKL: 0, Outcome: certify.OutcomeFailed},
	}
	got := string(timeline(h, 0.10125))
	i := strings.Index(got, `<polyline class="anchor" points="`)
	if i < 0 {
		t.Fatalf("no anchor line:\n%s", got)
	}
	pts := strings.Fields(got[i+len(`<polyline class="anchor" points="`) : i+strings.Index(got[i:], `"/>`)])
	if len(pts) != 2 {
		t.Errorf("the anchor line has %d points %q, want 2 (the promoted and the clipped update)", len(pts), pts)
	}
}
