package ui

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
)

func TestSafeNextStaysOnTheUI(t *testing.T) {
	for _, tc := range []struct{ next, want string }{
		{"/ui/events", "/ui/events"},
		{"/ui/", "/ui/"},
		{"/ui/counterfactuals?status=certified&after=ce-9", "/ui/counterfactuals?status=certified&after=ce-9"},
		{"/ui/counterfactuals/ce-1/", "/ui/counterfactuals/ce-1/"},
		{"/ui/./events", "/ui/events"},
		{"/ui/../metrics", "/ui/"},
		{"/ui/%2e%2e/metrics", "/ui/"},
		{"/ui/%2E%2E/v1/counterfactuals", "/ui/"},
		{"/ui/a/../../metrics?x=1", "/ui/"},
		{"/ui/..", "/ui/"},
		{"//evil.example/ui/", "/ui/"},
		{"/ui\\..\\metrics", "/ui/"},
		{"https://evil.example/ui/", "/ui/"},
		{"/metrics", "/ui/"},
		{"", "/ui/"},
	} {
		if got := safeNext(tc.next); got != tc.want {
			t.Errorf("safeNext(%q) = %q, want %q", tc.next, got, tc.want)
		}
	}
}

// A count of things is followed by the word that agrees with it: the singular for exactly one,
// the plural for every other count, 0 and fractions included.
func TestCountedAgreesWithItsNumber(t *testing.T) {
	for _, tc := range []struct {
		v    float64
		want string
	}{
		{0, "0 counterfactuals are"}, {1, "1 counterfactual is"}, {2, "2 counterfactuals are"},
		{1234, "1,234 counterfactuals are"}, {1.5, "1.5 counterfactuals are"},
	} {
		if got := counted(tc.v, "counterfactual is", "counterfactuals are"); got != tc.want {
			t.Errorf("counted(%v) = %q, want %q", tc.v, got, tc.want)
		}
	}
}

func TestCountPrintsWholeNumbers(t *testing.T) {
	for _, tc := range []struct {
		v    float64
		want string
	}{
		{0, "0"}, {7, "7"}, {999, "999"}, {1000, "1,000"}, {1e6, "1,000,000"}, {1234567, "1,234,567"},
		{1e7, "10,000,000"}, {-1234, "-1,234"}, {2.5, "2.5"},
	} {
		if got := count(tc.v); got != tc.want {
			t.Errorf("count(%v) = %q, want %q", tc.v, got, tc.want)
		}
	}
}

// TestStatementNamesWhatEachFigureIs: a lapsed certificate's statement gives p1 with the version
// it was measured under and Theorem 1's bound at the version read (nothing when the bound is not
// above 0); a decided at_risk says why a lower bound above 1 - delta does not certify it.
func TestStatementNamesWhatEachFigureIs(t *testing.T) {
	v := uint64(152)
	for _, tc := range []struct {
		name string
		ce   ledger.CE
		want string
	}{
		{"lapsed", ledger.CE{Status: certify.Certified, P1: 0.9983, AnchorVersion: 152, PosteriorVersion: 153, Bound: 0.4957, KLFromAnchor: 0.1263},
			"p1 = 0.9983 was measured under posterior version 152; under version 153, after what the posterior moved since (KL = 0.1263), Theorem 1 keeps the probability only at 0.4957 or more, which no longer certifies it."},
		{"lapsed far", ledger.CE{Status: certify.Certified, P1: 0.99, AnchorVersion: 1, PosteriorVersion: 3, Bound: -11, KLFromAnchor: 72},
			"Theorem 1 no longer bounds the probability (its bound, -11, is not above 0), which no longer certifies it."},
		{"lapsed to 0", ledger.CE{Status: certify.Certified, P1: 0.99, AnchorVersion: 1, PosteriorVersion: 3, Bound: 0, KLFromAnchor: 0.125},
			"Theorem 1 no longer bounds the probability (its bound, 0, is not above 0), which no longer certifies it."},
		{"at risk, decided", ledger.CE{Status: certify.AtRisk, Decided: true, ConfirmedVersion: &v, PosteriorVersion: 153},
			"gets one again only when a measurement's lower confidence bound reaches 1 - delta plus one more Monte-Carlo margin"},
	} {
		st := Statement(&tc.ce, 0.01)
		if body := strings.Join(st.Body, " "); !strings.Contains(body, tc.want) {
			t.Errorf("%s: %q does not say %q", tc.name, body, tc.want)
		}
	}
}

