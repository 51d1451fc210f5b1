// Package openapitest checks the daemon's HTTP answers against docs/openapi.yaml: the document
// decoded (Load), a validator of JSON values against its schemas (Validator), and Conformance,
// which sends requests to a running daemon and checks each answer against the operation the
// document gives for its route.
package openapitest

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

	"github.com/cfguard/cfguard/internal/tooltest"
)

// Doc is docs/openapi.yaml decoded generically (YAML maps become map[string]any).
type Doc map[string]any

// Load decodes the repository's docs/openapi.yaml, failing t when it is not an OpenAPI 3 document.
func Load(t testing.TB) Doc {
	t.Helper()
	path := filepath.Join(tooltest.RepoRoot(t), "docs", "openapi.yaml")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// Into a plain map: yaml.v3 gives nested mappings the type of the outermost one.
	var m map[string]any
	if err := yaml.Unmarshal(b, &m); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	doc := Doc(m)
	if v, _ := doc["openapi"].(string); !strings.HasPrefix(v, "3.") {
		t.Fatalf("%s: openapi %q, want 3.x", path, v)
	}
	return doc
}

// httpMethods are the operation keys of an OpenAPI path item.
var httpMethods = []string{"get", "put", "post", "delete", "options", "head", "patch", "trace"}

// Operations maps "METHOD /path" to the operation object.
func (d Doc) Operations(t testing.TB) map[string]map[string]any {
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

// Resolve follows $ref (local JSON pointers only) until v is not a reference.
func (d Doc) Resolve(t testing.TB, v any) map[string]any {
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
		v = d.Pointer(t, ref)
	}
	t.Fatalf("docs/openapi.yaml: $ref chain longer than 16")
	return nil
}

