// Package deploytest holds what the tests of cfguard's deployment files share: a daemon run
// in-process on loopback, a client of its API, counterfactuals registered on it, prometheus.yml
// read and rewritten for a test, and the Grafana dashboard's panels and queries.
//
// The tests are in package deploy (the files themselves: the image, the manifests, the
// configurations, the dashboard) and in deploy/internal/tests/alerting (the shipped Prometheus and
// Alertmanager run against a live daemon), two go test processes, each within go test's time
// limit on a busy core.
package deploytest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// HTTPGet returns the status and body of GET url with an optional bearer token.
func HTTPGet(url, token string) (int, []byte, error) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return 0, nil, err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// StartDaemon runs daemon.Run in-process on loopback (HTTP API and embedded broker on ephemeral
// ports, state in a temporary directory) with cfg as the starting point, and stops it when the
// test ends. It returns the running daemon once /readyz answers 200.
func StartDaemon(t testing.TB, cfg config.Config) *daemon.Daemon {
	t.Helper()
	cfg.StateDir = t.TempDir()
	cfg.Model.ExportDir = ""
	cfg.HTTP.Listen = "127.0.0.1:0"
	cfg.Kafka.Brokers = nil
	cfg.Kafka.EmbeddedListen = "127.0.0.1:0"
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan *daemon.Daemon, 1)
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(tooltest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelWarn}))
	go func() {
		done <- daemon.Run(ctx, daemon.Options{Config: &cfg, Logger: log, Registry: prometheus.NewRegistry(), Ready: ready})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("daemon stopped with %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("daemon did not stop within 30 s of cancel")
		}
	})
	var d *daemon.Daemon
	select {
	case d = <-ready:
	case err := <-done:
		t.Fatalf("daemon failed to start: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("daemon did not start within 60 s")
	}
	waitfor.Cond(t, 20*time.Second, "the daemon's /readyz", func() bool {
		code, _, err := HTTPGet("http://"+d.HTTPAddr()+"/readyz", "")
		return err == nil && code == 200
	})
	return d
}

// APIDo sends a JSON request to the daemon's API with the token.
func APIDo(t testing.TB, d *daemon.Daemon, token, method, path string, body any) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(method, "http://"+d.HTTPAddr()+path, bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, out
}

// admitted says whether a CE measured at (p, v) from S draws is admitted as certified, with a
// margin of 0.01 for the daemon's own draws: registration takes the rule that renews a
// certificate, lower(p) >= 1 - delta at confidence 1 - certify.verdict_alpha (the defaults).
// S = 400, the fewest draws the tests' daemons use, judges conservatively for more.
func admitted(p, v float64, S int) bool {
	lo, _ := certify.Evidence{P: p, Var: v, Samples: S}.Interval(certify.DefaultVerdictAlpha)
	return lo >= 0.96
}

// RegisterCounterfactuals asks the daemon (POST /v1/predict) for malignant rows x and benign
// rows x_cf of X (breast_cancer's) that the current posterior puts in the <delta, epsilon>-set
// for "benign", and registers n pairs, ce-0 to ce-(n-1), through POST /v1/counterfactuals.
func RegisterCounterfactuals(t testing.TB, d *daemon.Daemon, token string, X [][]float64, n int) {
	t.Helper()
	code, body := APIDo(t, d, token, "POST", "/v1/predict", map[string]any{"xs": X})
	if code != 200 {
		t.Fatalf("predict: %d %s", code, body)
	}
	var resp struct {
		Predictions []struct {
			Index int       `json:"index"`
			P     []float64 `json:"p"`
			Var   []float64 `json:"var"`
		} `json:"predictions"`
	}
	if err := json.Unmarshal(body, &resp); err != nil {
		t.Fatal(err)
	}
	var xs, cfs []int
	for i, p := range resp.Predictions {
		switch {
		case p.Index == 0 && p.P[0] > 0.9:
			xs = append(xs, i)
		case p.Var[1] < 0.002 && admitted(p.P[1], p.Var[1], 400):
			cfs = append(cfs, i)
		}
	}
	if len(xs) < n || len(cfs) < n {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	for k := 0; k < n; k++ {
		code, body := APIDo(t, d, token, "POST", "/v1/counterfactuals", map[string]any{"id": fmt.Sprintf("ce-%d", k), "x": X[xs[k]], "x_cf": X[cfs[k]], "target": "benign"})
		if code != http.StatusCreated {
			t.Fatalf("register ce-%d: %d %s", k, code, body)
		}
	}
}

// UncommentAuthorization returns prometheus.yml with its commented "authorization:" block
// (the metrics-token option) uncommented.
func UncommentAuthorization(t testing.TB, text []byte) []byte {
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

// PromConfig is the part of prometheus.yml the tests read and rewrite.
type PromConfig map[string]any

// LoadPromConfig decodes prometheus.yml's text.
func LoadPromConfig(t testing.TB, text []byte) PromConfig {
	t.Helper()
	var c map[string]any // a named map type would make yaml decode nested maps as PromConfig too
	if err := yaml.Unmarshal(text, &c); err != nil {
		t.Fatal(err)
	}
	return PromConfig(c)
}

// Job returns the scrape job named name, failing the test when there is none.
func (c PromConfig) Job(t testing.TB, name string) map[string]any {
	t.Helper()
	for _, j := range c["scrape_configs"].([]any) {
		if m := j.(map[string]any); m["job_name"] == name {
			return m
		}
	}
	t.Fatalf("prometheus.yml has no scrape job %q", name)
	return nil
}

// Write writes the configuration to dir/prometheus.yml and returns that path.
func (c PromConfig) Write(t testing.TB, dir string) string {
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

// Dashboard is the part of a Grafana dashboard the tests read.
type Dashboard struct {
	UID        string  `json:"uid"`
	Title      string  `json:"title"`
	Panels     []Panel `json:"panels"`
	Templating struct {
		List []struct {
			Name  string          `json:"name"`
			Type  string          `json:"type"`
			Query json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

// Panel is one panel of a Dashboard, or a row of panels.
type Panel struct {
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
	Panels []Panel `json:"panels"` // a row's
}

// LoadDashboard reads deploy/grafana/cfguard.json.
func LoadDashboard(t testing.TB) Dashboard {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(tooltest.RepoRoot(t), "deploy", "grafana", "cfguard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d Dashboard
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("deploy/grafana/cfguard.json: %v", err)
	}
	return d
}

// FlatPanels is every panel of d, those in rows included.
func (d Dashboard) FlatPanels() []Panel {
	var out []Panel
	var walk func(ps []Panel)
	walk = func(ps []Panel) {
		for _, p := range ps {
			out = append(out, p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return out
}

var labelValues = regexp.MustCompile(`^label_values\((.+), *\w+\)$`)

// Queries returns every PromQL expression of the dashboard: the panels' targets and the
// template variables' label_values(...) metric selectors, keyed by where they are.
func (d Dashboard) Queries(t testing.TB) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, p := range d.FlatPanels() {
		for _, tg := range p.Targets {
			out[p.Title+"/"+tg.RefID] = tg.Expr
		}
	}
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
		m := labelValues.FindStringSubmatch(q.Query)
		if m == nil {
			t.Fatalf("variable %s: %q is not label_values(selector, label)", v.Name, q.Query)
		}
		out["$"+v.Name] = m[1]
	}
	return out
}
