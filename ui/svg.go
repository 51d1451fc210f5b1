package ui

import (
	"fmt"
	"html/template"
	"math"
	"strings"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
)

// Timeline geometry, in SVG user units (the picture scales to its container).
const (
	tlWidth, tlHeight = 720.0, 240.0
	tlLeft, tlRight   = 64.0, 16.0
	tlTop, tlBottom   = 16.0, 40.0
	tlFloor           = 1e-8 // KLs at or below this (a step that did not move) do not widen the scale
	tlMinDecades      = 3.0
)

// timeline draws each update's KL, KL(q_new || q_prev), and the largest KL from a live anchor
// after it, against the budget line, on a log scale over the versions in h. It returns an empty
// picture's note when there is no update yet. The same figures are in the table below it.
func timeline(h []ledger.KLEntry, budget float64) template.HTML {
	if len(h) == 0 {
		return template.HTML(`<p>No update yet: the timeline starts with the first posterior update.</p>`)
	}
	lo, hi := math.Log10(budget), math.Log10(budget)
	for _, e := range h {
		for _, v := range []float64{e.KL, e.MaxAnchorKL} {
			if v > tlFloor {
				lo, hi = math.Min(lo, math.Log10(v)), math.Max(hi, math.Log10(v))
			}
		}
	}
	lo, hi = math.Floor(lo), math.Ceil(hi)
	if hi-lo < tlMinDecades {
		lo = hi - tlMinDecades
	}
	x := func(i int) float64 {
		if len(h) == 1 {
			return tlLeft + (tlWidth-tlLeft-tlRight)/2
		}
		return tlLeft + float64(i)*(tlWidth-tlLeft-tlRight)/float64(len(h)-1)
	}
	y := func(v float64) float64 {
		l := lo // 0, and a KL below the lowest decade, sit on the lowest line
		if v > 0 {
			l = math.Max(lo, math.Log10(v))
		}
		return tlTop + (hi-l)/(hi-lo)*(tlHeight-tlTop-tlBottom)
	}
	var b strings.Builder
	over := 0
	for _, e := range h {
		if e.Breached(budget) {
			over++
		}
	}
	fmt.Fprintf(&b, `<svg class="timeline" viewBox="0 0 %g %g" role="img" aria-labelledby="tl-title tl-desc" xmlns="http://www.w3.org/2000/svg">`, tlWidth, tlHeight)
	fmt.Fprintf(&b, `<title id="tl-title">Update KL per posterior version, log scale, against the budget</title>`)
	fmt.Fprintf(&b, `<desc id="tl-desc">%s proposed as versions %d to %d; %d over the budget of %s (clipped ones included). The largest KL from a live anchor is drawn dotted, after each promoted update, the budget dashed.</desc>`,
		counted(float64(len(h)), "update", "updates"), h[0].PosteriorVersion, h[len(h)-1].PosteriorVersion, over, fmtNum(budget))
	// Axes and decade grid.
	for d := lo; d <= hi; d++ {
		yy := y(math.Pow(10, d))
		fmt.Fprintf(&b, `<line class="grid" x1="%g" y1="%.1f" x2="%g" y2="%.1f"/>`, tlLeft, yy, tlWidth-tlRight, yy)
		fmt.Fprintf(&b, `<text class="tick" x="%g" y="%.1f" text-anchor="end">1e%d</text>`, tlLeft-6, yy+4, int(d))
	}
	fmt.Fprintf(&b, `<text class="tick" x="%g" y="%g" text-anchor="start">v%d</text>`, tlLeft, tlHeight-tlBottom+16, h[0].PosteriorVersion)
	fmt.Fprintf(&b, `<text class="tick" x="%g" y="%g" text-anchor="end">v%d</text>`, tlWidth-tlRight, tlHeight-tlBottom+16, h[len(h)-1].PosteriorVersion)
	fmt.Fprintf(&b, `<text class="tick" x="%g" y="%g" text-anchor="middle">posterior version</text>`, (tlWidth+tlLeft)/2, tlHeight-6)
	// The budget.
	by := y(budget)
	fmt.Fprintf(&b, `<line class="budget" x1="%g" y1="%.1f" x2="%g" y2="%.1f"/>`, tlLeft, by, tlWidth-tlRight, by)
	fmt.Fprintf(&b, `<text class="budget-label" x="%g" y="%.1f" text-anchor="end">budget %s</text>`, tlWidth-tlRight, by-4, fmtNum(budget))
	// The anchors' KL, dotted, then the update KL with a mark per update (a cross when it breached
	// the budget: over it, or clipped to it).
	line := func(class string, v func(ledger.KLEntry) float64, drawn func(ledger.KLEntry) bool) {
		fmt.Fprintf(&b, `<polyline class="%s" points="`, class)
		for i, e := range h {
			if drawn(e) {
				fmt.Fprintf(&b, "%.1f,%.1f ", x(i), y(v(e)))
			}
		}
		b.WriteString(`"/>`)
	}
	// An update that was not promoted re-certified nothing: its MaxAnchorKL is a placeholder 0.
	line("anchor", func(e ledger.KLEntry) float64 { return e.MaxAnchorKL }, promoted)
	line("update", func(e ledger.KLEntry) float64 { return e.KL }, func(ledger.KLEntry) bool { return true })
	for i, e := range h {
		cx, cy := x(i), y(e.KL)
		if what := breach(e, budget); what != "" {
			fmt.Fprintf(&b, `<path class="over" d="M%.1f %.1fl8 8m0 -8l-8 8"><title>v%d: KL %s, %s</title></path>`, cx-4, cy-4, e.PosteriorVersion, fmtNum(e.KL), what)
		} else if len(h) <= 200 {
			fmt.Fprintf(&b, `<circle class="point" cx="%.1f" cy="%.1f" r="2.5"><title>v%d: KL %s</title></circle>`, cx, cy, e.PosteriorVersion, fmtNum(e.KL))
		}
	}
	b.WriteString(`</svg>`)
	fmt.Fprintf(&b, `<p class="legend" id="tl-legend">Solid line and dots: each update's KL. Dotted grey line: the largest KL from a live anchor after it. Dashed red line: the budget. A cross: an update over the budget, or clipped to it. A KL below 1e%d (0 included) is drawn on the lowest line.</p>`, int(lo))
	return template.HTML(b.String())
}

// breach says how update e breached the budget: "over the budget", "clipped to the budget", or
// "" when it did not.
func breach(e ledger.KLEntry, budget float64) string {
	switch {
	case !e.Breached(budget):
		return ""
	case e.KL <= budget:
		return "clipped to the budget"
	}
	return "over the budget"
}

// promoted says whether e's posterior was promoted (clipped ones are): the others (rejected,
// failed) left the served posterior where it was and carry no largest anchor KL.
func promoted(e ledger.KLEntry) bool {
	return e.Outcome == certify.OutcomePromoted || e.Outcome == certify.OutcomeClipped
}
