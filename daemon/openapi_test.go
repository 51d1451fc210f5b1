package daemon

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// openAPIDoc is docs/openapi.yaml decoded generically (YAML maps become map[string]any).
type openAPIDoc map[string]any

func loadOpenAPI(t *testing.T) openAPIDoc {
	t.Helper()
	path := filepath.Join("..", "docs", "openapi.yaml")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// Into a plain map: yaml.v3 gives nested mappings the type of the outermost one.
	var m map[string]any
	if err := yaml.Unmarshal(b, &m); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	doc := openAPIDoc(m)
	if v, _ := doc["openapi"].(string); !strings.HasPrefix(v, "3.") {
		t.Fatalf("%s: openapi %q, want 3.x", path, v)
	}
	return doc
}

// httpMethods are the operation keys of an OpenAPI path item.
var httpMethods = []string{"get", "put", "post", "delete", "options", "head", "patch", "trace"}

// operations maps "METHOD /path" to the operation object.
func (d openAPIDoc) operations(t *testing.T) map[string]map[string]any {
	t.Helper()
	ops := map[string]map[string]any{}
	paths, ok := d["paths"].(map[string]any)
	if !ok {
		t.Fatal("docs/openapi.yaml has no paths")
	}
	for p, item := range paths {
		for k, op := range item.(map[string]any) {
			if slices.Contains(httpMethods, k) {
				ops[strings.ToUpper(k)+" "+p] = op.(map[string]any)
			}
		}
	}
	return ops
}

// resolve follows $ref (local JSON pointers only) until v is not a reference.
func (d openAPIDoc) resolve(t *testing.T, v any) map[string]any {
	t.Helper()
	for range 16 {
		m, ok := v.(map[string]any)
		if !ok {
			t.Fatalf("docs/openapi.yaml: %v is not an object", v)
		}
		ref, ok := m["$ref"].(string)
		if !ok {
			return m
		}
		v = d.pointer(t, ref)
	}
	t.Fatalf("docs/openapi.yaml: $ref chain longer than 16")
	return nil
}

// pointer returns what a local reference "#/a/b" names.
func (d openAPIDoc) pointer(t *testing.T, ref string) any {
	t.Helper()
	rest, ok := strings.CutPrefix(ref, "#/")
	if !ok {
		t.Fatalf("docs/openapi.yaml: $ref %q is not local", ref)
	}
	var cur any = map[string]any(d)
	for _, part := range strings.Split(rest, "/") {
		part = strings.NewReplacer("~1", "/", "~0", "~").Replace(part)
		m, ok := cur.(map[string]any)
		if !ok || m[part] == nil {
			t.Fatalf("docs/openapi.yaml: $ref %q does not resolve (at %q)", ref, part)
		}
		cur = m[part]
	}
	return cur
}

// authOf is the route table's auth field an operation's security requirement stands for:
// bearerToken is http.token ("token"), metricsToken is http.metrics_token ("metrics"), none is
// open (""). The document's top-level security applies when the operation has none.
func (d openAPIDoc) authOf(t *testing.T, op map[string]any) string {
	t.Helper()
	sec, ok := op["security"]
	if !ok {
		sec = d["security"]
	}
	reqs, _ := sec.([]any)
	switch len(reqs) {
	case 0:
		return ""
	case 1:
	default:
		t.Fatalf("security %v: one requirement or none, please (the daemon has one token per route)", reqs)
	}
	req := reqs[0].(map[string]any)
	if len(req) != 1 {
		t.Fatalf("security requirement %v names %d schemes, want 1", req, len(req))
	}
	for name := range req {
		switch name {
		case "bearerToken":
			return "token"
		case "metricsToken":
			return "metrics"
		}
		t.Fatalf("security scheme %q is not one the daemon has (bearerToken, metricsToken)", name)
	}
	return ""
}

// routeTable is the daemon's route table as "METHOD /path" -> auth.
func routeTable() map[string]string {
	a := &api{metrics: http.NotFoundHandler()}
	out := map[string]string{}
	for _, e := range a.endpoints() {
		out[e.pattern] = e.auth
	}
	return out
}

