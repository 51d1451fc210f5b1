package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
)

// TestAPIRefusesWhatItCannotAnswer sends what a client gets wrong, and what encoding/json or the
// model would take in silence, to a live daemon: each is a JSON error that names what is wrong,
// with the status docs/API.md gives it.
func TestAPIRefusesWhatItCannotAnswer(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	x, xcf := data.X[xs[0]], data.X[cfs[0]]
	js := func(v any) string { return mustJSON(t, v) }
	huge := append([]float64(nil), x...)
	huge[4] = -1e308 // finite: scaled and multiplied, it overflows
	hugeLast := append([]float64(nil), x...)
	hugeLast[len(x)-1] = 1e308 // the last feature, above the model's range
	features := strings.Split(strings.Trim(js(x), "[]"), ",")
	features[0] = "null"
	withNull := "[" + strings.Join(features, ",") + "]"
	for _, c := range []struct {
		name, method, path, body string
		code                     int
		says                     []string
	}{
		{"a feature far out of range, predict", "POST", "/v1/predict", `{"x":` + js(huge) + `}`, 400,
			[]string{`x[4] = -1e+308`, "standard deviations"}},
		{"the last feature far above range, predict", "POST", "/v1/predict", `{"x":` + js(hugeLast) + `}`, 400,
			[]string{fmt.Sprintf("x[%d] = 1e+308", len(x)-1), "standard deviations"}},
		{"one far out of range in a batch", "POST", "/v1/predict", `{"xs":[` + js(x) + `,` + js(huge) + `]}`, 400, []string{`xs[1][4]`}},
		{"a feature far out of range, explain", "POST", "/v1/explain", `{"x":` + js(huge) + `,"target":"benign"}`, 400, []string{`x[4]`}},
		{"x_cf far out of range", "POST", "/v1/counterfactuals", `{"x":` + js(x) + `,"x_cf":` + js(huge) + `,"target":"benign"}`, 400,
			[]string{`x_cf[4]`}},
		{"null in a vector, register", "POST", "/v1/counterfactuals", `{"x":` + withNull + `,"x_cf":` + js(xcf) + `,"target":"benign"}`, 400,
			[]string{`"x" holds a null`}},
		{"null in a vector, predict", "POST", "/v1/predict", `{"x":` + withNull + `}`, 400, []string{`"x" holds a null`}},
		{"the wrong number of features names x", "POST", "/v1/predict", `{"x":[1,2]}`, 400, []string{"x has 2 features"}},
		{"one feature too many", "POST", "/v1/predict", `{"x":` + js(append(x[:len(x):len(x)], 0)) + `}`, 400,
			[]string{fmt.Sprintf("x has %d features, the model takes %d", len(x)+1, len(x))}},
		{"an empty target name", "POST", "/v1/counterfactuals", `{"x":` + js(x) + `,"x_cf":` + js(xcf) + `,"target":""}`, 400,
			[]string{`target must be a class index (an integer) or a class name, got ""`}},
		{"a negative target index", "POST", "/v1/counterfactuals", `{"x":` + js(x) + `,"x_cf":` + js(xcf) + `,"target":-1}`, 400,
			[]string{"target -1 out of range: 2 classes"}},
		{"a target index one past the classes", "POST", "/v1/counterfactuals", `{"x":` + js(x) + `,"x_cf":` + js(xcf) + `,"target":2}`, 400,
			[]string{"target 2 out of range: 2 classes"}},
		{"an empty body", "POST", "/v1/counterfactuals", ``, 400, []string{"the body is empty"}},
		{"an audit body of null", "POST", "/v1/audit", `null`, 400, []string{"must be a JSON object", "not null"}},
		{"an audit body that is not JSON", "POST", "/v1/audit", `nope`, 400, []string{"must be a JSON object", "not byte 'n'"}},
		{"a path with a trailing slash", "GET", "/v1/model/", ``, 404, []string{"no such route"}},
		{"an audit body that is an array", "POST", "/v1/audit", `[]`, 400, []string{"not an array"}},
		{"a method a route does not take", "PUT", "/v1/counterfactuals/a", `{}`, 405, []string{"method not allowed", "GET, HEAD, DELETE"}},
		{"an empty id", "GET", "/v1/counterfactuals/", ``, 404, []string{"no such route"}},
		{"an id no CE can hold, get", "GET", "/v1/counterfactuals/a%20b", ``, 400, []string{`character ' ' not in`}},
		{"a dot segment, get", "GET", "/v1/counterfactuals/.", ``, 400, []string{`a path has no empty, "." or ".." segment`}},
		{"a dot-dot segment, delete", "DELETE", "/v1/counterfactuals/..", ``, 400, []string{`"/v1/counterfactuals/.."`}},
		{"an empty segment", "GET", "/v1//model", ``, 400, []string{`a path has no empty`}},
		{"a dot segment inside", "GET", "/v1/./model", ``, 400, []string{`a path has no empty`}},
		{"an id no CE can hold, delete", "DELETE", "/v1/counterfactuals/" + strings.Repeat("i", 129), ``, 400, []string{"want 1 to 128 characters"}},
		{"an empty method", "POST", "/v1/explain", `{"x":` + js(x) + `,"method":""}`, 400, []string{"method is empty", "psce"}},
		{"an Idempotency-Key to explain", "POST", "/v1/explain", `{"x":` + js(x) + `}`, 400, []string{"takes no Idempotency-Key", "give the body an id"}},
		{"an empty status filter", "GET", "/v1/counterfactuals?status=", ``, 400, []string{`"status" is empty`}},
		{"an empty limit", "GET", "/v1/counterfactuals?limit=", ``, 400, []string{`"limit" is empty`}},
		{"a misspelt filter", "GET", "/v1/counterfactuals?limit=1&statuss=certified", ``, 400,
			[]string{`unknown query parameter "statuss"`, "takes status, limit and after"}},
		{"a filter given twice", "GET", "/v1/counterfactuals?status=certified&status=at_risk", ``, 400, []string{`"status" given 2 times`}},
		{"partitions from a client", "GET", "/v1/counterfactuals?partitions=1", ``, 400, []string{`unknown query parameter "partitions"`}},
		{"a filter with a semicolon", "GET", "/v1/counterfactuals?status=certified;", ``, 400, []string{`invalid semicolon separator`}},
		{"no such path", "GET", "/v2/model", ``, 404, []string{"no such route"}},
		{"an escaped slash is not a route", "GET", "/v1/counterfactuals%2Fa1", ``, 404, []string{"GET /v1/counterfactuals%2Fa1: no such route"}},
		{"a syntax error says where", "POST", "/v1/predict", `{"x":[NaN]}`, 400, []string{"bad JSON at byte 7: invalid character 'N'"}},
		{"a number out of range names its field", "POST", "/v1/predict", `{"x":[1e309]}`, 400,
			[]string{`field "x": number 1e309 is not a finite number of 64 bits`}},
		{"a string for a number names its field", "POST", "/v1/counterfactuals", `{"x":"a","x_cf":[1],"target":1}`, 400,
			[]string{`field "x": string is not an array of numbers`}},
		{"a byte order mark", "POST", "/v1/audit", "\ufeff{}", 400, []string{"byte order mark"}},
		{"a huge unknown key is not echoed", "POST", "/v1/audit", `{"` + strings.Repeat("k", 100000) + `":1}`, 400,
			[]string{"unknown field", "(99872 more bytes)"}},
		{"a huge method is not echoed", "POST", "/v1/explain", `{"x":` + js(x) + `,"method":"` + strings.Repeat("m", 100000) + `"}`, 400,
			[]string{"unknown counterfactual method", "...", "want one of [psce"}},
		{"a huge target is not echoed", "POST", "/v1/counterfactuals", `{"x":` + js(x) + `,"x_cf":` + js(xcf) + `,"target":"` + strings.Repeat("t", 100000) + `"}`, 400,
			[]string{"unknown target class", "more bytes)", "classes: [malignant benign]"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var header map[string]string
			if strings.Contains(c.name, "Idempotency-Key") {
				header = map[string]string{"Idempotency-Key": "k1"}
			}
			resp, body := r.RawDo(t, c.method, c.path, c.body, header)
			var e struct{ Error string }
			if resp.StatusCode != c.code || resp.Header.Get("Content-Type") != "application/json" || json.Unmarshal(body, &e) != nil || e.Error == "" {
				t.Fatalf("%s %s: %d %s %q; want %d with a JSON error", c.method, c.path, resp.StatusCode, resp.Header.Get("Content-Type"), body, c.code)
			}
			for _, s := range c.says {
				if !strings.Contains(e.Error, s) {
					t.Errorf("%s %s: error %q does not say %q", c.method, c.path, ident.Clip(e.Error, 300), s)
				}
			}
			if len(e.Error) > maxErrorMessage+64 || strings.Contains(c.name, "not echoed") && len(e.Error) > 1000 {
				t.Errorf("%s %s: an error of %d bytes: it repeats the request", c.method, c.path, len(e.Error))
			}
			if c.code == http.StatusMethodNotAllowed && resp.Header.Get("Allow") != "GET, HEAD, DELETE" {
				t.Errorf("Allow: %q, want GET, HEAD, DELETE", resp.Header.Get("Allow"))
			}
		})
	}
}