// TestVerdictBoundSaysWhetherItCarries: a CE page calls a verdict bound what decided the status
// only while it carries to the posterior read (decided); an undecided CE's bound is the one
// measured under an earlier posterior, and the page says it no longer says what p is.
func TestVerdictBoundSaysWhetherItCarries(t *testing.T) {
	u := New(Config{}, nil)
	vb, lowVB, confirmed := 0.835, 0.4357, uint64(7)
	for _, tc := range []struct {
		name         string
		ce           ledger.CE
		bound, vbSay string
	}{
		{"decided at_risk", ledger.CE{Status: certify.AtRisk, Decided: true, VerdictBound: &vb, ConfirmedVersion: &confirmed, PosteriorVersion: 7},
			"this status rests on its verdict bound below", "0.835: the confidence bound on p that decided the verdict (lower: p is at least this)"},
		{"at_risk whose verdict no longer carries", ledger.CE{Status: certify.AtRisk, VerdictBound: &vb, ConfirmedVersion: &confirmed, PosteriorVersion: 8, VerdictPending: true},
			"its verdict bound below no longer carries to this posterior, and nothing decides this status now",
			"0.835: the confidence bound on p under the posterior it was measured under (lower); it no longer carries to posterior version 8 and says nothing of p now"},
		{"invalidated whose verdict no longer carries", ledger.CE{Status: certify.Invalidated, VerdictBound: &lowVB, ConfirmedVersion: &confirmed, PosteriorVersion: 8, VerdictPending: true},
			"nothing decides this status now", "0.4357: the confidence bound on p under the posterior it was measured under (upper); it no longer carries"},
		{"at_risk with no verdict yet", ledger.CE{Status: certify.AtRisk, PosteriorVersion: 8, VerdictPending: true},
			"this status rests on a verdict, and none decides it now", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.ce.ID, tc.ce.P1, tc.ce.Samples, tc.ce.X, tc.ce.XCF = "ce-1", 0.97, 1000, []float64{1}, []float64{2}
			rec := httptest.NewRecorder()
			u.render(rec, http.StatusOK, "ce", u.cePage(&tc.ce, &Snapshot{Classes: []string{"no", "yes"}, PosteriorVersion: tc.ce.PosteriorVersion}, "t"))
			page := rec.Body.String()
			if !strings.Contains(page, tc.bound) {
				t.Errorf("the page does not say %q of the Theorem 1 bound:\n%s", tc.bound, page)
			}
			if tc.vbSay == "" {
				if strings.Contains(page, `id="verdict-bound"`) {
					t.Errorf("a verdict bound shown for a CE with none")
				}
				return
			}
			if !strings.Contains(page, `<dd id="verdict-bound">`+tc.vbSay) {
				t.Errorf("the page does not say %q of the verdict bound:\n%s", tc.vbSay, page)
			}
		})
	}
}

// TestClassIndexTakesANameOrAnIndex: a list's target is a class name or an index of a class the
// model has (at least two when it names none), else no class.
func TestClassIndexTakesANameOrAnIndex(t *testing.T) {
	for _, tc := range []struct {
		classes []string
		s       string
		want    int
	}{
		{[]string{"no", "yes"}, "yes", 1}, {[]string{"no", "yes"}, "1", 1}, {[]string{"no", "yes"}, "2", -1},
		{[]string{"no", "yes"}, "-1", -1}, {[]string{"no", "yes"}, "maybe", -1},
		{nil, "1", 1}, {nil, "2", -1}, {[]string{"a", "b", "c"}, "2", 2},
	} {
		if got := classIndex(tc.classes, tc.s); got != tc.want {
			t.Errorf("classIndex(%q, %q) = %d, want %d", tc.classes, tc.s, got, tc.want)
		}
	}
}