// TestOpenAPIMatchesRouteTable: docs/openapi.yaml documents exactly the routes the daemon
// registers (both ways), each with the authentication the route table gives it, and every
// reference in it resolves.
func TestOpenAPIMatchesRouteTable(t *testing.T) {
	doc := loadOpenAPI(t)
	ops := doc.operations(t)
	table := routeTable()
	for pattern, auth := range table {
		op, ok := ops[pattern]
		if !ok {
			t.Errorf("route %q (auth %q) is not in docs/openapi.yaml", pattern, auth)
			continue
		}
		if got := doc.authOf(t, op); got != auth {
			t.Errorf("%s: docs/openapi.yaml's security means auth %q, the route table says %q", pattern, got, auth)
		}
		// An authenticated route documents its 401; an open one does not.
		responses := op["responses"].(map[string]any)
		if _, has := responses["401"]; has != (auth != "") {
			t.Errorf("%s: documents 401: %v, but its auth is %q", pattern, has, auth)
		}
		// Every 429 says when to retry (the answers TestOpenAPIDescribesAnswers cannot provoke
		// are checked here; the others it checks against what the daemon sends).
		if r, ok := responses["429"]; ok {
			if h, _ := doc.resolve(t, r)["headers"].(map[string]any); h["Retry-After"] == nil {
				t.Errorf("%s: 429 without Retry-After", pattern)
			}
		}
	}
	for pattern := range ops {
		if _, ok := table[pattern]; !ok {
			t.Errorf("docs/openapi.yaml documents %q, which the daemon does not route", pattern)
		}
	}
	// Both schemes are bearer tokens over HTTP.
	schemes := doc.pointer(t, "#/components/securitySchemes").(map[string]any)
	for _, name := range []string{"bearerToken", "metricsToken"} {
		s, _ := schemes[name].(map[string]any)
		if s["type"] != "http" || s["scheme"] != "bearer" {
			t.Errorf("securitySchemes.%s = %v, want type http, scheme bearer", name, s)
		}
	}
	// Every $ref resolves.
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if ref, ok := v["$ref"].(string); ok {
				doc.pointer(t, ref)
			}
			for _, c := range v {
				walk(c)
			}
		case []any:
			for _, c := range v {
				walk(c)
			}
		}
	}
	walk(map[string]any(doc))
}

// TestOpenAPIRouteTableCheckFails: the comparison above notices a route missing from the
// document and an operation whose security disagrees with the table.
func TestOpenAPIRouteTableCheckFails(t *testing.T) {
	doc := loadOpenAPI(t)
	ops := doc.operations(t)
	table := routeTable()
	if len(ops) != len(table) {
		t.Fatalf("%d operations, %d routes", len(ops), len(table))
	}
	delete(doc["paths"].(map[string]any), "/v1/audit")
	if got := len(doc.operations(t)); got != len(table)-2 {
		t.Fatalf("after removing /v1/audit: %d operations, want %d", got, len(table)-2)
	}
	if got := doc.authOf(t, map[string]any{}); got != "token" {
		t.Fatalf("an operation without security inherits the top level's: auth %q, want token", got)
	}
	if got := doc.authOf(t, map[string]any{"security": []any{}}); got != "" {
		t.Fatalf("security: [] is open, got %q", got)
	}
}

// validator checks a decoded JSON value (numbers as json.Number) against an OpenAPI 3.0 schema:
// $ref, type, nullable, properties, required, additionalProperties, items, enum, oneOf, allOf,
// minimum, maximum, minItems, maxItems, minLength, maxLength, pattern, format date-time. Any
// other keyword is an error, so the document cannot say more than the test checks.
type validator struct {
	t   *testing.T
	doc openAPIDoc
}

var schemaWords = map[string]bool{"$ref": true, "type": true, "nullable": true, "properties": true, "required": true,
	"additionalProperties": true, "items": true, "enum": true, "oneOf": true, "allOf": true, "minimum": true,
	"maximum": true, "minItems": true, "maxItems": true, "minLength": true, "maxLength": true, "pattern": true,
	"format": true, "description": true, "default": true}

