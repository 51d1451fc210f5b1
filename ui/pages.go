package ui

import (
	"context"
	"errors"
	"fmt"
	"html/template"
	"math"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
)

// page is every template's data: the layout's fields and one page's own.
type page struct {
	Title       string
	Nav         string // the navigation entry to mark as current
	NoNav       bool
	LoginNeeded bool
	Error       string
	Next        string

	Snap      *Snapshot
	Counts    []statusCount
	Timeline  template.HTML
	Latest    *ledger.KLEntry
	AppliedAt string
	Lag       string // the consumer lag gauge in words; empty: no gauges

	CEs        []ceRow
	Classes    []string
	Filter     listFilter
	NextURL    string
	Scanned    int    // the CEs a filtered list page read to fill itself
	VarCeiling string // a CE page's Theorem 2 ceiling, max(epsilon_max, epsilon); "" when not known
	Held       string // the overview's count of records held (cfguard_records_total{result="held"}), "" for none
	Dead       string // the overview's count of records dead-lettered (cfguard_records_total{result="dead_lettered"}), "" for none
	Short      bool   // a list page that stopped reading before it filled, with more to read
	Total      string // how many CEs the list holds in all, when the counts by status say it; "" else
	FirstURL   string
	Statuses   []string

	CE      *ledger.CE
	Rows    []featureRow
	Verdict statement
	// Reissues are the CEs stored as this one's replacements, ReissueOf the CE this one replaces
	// (explain.reissue names a replacement "<id>.r<posterior version>"; see reissues).
	Reissues  []reissueLink
	ReissueOf string
	History   []historyRow
	Target    string

	Events  []eventRow
	More    bool
	Failing *failing // the events page: the publisher's attempts fail; nil while they work

	Doc template.HTML // the runbook page's body

	Quality    []qualityRow
	Cluster    []qualityRow
	Conditions []conditionRow
	Gauges     bool // the conditions were evaluated
}

// clusterRows are the replication block's fields, in words, in a fixed order: what this replica
// knows of the cluster (its own place in the posterior log and its share of the CEs).
func clusterRows(r map[string]any) []qualityRow {
	var rows []qualityRow
	for _, k := range []struct{ key, name string }{
		{"writer", "this replica"}, {"updater", "the updater (writes the posterior log)"}, {"entry", "posterior log entry"},
		{"term", "term"}, {"offset", "entry's offset in the log"}, {"posterior_sha256", "posterior SHA-256"},
		{"lag_records", "entries behind the log's end"}, {"topic", "posterior log topic"}, {"covers", "input offsets the posterior covers"},
		{"ce_partitions", "CE partitions this replica owns"}, {"ce_generation", "CE group generation"}, {"stopped", "stopped"},
	} {
		if v, ok := r[k.key]; ok {
			rows = append(rows, qualityRow{k.name, fmt.Sprint(v)})
		}
	}
	return rows
}

type qualityRow struct{ Name, Value string }

// qualityRows are the prequential block's scores, in words, in a fixed order.
func qualityRows(q map[string]any) []qualityRow {
	if n, ok := q["window_records"].(int); ok && n == 0 { // nothing scored yet: the means are no figures
		return []qualityRow{{"records scored", "none yet: the first increment is scored before it is learned"}}
	}
	var rows []qualityRow
	for _, k := range []struct{ key, name string }{
		{"log_loss", "log loss"}, {"brier_score", "Brier score"}, {"accuracy", "accuracy"},
		{"calibration_error", "expected calibration error"}, {"window_records", "over the last records"},
		{"records", "records scored in all"}, {"changes", "quality changes detected"},
	} {
		switch v := q[k.key].(type) {
		case float64:
			rows = append(rows, qualityRow{k.name, fmtNum(v)})
		case int, int64, uint64:
			rows = append(rows, qualityRow{k.name, fmt.Sprint(v)})
		}
	}
	return rows
}

type statusCount struct {
	Status, Meaning string
	N, Decided      int
	URL, Undecided  string // the list of them, and of the undecided ones
}

