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
		{"read now", map[string]float64{"cfguard_consumer_lag_records": 5, "cfguard_consumer_offsets_read_timestamp_seconds": at(5 * time.Second)},
			"5 records (end offsets read at " + unix(at(5*time.Second)) + "; records produced since are not counted)"},
		{"no read time", map[string]float64{"cfguard_consumer_lag_records": 5}, "5 records"},
		{"one record", map[string]float64{"cfguard_consumer_lag_records": 1, "cfguard_consumer_offsets_read_timestamp_seconds": at(5 * time.Second)},
			"1 record (end offsets read at " + unix(at(5*time.Second)) + "; records produced since are not counted)"},
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
	rows = qualityRows(map[string]any{"records": int64(1), "window_records": 1, "log_loss": 0.7, "accuracy": 1.0})
	if len(rows) != 4 || rows[0].Name != "log loss" {
		t.Errorf("rows after 1 record: %+v, want the figures", rows)
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

// The timeline is drawn to scale: the versions span the plot's width (one update in its middle),
// a KL sits on the log scale between the decade lines that bound the figures and the budget
// (three decades at least; a KL below 1e-8, 0 included, on the lowest line), and the desc counts
// the updates that breached the budget, clipped ones included. The plot is x 64 to 704 and y 16
// (the top decade) to 200 (the lowest), in SVG user units.
func TestTimelineIsDrawnToScale(t *testing.T) {
	for _, tc := range []struct {
		name   string
		h      []ledger.KLEntry
		budget float64
		want   []string
	}{
		{"four updates, one clipped, one over the budget", []ledger.KLEntry{
			{PosteriorVersion: 1, KL: 0.001, MaxAnchorKL: 0.002, Outcome: certify.OutcomePromoted},
			{PosteriorVersion: 2, KL: 0.1, MaxAnchorKL: 0.01, Outcome: certify.OutcomeClipped},
			{PosteriorVersion: 3, KL: 0.2, MaxAnchorKL: 0, Outcome: certify.OutcomeRejected},
			{PosteriorVersion: 4, KL: 0, MaxAnchorKL: 0.001, Outcome: certify.OutcomePromoted},
		}, 0.1, []string{
			`<desc id="tl-desc">4 updates proposed as versions 1 to 4; 2 over the budget of 0.1 (clipped ones included).`,
			// The decades 1e-3 (the smallest KL) to 1e0 (above the largest), top to bottom.
			`<line class="grid" x1="64" y1="200.0" x2="704" y2="200.0"/><text class="tick" x="58" y="204.0" text-anchor="end">1e-3</text>` +
				`<line class="grid" x1="64" y1="138.7" x2="704" y2="138.7"/><text class="tick" x="58" y="142.7" text-anchor="end">1e-2</text>` +
				`<line class="grid" x1="64" y1="77.3" x2="704" y2="77.3"/><text class="tick" x="58" y="81.3" text-anchor="end">1e-1</text>` +
				`<line class="grid" x1="64" y1="16.0" x2="704" y2="16.0"/><text class="tick" x="58" y="20.0" text-anchor="end">1e0</text>` +
				`<text class="tick" x="64" y="216" text-anchor="start">v1</text><text class="tick" x="704" y="216" text-anchor="end">v4</text>`,
			`<line class="budget" x1="64" y1="77.3" x2="704" y2="77.3"/><text class="budget-label" x="704" y="73.3" text-anchor="end">budget 0.1</text>`,
			`<polyline class="anchor" points="64.0,181.5 277.3,138.7 704.0,200.0 "/>`,
			`<polyline class="update" points="64.0,200.0 277.3,77.3 490.7,58.9 704.0,200.0 "/>`,
			`<circle class="point" cx="64.0" cy="200.0" r="2.5"><title>v1: KL 0.001</title></circle>`,
			`<path class="over" d="M273.3 73.3l8 8m0 -8l-8 8"><title>v2: KL 0.1, clipped to the budget</title></path>`,
			`<path class="over" d="M486.7 54.9l8 8m0 -8l-8 8"><title>v3: KL 0.2, over the budget</title></path>`,
			`<circle class="point" cx="704.0" cy="200.0" r="2.5"><title>v4: KL 0</title></circle>`,
			"A KL below 1e-3 (0 included) is drawn on the lowest line",
		}},
		{"one update, below the floor", []ledger.KLEntry{{PosteriorVersion: 7, KL: 1e-9, Outcome: certify.OutcomeRejected}}, 0.1, []string{
			`<desc id="tl-desc">1 update proposed as versions 7 to 7; 0 over the budget of 0.1`,
			`<polyline class="update" points="384.0,200.0 "/>`,
			`<circle class="point" cx="384.0" cy="200.0" r="2.5"><title>v7: KL 1e-09</title></circle>`,
			"A KL below 1e-3 (0 included) is drawn on the lowest line",
		}},
		{"clipped to the budget exactly", []ledger.KLEntry{{PosteriorVersion: 9, KL: 0.1, MaxAnchorKL: 0.1, Outcome: certify.OutcomeClipped},
			{PosteriorVersion: 10, KL: 0.05, MaxAnchorKL: 0.1, Outcome: certify.OutcomeClipped}}, 0.1, []string{
			`<title>v9: KL 0.1, clipped to the budget</title>`, `<title>v10: KL 0.05, clipped to the budget</title>`,
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := string(timeline(tc.h, tc.budget))
			for _, want := range tc.want {
				if !strings.Contains(got, want) {
					t.Errorf("the timeline lacks %q:\n%s", want, got)
				}
			}
		})
	}
}

// Every update has a mark, a dot or a cross, up to 200 updates; past that only the crosses are
// drawn (the line still has every update).
func TestTimelineMarksUpTo200Updates(t *testing.T) {
	for _, n := range []int{200, 201} {
		h := make([]ledger.KLEntry, n)
		for i := range h {
			h[i] = ledger.KLEntry{PosteriorVersion: uint64(i + 1), KL: 0.01, MaxAnchorKL: 0.01, Outcome: certify.OutcomePromoted}
		}
		h[0].KL = 0.5
		got := string(timeline(h, 0.1))
		dots, crosses := strings.Count(got, `class="point"`), strings.Count(got, `class="over"`)
		if want := map[int]int{200: 199, 201: 0}[n]; dots != want || crosses != 1 {
			t.Errorf("%d updates: %d dots and %d crosses, want %d and 1", n, dots, crosses, want)
		}
	}
}

// A KL below the 1e-8 floor does not widen the scale, but when the scale reaches below it (a
// budget of 1e-6 or less: certify.delta of 0.4986 or more) it is drawn where it is, as the legend
// says: only a KL below the lowest decade is drawn on the lowest line.
func TestTimelineDrawsAKLBelowTheFloorWhereTheScaleReaches(t *testing.T) {
	h := []ledger.KLEntry{{PosteriorVersion: 1, KL: 5e-9, Outcome: certify.OutcomePromoted}, {PosteriorVersion: 2, KL: 0, Outcome: certify.OutcomePromoted}}
	got := string(timeline(h, 1e-6))
	for _, want := range []string{"A KL below 1e-9 (0 included) is drawn on the lowest line",
		`<circle class="point" cx="64.0" cy="157.1" r="2.5"><title>v1: KL 5e-09</title></circle>`,
		`<circle class="point" cx="704.0" cy="200.0" r="2.5"><title>v2: KL 0</title></circle>`} {
		if !strings.Contains(got, want) {
			t.Errorf("the timeline lacks %q:\n%s", want, got)
		}
	}
}