// TestBoundsAndCeilingSayNothingUnknown: a list row calls a bound that is not above 0 none (with
// the figure), and an uncertified CE's none; a CE page gives Theorem 2's ceiling as max(epsilon_max,
// the CE's epsilon), and none while epsilon_max is not known.
func TestBoundsAndCeilingSayNothingUnknown(t *testing.T) {
	u := New(Config{}, nil)
	for _, tc := range []struct {
		ce   ledger.CE
		want string
	}{
		{ledger.CE{Status: certify.Certified, Bound: 0.6}, "0.6"},
		{ledger.CE{Status: certify.Certified, Bound: 0}, "none (0)"},
		{ledger.CE{Status: certify.AtRisk, Bound: -0.5}, "none (-0.5)"},
		{ledger.CE{Status: certify.Uncertified, Bound: 0.6}, "none"},
	} {
		if got := u.row(&tc.ce, nil).Bound; got != tc.want {
			t.Errorf("%s with bound %v: the row says %q, want %q", tc.ce.Status, tc.ce.Bound, got, tc.want)
		}
	}
	for _, tc := range []struct {
		epsMax, eps float64
		want        string
	}{
		{0, 0.02, ""}, {0.01, 0.02, "0.02"}, {0.03, 0.02, "0.03"},
	} {
		ce := ledger.CE{ID: "ce-1", Status: certify.Certified, Epsilon: tc.eps}
		if got := u.cePage(&ce, &Snapshot{EpsilonMax: tc.epsMax}, "t").VarCeiling; got != tc.want {
			t.Errorf("epsilon_max %v, epsilon %v: the ceiling %q, want %q", tc.epsMax, tc.eps, got, tc.want)
		}
	}
}

// TestSaysNamesAnUndecidedStatus: a replacement's link says an undecided at_risk or invalidated
// status states nothing, as its page does, and a decided one what it states.
func TestSaysNamesAnUndecidedStatus(t *testing.T) {
	for _, tc := range []struct {
		ce   ledger.CE
		want string
	}{
		{ledger.CE{Status: certify.Certified, Decided: true}, "certified: it holds"},
		{ledger.CE{Status: certify.Certified}, "certified, its certificate lapsed: no statement until it is measured again"},
		{ledger.CE{Status: certify.AtRisk}, "at_risk, undecided: no statement"},
		{ledger.CE{Status: certify.AtRisk, Decided: true}, "at risk: the target is still the most likely class, not certified"},
		{ledger.CE{Status: certify.Invalidated}, "invalidated, undecided: no statement"},
		{ledger.CE{Status: certify.Invalidated, Decided: true}, "invalidated: it does not hold"},
		{ledger.CE{Status: certify.Uncertified}, "uncertified: never certified, no guarantee applies"},
	} {
		if got := says(&tc.ce); got != tc.want {
			t.Errorf("%s decided %v: %q, want %q", tc.ce.Status, tc.ce.Decided, got, tc.want)
		}
	}
}

// TestFeatureRowsChangedFirst: a CE page lists the changed features first, then the rest, each
// group in the model's order.
func TestFeatureRowsChangedFirst(t *testing.T) {
	ce := ledger.CE{ID: "ce-1", Status: certify.Certified, X: []float64{1, 2, 3, 4}, XCF: []float64{1, 5, 3, 6}}
	var got []string
	for _, r := range New(Config{}, nil).cePage(&ce, &Snapshot{Features: []string{"a", "b", "c", "d"}}, "t").Rows {
		got = append(got, r.Name)
	}
	if want := []string{"b", "d", "a", "c"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("rows %q, want %q", got, want)
	}
}

// A figure is rounded to four significant digits, but never across 1/2 or 1: a probability just
// under 1 does not read as certain, a bound just under 1/2 does not read as reaching it.
func TestFiguresKeepTheirSideOfOneHalfAndOne(t *testing.T) {
	for v, want := range map[float64]string{0.9999987670535658: "0.999999", 0.99996: "0.99996", 0.99994: "0.9999", 1: "1",
		0.49996: "0.49996", 0.500004: "0.5", 0.4999999999999999: "0.4999999999999999", 0.0045: "0.0045", -11.18: "-11.18", 74.12006940525939: "74.12"} {
		if got := fmtNum(v); got != want {
			t.Errorf("fmtNum(%v) = %q, want %q", v, got, want)
		}
	}
	ce := &ledger.CE{ID: "ce-1", Status: certify.Certified, Decided: true, P1: 0.9999987670535658, Bound: 0.9999987670535658, Samples: 1000, Var1: 3e-7, VarBound: 3e-7}
	if s := strings.Join(Statement(ce, 0.01).Body, " "); strings.Contains(s, "p1 = 1 ") || strings.Contains(s, " at 1 or more") {
		t.Errorf("a p1 of 0.999999 reads as 1: %s", s)
	}
}