type listFilter struct {
	Status  string
	Decided string // "", "yes", "no"
	Target  string // a class name or index; "": every target
	Pending string // "yes": a renewal or a verdict is pending; "no": none is; "": either
	After   string
}

type ceRow struct {
	ID, Status, Target, Decided, Flags string
	P1, Bound                          string
	Anchor                             uint64
	Updated                            string
}

// reissueLink is a replacement a CE's page links, with what its status lets one say of it: a
// replacement is stored as any CE is, uncertified too (certify.uncertified: store), and may have
// stopped holding since.
type reissueLink struct{ ID, Says string }

// says is a CE's status and what it lets one say, in a few words (Statement says it in full).
func says(ce *ledger.CE) string {
	switch {
	case valid(ce):
		return "certified: it holds"
	case ce.Status == certify.Certified:
		return "certified, its certificate lapsed: no statement until it is measured again"
	case ce.Status == certify.Uncertified:
		return "uncertified: never certified, no guarantee applies"
	case !ce.Decided:
		return ce.Status.String() + ", undecided: no statement"
	case ce.Status == certify.AtRisk:
		return "at risk: the target is still the most likely class, not certified"
	}
	return "invalidated: it does not hold"
}

type featureRow struct {
	Name, X, XCF, Change string
	Changed              bool
}

type historyRow struct {
	At, Event, Version, KL, Bound, P2 string
}

type eventRow struct {
	Seq        uint64
	Key, Value string
	Size       int // the event's bytes, when Value shows only the first eventShown of them
}

// eventShown is how many bytes of an event the events page shows: an event may hold up to 900 kB
// (an increment's held records), and the page shows up to 200 events.
const eventShown = 2000

// statement is what a CE's status lets one say, in words (see docs/MATHS.md).
type statement struct {
	Headline string // one line: holds, no statement, does not hold
	Kind     string // "holds", "open", "fails", "none": the CSS class and the icon's meaning
	Body     []string
}

var funcs = template.FuncMap{
	"pct": func(v float64) string { return strconv.FormatFloat(100*v, 'f', 1, 64) + "%" },
	"num": fmtNum,
	// promoted says whether an update KL entry's posterior was promoted (svg.go).
	"promoted": promoted,
	"breach":   breach,
	"margin":   func(b float64) float64 { return b - 0.5 },
	"valid":    valid,
	"sub":      func(a, b int) int { return a - b },
	// counted is a count and the word that agrees with it ("1 update", "2 updates").
	"counted": func(n int, one, many string) string { return counted(float64(n), one, many) },
	"time": func(t time.Time) string {
		if t.IsZero() {
			return "never"
		}
		return t.UTC().Format("2006-01-02 15:04:05 UTC")
	},
	"icon": func(kind string) string {
		switch kind {
		case "holds", "certified":
			return "✓"
		case "fails", "invalidated":
			return "✗"
		case "open", "at_risk":
			return "!"
		}
		return "–"
	},
}

// fmtNum prints a figure with four significant digits, or as many more as it takes to keep it on
// its side of 1/2 and of 1: a p1 of 0.999998 printed "1" would say the target is certain (and a
// bound "at 1 or more"), a lapsed bound of 0.49996 printed "0.5" would say it reaches 1/2.
func fmtNum(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return strconv.FormatFloat(v, 'g', -1, 64)
	}
	s := strconv.FormatFloat(v, 'g', 4, 64)
	for digits := 5; digits <= 17 && crosses(v, s); digits++ {
		s = strconv.FormatFloat(v, 'g', digits, 64)
	}
	return s
}

// crosses says whether s, v rounded, lies on the other side of 1/2 or 1 than v.
func crosses(v float64, s string) bool {
	r, _ := strconv.ParseFloat(s, 64)
	return (v < 0.5) != (r < 0.5) || (v < 1) != (r < 1)
}

