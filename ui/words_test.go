package ui

import "testing"

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