// TestCertificatePageSaysTheStatusItHas: the printable page of a CE that is not valid now says
// what keeps it from being valid, without contradicting its status: a certified CE whose
// certificate lapsed (renewal pending) is still certified, the others are not.
func TestCertificatePageSaysTheStatusItHas(t *testing.T) {
	u := New(Config{}, nil)
	for _, tc := range []struct {
		ce        ledger.CE
		want, not string
	}{
		{ledger.CE{Status: certify.Certified, RenewalPending: true}, "Its certificate has lapsed", "It is not certified now"},
		{ledger.CE{Status: certify.AtRisk, Decided: true}, "It is not certified now", "Its certificate has lapsed"},
		{ledger.CE{Status: certify.Uncertified}, "It is not certified now", "Its certificate has lapsed"},
	} {
		tc.ce.ID, tc.ce.X, tc.ce.XCF = "ce-1", []float64{1}, []float64{2}
		rec := httptest.NewRecorder()
		u.render(rec, http.StatusOK, "certificate", u.cePage(&tc.ce, &Snapshot{}, "t"))
		if page := rec.Body.String(); !strings.Contains(page, tc.want) || strings.Contains(page, tc.not) {
			t.Errorf("%s decided %v: the certificate page does not say %q, or says %q", tc.ce.Status, tc.ce.Decided, tc.want, tc.not)
		}
	}
}

// A lapsed certificate whose lapse version is known says it, on its page and in its statement;
// one whose lapse version is not known says no version.
func TestLapsedCertificateSaysSinceWhen(t *testing.T) {
	u := New(Config{}, nil)
	since := uint64(7)
	for _, tc := range []struct {
		since *uint64
		want  bool
	}{{&since, true}, {nil, false}} {
		ce := ledger.CE{ID: "ce-1", X: []float64{1}, XCF: []float64{2}, Status: certify.Certified, RenewalPending: true,
			RenewalPendingSince: tc.since, AnchorVersion: 3, PosteriorVersion: 9}
		rec := httptest.NewRecorder()
		u.render(rec, http.StatusOK, "ce", u.cePage(&ce, &Snapshot{}, "t"))
		page := rec.Body.String()
		for _, s := range []string{"renewal pending since posterior version 7", "failed at every posterior version since version 7"} {
			if strings.Contains(page, s) != tc.want {
				t.Errorf("since %v: the page says %q: %v, want %v", tc.since, s, !tc.want, tc.want)
			}
		}
		if !strings.Contains(page, "renewal pending") {
			t.Errorf("since %v: the page does not say the renewal is pending", tc.since)
		}
	}
}

// An undecided verdict whose version of stopping is known says it, on its page and in its
// statement; one whose version is not known says no version.
func TestVerdictThatStoppedCarryingSaysSinceWhen(t *testing.T) {
	u := New(Config{}, nil)
	since, cv, vb := uint64(7), uint64(4), 0.55
	for _, status := range []certify.Status{certify.AtRisk, certify.Invalidated} {
		for _, tc := range []struct {
			since *uint64
			want  bool
		}{{&since, true}, {nil, false}} {
			ce := ledger.CE{ID: "ce-1", X: []float64{1}, XCF: []float64{2}, Status: status, VerdictPending: true,
				VerdictPendingSince: tc.since, VerdictBound: &vb, ConfirmedVersion: &cv, AnchorVersion: 3, PosteriorVersion: 9}
			rec := httptest.NewRecorder()
			u.render(rec, http.StatusOK, "ce", u.cePage(&ce, &Snapshot{}, "t"))
			page := rec.Body.String()
			for _, s := range []string{"verdict pending since posterior version 7", "has not carried since posterior version 7"} {
				if strings.Contains(page, s) != tc.want {
					t.Errorf("%s since %v: the page says %q: %v, want %v", status, tc.since, s, !tc.want, tc.want)
				}
			}
			if !strings.Contains(page, "verdict pending") {
				t.Errorf("%s since %v: the page does not say the verdict is pending", status, tc.since)
			}
		}
	}
}
