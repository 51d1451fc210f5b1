package uibrowser

import (
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	cdplog "github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"

	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/ui/uitest"
)

//go:embed a11y.js
var a11yRules string

// chromium finds Debian's chromium: skipped without it, a failure when CFGUARD_REQUIRE_TOOLS=1.
func chromium(t *testing.T) string {
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	msg := "chromium is not installed (Debian: apt-get install chromium); the browser tests need it"
	if os.Getenv("CFGUARD_REQUIRE_TOOLS") == "1" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// browser is one headless chromium tab with the page errors it reported.
type browser struct {
	t        *testing.T
	ctx      context.Context
	shots    string
	mu       sync.Mutex
	problems []string
}

func newBrowser(t *testing.T) *browser {
	path := chromium(t)
	// Chromium makes its singleton socket's directory under TMPDIR and leaves it behind: give it
	// the test's own, removed once the browser has stopped (cleanups run last first).
	tmp := t.TempDir()
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(path), chromedp.NoSandbox,
		chromedp.WindowSize(1280, 800), chromedp.Flag("disable-dev-shm-usage", true), chromedp.Env("TMPDIR="+tmp))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(func() { cancel(); cancelAlloc() }) // stops the browser process
	b := &browser{t: t, ctx: ctx, shots: os.Getenv("CFGUARD_UI_ARTEFACTS")}
	if b.shots == "" {
		b.shots = t.TempDir()
	}
	err := chromedp.Listen(ctx, func(ev any) {
		b.mu.Lock()
		defer b.mu.Unlock()
		switch e := ev.(type) {
		case *runtime.EventConsoleAPICalled:
			if e.Type == runtime.ConsoleAPICalledTypeError || e.Type == runtime.ConsoleAPICalledTypeWarning {
				b.problems = append(b.problems, fmt.Sprintf("console %s: %v", e.Type, e.Args))
			}
		case *runtime.EventExceptionThrown:
			b.problems = append(b.problems, "exception: "+e.ExceptionDetails.Text)
		case *cdplog.EventEntryAdded:
			if e.Entry.Level == cdplog.EntryLevelError || e.Entry.Level == cdplog.EntryLevelWarning {
				b.problems = append(b.problems, fmt.Sprintf("log %s: %s %s", e.Entry.Level, e.Entry.Text, e.Entry.URL))
			}
		}
	})
	if err != nil {
		t.Fatalf("starting chromium: %v", err)
	}
	for _, enable := range []cdp.Command[cdp.Empty, cdp.Empty]{cdplog.Enable, runtime.Enable} {
		if _, err := chromedp.Call(ctx, enable, cdp.Empty{}); err != nil {
			t.Fatalf("chromium: %s: %v", enable.Method, err)
		}
	}
	return b
}

// run runs steps in the tab; a step that fails (or waits for two minutes) fails the test.
func (b *browser) run(steps ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 2*time.Minute)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		b.t.Fatalf("browser: %v", err)
	}
}

// follow runs steps that navigate (a click on a link or on a form's button) and waits until the
// page they lead to has loaded. Waiting for an element instead can find it on the page being left
// when both pages have it (the list and its next page), and a query of that page then waits for
// ever once the page is gone.
func (b *browser) follow(steps ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 2*time.Minute)
	defer cancel()
	if _, err := chromedp.RunResponse(ctx, steps...); err != nil {
		b.t.Fatalf("browser: %v", err)
	}
}

// value runs one action that returns a value.
func value[T any](b *browser, a chromedp.Action[T]) T {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 2*time.Minute)
	defer cancel()
	v, err := chromedp.Run(ctx, a)
	if err != nil {
		b.t.Fatalf("browser: %v", err)
	}
	return v
}

func (b *browser) text(sel string) string {
	b.t.Helper()
	return strings.TrimSpace(value(b, chromedp.Text(chromedp.CSS(sel))))
}

