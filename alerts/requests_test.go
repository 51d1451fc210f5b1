package alerts

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The request counters start at 0 for every kind and result, count what they are given, and
// create no series for a label value outside their sets.
func TestRequestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewRequestMetrics(reg)
	if n := testutil.CollectAndCount(m.skipped); n != len(RequestKinds()) {
		t.Errorf("%s has %d series, want %d", NameRequestsSkipped, n, len(RequestKinds()))
	}
	if n := testutil.CollectAndCount(m.replayed); n != len(RequestResults()) {
		t.Errorf("%s has %d series, want %d", NameRequestsReplayed, n, len(RequestResults()))
	}
	m.Skipped("delete", 2)
	m.Skipped("register", 0)
	m.Skipped("bogus", 1)
	m.Replayed("deleted")
	m.Replayed("bogus")
	want := `
# HELP cfguard_requests_skipped_total ` + help(t, reg, NameRequestsSkipped) + `
# TYPE cfguard_requests_skipped_total counter
cfguard_requests_skipped_total{kind="delete"} 2
cfguard_requests_skipped_total{kind="register"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), NameRequestsSkipped); err != nil {
		t.Error(err)
	}
	if got := testutil.ToFloat64(m.replayed.WithLabelValues("deleted")); got != 1 {
		t.Errorf("replayed{result=deleted} = %v, want 1", got)
	}
	if n := testutil.CollectAndCount(m.replayed); n != len(RequestResults()) {
		t.Errorf("after an unknown result, %s has %d series, want %d", NameRequestsReplayed, n, len(RequestResults()))
	}
}

// help is the help text reg gathers for name.
func help(t *testing.T, reg *prometheus.Registry, name string) string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetHelp()
		}
	}
	t.Fatalf("%s is not registered", name)
	return ""
}
