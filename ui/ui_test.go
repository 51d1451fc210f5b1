package ui_test

import (
	"context"
	"encoding/json"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/ui"
	"github.com/cfguard/cfguard/ui/uitest"
)

// get fetches a page with client c (nil: no cookies, no redirects followed) and the headers given.
func get(t *testing.T, c *http.Client, u string, header ...string) (int, http.Header, string) {
	t.Helper()
	if c == nil {
		c = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	req, err := http.NewRequest("GET", u, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header, string(b)
}

// field is the text of the element with the given id (tags inside it stripped).
func field(t *testing.T, page, id string) string {
	t.Helper()
	loc := regexp.MustCompile(`<(\w+)[^>]*\sid="` + regexp.QuoteMeta(id) + `"[^>]*>`).FindStringSubmatchIndex(page)
	if loc == nil {
		t.Fatalf("no element with id %q in the page", id)
	}
	rest := page[loc[1]:]
	end := strings.Index(rest, "</"+page[loc[2]:loc[3]]+">")
	if end < 0 {
		t.Fatalf("the element with id %q is not closed", id)
	}
	return strings.TrimSpace(regexp.MustCompile(`<[^>]*>`).ReplaceAllString(rest[:end], ""))
}

// num is a figure as the pages print it: four significant digits, more where rounding would take
// it across 1/2 or 1.
func num(v float64) string {
	s := strconv.FormatFloat(v, 'g', 4, 64)
	for digits := 5; digits <= 17; digits++ {
		if r, _ := strconv.ParseFloat(s, 64); (v < 0.5) == (r < 0.5) && (v < 1) == (r < 1) {
			break
		}
		s = strconv.FormatFloat(v, 'g', digits, 64)
	}
	return s
}

// TestLoginKeepsTheTokenOutOfURLsAndCookies signs in with the form, the way a browser does, and
// checks every way in and out: the token is needed, never lands in a URL or a cookie, and a
// sign-in posted from another site is refused.
func TestLoginKeepsTheTokenOutOfURLsAndCookies(t *testing.T) {
	const token = "s3cret-token-for-the-ui"
	d := uitest.Start(t, token)

	code, h, _ := get(t, nil, d.Base+"/ui/counterfactuals?status=certified")
	if code != http.StatusSeeOther || h.Get("Location") != "/ui/login?next=%2Fui%2Fcounterfactuals%3Fstatus%3Dcertified" {
		t.Fatalf("without the token: %d to %q, want 303 to the login form naming the page", code, h.Get("Location"))
	}
	if code, _, _ := get(t, nil, d.Base+"/ui/", "Authorization", "Bearer wrong"); code != http.StatusUnauthorized {
		t.Fatalf("a wrong bearer token: %d, want 401", code)
	}
	if code, _, body := get(t, nil, d.Base+"/ui/", "Authorization", "Bearer "+token); code != 200 || !strings.Contains(body, "<h1>Overview</h1>") {
		t.Fatalf("the bearer token: %d", code)
	}
	// The scheme's name is case-insensitive (RFC 9110, section 11.1).
	if code, _, _ := get(t, nil, d.Base+"/ui/", "Authorization", "bearer "+token); code != 200 {
		t.Fatalf("the bearer token, its scheme in lower case: %d", code)
	}
	if code, _, _ := get(t, nil, d.Base+"/ui/", "Authorization", "BEARER wrong"); code != http.StatusUnauthorized {
		t.Fatalf("a wrong bearer token, its scheme in upper case: %d, want 401", code)
	}
	// A browser behind http.web_config_file's basic auth sends that header on every request: it
	// is no token, and goes to the form.
	if code, h, _ := get(t, nil, d.Base+"/ui/events", "Authorization", "Basic dTpw"); code != http.StatusSeeOther || h.Get("Location") != "/ui/login?next=%2Fui%2Fevents" {
		t.Fatalf("a basic auth header: %d to %q, want 303 to the login form", code, h.Get("Location"))
	}

	jar, _ := cookiejar.New(nil)
	noFollow := &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	// origin is sent as Origin; "referer:URL" sends URL as the Referer instead.
	post := func(path string, form url.Values, origin string) *http.Response {
		req, _ := http.NewRequest("POST", d.Base+path, strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		if ref, ok := strings.CutPrefix(origin, "referer:"); ok {
			req.Header.Set("Referer", ref)
		} else if origin != "" {
			req.Header.Set("Origin", origin)
		}
		resp, err := noFollow.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	if resp := post("/ui/login", url.Values{"token": {"wrong"}, "next": {"/ui/events"}}, d.Base); resp.StatusCode != http.StatusUnauthorized || len(resp.Cookies()) != 0 {
		t.Fatalf("a wrong token in the form: %d, cookies %v", resp.StatusCode, resp.Cookies())
	}
	if resp := post("/ui/login", url.Values{"token": {token}}, "http://evil.example"); resp.StatusCode != http.StatusForbidden || len(resp.Cookies()) != 0 {
		t.Fatalf("a sign-in posted from another site: %d, cookies %v", resp.StatusCode, resp.Cookies())
	}
	if resp := post("/ui/login", url.Values{"token": {token}}, "referer:http://evil.example/page"); resp.StatusCode != http.StatusForbidden || len(resp.Cookies()) != 0 {
		t.Fatalf("a sign-in from another site's page without Origin: %d, cookies %v", resp.StatusCode, resp.Cookies())
	}
	if resp := post("/ui/login", url.Values{"token": {token}}, "referer:"+d.Base+"/ui/login"); resp.StatusCode != http.StatusSeeOther || len(resp.Cookies()) != 1 {
		t.Fatalf("a sign-in from the login form without Origin: %d, cookies %v", resp.StatusCode, resp.Cookies())
	}
	// A next that leaves the UI is not followed.
	resp := post("/ui/login", url.Values{"token": {token}, "next": {"//evil.example/x"}}, d.Base)
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/" {
		t.Fatalf("sign-in with an outside next: %d to %q, want 303 to /ui/", resp.StatusCode, resp.Header.Get("Location"))
	}
	resp = post("/ui/login", url.Values{"token": {token}, "next": {"/ui/events"}}, d.Base)
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui/events" {
		t.Fatalf("sign-in: %d to %q, want 303 to /ui/events", resp.StatusCode, resp.Header.Get("Location"))
	}
	cs := resp.Cookies()
	if len(cs) != 1 || !cs[0].HttpOnly || cs[0].SameSite != http.SameSiteStrictMode || cs[0].Path != "/ui/" ||
		strings.Contains(cs[0].Value, token) || cs[0].Value == "" {
		t.Fatalf("session cookie %+v: want one HttpOnly, SameSite=Strict cookie on /ui/ that is not the token", cs)
	}
	if code, _, body := get(t, noFollow, d.Base+"/ui/events"); code != 200 || strings.Contains(body, token) {
		t.Fatalf("with the session cookie: %d (or the page shows the token)", code)
	}
	// A CE's page does not link its JSON, which the cookie does not open: it names the route.
	if d.Register(t, 1) != 1 {
		t.Fatal("the CE was not stored")
	}
	if code, _, body := get(t, noFollow, d.Base+"/ui/counterfactuals/ce-000"); code != 200 || strings.Contains(body, `<a href="/v1/`) ||
		!strings.Contains(body, "<code>GET /v1/counterfactuals/ce-000</code> with the API token") {
		t.Errorf("a CE's page with a token set: %d; want no link into /v1/ and the route named", code)
	}
	// The cookie opens the UI only: the API still wants the token.
	req, _ := http.NewRequest("GET", d.Base+"/v1/model", nil)
	req.AddCookie(cs[0])
	if r, err := http.DefaultClient.Do(req); err != nil || r.StatusCode != http.StatusUnauthorized {
		t.Fatalf("the API with the UI's cookie: %v %v, want 401", r.StatusCode, err)
	}
	post("/ui/logout", nil, d.Base)
	if code, _, _ := get(t, noFollow, d.Base+"/ui/events"); code != http.StatusSeeOther {
		t.Fatalf("after sign-out: %d, want 303 to the login form", code)
	}
}

// TestPagesShowWhatTheAPIAnswers registers CEs, drifts the model with flipped labels, and holds
// every page's figures to the JSON API's at the same moment: counts, the list walked page by
// page and filtered, and each CE's certificate.
func TestPagesShowWhatTheAPIAnswers(t *testing.T) {
	d := uitest.Start(t, "")
	stored := d.Register(t, 120)
	d.Stream(t, 192, 256)

	var model struct {
		Version uint64         `json:"posterior_version"`
		Applied int64          `json:"applied"`
		Counts  map[string]int `json:"counterfactuals"`
		KLHist  []struct {
			Version uint64  `json:"posterior_version"`
			KL      float64 `json:"kl"`
		} `json:"kl_history"`
	}
	d.JSON(t, "/v1/model", &model)
	var all []*ledger.CE
	for after := ""; ; {
		var page struct {
			CEs  []*ledger.CE `json:"counterfactuals"`
			Next string       `json:"next"`
		}
		d.JSON(t, "/v1/counterfactuals?limit=1000&after="+url.QueryEscape(after), &page)
		all = append(all, page.CEs...)
		if after = page.Next; after == "" {
			break
		}
	}
	if len(all) != stored {
		t.Fatalf("the API lists %d CEs; %d were stored", len(all), stored)
	}
	statuses := map[string]bool{}
	for _, ce := range all {
		statuses[ce.Status.String()+fmt.Sprint(ce.Decided)] = true
	}
	t.Logf("posterior version %d, counts %v, kinds %v", model.Version, model.Counts, statuses)
	if len(statuses) < 2 {
		t.Fatalf("every CE is %v: the drift made no page worth comparing", statuses)
	}

	_, _, over := get(t, nil, d.Base+"/ui/")
	if got := field(t, over, "posterior-version"); got != strconv.FormatUint(model.Version, 10) {
		t.Errorf("overview: version %s, the API %d", got, model.Version)
	}
	if got := field(t, over, "ready"); got != "yes" {
		t.Errorf("overview: ready %q, /readyz 200", got)
	}
	if got := field(t, over, "applied"); got != strconv.FormatInt(model.Applied, 10) {
		t.Errorf("overview: applied %s, the API %d", got, model.Applied)
	}
	for _, s := range []string{"certified", "at_risk", "invalidated", "uncertified"} {
		if got := field(t, over, "count-"+s); got != strconv.Itoa(model.Counts[s]) {
			t.Errorf("overview: %s %s, the API %d", s, got, model.Counts[s])
		}
		decided := 0
		for _, ce := range all {
			if ce.Status.String() == s && ce.Decided {
				decided++
			}
		}
		if got := field(t, over, "decided-"+s); got != strconv.Itoa(decided) {
			t.Errorf("overview: %s decided %s, the API's CEs %d", s, got, decided)
		}
	}
	// The ingest figures are the gauges /metrics serves (still: the stream has been applied).
	utc := func(gauge string) string {
		return time.Unix(int64(d.Metric(t, gauge)), 0).UTC().Format("2006-01-02 15:04:05 UTC")
	}
	if got, want := field(t, over, "ingest-lag"), fmt.Sprintf("%.0f records (end offsets read at %s; records produced since are not counted)",
		d.Metric(t, "cfguard_consumer_lag_records"), utc("cfguard_consumer_offsets_read_timestamp_seconds")); got != want {
		t.Errorf("overview: records waiting %q, /metrics %q", got, want)
	}
	if got, want := field(t, over, "applied-at"), utc("cfguard_last_ingest_timestamp_seconds"); got != want {
		t.Errorf("overview: last records applied %q, /metrics %q", got, want)
	}
	// The alert conditions the overview lists are those the daemon's gauges make true.
	holding := field(t, over, "holding")
	if atRisk := model.Counts["at_risk"] > 0; atRisk != strings.Contains(holding, "CfguardCounterfactualsAtRisk") {
		t.Errorf("overview: %d at_risk, the conditions listed: %q", model.Counts["at_risk"], holding)
	}
	if inv := model.Counts["invalidated"] > 0; inv != strings.Contains(holding, "CfguardCounterfactualsInvalidated") {
		t.Errorf("overview: %d invalidated, the conditions listed: %q", model.Counts["invalidated"], holding)
	}
	if n := strings.Count(over, `class="point"`) + strings.Count(over, `class="over"`); n != len(model.KLHist) {
		t.Errorf("the timeline marks %d updates; the API's history has %d", n, len(model.KLHist))
	}

	// The list, page by page, with and without filters, against the API's CEs.
	walk := func(query string) []string {
		var ids []string
		next := "/ui/counterfactuals" + query
		for pages := 0; next != ""; pages++ {
			if pages > 100 {
				t.Fatalf("more than 100 pages for %q", query)
			}
			code, _, page := get(t, nil, d.Base+next)
			if code != 200 {
				t.Fatalf("GET %s: %d", next, code)
			}
			for _, m := range regexp.MustCompile(`<td data-label="Id"><a href="/ui/counterfactuals/([^"]+)">`).FindAllStringSubmatch(page, -1) {
				ids = append(ids, m[1])
			}
			next = ""
			if m := regexp.MustCompile(`rel="next" href="([^"]+)"`).FindStringSubmatch(page); m != nil {
				next = strings.ReplaceAll(m[1], "&amp;", "&")
			}
		}
		return ids
	}
	want := func(keep func(*ledger.CE) bool) []string {
		var ids []string
		for _, ce := range all {
			if keep(ce) {
				ids = append(ids, ce.ID)
			}
		}
		return ids
	}
	for _, c := range []struct {
		query string
		keep  func(*ledger.CE) bool
	}{
		{"", func(*ledger.CE) bool { return true }},
		{"?status=certified", func(ce *ledger.CE) bool { return ce.Status.String() == "certified" }},
		{"?status=at_risk", func(ce *ledger.CE) bool { return ce.Status.String() == "at_risk" }},
		{"?decided=no", func(ce *ledger.CE) bool { return !ce.Decided }},
		{"?status=certified&decided=yes", func(ce *ledger.CE) bool { return ce.Status.String() == "certified" && ce.Decided }},
		{"?target=benign", func(ce *ledger.CE) bool { return ce.Target == 1 }},
		{"?target=0&decided=yes", func(ce *ledger.CE) bool { return ce.Target == 0 && ce.Decided }},
		{"?pending=no", func(ce *ledger.CE) bool { return !ce.RenewalPending && !ce.VerdictPending }},
	} {
		if got, w := walk(c.query), want(c.keep); !slices.Equal(got, w) {
			t.Errorf("list %q: %d CEs %v\nthe API: %d %v", c.query, len(got), got, len(w), w)
		}
	}

	// Each CE's page and certificate say what the API says, in the words its status allows.
	for _, ce := range all {
		_, _, page := get(t, nil, d.Base+"/ui/counterfactuals/"+ce.ID)
		if _, h, _ := get(t, nil, d.Base+"/v1/counterfactuals/"+ce.ID); !strings.HasPrefix(field(t, page, "tag"), h.Get("ETag")+":") || h.Get("ETag") == "" {
			t.Errorf("%s: registration tag %q, the API's ETag %q", ce.ID, field(t, page, "tag"), h.Get("ETag"))
		}
		if got := field(t, page, "p1"); !strings.HasPrefix(got, num(ce.P1)+" from "+strconv.Itoa(ce.Samples)+" draws under posterior version "+strconv.FormatUint(ce.AnchorVersion, 10)) {
			t.Errorf("%s: p1 %q, the API %v under %d", ce.ID, got, ce.P1, ce.AnchorVersion)
		}
		switch got := field(t, page, "bound"); {
		case ce.Status.String() == "uncertified":
			if !strings.HasPrefix(got, "none: never certified") {
				t.Errorf("%s (uncertified): bound %q, want none (the API's 0 is no bound)", ce.ID, got)
			}
		case !strings.HasPrefix(got, num(ce.Bound)+" "):
			t.Errorf("%s: bound %q, the API %v", ce.ID, got, ce.Bound)
		}
		if st := ce.Status.String(); st != "uncertified" {
			// The Theorem 2 bound names its ceiling, and a verdict's status says the Theorem 1
			// bound is not what it rests on.
			// A bound at 1/4, every probability's largest variance, says so.
			want := num(ce.VarBound) + " "
			if ce.VarBound >= 0.25 {
				want += "(the most any probability's variance can be: Theorem 2 adds nothing here) "
			}
			if got := field(t, page, "var-bound"); !strings.HasPrefix(got, want+"(a certificate needs at most 0.25:") {
				t.Errorf("%s: Theorem 2 bound %q, want the API's %v and its ceiling 0.25", ce.ID, got, ce.VarBound)
			}
			// A verdict's status rests on its verdict bound only while that bound carries (decided).
			if got := field(t, page, "bound"); strings.Contains(got, "this status rests on its verdict bound") != (st != "certified" && ce.Decided) ||
				strings.Contains(got, "nothing decides this status now") != (st != "certified" && !ce.Decided && ce.VerdictBound != nil) {
				t.Errorf("%s (%s, decided %v): Theorem 1 bound %q", ce.ID, st, ce.Decided, got)
			}
		}
		if ce.VerdictBound != nil {
			got := field(t, page, "verdict-bound")
			if !strings.HasPrefix(got, num(*ce.VerdictBound)+": ") {
				t.Errorf("%s: verdict bound %q, the API %v", ce.ID, got, *ce.VerdictBound)
			}
			// An undecided CE's bound no longer says what p is at least or at most.
			if strings.Contains(got, "decided the verdict") != ce.Decided || strings.Contains(got, "says nothing of p now") == ce.Decided {
				t.Errorf("%s (decided %v): verdict bound %q", ce.ID, ce.Decided, got)
			}
		}
		status := field(t, page, "status")
		if !strings.Contains(status, ce.Status.String()) || strings.Contains(status, ", decided") != ce.Decided {
			t.Errorf("%s: status %q, the API %s decided=%v", ce.ID, status, ce.Status, ce.Decided)
		}
		_, _, cert := get(t, nil, d.Base+"/ui/counterfactuals/"+ce.ID+"/certificate")
		head := field(t, cert, "headline")
		holds := strings.Contains(head, "holds under the current posterior")
		if valid := ce.Status.String() == "certified" && ce.Decided; holds != valid ||
			strings.Contains(cert, "<title>Certificate of validity") != valid || strings.Contains(cert, "It is not certified now") == valid {
			t.Errorf("%s (%s, decided=%v): the certificate says %q, titled %v", ce.ID, ce.Status, ce.Decided, head, strings.Contains(cert, "<title>Certificate of validity"))
		}
		if !ce.Decided && !strings.HasPrefix(head, "No statement") && ce.Status.String() != "uncertified" {
			t.Errorf("%s (%s, undecided): the certificate says %q, want no statement", ce.ID, ce.Status, head)
		}
	}
	// Every alert's ui_path annotation is a page the UI serves.
	rules, err := os.ReadFile("../alerts/rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	paths := regexp.MustCompile(`(?m)^\s*ui_path: "([^"]+)"`).FindAllStringSubmatch(string(rules), -1)
	if alerts := strings.Count(string(rules), "- alert: "); len(paths) != alerts {
		t.Errorf("alerts/rules.yml: %d ui_path annotations for %d alerts", len(paths), alerts)
	}
	for _, m := range paths {
		if code, _, _ := get(t, nil, d.Base+m[1]); code != 200 {
			t.Errorf("ui_path %s: %d", m[1], code)
		}
	}
	if code, _, _ := get(t, nil, d.Base+"/ui/counterfactuals/no-such-ce"); code != http.StatusNotFound {
		t.Errorf("an unknown CE: %d, want 404", code)
	}
	for _, id := range []string{"no%20such%20ce", strings.Repeat("c", ident.MaxLen+1)} { // ids no CE can hold, 400 as in the API
		if code, _, page := get(t, nil, d.Base+"/ui/counterfactuals/"+id); code != http.StatusBadRequest || !strings.Contains(page, "not in [A-Za-z0-9._:-]") && !strings.Contains(page, "want 1 to 128 characters") {
			t.Errorf("the page of an invalid id %.20s...: %d, want 400 naming the rule", id, code)
		}
	}
	// Without a token a CE's page links its JSON, and the sign-in page says there is nothing to
	// sign in to.
	if _, _, page := get(t, nil, d.Base+"/ui/counterfactuals/"+all[0].ID); !strings.Contains(page, `<a href="/v1/counterfactuals/`+all[0].ID+`">JSON</a>`) {
		t.Errorf("%s's page without a token does not link its JSON", all[0].ID)
	}
	if _, _, page := get(t, nil, d.Base+"/ui/login"); !strings.Contains(page, `id="no-token"`) || strings.Contains(page, "requires its API token") ||
		strings.Contains(page, `name="token"`) {
		t.Error("the sign-in page of a daemon without a token asks for one")
	}
	if code, _, _ := get(t, nil, d.Base+"/ui/counterfactuals?target=nosuchclass"); code != http.StatusBadRequest {
		t.Errorf("an unknown target: %d, want 400", code)
	}
	if code, _, _ := get(t, nil, d.Base+"/ui/counterfactuals?status=bogus"); code != http.StatusBadRequest {
		t.Errorf("an unknown status filter: %d, want 400", code)
	}
	if code, _, _ := get(t, nil, d.Base+"/ui/counterfactuals?status=certified;"); code != http.StatusBadRequest {
		t.Errorf("a filter with a semicolon, which would be dropped: %d, want 400", code)
	}
	// Refused as the API refuses them: a filter given twice, a parameter the list does not take.
	for q, want := range map[string]string{"status=invalidated&status=certified": `parameter "status" given 2 times`,
		"status=certified&limit=5": `unknown parameter "limit"`} {
		if code, _, page := get(t, nil, d.Base+"/ui/counterfactuals?"+q); code != http.StatusBadRequest || !strings.Contains(html.UnescapeString(page), want) {
			t.Errorf("?%s: %d, want 400 saying %s", q, code, want)
		}
	}
	// A path or method no page takes gets a page of the UI that says so, not the mux's plain text.
	for _, path := range []string{"/ui/nope", "/ui/counterfactuals/", "/ui/counterfactuals/" + all[0].ID + "/certificate/x"} {
		if code, h, page := get(t, nil, d.Base+path); code != http.StatusNotFound || !strings.HasPrefix(h.Get("Content-Type"), "text/html") ||
			!strings.Contains(page, "There is no page at "+path) {
			t.Errorf("GET %s: %d %s, want the UI's 404 page", path, code, h.Get("Content-Type"))
		}
	}
	// A method its path does not take: a 405 page whose Allow names the methods that path takes.
	for _, c := range []struct{ method, path, allow, says string }{
		{"POST", "/ui/counterfactuals", "GET, HEAD", "read with GET"},
		{"PUT", "/ui/login", "GET, HEAD, POST", "sent with POST"},
		{"DELETE", "/ui/login", "GET, HEAD, POST", "sent with POST"},
		{"GET", "/ui/logout", "POST", "signing out is a POST"},
	} {
		req, _ := http.NewRequest(c.method, d.Base+c.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusMethodNotAllowed || resp.Header.Get("Allow") != c.allow ||
			!strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") || !strings.Contains(string(b), c.says) {
			t.Errorf("%s %s: %d (Allow %q), want the UI's 405 page with Allow %q saying %q", c.method, c.path, resp.StatusCode, resp.Header.Get("Allow"), c.allow, c.says)
		}
	}
	// A target given by its index is the class the form then shows, so that filtering again keeps it.
	if _, _, page := get(t, nil, d.Base+"/ui/counterfactuals?target=1&status=certified"); !strings.Contains(page, `<option value="benign" selected>`) {
		t.Error("?target=1: the form's target select does not show benign")
	}
	// An uncertified CE's bound is none, not the API's 0; a list of one page names no pages.
	if _, _, page := get(t, nil, d.Base+"/ui/counterfactuals?status=uncertified"); !strings.Contains(page, `<td class="n" data-label="Bound now">none</td>`) ||
		strings.Contains(page, `aria-label="Pages"`) {
		t.Error("the uncertified list: want bound none and no page navigation")
	}
}

// TestEventsPageShowsTheNewestFirst fills a ledger's outbox past a page and reads the events page
// over it: the newest 200 in descending order, a note that older ones wait, and after the
// publisher's acknowledgement of all of them, none.
func TestEventsPageShowsTheNewestFirst(t *testing.T) {
	l, err := ledger.Open(t.TempDir(), ledger.Options{Policy: certify.DefaultPolicy(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	const n = 205
	var evs []ledger.OutboxEntry
	for i := 1; i <= n; i++ {
		evs = append(evs, ledger.OutboxEntry{Key: fmt.Sprintf("ce-%d", i), Value: []byte(fmt.Sprintf(`{"n":%d}`, i))})
	}
	// The newest is 900 kB (an increment's held records): the page shows its first 2,000 bytes
	// (not splitting a character) and says how large it is.
	big := `{"n":205,"held":"` + strings.Repeat("é", 450_000) + `"}`
	evs[n-1].Value = []byte(big)
	if err := l.Checkpoint(&ledger.Checkpoint{Events: evs}); err != nil {
		t.Fatal(err)
	}
	u := ui.New(ui.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, ledgerSource{l})
	read := func() string {
		rec := httptest.NewRecorder()
		u.ServeHTTP(rec, httptest.NewRequest("GET", "/ui/events", nil))
		if rec.Code != 200 {
			t.Fatalf("GET /ui/events: %d %s", rec.Code, rec.Body)
		}
		return rec.Body.String()
	}
	page := read()
	if len(page) > 100_000 {
		t.Errorf("the events page weighs %d bytes with one event of %d", len(page), len(big))
	}
	if want := fmt.Sprintf("(the first 1999 of its %d bytes;", len(big)); !strings.Contains(page, want) || !strings.Contains(page, `{&#34;n&#34;:205,&#34;held&#34;:&#34;é`) {
		t.Errorf("the large event is not shown cut, saying %q", want)
	}
	var seqs []int
	for _, m := range regexp.MustCompile(`<tr><td class="n">(\d+)</td><td>ce-(\d+)</td>`).FindAllStringSubmatch(page, -1) {
		if m[1] != m[2] {
			t.Fatalf("event %s shows the key of event %s", m[1], m[2])
		}
		s, _ := strconv.Atoi(m[1])
		seqs = append(seqs, s)
	}
	if len(seqs) != 200 || seqs[0] != n || !slices.IsSortedFunc(seqs, func(a, b int) int { return b - a }) || seqs[199] != n-199 {
		t.Fatalf("the events page lists %d events %v..., want %d down to %d", len(seqs), seqs[:min(3, len(seqs))], n, n-199)
	}
	if !strings.Contains(field(t, page, "more"), "newest 200") {
		t.Errorf("the page does not say older events wait")
	}
	if err := l.AckOutbox(n); err != nil {
		t.Fatal(err)
	}
	if got := field(t, read(), "none"); !strings.Contains(got, "No event is waiting") {
		t.Errorf("after every event was published the page says %q", got)
	}
}

// TestReissueLinks: a daemon without explain.reissue names no replacement on any page, whatever
// the ids (TestReissueLinksFollowTheNames checks the names and statuses with it set).
func TestReissueLinks(t *testing.T) {
	plain := uitest.Start(t, "")
	if plain.Register(t, 1) != 1 {
		t.Fatal("the CE was not stored")
	}
	var p ledger.CE
	plain.JSON(t, "/v1/counterfactuals/ce-000", &p)
	body, _ := json.Marshal(map[string]any{"id": "ce-000.r7", "x": p.X, "x_cf": p.XCF, "target": p.Target})
	if code, out := plain.Do(t, "POST", "/v1/counterfactuals", body); code != http.StatusCreated {
		t.Fatalf("registering ce-000.r7: %d %s", code, out)
	}
	for _, id := range []string{"ce-000", "ce-000.r7"} {
		if _, page := plain.Do(t, "GET", "/ui/counterfactuals/"+id, nil); strings.Contains(string(page), `id="reissue-of"`) || strings.Contains(string(page), `id="reissues"`) {
			t.Errorf("%s's page names a reissue without explain.reissue", id)
		}
	}
}

// notYetSource is a Source whose lists and CEs cannot be read yet (a replica's partition being
// rebuilt).
type notYetSource struct{ ledgerSource }

func (notYetSource) Snapshot(context.Context) (ui.Snapshot, error) {
	return ui.Snapshot{Classes: []string{"malignant", "benign"}, Now: time.Now()}, nil
}

func (notYetSource) List(context.Context, certify.Status, int, string) ([]*ledger.CE, string, error) {
	return nil, "", fmt.Errorf("%w: partition 3 being rebuilt", ui.ErrNotYet)
}

func (notYetSource) Get(context.Context, string) (*ledger.CE, error) {
	return nil, fmt.Errorf("%w: partition 3 being rebuilt", ui.ErrNotYet)
}

// A page whose source cannot answer yet is a 503 with Retry-After that says why and asks to
// reload, not an error of the daemon's state.
func TestPagesNotAvailableYetSayWhy(t *testing.T) {
	l, err := ledger.Open(t.TempDir(), ledger.Options{Policy: certify.DefaultPolicy(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	u := ui.New(ui.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, notYetSource{ledgerSource{l}})
	for _, path := range []string{"/ui/counterfactuals", "/ui/counterfactuals/ce-1", "/ui/counterfactuals/ce-1/certificate"} {
		rec := httptest.NewRecorder()
		u.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		body := rec.Body.String()
		if rec.Code != http.StatusServiceUnavailable || rec.Header().Get("Retry-After") == "" ||
			!strings.Contains(body, "partition 3 being rebuilt") || !strings.Contains(body, "Reload this page") {
			t.Errorf("GET %s: %d (Retry-After %q)\n%s", path, rec.Code, rec.Header().Get("Retry-After"), body)
		}
	}
}

// A path under /ui/static/ that names no file, the directory itself included, gets the UI's 404
// page as every path that is no page does, not the file server's plain text or its listing; the
// stylesheet is served. The same holds while the daemon starts, whose pages are its 503.
func TestStaticPathsThatNameNoFileAreNoPage(t *testing.T) {
	l, err := ledger.Open(t.TempDir(), ledger.Options{Policy: certify.DefaultPolicy(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	u := ui.New(ui.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, ledgerSource{l})
	starting := ui.Starting(func() string { return "opening the ledger" }, 10)
	for _, c := range []struct {
		h    http.Handler
		code int
		says string
	}{{u, http.StatusNotFound, "There is no page at "}, {starting, http.StatusServiceUnavailable, "cfguard is starting"}} {
		for _, path := range []string{"/ui/static/", "/ui/static/nope.css", "/ui/static/style.css/"} {
			rec := httptest.NewRecorder()
			c.h.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
			if rec.Code != c.code || !strings.HasPrefix(rec.Header().Get("Content-Type"), "text/html") || !strings.Contains(rec.Body.String(), c.says) ||
				!strings.Contains(rec.Body.String(), `<a href="/ui/">`) {
				t.Errorf("GET %s: %d %s, want %d saying %q with a way back\n%s", path, rec.Code, rec.Header().Get("Content-Type"), c.code, c.says, rec.Body.String())
			}
		}
		rec := httptest.NewRecorder()
		c.h.ServeHTTP(rec, httptest.NewRequest("GET", "/ui/static/style.css", nil))
		if rec.Code != http.StatusOK || !strings.HasPrefix(rec.Header().Get("Content-Type"), "text/css") {
			t.Errorf("GET /ui/static/style.css: %d %s, want the stylesheet", rec.Code, rec.Header().Get("Content-Type"))
		}
	}
}

// emptySource is a daemon that stores no CE.
type emptySource struct{}

func (emptySource) Snapshot(context.Context) (ui.Snapshot, error) {
	return ui.Snapshot{Classes: []string{"malignant", "benign"}, Now: time.Now()}, nil
}
func (emptySource) List(context.Context, certify.Status, int, string) ([]*ledger.CE, string, error) {
	return nil, "", nil
}
func (emptySource) Get(context.Context, string) (*ledger.CE, error) { return nil, ledger.ErrNotFound }
func (emptySource) Events(int) ([]ledger.OutboxEntry, error)        { return nil, nil }
func (emptySource) Publishing() ui.Publishing                       { return ui.Publishing{} }

// The list's cursor is a CE id: other text, which the page's caption would show as its own
// words ("after ..."), a right-to-left override turning the rest of the line around, is refused
// as an id no CE can hold is; an id, stored or not, is a cursor.
func TestListCursorIsAnID(t *testing.T) {
	u := ui.New(ui.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, emptySource{})
	for after, code := range map[string]int{"ce-1": http.StatusOK, strings.Repeat("W", 128): http.StatusOK,
		"x; every counterfactual here is certified": http.StatusBadRequest, "\u202edeifitrec": http.StatusBadRequest,
		"<b>x</b>": http.StatusBadRequest, "..": http.StatusBadRequest, strings.Repeat("W", 129): http.StatusBadRequest} {
		rec := httptest.NewRecorder()
		u.ServeHTTP(rec, httptest.NewRequest("GET", "/ui/counterfactuals?after="+url.QueryEscape(after), nil))
		if rec.Code != code {
			t.Errorf("after=%q: %d, want %d", after, rec.Code, code)
		}
		if strings.Contains(rec.Body.String(), "\u202e") || strings.Contains(rec.Body.String(), ", after x; every") {
			t.Errorf("after=%q: the page shows the text as its own", after)
		}
	}
}

// TestLoginFormOverTheBodyLimit: a sign-in form whose body passes the daemon's bound
// (http.max_body_bytes) is a 413 that names the setting, as the API answers such a body; a form
// that cannot be read for another reason is a 400.
func TestLoginFormOverTheBodyLimit(t *testing.T) {
	u := ui.New(ui.Config{Token: "t0ken", Logger: slog.New(slog.DiscardHandler)}, nil)
	for _, c := range []struct {
		name string
		body func(w http.ResponseWriter) io.ReadCloser
		code int
		says string
	}{
		{"over the limit", func(w http.ResponseWriter) io.ReadCloser {
			return http.MaxBytesReader(w, io.NopCloser(strings.NewReader("token="+strings.Repeat("a", 64))), 16)
		}, http.StatusRequestEntityTooLarge, "The form is over 16 bytes (http.max_body_bytes)."},
		{"cut short", func(http.ResponseWriter) io.ReadCloser {
			return io.NopCloser(io.MultiReader(strings.NewReader("token="), iotest.ErrReader(io.ErrUnexpectedEOF)))
		}, http.StatusBadRequest, "The form could not be read."},
	} {
		t.Run(c.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			req := httptest.NewRequest("POST", "/ui/login", nil)
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			req.Body = c.body(rec)
			u.ServeHTTP(rec, req)
			if rec.Code != c.code || !strings.Contains(rec.Body.String(), html.EscapeString(c.says)) {
				t.Fatalf("%d %.300s, want %d saying %q", rec.Code, rec.Body, c.code, c.says)
			}
		})
	}
}

// A replica that refused to join its cluster serves, at every page of the UI, a 503 that gives
// the refusal and leads to the runbook's section of the alert that fires
// (CfguardReplicaSettingsDiffer, whose ui_path is /ui/); that section is served, as is the
// stylesheet. Every other page is the same 503: there is no state to show.
func TestRefusedReplicaShowsWhyAndTheRunbook(t *testing.T) {
	const why = "not joining the cluster: certify.delta: this replica 0.2, the cluster's log 0.05"
	h := ui.Refused(why)
	get := func(path string) *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		return rec
	}
	var link string
	for _, path := range []string{"/ui/", "/ui/counterfactuals", "/ui/counterfactuals/ce-1", "/ui/events", "/ui/nope"} {
		rec := get(path)
		body := rec.Body.String()
		m := regexp.MustCompile(`href="(/ui/runbook#[^"]+)"`).FindStringSubmatch(body)
		if rec.Code != http.StatusServiceUnavailable || !strings.HasPrefix(rec.Header().Get("Content-Type"), "text/html") ||
			!strings.Contains(body, html.EscapeString(why)) || m == nil {
			t.Fatalf("GET %s: %d %s, want a 503 page giving the refusal and linking the runbook\n%s", path, rec.Code, rec.Header().Get("Content-Type"), body)
		}
		link = m[1]
	}
	rec := get("/ui/runbook")
	anchor := link[strings.Index(link, "#")+1:]
	if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), ` id="`+anchor+`"`) || anchor != "cfguardreplicasettingsdiffer" {
		t.Errorf("GET /ui/runbook: %d; want the runbook, with the section %s links (CfguardReplicaSettingsDiffer's)", rec.Code, link)
	}
	if rec := get("/ui/static/style.css"); rec.Code != http.StatusOK {
		t.Errorf("GET /ui/static/style.css: %d, want the stylesheet", rec.Code)
	}
}
