package ui

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The runbook page holds a section for every alert of alerts/rules.yml, under the anchor its
// runbook_url names; every link inside the page leads to an id of the page, and every other
// link out of the daemon, not to a path the daemon does not serve. The UI's own links into it
// (templates and conditions) name sections that exist.
func TestRunbookPageHasEveryAlertsSection(t *testing.T) {
	u := New(Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, nil)
	rec := httptest.NewRecorder()
	u.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, runbookPath, nil))
	page := rec.Body.String()
	if rec.Code != http.StatusOK || !strings.HasPrefix(rec.Header().Get("Content-Type"), "text/html") {
		t.Fatalf("GET %s: %d %s", runbookPath, rec.Code, rec.Header().Get("Content-Type"))
	}
	if n := strings.Count(page, "<h1"); n != 1 || !strings.Contains(page, `aria-current="page">Runbook</a>`) {
		t.Errorf("%d level-1 headings (want the page's one alone), or the navigation does not mark the runbook", n)
	}
	ids := map[string]bool{}
	for _, m := range regexp.MustCompile(` id="([^"]+)"`).FindAllStringSubmatch(page, -1) {
		ids[m[1]] = true
	}

	rules, err := os.ReadFile(filepath.Join("..", "alerts", "rules.yml"))
	if err != nil {
		t.Fatal(err)
	}
	alerts := regexp.MustCompile(`(?s)- alert: (\w+).*?runbook_url: "[^"#]+#([^"]+)"`).FindAllStringSubmatch(string(rules), -1)
	if len(alerts) < 10 {
		t.Fatalf("%d alerts with a runbook_url in alerts/rules.yml: the pattern no longer reads the file", len(alerts))
	}
	for _, m := range alerts {
		if !ids[m[2]] {
			t.Errorf("%s: its runbook_url names #%s, which is no id of the runbook page", m[1], m[2])
		}
		if !ids[strings.TrimPrefix(runbookLink(m[1]), runbookPath+"#")] {
			t.Errorf("%s: the UI links %s, which is no id of the runbook page", m[1], runbookLink(m[1]))
		}
	}

	hrefs := regexp.MustCompile(` href="([^"]*)"`).FindAllStringSubmatch(page, -1)
	inPage := 0
	for _, m := range hrefs {
		switch h := m[1]; {
		case strings.HasPrefix(h, "#"):
			inPage++
			if !ids[h[1:]] {
				t.Errorf("the link %s names no id of the page", h)
			}
		case strings.HasPrefix(h, "/ui/"), strings.HasPrefix(h, "https://"), h == "data:,": // data:, is the layout's empty icon
		default:
			t.Errorf("the link %q leads nowhere the UI serves", h)
		}
	}
	if inPage == 0 {
		t.Error("no link inside the page: the runbook's own links were lost")
	}

	// The templates' links into the runbook.
	tmpls, err := filepath.Glob(filepath.Join("templates", "*.html"))
	if err != nil {
		t.Fatal(err)
	}
	links := 0
	for _, f := range tmpls {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range regexp.MustCompile(regexp.QuoteMeta(runbookPath)+`#([a-z0-9-]+)`).FindAllStringSubmatch(string(b), -1) {
			links++
			if !ids[m[1]] {
				t.Errorf("%s links %s#%s, which is no id of the runbook page", f, runbookPath, m[1])
			}
		}
	}
	if links == 0 {
		t.Error("no template links into the runbook")
	}
}

// A link of the runbook leads where it leads on GitHub: within the page, out, or to the
// repository's copy of another file.
func TestRunbookLinks(t *testing.T) {
	for dest, want := range map[string]string{
		"#cfguarddown":                  "#cfguarddown",
		"UI.md":                         "https://github.com/cfguard/cfguard/blob/main/docs/UI.md",
		"OPERATIONS.md#events":          "https://github.com/cfguard/cfguard/blob/main/docs/OPERATIONS.md#events",
		"../alerts/rules.yml":           "https://github.com/cfguard/cfguard/blob/main/alerts/rules.yml",
		"../deploy/k8s/":                "https://github.com/cfguard/cfguard/blob/main/deploy/k8s",
		"https://prometheus.io/docs/":   "https://prometheus.io/docs/",
		"mailto:oncall@example.org":     "mailto:oncall@example.org",
		"../README.md#set-up":           "https://github.com/cfguard/cfguard/blob/main/README.md#set-up",
		"./CONFIGURATION.md#http-token": "https://github.com/cfguard/cfguard/blob/main/docs/CONFIGURATION.md#http-token",
	} {
		if got := repoLink(dest); got != want {
			t.Errorf("repoLink(%q) = %q, want %q", dest, got, want)
		}
	}
}

// With http.token set the runbook, like every page, asks for it.
func TestRunbookAsksForTheToken(t *testing.T) {
	u := New(Config{Token: "tok", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, nil)
	rec := httptest.NewRecorder()
	u.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, runbookPath, nil))
	if rec.Code != http.StatusSeeOther || !strings.HasPrefix(rec.Header().Get("Location"), "/ui/login?next=") {
		t.Fatalf("GET %s without the token: %d to %q, want 303 to the sign-in form", runbookPath, rec.Code, rec.Header().Get("Location"))
	}
}