// check runs the page checks every page gets: no page error, the accessibility rules, no
// horizontal scrolling at a phone's width, and a screenshot at each width.
func (b *browser) check(name string) {
	b.t.Helper()
	for _, v := range value(b, chromedp.Evaluate[[]string](a11yRules)) {
		b.t.Errorf("%s: accessibility: %s", name, v)
	}
	b.save(name+"-1280.png", value(b, chromedp.FullScreenshot(100)))
	b.run(chromedp.EmulateViewport(375, 800))
	overflow := value(b, chromedp.Evaluate[bool](`document.documentElement.scrollWidth > document.documentElement.clientWidth + 1`))
	b.save(name+"-375.png", value(b, chromedp.FullScreenshot(100)))
	b.run(chromedp.EmulateViewport(1280, 800))
	if overflow {
		b.t.Errorf("%s: the page scrolls sideways at 375 px", name)
	}
	b.mu.Lock()
	for _, p := range b.problems {
		b.t.Errorf("%s: %s", name, p)
	}
	b.problems = nil
	b.mu.Unlock()
}

// readmeShot writes what a 1280x800 window shows to $CFGUARD_UI_SCREENSHOTS/name, when that
// is set (a relative path is from the repository's root): the README's pictures come from this test (docs/DEVELOPMENT.md has the command).
func (b *browser) readmeShot(name string) {
	b.t.Helper()
	dir := os.Getenv("CFGUARD_UI_SCREENSHOTS")
	if dir == "" {
		return
	}
	if !filepath.IsAbs(dir) { // relative to the repository's root, where the command runs
		dir = filepath.Join("..", "..", dir)
	}
	value(b, chromedp.Evaluate[any](`document.activeElement.blur(); window.scrollTo(0, 0)`))
	if err := os.WriteFile(filepath.Join(dir, name), value(b, chromedp.CaptureScreenshot()), 0o644); err != nil {
		b.t.Errorf("README screenshot %s: %v", name, err)
	}
}

func (b *browser) save(name string, png []byte) {
	if err := os.WriteFile(filepath.Join(b.shots, name), png, 0o644); err != nil {
		b.t.Errorf("screenshot %s: %v", name, err)
	}
}

// tabReachesEverything presses Tab through the page and checks that every link, button and
// form control it shows gets the focus, in document order.
func (b *browser) tabReachesEverything(name string) {
	b.t.Helper()
	const mark = `(() => {
	  const els = Array.from(document.querySelectorAll('a[href], button, select, input:not([type="hidden"]), summary, [tabindex="0"]'))
	    .filter((e) => e.classList.contains('skip') || (e.getClientRects().length > 0 && !e.closest('details:not([open]) > :not(summary)')));
	  els.forEach((e, i) => e.setAttribute('data-tab', i));
	  return els.length;
	})()`
	n := value(b, chromedp.Evaluate[int](mark))
	value(b, chromedp.Evaluate[any](`document.activeElement.blur()`))
	var order []int
	for range n + 2 {
		b.run(chromedp.KeyEvent(kb.Tab))
		k := value(b, chromedp.Evaluate[string](`document.activeElement.getAttribute('data-tab') || ''`))
		if k == "" {
			break
		}
		i, _ := strconv.Atoi(k)
		order = append(order, i)
	}
	if len(order) < n {
		b.t.Errorf("%s: Tab reached %d of the %d focusable elements (order %v)", name, len(order), n, order)
		return
	}
	for i := range n {
		if order[i] != i {
			b.t.Errorf("%s: the %dth Tab focused element %d, want document order (%v)", name, i+1, order[i], order[:n])
			return
		}
	}
}