func (v validator) check(at string, schema map[string]any, x any) []string {
	schema = v.doc.resolve(v.t, schema)
	for k := range schema {
		if !schemaWords[k] {
			v.t.Fatalf("docs/openapi.yaml: schema keyword %q at %s is not checked by this test", k, at)
		}
	}
	if x == nil {
		if schema["nullable"] == true {
			return nil
		}
		if _, typed := schema["type"]; typed {
			return []string{at + ": null, schema is not nullable"}
		}
	}
	var errs []string
	fail := func(f string, a ...any) { errs = append(errs, at+": "+fmt.Sprintf(f, a...)) }
	if all, ok := schema["allOf"].([]any); ok {
		for _, s := range all {
			errs = append(errs, v.check(at, s.(map[string]any), x)...)
		}
	}
	if one, ok := schema["oneOf"].([]any); ok {
		n := 0
		for _, s := range one {
			if len(v.check(at, s.(map[string]any), x)) == 0 {
				n++
			}
		}
		if n != 1 {
			fail("%v matches %d of oneOf's %d schemas, want 1", x, n, len(one))
		}
	}
	if enum, ok := schema["enum"].([]any); ok {
		if !slices.ContainsFunc(enum, func(e any) bool { return fmt.Sprint(e) == fmt.Sprint(x) }) {
			fail("%v not in %v", x, enum)
		}
	}
	switch schema["type"] {
	case nil:
	case "object":
		m, ok := x.(map[string]any)
		if !ok {
			fail("%T, want object", x)
			break
		}
		props, _ := schema["properties"].(map[string]any)
		for _, r := range asSlice(schema["required"]) {
			if _, ok := m[r.(string)]; !ok {
				fail("required property %q missing", r)
			}
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			if ps, ok := props[k]; ok {
				errs = append(errs, v.check(at+"."+k, ps.(map[string]any), m[k])...)
				continue
			}
			switch ap := schema["additionalProperties"].(type) {
			case bool:
				if !ap {
					fail("property %q is not documented", k)
				}
			case map[string]any:
				errs = append(errs, v.check(at+"."+k, ap, m[k])...)
			}
		}
	case "array":
		a, ok := x.([]any)
		if !ok {
			fail("%T, want array", x)
			break
		}
		if n, ok := schema["minItems"].(int); ok && len(a) < n {
			fail("%d items, minItems %d", len(a), n)
		}
		if n, ok := schema["maxItems"].(int); ok && len(a) > n {
			fail("%d items, maxItems %d", len(a), n)
		}
		if items, ok := schema["items"].(map[string]any); ok {
			for i, e := range a {
				errs = append(errs, v.check(fmt.Sprintf("%s[%d]", at, i), items, e)...)
			}
		}
	case "string":
		s, ok := x.(string)
		if !ok {
			fail("%T %v, want string", x, x)
			break
		}
		if n, ok := schema["minLength"].(int); ok && len(s) < n {
			fail("%q shorter than %d", s, n)
		}
		if n, ok := schema["maxLength"].(int); ok && len(s) > n {
			fail("%q longer than %d", s, n)
		}
		if p, ok := schema["pattern"].(string); ok && !regexp.MustCompile(p).MatchString(s) {
			fail("%q does not match %s", s, p)
		}
		if schema["format"] == "date-time" {
			if _, err := time.Parse(time.RFC3339Nano, s); err != nil {
				fail("%q is not a date-time: %v", s, err)
			}
		}
	case "integer", "number":
		n, ok := x.(json.Number)
		if !ok {
			fail("%T %v, want %s", x, x, schema["type"])
			break
		}
		f, err := n.Float64()
		if err != nil {
			fail("%v: %v", n, err)
			break
		}
		if schema["type"] == "integer" {
			if _, err := strconv.ParseInt(n.String(), 10, 64); err != nil {
				if _, err := strconv.ParseUint(n.String(), 10, 64); err != nil {
					fail("%v is not an integer", n)
				}
			}
		}
		if m, ok := number(schema["minimum"]); ok && f < m {
			fail("%v < minimum %v", f, m)
		}
		if m, ok := number(schema["maximum"]); ok && f > m {
			fail("%v > maximum %v", f, m)
		}
	case "boolean":
		if _, ok := x.(bool); !ok {
			fail("%T %v, want boolean", x, x)
		}
	default:
		v.t.Fatalf("docs/openapi.yaml: type %v at %s", schema["type"], at)
	}
	return errs
}

