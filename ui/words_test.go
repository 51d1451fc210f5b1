package ui

import (
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
		{"at risk, decided", ledger.CE{Status: certify.AtRisk, Decided: true, ConfirmedVersion: &v, PosteriorVersion: 153},
			"gets one again only when a measurement's lower confidence bound reaches 1 - delta plus one more Monte-Carlo margin"},
	} {
		st := Statement(&tc.ce, 0.01)
		if body := strings.Join(st.Body, " "); !strings.Contains(body, tc.want) {
			t.Errorf("%s: %q does not say %q", tc.name, body, tc.want)
		}
	}
}