// TestUIInABrowser signs in through the form, then opens every page a reader of the UI would:
// figures against the JSON API, the status filter and the pages of the list, a CE's certificate
// in words after a drift, keyboard navigation, and the page checks of (*browser).check.
func TestUIInABrowser(t *testing.T) {
	b := newBrowser(t)
	const token = "browser-test-token"
	d := uitest.Start(t, token)
	d.Register(t, 120)
	d.Stream(t, 192, 256)
	var model struct {
		Version uint64         `json:"posterior_version"`
		Counts  map[string]int `json:"counterfactuals"`
	}
	d.JSON(t, "/v1/model", &model)
	var list struct {
		CEs []*ledger.CE `json:"counterfactuals"`
	}
	d.JSON(t, "/v1/counterfactuals?limit=1000", &list)

	// Sign in: the form, then the page first asked for.
	b.run(chromedp.Navigate(d.Base+"/ui/counterfactuals"), chromedp.WaitVisible(chromedp.CSS("#token")))
	at := value(b, chromedp.Location())
	if !strings.Contains(at, "/ui/login?next=") {
		t.Fatalf("without a session the UI went to %s, want the login form", at)
	}
	b.check("login")
	b.run(chromedp.SendKeys(chromedp.CSS("#token"), token), chromedp.Submit(chromedp.CSS("#token")),
		chromedp.WaitVisible(chromedp.CSS("form.filters")))
	at = value(b, chromedp.Location())
	if !strings.HasSuffix(at, "/ui/counterfactuals") {
		t.Fatalf("after signing in the UI is at %s, want the list asked for", at)
	}
	if strings.Contains(at, token) {
		t.Fatalf("the token is in the URL %s", at)
	}

	// Overview.
	b.run(chromedp.Navigate(d.Base+"/ui/"), chromedp.WaitVisible(chromedp.CSS("#posterior-version")))
	if got := b.text("#posterior-version"); got != strconv.FormatUint(model.Version, 10) {
		t.Errorf("overview: version %s, the API %d", got, model.Version)
	}
	for s, n := range model.Counts {
		if got := b.text("#count-" + s); got != strconv.Itoa(n) {
			t.Errorf("overview: %s %s, the API %d", s, got, n)
		}
	}
	b.check("overview")
	b.tabReachesEverything("overview")
	b.readmeShot("overview.png")

	// The list filtered by status through the form, then its pages.
	want := 0
	for _, ce := range list.CEs {
		if ce.Status.String() == "at_risk" {
			want++
		}
	}
	b.run(chromedp.Navigate(d.Base+"/ui/counterfactuals"), chromedp.WaitVisible(chromedp.CSS("#status")),
		chromedp.SetValue(chromedp.CSS("#status"), "at_risk"))
	b.follow(chromedp.Click(chromedp.CSS("form.filters button")))
	got := 0
	for pages := 0; ; pages++ {
		rows := value(b, chromedp.Nodes(chromedp.CSSAll("table.ces tbody tr"), chromedp.AtLeast(0)))
		next := value(b, chromedp.Nodes(chromedp.CSSAll(`a[rel="next"]`), chromedp.AtLeast(0)))
		got += len(rows)
		if pages == 0 {
			b.check("list")
			b.tabReachesEverything("list")
		}
		if len(next) == 0 || pages > 10 {
			break
		}
		b.follow(chromedp.Click(chromedp.CSS(`a[rel="next"]`)))
	}
	if got != want {
		t.Errorf("the at_risk filter listed %d CEs over its pages; the API has %d", got, want)
	}

	// A CE of each kind the drift left: its page and its certificate say what its status allows.
	seen := map[string]bool{}
	for _, ce := range list.CEs {
		kind := ce.Status.String() + map[bool]string{true: "-decided", false: "-undecided"}[ce.Decided]
		if seen[kind] {
			continue
		}
		seen[kind] = true
		b.run(chromedp.Navigate(d.Base+"/ui/counterfactuals/"+ce.ID), chromedp.WaitVisible(chromedp.CSS("#headline")))
		head := b.text("#headline")
		switch {
		case ce.Status.String() == "certified" && ce.Decided:
			if !strings.Contains(head, "holds") {
				t.Errorf("%s (%s): %q", ce.ID, kind, head)
			}
		case ce.Status.String() == "uncertified":
			if !strings.Contains(head, "Never certified") {
				t.Errorf("%s (%s): %q", ce.ID, kind, head)
			}
		case !ce.Decided:
			if !strings.HasPrefix(head, "No statement") {
				t.Errorf("%s (%s): %q, want no statement", ce.ID, kind, head)
			}
		default:
			if strings.Contains(head, "holds under") {
				t.Errorf("%s (%s): %q claims it holds", ce.ID, kind, head)
			}
		}
		if got := b.text("#p1"); !strings.Contains(got, "under posterior version "+strconv.FormatUint(ce.AnchorVersion, 10)) {
			t.Errorf("%s: p1 %q, anchor %d", ce.ID, got, ce.AnchorVersion)
		}
		b.check("ce-" + kind)
		if len(seen) == 1 {
			b.readmeShot("ce.png")
		}
		b.tabReachesEverything("ce-" + kind)
		b.run(chromedp.Click(chromedp.CSS(`a[href$="/certificate"]`)), chromedp.WaitVisible(chromedp.CSS("article.certificate")))
		if got := b.text("#headline"); got != head {
			t.Errorf("%s: the certificate says %q, its page %q", ce.ID, got, head)
		}
		b.check("certificate-" + kind)
	}
	t.Logf("CE kinds shown: %v", seen)

	b.run(chromedp.Navigate(d.Base+"/ui/events"), chromedp.WaitVisible(chromedp.CSS("main")))
	b.check("events")
	b.tabReachesEverything("events")
	// The runbook, served by the daemon: an alert's section by its anchor.
	b.run(chromedp.Navigate(d.Base+"/ui/runbook#cfguardkloverbudget"), chromedp.WaitVisible(chromedp.CSS("#cfguardkloverbudget")))
	b.check("runbook")
	// Sign out: the next page asks for the token again.
	b.run(chromedp.Click(chromedp.CSS("form.logout button")), chromedp.WaitVisible(chromedp.CSS("#token")))
	t.Logf("screenshots in %s", b.shots)
}