// Pointer returns what a local reference "#/a/b" names.
func (d Doc) Pointer(t testing.TB, ref string) any {
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

// AuthOf is the route table's auth field an operation's security requirement stands for:
// bearerToken is http.token ("token"), metricsToken is http.metrics_token ("metrics"), none is
// open (""). The document's top-level security applies when the operation has none.
func (d Doc) AuthOf(t testing.TB, op map[string]any) string {
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

// Validator checks a decoded JSON value (numbers as json.Number) against an OpenAPI 3.0 schema:
// $ref, type, nullable, properties, required, additionalProperties, items, enum, oneOf, allOf,
// minimum, maximum, minItems, maxItems, minLength, maxLength, pattern, format date-time. Any
// other keyword is an error, so the document cannot say more than the test checks.
type Validator struct {
	T   testing.TB
	Doc Doc
}

var schemaWords = map[string]bool{"$ref": true, "type": true, "nullable": true, "properties": true, "required": true,
	"additionalProperties": true, "items": true, "enum": true, "oneOf": true, "allOf": true, "minimum": true,
	"maximum": true, "minItems": true, "maxItems": true, "minLength": true, "maxLength": true, "pattern": true,
	"format": true, "description": true, "default": true}

// Check returns what is wrong with x against schema (none when it fits), each error prefixed
// by at, the place in the answer.
func (v Validator) Check(at string, schema map[string]any, x any) []string {
	schema = v.Doc.Resolve(v.T, schema)
	for k := range schema {
		if !schemaWords[k] {
			v.T.Fatalf("docs/openapi.yaml: schema keyword %q at %s is not checked by this test", k, at)
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
			errs = append(errs, v.Check(at, s.(map[string]any), x)...)
		}
	}
	if one, ok := schema["oneOf"].([]any); ok {
		n := 0
		for _, s := range one {
			if len(v.Check(at, s.(map[string]any), x)) == 0 {
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
				errs = append(errs, v.Check(at+"."+k, ps.(map[string]any), m[k])...)
				continue
			}
			switch ap := schema["additionalProperties"].(type) {
			case bool:
				if !ap {
					fail("property %q is not documented", k)
				}
			case map[string]any:
				errs = append(errs, v.Check(at+"."+k, ap, m[k])...)
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
				errs = append(errs, v.Check(fmt.Sprintf("%s[%d]", at, i), items, e)...)
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
		v.T.Fatalf("docs/openapi.yaml: type %v at %s", schema["type"], at)
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

// DecodeJSONNumbers decodes the JSON value b with numbers as json.Number, as Check wants them.
func DecodeJSONNumbers(t testing.TB, b []byte) any {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var x any
	if err := dec.Decode(&x); err != nil {
		t.Fatalf("response body is not JSON: %v: %s", err, b)
	}
	return x
}

// Conformance sends requests to a running daemon and checks each answer against the operation
// docs/openapi.yaml gives for its route: the status code is documented, the documented
// headers are there (and every header it sends of its own, Cfguard-*, or that tells a client what
// to do, Retry-After, ETag and WWW-Authenticate, is documented), the content type is
// one documented, and a JSON body fits its schema.
type Conformance struct {
	t     testing.TB
	r     Requester
	Doc   Doc
	Ops   map[string]map[string]any // the document's operations, by "METHOD /template"
	Seen  map[string]bool           // "METHOD /template" exercised
	Codes map[string]bool           // "METHOD /template status" exercised
}

// Requester sends one request to a daemon, as daemontest.Running's RawDo does.
type Requester interface {
	RawDo(t testing.TB, method, path, body string, header map[string]string) (*http.Response, []byte)
}

// New returns a Conformance that sends requests through r and checks them against doc.
func New(t testing.TB, r Requester, doc Doc) *Conformance {
	return &Conformance{t: t, r: r, Doc: doc, Ops: doc.Operations(t), Seen: map[string]bool{}, Codes: map[string]bool{}}
}

// route finds the documented "METHOD /template" a request path matches.
func (c *Conformance) route(method, path string) string {
	path, _, _ = strings.Cut(path, "?")
	segs := strings.Split(path, "/")
	for pattern := range c.Ops {
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

// Send makes the request and checks the answer; it returns the status, headers and body.
func (c *Conformance) Send(method, path, token string, header map[string]string, body string, want int) (int, http.Header, []byte) {
	c.t.Helper()
	code, h, _, b := c.SendTrailer(method, path, token, header, body, want)
	return code, h, b
}

// SendTrailer is Send that also returns the response's trailers.
func (c *Conformance) SendTrailer(method, path, token string, header map[string]string, body string, want int) (int, http.Header, http.Header, []byte) {
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
	c.Seen[pattern] = true
	c.Codes[pattern+" "+strconv.Itoa(resp.StatusCode)] = true
	responses := c.Ops[pattern]["responses"].(map[string]any)
	doc, ok := responses[strconv.Itoa(resp.StatusCode)]
	if !ok {
		t.Errorf("%s: status not documented for %s", where, pattern)
		return resp.StatusCode, resp.Header, resp.Trailer, b
	}
	r := c.Doc.Resolve(t, doc)
	headers, _ := r["headers"].(map[string]any)
	for name, h := range headers {
		if c.Doc.Resolve(t, h)["required"] == true && resp.Header.Get(name) == "" {
			t.Errorf("%s: documented header %s missing", where, name)
		}
	}
	for name := range resp.Header {
		if watched(name) && !documented(headers, name) {
			t.Errorf("%s: sends %s, which the document does not list", where, name)
		}
	}
	for name, h := range headers {
		if s, ok := c.Doc.Resolve(t, h)["schema"].(map[string]any); ok && resp.Header.Get(name) != "" {
			hv := resp.Header.Get(name)
			var x any = hv
			if c.Doc.Resolve(t, s)["type"] == "integer" {
				x = json.Number(hv)
			}
			for _, e := range (Validator{T: t, Doc: c.Doc}).Check(where+" header "+name, s, x) {
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
		for _, e := range (Validator{T: t, Doc: c.Doc}).Check(where, media["schema"].(map[string]any), DecodeJSONNumbers(t, b)) {
			t.Error(e)
		}
	}
	return resp.StatusCode, resp.Header, resp.Trailer, b
}

// watched reports whether a response header must be documented when sent: the daemon's own
// (Cfguard-*) and those that tell a client what to do (Retry-After, ETag, WWW-Authenticate).
func watched(name string) bool {
	switch name = http.CanonicalHeaderKey(name); name {
	case "Retry-After", "Etag", "Www-Authenticate":
		return true
	}
	return strings.HasPrefix(name, "Cfguard-")
}

// documented reports whether headers (a response's, from the document) lists name, in any case.
func documented(headers map[string]any, name string) bool {
	for h := range headers {
		if http.CanonicalHeaderKey(h) == http.CanonicalHeaderKey(name) {
			return true
		}
	}
	return false
}