func asSlice(v any) []any { s, _ := v.([]any); return s }

func number(v any) (float64, bool) {
	switch v := v.(type) {
	case int:
		return float64(v), true
	case float64:
		return v, true
	}
	return 0, false
}

// TestValidatorCatchesMismatches: the validator rejects what the document does not describe.
func TestValidatorCatchesMismatches(t *testing.T) {
	v := validator{t, loadOpenAPI(t)}
	ce := func(s string) any { return decodeJSONNumbers(t, []byte(s)) }
	for _, c := range []struct {
		schema, body string
		ok           bool
	}{
		{"Error", `{"error":"x"}`, true},
		{"Error", `{"error":"x","extra":1}`, false},
		{"Error", `{}`, false},
		{"Status", `"at_risk"`, true},
		{"Status", `"fine"`, false},
		{"Target", `1`, true},
		{"Target", `"benign"`, true},
		{"Target", `1.5`, false},
		{"Anchor", `{"version":1,"refs":2,"kl":0.1,"kl_version":3,"created_at":"2026-01-02T03:04:05Z"}`, true},
		{"Anchor", `{"version":-1,"refs":2,"kl":0.1,"kl_version":3,"created_at":"2026-01-02T03:04:05Z"}`, false},
		{"Anchor", `{"version":1,"refs":2,"kl":0.1,"kl_version":3,"created_at":"yesterday"}`, false},
		{"CounterfactualPage", `{"counterfactuals":null,"next":""}`, true},
		{"CounterfactualPage", `{"counterfactuals":[{"id":"a"}],"next":""}`, false},
		{"PredictResponse", `{"posterior_version":0,"samples":10,"prediction":{"class":"a","index":0,"p":[1],"var":["x"]}}`, false},
	} {
		errs := v.check(c.schema, map[string]any{"$ref": "#/components/schemas/" + c.schema}, ce(c.body))
		if (len(errs) == 0) != c.ok {
			t.Errorf("%s %s: errors %v, want ok %v", c.schema, c.body, errs, c.ok)
		}
	}
}

func decodeJSONNumbers(t *testing.T, b []byte) any {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var x any
	if err := dec.Decode(&x); err != nil {
		t.Fatalf("response body is not JSON: %v: %s", err, b)
	}
	return x
}

// conformance sends requests to a running daemon and checks each answer against the operation
// docs/openapi.yaml gives for its route: the status code is documented, the documented
// headers are there (and Retry-After and ETag are documented when sent), the content type is
// one documented, and a JSON body fits its schema.
type conformance struct {
	t     *testing.T
	r     *running
	doc   openAPIDoc
	ops   map[string]map[string]any
	seen  map[string]bool // "METHOD /template" exercised
	codes map[string]bool // "METHOD /template status" exercised
}

// route finds the documented "METHOD /template" a request path matches.
func (c *conformance) route(method, path string) string {
	path, _, _ = strings.Cut(path, "?")
	segs := strings.Split(path, "/")
	for pattern := range c.ops {
		m, tmpl, _ := strings.Cut(pattern, " ")
		ts := strings.Split(tmpl, "/")
		if m != method || len(ts) != len(segs) {
			continue
		}
		match := true
		for i := range ts {
			if ts[i] != segs[i] && !(strings.HasPrefix(ts[i], "{") && strings.HasSuffix(ts[i], "}")) {
				match = false
			}
		}
		if match {
			return pattern
		}
	}
	c.t.Fatalf("%s %s: no documented route matches", method, path)
	return ""
}

