package deploy

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/deploy/internal/deploytest"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// TestDeployGuide: what docs/DEPLOY.md names exists. Every repository path in backquotes is a
// file or directory, every configuration key (`section.key`, `section.key.*`) is one the daemon
// reads, every alert is in alerts/rules.yml and every alert of it is named, and every metric is
// served by a running daemon.
func TestDeployGuide(t *testing.T) {
	root := tooltest.RepoRoot(t)
	guide, err := os.ReadFile(filepath.Join(root, "docs", "DEPLOY.md"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(guide)

	// Code spans, and the fenced blocks' words.
	var spans []string
	for _, m := range regexp.MustCompile("`([^`\n]+)`").FindAllStringSubmatch(text, -1) {
		spans = append(spans, m[1])
	}

	// Paths.
	paths := 0
	for _, s := range spans {
		w := strings.Fields(s)
		if len(w) == 0 {
			continue
		}
		p := strings.TrimSuffix(strings.TrimRight(w[0], ":,"), "/")
		if !regexp.MustCompile(`^(deploy|alerts|docs|examples|cmd|Dockerfile)\b[\w./-]*$`).MatchString(p) || strings.Contains(p, "://") {
			continue
		}
		paths++
		if _, err := os.Stat(filepath.Join(root, p)); err != nil {
			t.Errorf("docs/DEPLOY.md names %s, which is not in the repository", p)
		}
	}
	if paths < 10 {
		t.Errorf("only %d repository paths found in docs/DEPLOY.md; the pattern above is wrong", paths)
	}

	// Configuration keys, against the default configuration's YAML.
	b, err := yaml.Marshal(config.Default())
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := yaml.Unmarshal(b, &cfg); err != nil {
		t.Fatal(err)
	}
	keys := 0
	for _, s := range spans {
		if !regexp.MustCompile(`^[a-z_]+(\.[a-z_]+)+(\.\*)?$`).MatchString(s) {
			continue
		}
		first, _, _ := strings.Cut(s, ".")
		if _, ok := cfg[first]; !ok || regexp.MustCompile(`\.(json|safetensors|ya?ml|db)$`).MatchString(s) {
			continue // a file name such as model.json
		}
		keys++
		var cur any = cfg
		for _, part := range strings.Split(strings.TrimSuffix(s, ".*"), ".") {
			m, ok := cur.(map[string]any)
			if !ok {
				t.Errorf("docs/DEPLOY.md names the setting %s, which the configuration does not have (%s is not a section)", s, part)
				break
			}
			if cur, ok = m[part]; !ok {
				t.Errorf("docs/DEPLOY.md names the setting %s, which the configuration does not have", s)
				break
			}
		}
	}
	if keys < 8 {
		t.Errorf("only %d configuration keys found in docs/DEPLOY.md; the pattern above is wrong", keys)
	}

	// Alerts.
	rules, err := os.ReadFile(filepath.Join(root, "alerts", "rules.yml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range regexp.MustCompile(`\bCfguard[A-Z]\w+`).FindAllString(text, -1) {
		if !strings.Contains(string(rules), "alert: "+a+"\n") {
			t.Errorf("docs/DEPLOY.md names the alert %s, which alerts/rules.yml does not define", a)
		}
	}
	for _, m := range regexp.MustCompile(`(?m)^\s*- alert: (\w+)`).FindAllStringSubmatch(string(rules), -1) {
		if !strings.Contains(text, "`"+m[1]+"`") {
			t.Errorf("alerts/rules.yml defines %s, which docs/DEPLOY.md's list of alerts does not name", m[1])
		}
	}

	// Metrics, against a running daemon's /metrics.
	cfg2 := config.Default()
	cfg2.Audit.Schedule = ""
	d := deploytest.StartDaemon(t, cfg2)
	code, body, err := deploytest.HTTPGet("http://"+d.HTTPAddr()+"/metrics", "")
	if err != nil || code != 200 {
		t.Fatalf("/metrics: %d %v", code, err)
	}
	served := metricNames(body)
	for _, m := range metricName.FindAllString(text, -1) {
		if !served[familyOf(m, served)] {
			t.Errorf("docs/DEPLOY.md names the metric %s, which the daemon does not serve", m)
		}
	}
}
