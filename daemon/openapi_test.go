package daemon

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/openapitest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

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
	doc := openapitest.Load(t)
	ops := doc.Operations(t)
	table := routeTable()
	for pattern, auth := range table {
		op, ok := ops[pattern]
		if !ok {
			t.Errorf("route %q (auth %q) is not in docs/openapi.yaml", pattern, auth)
			continue
		}
		if got := doc.AuthOf(t, op); got != auth {
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
			if h, _ := doc.Resolve(t, r)["headers"].(map[string]any); h["Retry-After"] == nil {
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
	schemes := doc.Pointer(t, "#/components/securitySchemes").(map[string]any)
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
				doc.Pointer(t, ref)
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
	doc := openapitest.Load(t)
	ops := doc.Operations(t)
	table := routeTable()
	if len(ops) != len(table) {
		t.Fatalf("%d operations, %d routes", len(ops), len(table))
	}
	delete(doc["paths"].(map[string]any), "/v1/audit")
	if got := len(doc.Operations(t)); got != len(table)-2 {
		t.Fatalf("after removing /v1/audit: %d operations, want %d", got, len(table)-2)
	}
	if got := doc.AuthOf(t, map[string]any{}); got != "token" {
		t.Fatalf("an operation without security inherits the top level's: auth %q, want token", got)
	}
	if got := doc.AuthOf(t, map[string]any{"security": []any{}}); got != "" {
		t.Fatalf("security: [] is open, got %q", got)
	}
}

// TestOpenAPIDescribesAnswers runs a daemon and checks its answers to requests on every route
// (successes and the errors a client meets) against docs/openapi.yaml.
func TestOpenAPIDescribesAnswers(t *testing.T) {
	const token, metricsToken = "t0ken", "m3trics"
	r := startDaemon(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		c.HTTP.Token, c.HTTP.MetricsToken = token, metricsToken
		c.Explain.Concurrency = 1
	}))
	doc := openapitest.Load(t)
	c := openapitest.New(t, r, doc)
	js := func(v any) string { b, _ := json.Marshal(v); return string(b) }
	data := daemontest.Bundled(t)

	c.Send("GET", "/healthz", "", nil, "", 200)
	c.Send("GET", "/readyz", "", nil, "", 200)
	c.Send("GET", "/metrics", metricsToken, nil, "", 200)
	c.Send("GET", "/metrics", token, nil, "", 401)
	c.Send("GET", "/v1/model", "", nil, "", 401)
	c.Send("GET", "/v1/model", metricsToken, nil, "", 401)

	// Predictions, one and a batch; the rows that make counterfactual pairs.
	c.Send("POST", "/v1/predict", token, nil, js(map[string]any{"x": data.X[0]}), 200)
	_, _, body := c.Send("POST", "/v1/predict", token, nil, js(map[string]any{"xs": data.X}), 200)
	c.Send("POST", "/v1/predict", token, nil, js(map[string]any{"x": data.X[0], "xs": data.X[:2]}), 400)
	c.Send("POST", "/v1/predict", token, nil, `{"x": [1, 2]}`, 400)
	c.Send("POST", "/v1/predict", token, nil, strings.Repeat(" ", int(r.Config.HTTP.MaxBodyBytes)+1), 413)
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
	c.Send("POST", "/v1/counterfactuals", token, nil, js(ce), 201)
	c.Send("POST", "/v1/counterfactuals", token, nil, js(map[string]any{"x": data.X[xs[1]], "x_cf": data.X[cfs[1]], "target": 1}), 201)
	c.Send("POST", "/v1/counterfactuals", token, nil, js(ce), 409)
	c.Send("POST", "/v1/counterfactuals", token, nil, js(map[string]any{"id": "ce-x", "x": data.X[cfs[0]], "x_cf": data.X[cfs[1]], "target": "benign"}), 422)
	c.Send("POST", "/v1/counterfactuals", token, nil, `{"id":"ce-y","x":[],"x_cf":[],"target":"benign","extra":1}`, 400)
	c.Send("POST", "/v1/counterfactuals", "", nil, js(ce), 401)
	c.Send("GET", "/v1/counterfactuals?status=certified", token, nil, "", 200)
	c.Send("GET", "/v1/counterfactuals?status=certified&limit=1", token, nil, "", 200)
	c.Send("GET", "/v1/counterfactuals?status=invalidated", token, nil, "", 200)
	c.Send("GET", "/v1/counterfactuals?status=fine", token, nil, "", 400)
	c.Send("GET", "/v1/counterfactuals/ce-0", token, nil, "", 200)
	c.Send("GET", "/v1/counterfactuals/nope", token, nil, "", 404)
	bulk := js(map[string]any{"id": "bulk-1", "x": data.X[xs[1]], "x_cf": data.X[cfs[0]], "target": "benign"}) + "\n{\"x\":\n\n" + js(ce) + "\n"
	_, _, body = c.Send("POST", "/v1/counterfactuals:bulk", token, map[string]string{"Content-Type": "application/x-ndjson"}, bulk, 200)
	if !strings.Contains(string(body), `"stored":1,"accepted":0,"exists":1,"refused":1`) {
		t.Errorf("bulk: %s, want one stored, one exists, one refused", body)
	}
	// Each stored or found line carries its CE's ETag, as a GET of it does.
	var bulkAnswer struct {
		Results []struct{ ID, Status, ETag string }
	}
	if err := json.Unmarshal(body, &bulkAnswer); err != nil {
		t.Fatal(err)
	}
	for _, res := range bulkAnswer.Results {
		if res.ID == "" {
			continue
		}
		if _, h, _ := c.Send("GET", "/v1/counterfactuals/"+res.ID, token, nil, "", 200); res.ETag == "" || res.ETag != h.Get("ETag") {
			t.Errorf("bulk line %s (%s): etag %q, GET's ETag %q", res.ID, res.Status, res.ETag, h.Get("ETag"))
		}
	}
	c.Send("POST", "/v1/counterfactuals:bulk", token, nil, strings.Repeat("{}\n", maxBulkLines+1), 400)
	c.Send("POST", "/v1/counterfactuals:bulk", "", nil, bulk, 401)

	// Records, so that the model's KL history, anchors and prequential scores are not empty (correct
	// labels: the explanation below must still find a robust counterfactual).
	var recs [][]byte
	for i := 0; i < 64; i++ {
		recs = append(recs, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, recs...)
	waitfor.Cond(t, 30*time.Second, "two updates", func() bool { return r.D.current().Version >= 2 })
	c.Send("GET", "/v1/model", token, nil, "", 200)
	c.Send("GET", "/v1/counterfactuals/ce-0", token, nil, "", 200)

	// The posterior's two files, then 304 for their ETags.
	for _, p := range []string{"/v1/model/posterior", "/v1/model/posterior/sidecar"} {
		_, h, _ := c.Send("GET", p, token, nil, "", 200)
		c.Send("GET", p, token, map[string]string{"If-None-Match": h.Get("ETag")}, "", 304)
		c.Send("GET", p, token, map[string]string{"If-None-Match": `"0000"`}, "", 200)
	}

	// Audits: 409 with Retry-After while one runs, then one that runs.
	if err := r.D.audits.begin("schedule", time.Now()); err != nil {
		t.Fatal(err)
	}
	c.Send("POST", "/v1/audit", token, nil, "", 409)
	c.Send("GET", "/v1/audit", token, nil, "", 200)
	r.D.audits.end(ledger.AuditReport{}, fmt.Errorf("stopped by the test"), time.Now())
	c.Send("GET", "/v1/audit", token, nil, "", 200)
	c.Send("POST", "/v1/audit", token, nil, "", 200)
	c.Send("POST", "/v1/audit", token, nil, `{"bogus":1}`, 400)
	c.Send("GET", "/v1/audit", token, nil, "", 200)

	// Explain: bad requests, 429 with every slot taken, then (without -short) one generation.
	c.Send("POST", "/v1/explain", token, nil, js(map[string]any{"x": data.X[0][:3]}), 400)
	c.Send("POST", "/v1/explain", token, nil, js(map[string]any{"x": data.X[0], "method": "magic"}), 400)
	release, err := r.D.exp.acquire()
	if err != nil {
		t.Fatal(err)
	}
	c.Send("POST", "/v1/explain", token, nil, js(map[string]any{"x": data.X[0]}), 429)
	release()
	if !testing.Short() {
		_, h, _ := c.Send("POST", "/v1/explain", token, nil, js(map[string]any{"id": "psce-1", "x": data.X[xs[0]], "target": "benign"}), 201)
		if _, g, _ := c.Send("GET", "/v1/counterfactuals/psce-1", token, nil, "", 200); h.Get("ETag") == "" || h.Get("ETag") != g.Get("ETag") {
			t.Errorf("explain's 201 ETag %q, the CE's GET %q", h.Get("ETag"), g.Get("ETag"))
		}
	}

	// A backup: the ledger file, its outcome in the documented trailers.
	c.Send("GET", "/v1/backup", "", nil, "", 401)
	_, _, trailer, backup := c.SendTrailer("GET", "/v1/backup", token, nil, "", 200)
	documented := c.Doc.Resolve(t, c.Ops["GET /v1/backup"]["responses"].(map[string]any)["200"])["x-trailers"].(map[string]any)
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

	_, h, _ := c.Send("GET", "/v1/counterfactuals/bulk-1", token, nil, "", 200)
	c.Send("GET", "/v1/counterfactuals/bulk-1", token, map[string]string{"If-Match": `"00000000000000000000000000000000"`}, "", 412)
	c.Send("DELETE", "/v1/counterfactuals/bulk-1", token, map[string]string{"If-Match": `"00000000000000000000000000000000"`}, "", 412)
	c.Send("DELETE", "/v1/counterfactuals/bulk-1", token, map[string]string{"If-Match": "0000"}, "", 400)
	c.Send("DELETE", "/v1/counterfactuals/bulk-1", token, map[string]string{"If-Match": h.Get("ETag")}, "", 204)
	c.Send("DELETE", "/v1/counterfactuals/ce-0", token, map[string]string{"Idempotency-Key": "del-0"}, "", 204)
	c.Send("DELETE", "/v1/counterfactuals/ce-0", token, map[string]string{"Idempotency-Key": "del-0"}, "", 204) // a retry
	c.Send("DELETE", "/v1/counterfactuals/ce-1", token, map[string]string{"Idempotency-Key": "del-0"}, "", 422)
	c.Send("DELETE", "/v1/counterfactuals/ce-1", token, map[string]string{"Idempotency-Key": ""}, "", 400)
	c.Send("DELETE", "/v1/counterfactuals/ce-0", token, nil, "", 404)

	for pattern := range routeTable() {
		if !c.Seen[pattern] {
			t.Errorf("%s: no request in this test; add one", pattern)
		}
	}
	var codes []string
	for k := range c.Codes {
		codes = append(codes, k)
	}
	sort.Strings(codes)
	t.Logf("checked %d (route, status) answers against docs/openapi.yaml: %s", len(codes), strings.Join(codes, ", "))
}