// send makes the request and checks the answer; it returns the status, headers and body.
func (c *conformance) send(method, path, token string, header map[string]string, body string, want int) (int, http.Header, []byte) {
	c.t.Helper()
	code, h, _, b := c.sendTrailer(method, path, token, header, body, want)
	return code, h, b
}

// sendTrailer is send that also returns the response's trailers.
func (c *conformance) sendTrailer(method, path, token string, header map[string]string, body string, want int) (int, http.Header, http.Header, []byte) {
	t := c.t
	t.Helper()
	hdr := map[string]string{}
	if token != "" {
		hdr["Authorization"] = "Bearer " + token
	}
	maps.Copy(hdr, header)
	resp, b := c.r.RawDo(t, method, path, body, hdr)
	where := fmt.Sprintf("%s %s -> %d", method, path, resp.StatusCode)
	if resp.StatusCode != want {
		t.Fatalf("%s, want %d: %s", where, want, b)
	}
	pattern := c.route(method, path)
	c.seen[pattern] = true
	c.codes[pattern+" "+strconv.Itoa(resp.StatusCode)] = true
	responses := c.ops[pattern]["responses"].(map[string]any)
	doc, ok := responses[strconv.Itoa(resp.StatusCode)]
	if !ok {
		t.Errorf("%s: status not documented for %s", where, pattern)
		return resp.StatusCode, resp.Header, resp.Trailer, b
	}
	r := c.doc.resolve(t, doc)
	headers, _ := r["headers"].(map[string]any)
	for name, h := range headers {
		if c.doc.resolve(t, h)["required"] == true && resp.Header.Get(name) == "" {
			t.Errorf("%s: documented header %s missing", where, name)
		}
	}
	for _, name := range []string{"Retry-After", "ETag", headerPosteriorVersion, headerWeightsSHA256, "WWW-Authenticate"} {
		if resp.Header.Get(name) != "" && headers[name] == nil {
			t.Errorf("%s: sends %s, which the document does not list", where, name)
		}
	}
	for name, h := range headers {
		if s, ok := c.doc.resolve(t, h)["schema"].(map[string]any); ok && resp.Header.Get(name) != "" {
			hv := resp.Header.Get(name)
			var x any = hv
			if c.doc.resolve(t, s)["type"] == "integer" {
				x = json.Number(hv)
			}
			for _, e := range (validator{t, c.doc}).check(where+" header "+name, s, x) {
				t.Error(e)
			}
		}
	}
	content, _ := r["content"].(map[string]any)
	if len(content) == 0 {
		if len(b) != 0 {
			t.Errorf("%s: documented without a body, got %q", where, b)
		}
		return resp.StatusCode, resp.Header, resp.Trailer, b
	}
	ctype, _, _ := strings.Cut(resp.Header.Get("Content-Type"), ";")
	media, ok := content[strings.TrimSpace(ctype)].(map[string]any)
	if !ok {
		t.Errorf("%s: Content-Type %q, documented %v", where, resp.Header.Get("Content-Type"), content)
		return resp.StatusCode, resp.Header, resp.Trailer, b
	}
	if ctype == "application/json" {
		for _, e := range (validator{t, c.doc}).check(where, media["schema"].(map[string]any), decodeJSONNumbers(t, b)) {
			t.Error(e)
		}
	}
	return resp.StatusCode, resp.Header, resp.Trailer, b
}

