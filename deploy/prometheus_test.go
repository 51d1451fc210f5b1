package deploy

import (
	"bufio"
	"bytes"
	"encoding/json"
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
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/postlog"
)

// uncommentAuthorization returns prometheus.yml with its commented "authorization:" block
// (the metrics-token option) uncommented.
func uncommentAuthorization(t *testing.T, text []byte) []byte {
	t.Helper()
	lines := strings.Split(string(text), "\n")
	found := false
	for i := 0; i < len(lines); i++ {
		if strings.TrimSpace(lines[i]) != "# authorization:" {
			continue
		}
		found = true
		indent := lines[i][:strings.Index(lines[i], "#")]
		lines[i] = indent + "authorization:"
		for j := i + 1; j < len(lines) && strings.HasPrefix(lines[j], indent+"#   "); j++ {
			lines[j] = indent + strings.TrimPrefix(lines[j], indent+"# ")
		}
	}
	if !found {
		t.Fatal("prometheus.yml shows no commented authorization: block for the metrics token")
	}
	return []byte(strings.Join(lines, "\n"))
}

// promConfig is the part of prometheus.yml the tests read and rewrite.
type promConfig map[string]any

func loadPromConfig(t *testing.T, text []byte) promConfig {
	t.Helper()
	var c map[string]any // a named map type would make yaml decode nested maps as promConfig too
	if err := yaml.Unmarshal(text, &c); err != nil {
		t.Fatal(err)
	}
	return promConfig(c)
}

func (c promConfig) job(t *testing.T, name string) map[string]any {
	t.Helper()
	for _, j := range c["scrape_configs"].([]any) {
		if m := j.(map[string]any); m["job_name"] == name {
			return m
		}
	}
	t.Fatalf("prometheus.yml has no scrape job %q", name)
	return nil
}

func (c promConfig) write(t *testing.T, dir string) string {
	t.Helper()
	b, err := yaml.Marshal(map[string]any(c))
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

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
	c := loadPromConfig(t, text)
	rules := c["rule_files"].([]any)
	if len(rules) != 1 {
		t.Fatalf("rule_files %v", rules)
	}
	if got, _ := filepath.Abs(filepath.Join(filepath.Dir(p), rules[0].(string))); got != filepath.Join(root, "alerts", "rules.yml") {
		t.Errorf("rule_files points at %s, want alerts/rules.yml", got)
	}
	job := c.job(t, "cfguard")
	targets := job["static_configs"].([]any)[0].(map[string]any)["targets"].([]any)
	if targets[0] != config.Default().HTTP.Listen || job["metrics_path"] != "/metrics" {
		t.Errorf("cfguard job scrapes %v%v, want %s/metrics", targets, job["metrics_path"], config.Default().HTTP.Listen)
	}

	// The commented metrics-token option is valid configuration once uncommented.
	withAuth := loadPromConfig(t, uncommentAuthorization(t, text))
	auth, ok := withAuth.job(t, "cfguard")["authorization"].(map[string]any)
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
	promtoolCheck(t, withAuth.write(t, dir))
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

// dashboard is the part of a Grafana dashboard the tests read.
type dashboard struct {
	UID        string  `json:"uid"`
	Title      string  `json:"title"`
	Panels     []panel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

type panel struct {
	ID          int    `json:"id"`
	Type        string `json:"type"`
	Title       string `json:"title"`
	Description string `json:"description"`
	FieldConfig struct {
		Defaults struct {
			NoValue string `json:"noValue"` // what the panel says when its queries return nothing
		} `json:"defaults"`
	} `json:"fieldConfig"`
	Datasource struct {
		Type string `json:"type"`
		UID  string `json:"uid"`
	} `json:"datasource"`
	GridPos struct{ X, Y, W, H int } `json:"gridPos"`
	Targets []struct {
		Expr  string `json:"expr"`
		RefID string `json:"refId"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // a row's
}

func loadDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(tooltest.RepoRoot(t), "deploy", "grafana", "cfguard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("deploy/grafana/cfguard.json: %v", err)
	}
	return d
}

// queries returns every PromQL expression of the dashboard: the panels' targets and the
// template variables' label_values(...) metric selectors, keyed by where they are.
func (d dashboard) queries(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	var walk func(ps []panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			for _, tg := range p.Targets {
				out[p.Title+"/"+tg.RefID] = tg.Expr
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	lv := regexp.MustCompile(`^label_values\((.+), *\w+\)$`)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		if err := json.Unmarshal(v.Query, &q); err != nil {
			var s string
			if json.Unmarshal(v.Query, &s) != nil {
				t.Fatalf("variable %s: query %s", v.Name, v.Query)
			}
			q.Query = s
		}
		m := lv.FindStringSubmatch(q.Query)
		if m == nil {
			t.Fatalf("variable %s: %q is not label_values(selector, label)", v.Name, q.Query)
		}
		out["$"+v.Name] = m[1]
	}
	return out
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
	d := loadDashboard(t)
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
	qs := d.queries(t)
	// One certified counterfactual, so that every gauge has a sample (the smallest bound has none
	// while nothing is certified).
	srv := startDaemon(t, config.Default())
	data, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	registerCounterfactuals(t, srv, "", data.X, 1)
	code, body, err := httpGet("http://"+srv.HTTPAddr()+"/metrics", "")
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