// meanings are the statuses in words, for the overview's legend.
var meanings = map[certify.Status]string{
	certify.Certified:   "decided, Theorems 1 and 2 keep the explanation valid under the current posterior; undecided, its certificate lapsed and waits for renewal",
	certify.AtRisk:      "not certified: decided, a measurement found the target's probability at or above 1/2 (so it is still the most likely class); undecided, nothing is known",
	certify.Invalidated: "decided, a measurement found the target's probability below 1/2 (with two classes, the other class is given); undecided, a verdict that no longer carries",
	certify.Uncertified: "stored outside the certified set; no theorem applies",
}

func (u *UI) overview(w http.ResponseWriter, r *http.Request) {
	snap, err := u.src.Snapshot(r.Context())
	if err != nil {
		u.fail(w, http.StatusInternalServerError, err)
		return
	}
	p := page{Title: "Overview", Nav: "overview", Snap: &snap, Timeline: timeline(snap.History, snap.Budget)}
	for _, s := range certify.Statuses() {
		p.Counts = append(p.Counts, statusCount{Status: s.String(), Meaning: meanings[s], N: snap.State.Counts[s],
			Decided: snap.State.Decided[s], URL: "/ui/counterfactuals?status=" + s.String(),
			Undecided: "/ui/counterfactuals?status=" + s.String() + "&decided=no"})
	}
	if n := len(snap.History); n > 0 {
		p.Latest = &snap.History[n-1]
	}
	p.Quality = qualityRows(snap.Quality)
	p.Conditions, p.Gauges = holding(snap.Gauges, snap.Now), snap.Gauges != nil
	p.Cluster = clusterRows(snap.Replication)
	p.AppliedAt = funcs["time"].(func(time.Time) string)(snap.State.AppliedAt)
	p.Lag = ingestLag(snap.Gauges, snap.Now)
	if n := snap.Gauges[`cfguard_records_total{result="held"}`]; n > 0 {
		p.Held = count(n)
	}
	if n := snap.Gauges[`cfguard_records_total{result="dead_lettered"}`]; n > 0 {
		p.Dead = count(n)
	}
	u.render(w, http.StatusOK, "overview", p)
}

// ingestLag is the gauge of records waiting (cfguard_consumer_lag_records) in words: the input
// topic's end, as last read, past the ledger's offsets, and when the end was read: records
// produced since are not counted (the ends are read every few seconds), and a read more than a
// minute ago says the reads fail. Empty when the daemon has no registry to read it from.
func ingestLag(g map[string]float64, now time.Time) string {
	if g == nil {
		return ""
	}
	read, known := g["cfguard_consumer_offsets_read_timestamp_seconds"]
	v, ok := g["cfguard_consumer_lag_records"]
	switch {
	case !ok:
		return "unknown: the input topic's offsets have not been read"
	case known && float64(now.Unix())-read > 60:
		return records(v) + " as read at " + unix(read) + "; the offsets cannot be read since"
	case known && read > 0:
		return records(v) + " (end offsets read at " + unix(read) + "; records produced since are not counted)"
	}
	return records(v)
}

// records is a count of records as the overview's ingest row prints it: no thousands separator,
// "record" for one.
func records(v float64) string {
	if v == 1 {
		return "1 record"
	}
	return strconv.FormatFloat(v, 'f', 0, 64) + " records"
}