// TestAPIAnswersWhatItDocuments: the answers a client relies on to go on: an empty bulk is an
// empty list of results, the last page of a list says it is the last even when it is full, and
// a keyed registration refused for an id that held another CE answers 409 when sent again, also
// once the id is free (docs/API.md, Idempotency keys).
func TestAPIAnswersWhatItDocuments(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	resp, body := r.RawDo(t, "POST", "/v1/counterfactuals:bulk", "", nil)
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"results":[]`) {
		t.Errorf("an empty bulk: %d %s, want 200 with results []", resp.StatusCode, body)
	}

	ids := daemontest.RegisterCEs(t, r, data, 3, "")
	for _, c := range []struct {
		query, next string
	}{
		{"?limit=3", ""},
		{"?limit=2", ids[1]},
		{"?limit=2&after=" + ids[1], ""},
		{"?limit=5", ""},
	} {
		code, b := r.Get(t, "/v1/counterfactuals"+c.query)
		var page struct{ Next string }
		if code != 200 || json.Unmarshal(b, &page) != nil || page.Next != c.next {
			t.Errorf("GET /v1/counterfactuals%s: %d next %q, want %q", c.query, code, page.Next, c.next)
		}
	}

	// A keyed registration refused for an id that holds a CE (another one, the same one, or one
	// given on an earlier line of the same request) answers 409, and so does every retry of it,
	// also once the id is free; the first attempt is no replay.
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	reg := func(id string, k int) string {
		return `{"id":"` + id + `","x":` + mustJSON(t, data.X[xs[k]]) + `,"x_cf":` + mustJSON(t, data.X[cfs[k]]) + `,"target":"benign"}`
	}
	other, same := reg(ids[0], 5), reg(ids[1], 1)
	bulk := reg("dup", 6) + "\n" + reg("dup", 7) + "\n"
	type attempt struct {
		name, method, path, body, key string
		first                         string // in the first answer
	}
	attempts := []attempt{
		{"another CE under a stored id", "POST", "/v1/counterfactuals", other, "k-other", keyedExistsAdvice},
		{"the stored CE itself", "POST", "/v1/counterfactuals", same, "k-same", keyedExistsAdvice},
		{"an id given on an earlier line", "POST", "/v1/counterfactuals:bulk", bulk, "k-bulk", `"line":2,"id":"dup","code":409`},
	}
	for _, a := range attempts {
		resp, body := r.RawDo(t, a.method, a.path, a.body, map[string]string{"Idempotency-Key": a.key})
		if code := resp.StatusCode; (a.method == "POST" && a.path == "/v1/counterfactuals" && code != http.StatusConflict) ||
			!strings.Contains(string(body), a.first) {
			t.Fatalf("%s: %d %s, want it to say %q", a.name, code, body, a.first)
		}
	}
	if n := r.Metric(t, "cfguard_requests_replayed_total", "result", "exists"); n != 0 {
		t.Errorf("cfguard_requests_replayed_total{result=exists} after first attempts: %v, want 0", n)
	}
	for _, id := range []string{ids[0], ids[1], "dup"} {
		if resp, body := r.RawDo(t, "DELETE", "/v1/counterfactuals/"+id, "", nil); resp.StatusCode != http.StatusNoContent {
			t.Fatalf("DELETE %s: %d %s", id, resp.StatusCode, body)
		}
	}
	for _, a := range attempts {
		resp, body := r.RawDo(t, a.method, a.path, a.body, map[string]string{"Idempotency-Key": a.key})
		if a.path == "/v1/counterfactuals" && (resp.StatusCode != http.StatusConflict || strings.Contains(string(body), "DELETE it first") ||
			!strings.Contains(string(body), keyedExistsAdvice)) {
			t.Errorf("%s, sent again once the id is free: %d %s; want the 409 it had, saying how to go on", a.name, resp.StatusCode, body)
		}
		if a.path != "/v1/counterfactuals" && !strings.Contains(string(body), `"line":2,"id":"dup","code":409`) {
			t.Errorf("%s, sent again once the id is free: %d %s; want line 2 refused again", a.name, resp.StatusCode, body)
		}
	}
	for _, id := range []string{ids[0], ids[1], "dup"} {
		if code, _ := r.Get(t, "/v1/counterfactuals/"+id); code != http.StatusNotFound {
			t.Errorf("GET %s after the retries: %d, want 404 (nothing registered again)", id, code)
		}
	}
	if n := r.Metric(t, "cfguard_requests_replayed_total", "result", "exists"); n != 3 {
		t.Errorf("cfguard_requests_replayed_total{result=exists} after three retries: %v, want 3", n)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// A value JSON cannot hold is a 500 that says so, not a 200 with an empty body.
func TestWriteJSONOfANaNIs500(t *testing.T) {
	w := httptest.NewRecorder()
	writeJSON(w, http.StatusOK, map[string]float64{"p": math.NaN()})
	var e struct{ Error string }
	if w.Code != http.StatusInternalServerError || json.Unmarshal(w.Body.Bytes(), &e) != nil || !strings.Contains(e.Error, "NaN") {
		t.Errorf("writeJSON of a NaN: %d %q, want 500 with an error naming it", w.Code, w.Body.String())
	}
}

// POST /v1/explain answers an x the model already puts in the target class as
// POST /v1/counterfactuals does (422: well formed, but no counterfactual can exist), and a 429
// names the setting that bounds it.
func TestExplainAnswersAsRegistrationDoes(t *testing.T) {
	if testing.Short() {
		t.Skip("trains the shared VAE (daemontest.SharedVAEDir): not with -short")
	}
	r := startDaemon(t, daemontest.WithSharedVAE(t, nil))
	data := daemontest.Bundled(t)
	_, xs, _ := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	x := mustJSON(t, data.X[xs[0]]) // malignant with p > 0.9
	for _, route := range []struct{ path, body string }{
		{"/v1/explain", `{"x":` + x + `,"target":"malignant"}`},
		{"/v1/counterfactuals", `{"x":` + x + `,"x_cf":` + x + `,"target":"malignant"}`},
	} {
		resp, body := r.RawDo(t, "POST", route.path, route.body, nil)
		if resp.StatusCode != http.StatusUnprocessableEntity || !strings.Contains(string(body), "already classified") {
			t.Errorf("POST %s for an x of the target class: %d %s, want 422 saying it is already classified so", route.path, resp.StatusCode, body)
		}
	}
	var releases []func()
	for {
		release, err := r.D.exp.acquire()
		if err != nil {
			break
		}
		releases = append(releases, release)
	}
	resp, body := r.RawDo(t, "POST", "/v1/explain", `{"x":`+x+`}`, nil)
	for _, release := range releases {
		release()
	}
	if resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(string(body), fmt.Sprintf("explain.concurrency: %d at once", len(releases))) {
		t.Errorf("POST /v1/explain with every slot taken: %d %s, want 429 naming explain.concurrency", resp.StatusCode, body)
	}
}

// A registration refused is answered with the status docs/API.md gives its reason, however the
// reason is wrapped: 400 for a bad request or a CE the ledger finds invalid, 409 for an id that
// holds (or held) a CE, 422 for a reused key and for a pair that is no counterfactual or outside
// the <delta, epsilon>-set, 503 with a Retry-After of 10 s when nothing could be stored (a ledger
// that cannot be written, a daemon that stops), else 500. A 409 for an id that holds a CE says to
// DELETE it first, unless the refusal is an earlier answer held for the request's key.
func TestRegisterErrorsAnswerTheirStatus(t *testing.T) {
	wrap := func(err error) error { return fmt.Errorf("register: %w", err) }
	for _, c := range []struct {
		name       string
		err        error
		code       int
		retryAfter string
		says, not  string
	}{
		{"a bad request", wrap(errBadRequest), 400, "", "", ""},
		{"a CE the ledger finds invalid", wrap(ledger.ErrInvalid), 400, "", "", ""},
		{"a reused key", wrap(errKeyReused), 422, "", "", ""},
		{"an id that holds a CE", wrap(ledger.ErrExists), 409, "", "DELETE it first or choose another id", ""},
		{"an id that held a CE, answered again", &heldError{wrap(ledger.ErrExists)}, 409, "", "", "DELETE it first"},
		{"registered by the request and deleted since", wrap(errDeletedSince), 409, "", "", ""},
		{"stored before the request and deleted since", wrap(errFoundDeletedSince), 409, "", "", ""},
		{"not a counterfactual", wrap(errNotCounterfactual), 422, "", "", ""},
		{"outside the set", wrap(errOutsideSet), 422, "", "", ""},
		{"a ledger that cannot be written", wrap(ledger.ErrWrite), 503, "10", "nothing was stored, retry later", ""},
		{"a daemon that stops", wrap(errStopping), 503, "10", errStopping.Error(), "the ledger cannot be written"},
		{"anything else", errors.New("boom"), 500, "", "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := httptest.NewRecorder()
			writeRegisterError(w, c.err)
			var e struct{ Error string }
			if w.Code != c.code || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error == "" {
				t.Fatalf("%v: %d %q, want %d with a JSON error", c.err, w.Code, w.Body.String(), c.code)
			}
			if got := w.Header().Get("Retry-After"); got != c.retryAfter {
				t.Errorf("%v: Retry-After %q, want %q", c.err, got, c.retryAfter)
			}
			if c.says != "" && !strings.Contains(e.Error, c.says) {
				t.Errorf("%v: error %q does not say %q", c.err, e.Error, c.says)
			}
			if c.not != "" && strings.Contains(e.Error, c.not) {
				t.Errorf("%v: error %q says %q", c.err, e.Error, c.not)
			}
		})
	}
}

// GET /v1/counterfactuals lists 100 CEs when no limit is given, and takes a limit of 1 to 1000:
// a page holds that many, and next names its last CE while more follow; a limit outside 1..1000
// is refused, not cut to fit. A page without CEs is an empty list, not null.
func TestListLimitIsOneToAThousand(t *testing.T) {
	r := startDaemon(t, nil)
	if code, b := r.Get(t, "/v1/counterfactuals"); code != 200 || !strings.Contains(string(b), `"counterfactuals":[]`) {
		t.Errorf("GET /v1/counterfactuals of an empty ledger: %d %s, want 200 with counterfactuals []", code, b)
	}
	daemontest.StoreCEs(t, r, daemontest.Bundled(t), 1001)
	for _, c := range []struct {
		query string
		code  int
		n     int
		next  string
	}{
		{"", 200, 100, "ce-0000099"},
		{"?limit=1", 200, 1, "ce-0000000"},
		{"?limit=1000", 200, 1000, "ce-0000999"},
		{"?limit=1000&after=ce-0000999", 200, 1, ""},
		{"?limit=0", 400, 0, ""},
		{"?limit=1001", 400, 0, ""},
		{"?limit=-1", 400, 0, ""},
	} {
		code, b := r.Get(t, "/v1/counterfactuals"+c.query)
		if code != c.code {
			t.Errorf("GET /v1/counterfactuals%s: %d %.200s, want %d", c.query, code, b, c.code)
			continue
		}
		if code != 200 {
			if !strings.Contains(string(b), "must be 1..1000") {
				t.Errorf("GET /v1/counterfactuals%s: %s, want it to say the limit must be 1..1000", c.query, b)
			}
			continue
		}
		var page struct {
			Counterfactuals []json.RawMessage
			Next            string
		}
		if err := json.Unmarshal(b, &page); err != nil || len(page.Counterfactuals) != c.n || page.Next != c.next {
			t.Errorf("GET /v1/counterfactuals%s: %d CEs, next %q (%v); want %d, next %q", c.query, len(page.Counterfactuals), page.Next, err, c.n, c.next)
		}
	}
}

// Another replica's question for a request's outcome (GET of a CE with a request id, forwarded)
// may name the offset its partition must be applied past: a number from 0 up, or it is refused
// with 400; a request this daemon has not applied is 404, whatever the offset.
func TestOutcomeQuestionTakesAnOffsetFromZero(t *testing.T) {
	r := startDaemon(t, nil)
	for _, c := range []struct {
		after string
		code  int
		says  string
	}{
		{"", 404, `request "rid-1" for "a1" not applied here`},
		{"0", 404, `request "rid-1" for "a1" not applied here`},
		{"-1", 400, `Cfguard-Applied-After: "-1" is not an offset`},
		{"one", 400, `Cfguard-Applied-After: "one" is not an offset`},
	} {
		header := map[string]string{cluster.HeaderForwarded: "r2", cluster.HeaderRequestID: "rid-1"}
		if c.after != "" {
			header[cluster.HeaderAppliedAfter] = c.after
		}
		resp, body := r.RawDo(t, "GET", "/v1/counterfactuals/a1", "", header)
		var e struct{ Error string }
		if resp.StatusCode != c.code || json.Unmarshal(body, &e) != nil || e.Error != c.says {
			t.Errorf("the outcome of rid-1, applied after %q: %d %s; want %d with the error %q", c.after, resp.StatusCode, body, c.code, c.says)
		}
	}
}
