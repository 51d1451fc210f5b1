package runbook

import (
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/runbooktest"
)

// families returns the metric family names r's registry exposes.
func families(r *launch.Running, t *testing.T) []string {
	t.Helper()
	mfs, err := r.Reg.Gather()
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
	t.Parallel() // mostly waits for a replica to join and for promtool
	single := launch.Daemon(t, nil)
	replica := launch.Replica(t, daemontest.StartCluster(t, 1), "r1")
	registered := map[string]bool{}
	for _, c := range []struct {
		kind string
		r    *launch.Running
	}{{"single node", single}, {"replica", replica}} {
		for _, name := range families(c.r, t) {
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

// Each `curl .../metrics | grep -E 'PATTERN'` of the single-node sections of docs/RUNBOOK.md,
// run on a live daemon's /metrics as written, prints a sample of every metric its pattern names
// (cfguard_a_(b|c) names cfguard_a_b and cfguard_a_c), so that a runbook command shows what its
// section says it shows. The replicas' sections (daemontest.RunbookReplicaSections) name metrics a single
// node does not have; their tests run them against replicas and check what they print.
func TestRunbookMetricGrepsFindTheirMetrics(t *testing.T) {
	r := launch.Daemon(t, nil)
	code, body := r.Get(t, "/metrics")
	if code != 200 {
		t.Fatalf("GET /metrics: %d", code)
	}
	lines := strings.Split(string(body), "\n")
	var greps [][]string
	for _, s := range runbooktest.Sections(t, daemontest.RunbookPath(t)) {
		if _, replicas := daemontest.RunbookReplicaSections[s.Name]; !replicas {
			for _, c := range s.Commands {
				greps = append(greps, regexp.MustCompile(`/metrics \| grep -E '([^']+)'`).FindAllStringSubmatch(c, -1)...)
			}
		}
	}
	if len(greps) < 3 {
		t.Fatalf("docs/RUNBOOK.md has %d greps of /metrics; the test expects the three of its sections", len(greps))
	}
	alternation := regexp.MustCompile(`^\^?(cfguard_[a-z0-9_]*)\(([a-z0-9_|]+)\)$`)
	for _, g := range greps {
		pattern := g[1]
		re, err := regexp.Compile(pattern)
		if err != nil {
			t.Errorf("grep -E '%s': %v", pattern, err)
			continue
		}
		m := alternation.FindStringSubmatch(pattern)
		if m == nil {
			t.Errorf("grep -E '%s' is not of the form cfguard_prefix_(name|name...): the test cannot tell what it should print", pattern)
			continue
		}
		for _, alt := range strings.Split(m[2], "|") {
			name, found := m[1]+alt, false
			for _, l := range lines {
				if re.MatchString(l) && (strings.HasPrefix(l, name+" ") || strings.HasPrefix(l, name+"{")) {
					found = true
					break
				}
			}
			if !found {
				t.Errorf("grep -E '%s' on a live daemon's /metrics prints no sample of %s", pattern, name)
			}
		}
	}
}
