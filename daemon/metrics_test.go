package daemon

import (
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/alerts"
)

// families returns the metric family names r's registry exposes.
func (r *running) families(t *testing.T) []string {
	t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, mf := range mfs {
		names = append(names, mf.GetName())
	}
	return names
}

// A running daemon's registry holds only metrics of package alerts (their one home, where the
// naming rule is tested) beside the client library's own (promhttp_; go_ and process_ where
// main adds them), and every metric an alert queries is registered by a single node or, for the
// replicas' alerts, by a replica.
func TestRulesQueryWhatTheDaemonRegisters(t *testing.T) {
	single := startDaemon(t, nil)
	replica := startReplica(t, startCluster(t, 1), "r1")
	registered := map[string]bool{}
	for _, c := range []struct {
		kind string
		r    *running
	}{{"single node", single}, {"replica", replica}} {
		for _, name := range c.r.families(t) {
			library := strings.HasPrefix(name, "promhttp_") || strings.HasPrefix(name, "go_") || strings.HasPrefix(name, "process_")
			if !library && !slices.Contains(alerts.Names(), name) {
				t.Errorf("the %s registers %s, which package alerts does not define", c.kind, name)
			}
			registered[name] = true
		}
	}
	rules, err := alerts.RuleMetrics()
	if err != nil {
		t.Fatal(err)
	}
	if len(rules) == 0 {
		t.Fatal("alerts.RuleMetrics found no alert")
	}
	for alert, metrics := range rules {
		for _, m := range metrics {
			if !registered[m] {
				t.Errorf("alert %s queries %s, which neither a single node nor a replica registers", alert, m)
			}
		}
	}
}