// list shows one page of CEs. The filters but status are applied to the pages the ledger
// returns, so a page reads ahead (at most ten pages' worth) to fill itself, and its "next" link
// resumes after the last CE it read.
func (u *UI) list(w http.ResponseWriter, r *http.Request) {
	q, err := url.ParseQuery(r.URL.RawQuery) // r.URL.Query() drops what does not parse, a filter with it
	if err != nil {
		u.fail(w, http.StatusBadRequest, fmt.Errorf("query: %w (parameters are separated by &)", err))
		return
	}
	for k, vs := range q { // refused as the API refuses them: a misspelt filter would list everything
		switch {
		case !slices.Contains(listParams, k):
			u.fail(w, http.StatusBadRequest, fmt.Errorf("unknown parameter %q: the list takes %s", ident.Clip(k, 64), strings.Join(listParams, ", ")))
			return
		case len(vs) > 1:
			u.fail(w, http.StatusBadRequest, fmt.Errorf("parameter %q given %d times", k, len(vs)))
			return
		}
	}
	f := listFilter{Status: q.Get("status"), Decided: q.Get("decided"), Target: q.Get("target"), Pending: q.Get("pending"), After: q.Get("after")}
	var st certify.Status
	if f.Status != "" {
		var err error
		if st, err = certify.ParseStatus(f.Status); err != nil {
			u.fail(w, http.StatusBadRequest, fmt.Errorf("status %q: %w", f.Status, err))
			return
		}
	}
	for _, v := range []struct{ key, val string }{{"decided", f.Decided}, {"pending", f.Pending}} {
		if v.val != "" && v.val != "yes" && v.val != "no" {
			u.fail(w, http.StatusBadRequest, fmt.Errorf("%s %q: want yes, no or nothing", v.key, v.val))
			return
		}
	}
	if f.After != "" { // the cursor the Next page link carries is a CE id; other text would be shown as the page's own
		if err := ident.Check(f.After); err != nil {
			u.fail(w, http.StatusBadRequest, fmt.Errorf("after: %w (the cursor of the Next page link, a CE id)", err))
			return
		}
	}
	snap, err := u.src.Snapshot(r.Context())
	if err != nil {
		u.fail(w, http.StatusInternalServerError, err)
		return
	}
	target := -1
	if f.Target != "" {
		if target = classIndex(snap.Classes, f.Target); target < 0 {
			u.fail(w, http.StatusBadRequest, fmt.Errorf("target %q: the model's classes are %v (or their index)", f.Target, snap.Classes))
			return
		}
		if target < len(snap.Classes) && snap.Classes[target] != "" {
			f.Target = snap.Classes[target] // an index given: the form's select shows the class it names
		}
	}
	keep := func(ce *ledger.CE) bool {
		return (f.Decided == "" || (f.Decided == "yes") == ce.Decided) &&
			(f.Pending == "" || (f.Pending == "yes") == (ce.RenewalPending || ce.VerdictPending)) &&
			(target < 0 || ce.Target == target)
	}
	size := u.cfg.PageSize
	var rows []ceRow
	after, more := f.After, false
	scanned := 0
	for pages := 0; len(rows) < size && scanned < 10*size && pages < 20; pages++ {
		ces, next, err := u.src.List(r.Context(), st, size, after)
		if err != nil {
			u.fail(w, http.StatusInternalServerError, err)
			return
		}
		scanned += len(ces)
		more = next != ""
		full := false
		for i, ce := range ces {
			after = ce.ID
			if keep(ce) {
				rows = append(rows, u.row(ce, snap.Classes))
			}
			if len(rows) == size {
				more, full = more || i < len(ces)-1, true
				break
			}
		}
		if !more {
			break
		}
		if !full {
			after = next // on replicas the cursor may pass CEs a page left out (see GET /v1/counterfactuals)
		}
	}
	p := page{Title: "Counterfactuals", Nav: "list", CEs: rows, Filter: f, Snap: &snap, Classes: snap.Classes, Scanned: scanned,
		Short: more && len(rows) < size}
	if f.Decided == "" && f.Target == "" && f.Pending == "" { // the counts say how many the list holds in all
		n := 0
		for s, c := range snap.State.Counts {
			if f.Status == "" || s == st {
				n += c
			}
		}
		p.Total = count(float64(n))
	}
	for _, s := range certify.Statuses() {
		p.Statuses = append(p.Statuses, s.String())
	}
	v := url.Values{}
	for _, kv := range [][2]string{{"status", f.Status}, {"decided", f.Decided}, {"target", f.Target}, {"pending", f.Pending}} {
		if kv[1] != "" {
			v.Set(kv[0], kv[1])
		}
	}
	p.FirstURL = "/ui/counterfactuals?" + v.Encode()
	if more {
		v.Set("after", after)
		p.NextURL = "/ui/counterfactuals?" + v.Encode()
	}
	u.render(w, http.StatusOK, "list", p)
}