// TestLongIDsDoNotWidenThePage opens the pages that show a CE id of the longest kind (128
// characters, no space to break at) at a phone's width and a desktop's: the list, whose table
// shows one block per row there, its next page's caption, the CE's page and the 404 page of an
// id not stored. The id wraps; neither the page nor the list's table scrolls sideways.
func TestLongIDsDoNotWidenThePage(t *testing.T) {
	b := newBrowser(t)
	d := uitest.Start(t, "")
	d.Register(t, 2)
	var ce ledger.CE
	d.JSON(t, "/v1/counterfactuals/ce-001", &ce)
	long := strings.Repeat("W", 128)
	body, _ := json.Marshal(map[string]any{"id": long, "x": ce.X, "x_cf": ce.XCF, "target": ce.Target})
	if code, b := d.Do(t, "POST", "/v1/counterfactuals", body); code != 201 {
		t.Fatalf("registering %s: %d %s", long, code, b)
	}
	for _, path := range []string{"/ui/counterfactuals", "/ui/counterfactuals?after=" + long, "/ui/counterfactuals/" + long,
		"/ui/counterfactuals/" + strings.Repeat("M", 128)} {
		for _, width := range []int64{375, 1280} {
			b.run(chromedp.EmulateViewport(width, 800), chromedp.Navigate(d.Base+path), chromedp.WaitVisible(chromedp.CSS("main")))
			wide := value(b, chromedp.Evaluate[[]string](`[document.documentElement, ...document.querySelectorAll('.scroll:has(table.ces)')]
			  .filter((e) => e.scrollWidth > e.clientWidth + 1).map((e) => e.tagName + ' ' + e.scrollWidth + ' > ' + e.clientWidth)`))
			if len(wide) > 0 {
				t.Errorf("%s at %d px: scrolls sideways: %v", path, width, wide)
			}
		}
	}
	b.run(chromedp.EmulateViewport(1280, 800))
}

// An alert's runbook link opened without a session comes back, once signed in, to the alert's
// section: the fragment is the browser's alone, and the form keeps it through its post and the
// redirect that follows.
func TestSignInReturnsToTheRunbooksSection(t *testing.T) {
	b := newBrowser(t)
	const token = "browser-test-token"
	d := uitest.Start(t, token)
	b.run(chromedp.Navigate(d.Base+"/ui/runbook#cfguardoutboxbacklog"), chromedp.WaitVisible(chromedp.CSS("#token")))
	b.run(chromedp.SendKeys(chromedp.CSS("#token"), token), chromedp.Submit(chromedp.CSS("#token")),
		chromedp.WaitVisible(chromedp.CSS("#cfguardoutboxbacklog")))
	if at := value(b, chromedp.Location()); !strings.HasSuffix(at, "/ui/runbook#cfguardoutboxbacklog") {
		t.Errorf("after signing in the UI is at %s, want the runbook's section /ui/runbook#cfguardoutboxbacklog", at)
	}
}
