package deploy

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/deploy/internal/deploytest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/postlog"
)

func promtoolCheck(t *testing.T, path string) {
	t.Helper()
	promtool := tooltest.Command(t, "apt-get install prometheus", "promtool")
	if out, err := exec.Command(promtool, "check", "config", path).CombinedOutput(); err != nil {
		t.Fatalf("promtool check config %s: %v\n%s", path, err, out)
	}
}

// TestPrometheusConfig: promtool accepts prometheus.yml as shipped and with its metrics-token
// option uncommented; rule_files names alerts/rules.yml; the scrape target is cfguard's
// default http.listen.
func TestPrometheusConfig(t *testing.T) {
	root := tooltest.RepoRoot(t)
	p := filepath.Join(root, "deploy", "prometheus", "prometheus.yml")
	promtoolCheck(t, p)
	text, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	c := deploytest.LoadPromConfig(t, text)
	rules := c["rule_files"].([]any)
	if len(rules) != 1 {
		t.Fatalf("rule_files %v", rules)
	}
	if got, _ := filepath.Abs(filepath.Join(filepath.Dir(p), rules[0].(string))); got != filepath.Join(root, "alerts", "rules.yml") {
		t.Errorf("rule_files points at %s, want alerts/rules.yml", got)
	}
	job := c.Job(t, "cfguard")
	targets := job["static_configs"].([]any)[0].(map[string]any)["targets"].([]any)
	if targets[0] != config.Default().HTTP.Listen || job["metrics_path"] != "/metrics" {
		t.Errorf("cfguard job scrapes %v%v, want %s/metrics", targets, job["metrics_path"], config.Default().HTTP.Listen)
	}

	// The commented metrics-token option is valid configuration once uncommented.
	withAuth := deploytest.LoadPromConfig(t, deploytest.UncommentAuthorization(t, text))
	auth, ok := withAuth.Job(t, "cfguard")["authorization"].(map[string]any)
	if !ok || auth["type"] != "Bearer" || auth["credentials_file"] == nil {
		t.Fatalf("uncommented authorization: %v", auth)
	}
	// promtool wants the credentials file to exist.
	dir := t.TempDir()
	auth["credentials_file"] = filepath.Join(dir, "cfguard-metrics-token")
	if err := os.WriteFile(auth["credentials_file"].(string), []byte("m3trics"), 0o600); err != nil {
		t.Fatal(err)
	}
	withAuth["rule_files"] = []any{filepath.Join(root, "alerts", "rules.yml")}
	promtoolCheck(t, withAuth.Write(t, dir))
}

// TestAlertmanagerConfig: amtool accepts alertmanager.yml, and routes each of cfguard's alerts
// by its severity: critical ones page, the others go to the ticket receiver.
func TestAlertmanagerConfig(t *testing.T) {
	amtool := tooltest.Command(t, "apt-get install prometheus-alertmanager", "amtool")
	p := filepath.Join(tooltest.RepoRoot(t), "deploy", "prometheus", "alertmanager.yml")
	if out, err := exec.Command(amtool, "check-config", p).CombinedOutput(); err != nil {
		t.Fatalf("amtool check-config: %v\n%s", err, out)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert  string            `yaml:"alert"`
				Labels map[string]string `yaml:"labels"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(alerts.Rules(), &rules); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			want := map[string]string{"critical": "cfguard-page", "warning": "cfguard-ticket"}[r.Labels["severity"]]
			if want == "" {
				t.Errorf("alert %s has severity %q, which the route does not expect", r.Alert, r.Labels["severity"])
				continue
			}
			// stdout only: amtool warns on stderr when an amtool config file names a server.
			out, err := exec.Command(amtool, "config", "routes", "test", "--config.file", p,
				"alertname="+r.Alert, "severity="+r.Labels["severity"], "job=cfguard", "instance=cfguard:8080").Output()
			if err != nil || strings.TrimSpace(string(out)) != want {
				t.Errorf("amtool routes %s to %q (%v), want %s", r.Alert, strings.TrimSpace(string(out)), err, want)
			}
			n++
		}
	}
	if n == 0 {
		t.Fatal("no alert rules read")
	}
}

var metricName = regexp.MustCompile(`\bcfguard_[a-zA-Z0-9_]+`)

// metricNames scrapes a /metrics body for its metric family names.
func metricNames(body []byte) map[string]bool {
	names := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(body))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) >= 3 && f[0] == "#" && f[1] == "TYPE" {
			names[f[2]] = true
		}
	}
	return names
}

// familyOf maps a series name to its family (histograms' _bucket, _sum and _count).
func familyOf(name string, names map[string]bool) string {
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok && names[base] {
			return base
		}
	}
	return name
}

// TestDashboard: the dashboard's panels are well formed, cover what an operator needs, and
// every metric its queries name is served by a running daemon's /metrics.
func TestDashboard(t *testing.T) {
	d := deploytest.LoadDashboard(t)
	if d.UID == "" || d.Title == "" {
		t.Error("the dashboard needs a uid and a title (import and links)")
	}
	ids := map[int]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d repeated", p.ID)
		}
		ids[p.ID] = true
		if p.Title == "" || len(p.Targets) == 0 || p.Datasource.UID != "${datasource}" || p.GridPos.W == 0 || p.GridPos.H == 0 {
			t.Errorf("panel %d %q: want a title, targets, the ${datasource} variable and a size", p.ID, p.Title)
		}
	}
	qs := d.Queries(t)
	// One certified counterfactual, so that every gauge has a sample (the smallest bound has none
	// while nothing is certified).
	srv := deploytest.StartDaemon(t, config.Default())
	data, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	deploytest.RegisterCounterfactuals(t, srv, "", data.X, 1)
	code, body, err := deploytest.HTTPGet("http://"+srv.HTTPAddr()+"/metrics", "")
	if err != nil || code != 200 {
		t.Fatalf("scraping the daemon: %d %v", code, err)
	}
	served := metricNames(body)
	// A single node does not serve the replicas' metrics: those come from what package alerts
	// registers for a replica (the daemon's tests check a replica registers them).
	replica := prometheus.NewRegistry()
	alerts.NewReplicaMetrics(replica, []string{string(postlog.PastEnd), string(postlog.Invalid)}, "cfguard.posterior", "cfguard.ce")
	mfs, err := replica.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		served[mf.GetName()] = true
	}
	used := map[string]bool{}
	for where, q := range qs {
		refs := metricName.FindAllString(q, -1)
		if len(refs) == 0 {
			t.Errorf("%s: %q names no cfguard metric", where, q)
		}
		for _, r := range refs {
			f := familyOf(r, served)
			if !served[f] {
				t.Errorf("%s: %s is not served by the daemon's /metrics", where, r)
			}
			used[f] = true
		}
	}
	// What the dashboard is for.
	for _, want := range []string{alerts.NamePosteriorKL, alerts.NamePosteriorKLMaxAnchor, alerts.NameKLBudget, alerts.NameCounterfactuals,
		alerts.NameBoundMin, alerts.NameRecords, alerts.NameConsumerLag, alerts.NameUpdates} {
		if !used[want] {
			t.Errorf("no panel shows %s", want)
		}
	}
	if !slices.ContainsFunc(slices.Collect(func(yield func(string) bool) {
		for _, q := range qs {
			if !yield(q) {
				return
			}
		}
	}), func(q string) bool { return strings.Contains(q, `result="dead_lettered"`) }) {
		t.Error("no panel shows the dead-letter rate")
	}
}