// listParams are the parameters a list page takes (its form sends each, empty for none).
var listParams = []string{"status", "decided", "target", "pending", "after"}

// classIndex is the class named s (by name or index), -1 when there is none.
func classIndex(classes []string, s string) int {
	for i, c := range classes {
		if c == s {
			return i
		}
	}
	if i, err := strconv.Atoi(s); err == nil && i >= 0 && i < max(len(classes), 2) {
		return i
	}
	return -1
}

func (u *UI) row(ce *ledger.CE, classes []string) ceRow {
	r := ceRow{ID: ce.ID, Status: ce.Status.String(), Target: className(classes, ce.Target), Anchor: ce.AnchorVersion,
		P1: fmtNum(ce.P1), Bound: fmtNum(ce.Bound), Updated: funcs["time"].(func(time.Time) string)(ce.UpdatedAt)}
	r.Decided = "undecided"
	if ce.Decided {
		r.Decided = "decided"
	}
	switch {
	case ce.Status == certify.Uncertified:
		r.Bound = "none" // never certified: the API's 0 is no bound
	case ce.Bound <= 0:
		r.Bound = "none (" + r.Bound + ")" // a lower bound on a probability that is not above 0 bounds nothing
	}
	var flags []string
	if ce.RenewalPending {
		flags = append(flags, "renewal pending")
	}
	if ce.VerdictPending {
		flags = append(flags, "verdict pending")
	}
	r.Flags = strings.Join(flags, ", ")
	return r
}

func className(classes []string, i int) string {
	if i >= 0 && i < len(classes) && classes[i] != "" {
		return fmt.Sprintf("%s (class %d)", classes[i], i)
	}
	return fmt.Sprintf("class %d", i)
}

// load reads the CE and the snapshot a CE page needs.
func (u *UI) load(w http.ResponseWriter, r *http.Request) (*ledger.CE, *Snapshot, bool) {
	if err := ident.Check(r.PathValue("id")); err != nil { // no CE can hold it: 400, as the API answers
		u.fail(w, http.StatusBadRequest, err)
		return nil, nil, false
	}
	ce, err := u.src.Get(r.Context(), r.PathValue("id"))
	if errors.Is(err, ledger.ErrNotFound) {
		u.fail(w, http.StatusNotFound, fmt.Errorf("no counterfactual %q is stored", r.PathValue("id")))
		return nil, nil, false
	}
	if err != nil {
		u.fail(w, http.StatusInternalServerError, err)
		return nil, nil, false
	}
	snap, err := u.src.Snapshot(r.Context())
	if err != nil {
		u.fail(w, http.StatusInternalServerError, err)
		return nil, nil, false
	}
	return ce, &snap, true
}

func (u *UI) ce(w http.ResponseWriter, r *http.Request) {
	ce, snap, ok := u.load(w, r)
	if !ok {
		return
	}
	p := u.cePage(ce, snap, "Counterfactual "+ce.ID)
	if u.cfg.Reissue {
		var err error
		if p.Reissues, p.ReissueOf, err = u.reissues(r.Context(), ce, max(snap.PosteriorVersion, ce.PosteriorVersion)); err != nil {
			u.fail(w, http.StatusInternalServerError, err)
			return
		}
	}
	u.render(w, http.StatusOK, "ce", p)
}