// TestOpenAPIDescribesAnswers runs a daemon and checks its answers to requests on every route
// (successes and the errors a client meets) against docs/openapi.yaml.
func TestOpenAPIDescribesAnswers(t *testing.T) {
	const token, metricsToken = "t0ken", "m3trics"
	r := startDaemon(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		c.HTTP.Token, c.HTTP.MetricsToken = token, metricsToken
		c.Explain.Concurrency = 1
	}))
	doc := loadOpenAPI(t)
	c := &conformance{t: t, r: r, doc: doc, ops: doc.operations(t), seen: map[string]bool{}, codes: map[string]bool{}}
	js := func(v any) string { b, _ := json.Marshal(v); return string(b) }
	data := daemontest.Bundled(t)

	c.send("GET", "/healthz", "", nil, "", 200)
	c.send("GET", "/readyz", "", nil, "", 200)
	c.send("GET", "/metrics", metricsToken, nil, "", 200)
	c.send("GET", "/metrics", token, nil, "", 401)
	c.send("GET", "/v1/model", "", nil, "", 401)
	c.send("GET", "/v1/model", metricsToken, nil, "", 401)

	// Predictions, one and a batch; the rows that make counterfactual pairs.
	c.send("POST", "/v1/predict", token, nil, js(map[string]any{"x": data.X[0]}), 200)
	_, _, body := c.send("POST", "/v1/predict", token, nil, js(map[string]any{"xs": data.X}), 200)
	c.send("POST", "/v1/predict", token, nil, js(map[string]any{"x": data.X[0], "xs": data.X[:2]}), 400)
	c.send("POST", "/v1/predict", token, nil, `{"x": [1, 2]}`, 400)
	var pred struct {
		Predictions []prediction `json:"predictions"`
	}
	if err := json.Unmarshal(body, &pred); err != nil {
		t.Fatal(err)
	}
	var xs, cfs []int
	for i, p := range pred.Predictions {
		switch {
		case p.Index == 0 && p.P[0] > 0.9:
			xs = append(xs, i)
		case p.P[1] > 0.985 && p.Var[1] < 0.002:
			cfs = append(cfs, i)
		}
	}
	if len(xs) < 2 || len(cfs) < 2 {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}

	// Counterfactuals: stored, listed, read, refused, deleted.
	ce := map[string]any{"id": "ce-0", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
	c.send("POST", "/v1/counterfactuals", token, nil, js(ce), 201)
	c.send("POST", "/v1/counterfactuals", token, nil, js(map[string]any{"x": data.X[xs[1]], "x_cf": data.X[cfs[1]], "target": 1}), 201)
	c.send("POST", "/v1/counterfactuals", token, nil, js(ce), 409)
	c.send("POST", "/v1/counterfactuals", token, nil, js(map[string]any{"id": "ce-x", "x": data.X[cfs[0]], "x_cf": data.X[cfs[1]], "target": "benign"}), 422)
	c.send("POST", "/v1/counterfactuals", token, nil, `{"id":"ce-y","x":[],"x_cf":[],"target":"benign","extra":1}`, 400)
	c.send("POST", "/v1/counterfactuals", "", nil, js(ce), 401)
	c.send("GET", "/v1/counterfactuals?status=certified", token, nil, "", 200)
	c.send("GET", "/v1/counterfactuals?status=certified&limit=1", token, nil, "", 200)
	c.send("GET", "/v1/counterfactuals?status=invalidated", token, nil, "", 200)
	c.send("GET", "/v1/counterfactuals?status=fine", token, nil, "", 400)
	c.send("GET", "/v1/counterfactuals/ce-0", token, nil, "", 200)
	c.send("GET", "/v1/counterfactuals/nope", token, nil, "", 404)
	bulk := js(map[string]any{"id": "bulk-1", "x": data.X[xs[1]], "x_cf": data.X[cfs[0]], "target": "benign"}) + "\n{\"x\":\n\n" + js(ce) + "\n"
	_, _, body = c.send("POST", "/v1/counterfactuals:bulk", token, map[string]string{"Content-Type": "application/x-ndjson"}, bulk, 200)
	if !strings.Contains(string(body), `"stored":1,"accepted":0,"exists":1,"refused":1`) {
		t.Errorf("bulk: %s, want one stored, one exists, one refused", body)
	}
	c.send("POST", "/v1/counterfactuals:bulk", token, nil, strings.Repeat("{}\n", maxBulkLines+1), 400)
	c.send("POST", "/v1/counterfactuals:bulk", "", nil, bulk, 401)

	// Records, so that the model's KL history, anchors and prequential scores are not empty (correct
	// labels: the explanation below must still find a robust counterfactual).
	var recs [][]byte
	for i := 0; i < 64; i++ {
		recs = append(recs, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, recs...)
	waitfor.Cond(t, 30*time.Second, "two updates", func() bool { return r.D.current().Version >= 2 })
	c.send("GET", "/v1/model", token, nil, "", 200)
	c.send("GET", "/v1/counterfactuals/ce-0", token, nil, "", 200)

	// The posterior's two files, then 304 for their ETags.
	for _, p := range []string{"/v1/model/posterior", "/v1/model/posterior/sidecar"} {
		_, h, _ := c.send("GET", p, token, nil, "", 200)
		c.send("GET", p, token, map[string]string{"If-None-Match": h.Get("ETag")}, "", 304)
		c.send("GET", p, token, map[string]string{"If-None-Match": `"0000"`}, "", 200)
	}

	// Audits: 409 with Retry-After while one runs, then one that runs.
	if err := r.D.audits.begin("schedule", time.Now()); err != nil {
		t.Fatal(err)
	}
	c.send("POST", "/v1/audit", token, nil, "", 409)
	c.send("GET", "/v1/audit", token, nil, "", 200)
	r.D.audits.end(ledger.AuditReport{}, fmt.Errorf("stopped by the test"), time.Now())
	c.send("GET", "/v1/audit", token, nil, "", 200)
	c.send("POST", "/v1/audit", token, nil, "", 200)
	c.send("POST", "/v1/audit", token, nil, `{"bogus":1}`, 400)
	c.send("GET", "/v1/audit", token, nil, "", 200)

	// Explain: bad requests, 429 with every slot taken, then (without -short) one generation.
	c.send("POST", "/v1/explain", token, nil, js(map[string]any{"x": data.X[0][:3]}), 400)
	c.send("POST", "/v1/explain", token, nil, js(map[string]any{"x": data.X[0], "method": "magic"}), 400)
	release, err := r.D.exp.acquire()
	if err != nil {
		t.Fatal(err)
	}
	c.send("POST", "/v1/explain", token, nil, js(map[string]any{"x": data.X[0]}), 429)
	release()
	if !testing.Short() {
		c.send("POST", "/v1/explain", token, nil, js(map[string]any{"id": "psce-1", "x": data.X[xs[0]], "target": "benign"}), 201)
	}

	// A backup: the ledger file, its outcome in the documented trailers.
	c.send("GET", "/v1/backup", "", nil, "", 401)
	_, _, trailer, backup := c.sendTrailer("GET", "/v1/backup", token, nil, "", 200)
	documented := c.doc.resolve(t, c.ops["GET /v1/backup"]["responses"].(map[string]any)["200"])["x-trailers"].(map[string]any)
	for name := range trailer {
		if documented[name] == nil {
			t.Errorf("GET /v1/backup: trailer %s is not documented", name)
		}
	}
	for _, name := range []string{"Cfguard-Backup-Txid", "Cfguard-Backup-Posterior-Version"} {
		if _, err := strconv.ParseUint(trailer.Get(name), 10, 64); err != nil {
			t.Errorf("GET /v1/backup: trailer %s = %q, want an integer", name, trailer.Get(name))
		}
	}
	if e := trailer.Get("Cfguard-Backup-Error"); e != "" || len(backup) == 0 {
		t.Errorf("GET /v1/backup: %d bytes, error trailer %q", len(backup), e)
	}

	c.send("DELETE", "/v1/counterfactuals/ce-0", token, map[string]string{"Idempotency-Key": "del-0"}, "", 204)
	c.send("DELETE", "/v1/counterfactuals/ce-0", token, map[string]string{"Idempotency-Key": "del-0"}, "", 204) // a retry
	c.send("DELETE", "/v1/counterfactuals/bulk-1", token, map[string]string{"Idempotency-Key": "del-0"}, "", 422)
	c.send("DELETE", "/v1/counterfactuals/bulk-1", token, map[string]string{"Idempotency-Key": ""}, "", 400)
	c.send("DELETE", "/v1/counterfactuals/ce-0", token, nil, "", 404)

	for pattern := range routeTable() {
		if !c.seen[pattern] {
			t.Errorf("%s: no request in this test; add one", pattern)
		}
	}
	var codes []string
	for k := range c.codes {
		codes = append(codes, k)
	}
	sort.Strings(codes)
	t.Logf("checked %d (route, status) answers against docs/openapi.yaml: %s", len(codes), strings.Join(codes, ", "))
}

// A replica's answers that differ from a single daemon's (the replication block of /v1/model,
// lists and audits over the cluster) are what docs/openapi.yaml says too.
func TestOpenAPIDescribesReplicaAnswers(t *testing.T) {
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	r := startReplica(t, b, "r1")
	doc := loadOpenAPI(t)
	c := &conformance{t: t, r: r, doc: doc, ops: doc.operations(t), seen: map[string]bool{}, codes: map[string]bool{}}
	daemontest.RegisterCEs(t, r, daemontest.Bundled(t), 2, "")
	_, _, body := c.send("GET", "/v1/model", "", nil, "", 200)
	for _, empty := range []string{`"ce_partitions_rebuilding":[]`, `"ce_partitions_blocked":[]`} {
		if !strings.Contains(string(body), empty) {
			t.Errorf("GET /v1/model at a caught-up replica: no %s in %s", empty, body)
		}
	}
	c.send("GET", "/v1/counterfactuals?limit=10", "", nil, "", 200)
	c.send("POST", "/v1/audit", "", nil, "{}", 200)
	c.send("GET", "/v1/audit", "", nil, "", 200)
	// Without a token, what a web page may send is 403, as the spec says of every operation.
	for _, path := range []string{"/v1/model", "/v1/counterfactuals?limit=1", "/metrics"} {
		c.send("GET", path, "", map[string]string{"Origin": "http://evil.example"}, "", 403)
	}
	// A bulk line a replica sends to its owner is accepted, not stored: the owner judges it.
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	if len(xs) == 0 || len(cfs) == 0 {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	line, _ := json.Marshal(map[string]any{"id": "bulk-0", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"})
	_, _, body = c.send("POST", "/v1/counterfactuals:bulk", "", map[string]string{"Content-Type": "application/x-ndjson"}, string(line)+"\n", 200)
	var bulk struct {
		Stored, Accepted int
		Results          []struct{ Status string }
	}
	if err := json.Unmarshal(body, &bulk); err != nil || bulk.Stored != 0 || bulk.Accepted != 1 || len(bulk.Results) != 1 || bulk.Results[0].Status != "accepted" {
		t.Errorf("a bulk line at a replica: %s (%v), want it accepted and counted so, not stored", body, err)
	}
}

// A replica answers 202 when the owner of a CE's partition has not applied a registration or
// deletion within replication.register_wait: with 0 it answers at once, naming the partition
// and offset where the request landed, as docs/openapi.yaml says.
func TestOpenAPIDescribesPendingAnswers(t *testing.T) {
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	// The shared VAE: a VAE trained on the first explanation would outlast explain.timeout (60 s)
	// on a busy core under the race detector, and the explanation would be a 503.
	r := startDaemonWith(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", key)
		c.Replication.RegisterWait = 0
	}), nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	doc := loadOpenAPI(t)
	c := &conformance{t: t, r: r, doc: doc, ops: doc.operations(t), seen: map[string]bool{}, codes: map[string]bool{}}
	js := func(v any) string { b, _ := json.Marshal(v); return string(b) }
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	if len(xs) == 0 || len(cfs) == 0 {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	c.send("POST", "/v1/counterfactuals", "", nil, js(map[string]any{"id": "pending-0", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}), 202)
	c.send("DELETE", "/v1/counterfactuals/pending-0", "", nil, "", 202)
	c.send("POST", "/v1/explain", "", nil, js(map[string]any{"id": "pending-psce", "x": data.X[xs[0]], "target": "benign"}), 202)
}