// reissues finds the replacements explain.reissue stored for ce, and the CE ce replaces: a CE
// named ident.Reissue(id, posterior version) for the same input and target. The list is in id
// order, so the replacements follow their stem and ".r" in it; the CE a replacement of a long id
// replaces is among the ids that start with the stem's first characters.
//
// A client may store a CE under such a name itself, so a replacement is shown only if the CE it
// replaces stopped holding by the version in its name, as the reissuer's do (it reissues a CE
// when a status change moves it out of certified, under a version at or after the change's):
// the version is at most current, the posterior version now, and the CE's history (the last
// ledger.MaxHistory changes) has a change out of certified at or before it, or, when the CE is
// not certified now and its history is full, begins after it (the change may be older).
func (u *UI) reissues(ctx context.Context, ce *ledger.CE, current uint64) (next []reissueLink, prev string, err error) {
	same := func(o *ledger.CE) bool { return o.Target == ce.Target && slices.Equal(o.X, ce.X) }
	replaces := func(newID string, old *ledger.CE) bool {
		i := strings.LastIndex(newID, ".r")
		if i < 0 {
			return false
		}
		v, err := strconv.ParseUint(newID[i+2:], 10, 64)
		if err != nil || v > current {
			return false
		}
		for _, h := range old.History {
			if h.To != certify.Certified && h.PosteriorVersion <= v {
				return true
			}
		}
		return old.Status != certify.Certified && len(old.History) >= ledger.MaxHistory && old.History[0].PosteriorVersion > v
	}
	// An id of 107 to 125 characters has a stem of its own; its replacements stored before
	// stems existed are named "<id>.r<version>".
	for _, after := range slices.Compact([]string{ident.ReissueStem(ce.ID) + ".r", ce.ID + ".r"}) {
		ces, _, err := u.src.List(ctx, 0, 16, after)
		if err != nil {
			return nil, "", err
		}
		for _, o := range ces {
			v, ok := strings.CutPrefix(o.ID, after)
			if !ok {
				break
			}
			if isDigits(v) && same(o) && replaces(o.ID, ce) {
				next = append(next, reissueLink{ID: o.ID, Says: says(o)})
			}
		}
	}
	i := strings.LastIndex(ce.ID, ".r")
	if i <= 0 || !isDigits(ce.ID[i+2:]) {
		return next, "", nil
	}
	stem := ce.ID[:i]
	o, err := u.src.Get(ctx, stem)
	switch {
	case errors.Is(err, ledger.ErrNotFound):
	case err != nil:
		return nil, "", err
	case same(o) && replaces(ce.ID, o):
		return next, o.ID, nil
	}
	// A long id's stem: its first characters, ".", 16 hex digits.
	j := strings.LastIndexByte(stem, '.')
	if j <= 0 || len(stem)-j != 17 {
		return next, "", nil
	}
	cands, _, err := u.src.List(ctx, 0, 64, stem[:j])
	if err != nil {
		return nil, "", err
	}
	for _, o := range cands {
		if !strings.HasPrefix(o.ID, stem[:j]) {
			break
		}
		if ident.ReissueStem(o.ID) == stem && same(o) && replaces(ce.ID, o) {
			return next, o.ID, nil
		}
	}
	return next, "", nil
}

func isDigits(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// certificate is the printable page: a certificate of validity while the CE is certified and
// decided, else a statement of what holds of it now.
func (u *UI) certificate(w http.ResponseWriter, r *http.Request) {
	ce, snap, ok := u.load(w, r)
	if !ok {
		return
	}
	title := "Statement on counterfactual " + ce.ID
	if valid(ce) {
		title = "Certificate of validity: " + ce.ID
	}
	u.render(w, http.StatusOK, "certificate", u.cePage(ce, snap, title))
}

// valid says whether ce holds under the posterior it was read at: certified, and decided.
func valid(ce *ledger.CE) bool { return ce.Status == certify.Certified && ce.Decided }

func (u *UI) cePage(ce *ledger.CE, snap *Snapshot, title string) page {
	p := page{Title: title, Nav: "list", CE: ce, Snap: snap, Target: className(snap.Classes, ce.Target),
		Verdict: Statement(ce, snap.Alpha)}
	if snap.EpsilonMax > 0 {
		p.VarCeiling = fmtNum(max(snap.EpsilonMax, ce.Epsilon))
	}
	for j := range ce.X {
		name := fmt.Sprintf("feature %d", j)
		if j < len(snap.Features) && snap.Features[j] != "" {
			name = snap.Features[j]
		}
		fr := featureRow{Name: name, X: fmtNum(ce.X[j])}
		if j < len(ce.XCF) {
			fr.XCF = fmtNum(ce.XCF[j])
			if d := ce.XCF[j] - ce.X[j]; d != 0 {
				fr.Changed = true
				fr.Change = fmt.Sprintf("%+.4g", d)
			}
		}
		p.Rows = append(p.Rows, fr)
	}
	// Changed features first, then the rest in the model's order.
	sort.SliceStable(p.Rows, func(a, b int) bool { return p.Rows[a].Changed && !p.Rows[b].Changed })
	for i := len(ce.History) - 1; i >= 0; i-- {
		h := ce.History[i]
		ev := h.From.String() + " → " + h.To.String()
		if h.Renewal {
			ev = "certificate renewed"
		}
		hr := historyRow{At: funcs["time"].(func(time.Time) string)(h.At), Event: ev, Version: strconv.FormatUint(h.PosteriorVersion, 10),
			KL: fmtNum(h.KL), Bound: fmtNum(h.Bound), P2: "—"}
		if h.P2 != nil {
			hr.P2 = fmtNum(*h.P2)
		}
		p.History = append(p.History, hr)
	}
	return p
}

// Statement says what a CE's status guarantees under the current posterior, in words derived
// from docs/MATHS.md ("Renewal and verdicts"): only a decided status states anything about p.
func Statement(ce *ledger.CE, alpha float64) statement {
	version := ce.PosteriorVersion // the version its bounds were judged at, which a snapshot read after may have passed
	conf := "at least " + strconv.FormatFloat(100*(1-alpha), 'g', 4, 64) + "%"
	switch {
	case valid(ce):
		m := certify.BernsteinMargin(ce.Var1, ce.Samples, alpha)
		return statement{Headline: "This explanation holds under the current posterior.", Kind: "holds", Body: []string{
			fmt.Sprintf("Under posterior version %d, Theorem 1 keeps the probability measured under posterior version %d (p1 = %s from %d draws) at %s or more, at or above 1/2, after what the posterior moved since (KL = %s).",
				version, ce.AnchorVersion, fmtNum(ce.P1), ce.Samples, fmtNum(ce.Bound), fmtNum(ce.KLFromAnchor)),
			fmt.Sprintf("p1 is an estimate: with confidence %s, the model gives the target class to the changed input with probability at least %s, that bound less p1's Monte-Carlo margin (%s). The certificate is judged from p1, as the paper does, so this is 1/2 less the margin at worst (docs/MATHS.md, \"What certified guarantees\").",
				conf, fmtNum(ce.Bound-m), fmtNum(m)),
			fmt.Sprintf("Theorem 2 bounds the variance of that probability over the posterior by %s, from the variance measured with p1 (%s, a point estimate, as at registration).", fmtNum(ce.VarBound), fmtNum(ce.Var1)),
			"The confidence is for this explanation on its own: explanations measured under one posterior version share its draws, so no statement is joint over several.",
		}}
	case ce.Status == certify.Certified:
		body := []string{
			fmt.Sprintf("p1 = %s was measured under posterior version %d; under version %d, after what the posterior moved since (KL = %s), Theorem 1 %s, which no longer certifies it. Until the confirmer measures it under the current posterior (renewal pending), nothing is guaranteed.",
				fmtNum(ce.P1), ce.AnchorVersion, version, fmtNum(ce.KLFromAnchor), keeps(ce.Bound)),
		}
		if s := ce.RenewalPendingSince; s != nil {
			body = append(body, fmt.Sprintf("Its bound has failed at every posterior version since version %d, the first at which the posterior had moved too far from version %d for it.",
				*s, ce.AnchorVersion))
		}
		return statement{Headline: "No statement: the certificate has lapsed and waits to be measured again.", Kind: "open", Body: body}
	case ce.Status == certify.AtRisk && ce.Decided:
		return statement{Headline: "At risk: the target is still the most likely class, but the explanation is no longer certified.", Kind: "open", Body: []string{
			fmt.Sprintf("A measurement under posterior version %s found the probability of the target class at or above 1/2 with confidence %s, and that bound still carries to version %d.",
				confirmed(ce), conf, version),
			"It is not certified: an explanation that lost its certificate gets one again only when a measurement's lower confidence bound reaches 1 - delta plus one more Monte-Carlo margin, and its variance is at most epsilon, so that it does not go back and forth at the threshold (docs/MATHS.md, \"Renewal\").",
		}}
	case ce.Status == certify.AtRisk:
		return statement{Headline: "No statement: this at-risk status is kept until a new measurement decides it.", Kind: "open", Body: stoppedCarrying(ce, []string{
			"Nothing is known about the probability of the target class under the current posterior: the status is kept by hysteresis, or its last verdict no longer carries, or a lapsed certificate has had no verdict yet. Do not read it as still valid.",
		})}
	case ce.Status == certify.Invalidated && ce.Decided:
		return statement{Headline: "This explanation no longer holds.", Kind: "fails", Body: []string{
			fmt.Sprintf("A measurement under posterior version %s found the probability of the target class below 1/2 with confidence %s, and that bound still carries to version %d: the changed input no longer gets the target with probability 1/2 or more (with two classes, it gets the other class).",
				confirmed(ce), conf, version),
		}}
	case ce.Status == certify.Invalidated:
		return statement{Headline: "No statement: invalidated by an earlier measurement that no longer carries.", Kind: "open", Body: stoppedCarrying(ce, []string{
			"The verdict was kept, but it is not backed by a bound under the current posterior; it waits to be measured again. Treat the explanation as not valid.",
		})}
	}
	return statement{Headline: "Never certified: no guarantee applies.", Kind: "none", Body: []string{
		fmt.Sprintf("It was stored outside the certified set (p1 = %s, variance %s against delta %s, epsilon %s).", fmtNum(ce.P1), fmtNum(ce.Var1), fmtNum(ce.Delta), fmtNum(ce.Epsilon)),
	}}
}

// stoppedCarrying adds to body the version at which an undecided verdict stopped carrying, when
// the CE says it (VerdictPendingSince).
func stoppedCarrying(ce *ledger.CE, body []string) []string {
	if s := ce.VerdictPendingSince; s != nil {
		body = append(body, fmt.Sprintf("The verdict measured under posterior version %s has not carried since posterior version %d, the first at which the posterior had moved too far from version %s for its bound.",
			confirmed(ce), *s, confirmed(ce)))
	}
	return body
}

// keeps says what Theorem 1's bound b keeps of the probability: nothing when it is not above 0.
func keeps(b float64) string {
	if b <= 0 {
		return fmt.Sprintf("no longer bounds the probability (its bound, %s, is not above 0)", fmtNum(b))
	}
	return fmt.Sprintf("keeps the probability only at %s or more", fmtNum(b))
}

func confirmed(ce *ledger.CE) string {
	if ce.ConfirmedVersion == nil {
		return "(unknown)"
	}
	return strconv.FormatUint(*ce.ConfirmedVersion, 10)
}

// failing is what the events page says of a publisher whose attempts fail.
type failing struct {
	Since, Attempts, Err string
}

func (u *UI) events(w http.ResponseWriter, r *http.Request) {
	const max = 200
	evs, err := u.src.Events(max + 1)
	if err != nil {
		u.fail(w, http.StatusInternalServerError, err)
		return
	}
	p := page{Title: "Events", Nav: "events", More: len(evs) > max}
	if pub := u.src.Publishing(); !pub.FailingSince.IsZero() {
		p.Failing = &failing{Since: pub.FailingSince.UTC().Format("2006-01-02 15:04:05 UTC"), Attempts: count(float64(pub.Attempts)), Err: pub.Err}
	}
	for _, e := range evs[:min(len(evs), max)] { // newest first
		row := eventRow{Seq: e.Seq, Key: e.Key, Value: string(e.Value)}
		if len(e.Value) > eventShown {
			cut := eventShown
			for cut > 0 && !utf8.RuneStart(e.Value[cut]) {
				cut--
			}
			row.Value, row.Size = string(e.Value[:cut]), len(e.Value)
		}
		p.Events = append(p.Events, row)
	}
	u.render(w, http.StatusOK, "events", p)
}
