// Package openapi checks a replica's answers against docs/openapi.yaml: those that differ from
// a single daemon's (the replication block of /v1/model, lists and audits over the cluster, a
// bulk line accepted for its owner) and the 202 of a request its owner has not applied yet. The
// single daemon's answers are checked in package daemon, which reaches into the daemon to provoke
// some of them.
package openapi

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/daemon/internal/openapitest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// A replica's answers that differ from a single daemon's (the replication block of /v1/model,
// lists and audits over the cluster) are what docs/openapi.yaml says too.
func TestOpenAPIDescribesReplicaAnswers(t *testing.T) {
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	r := launch.Replica(t, b, "r1")
	doc := openapitest.Load(t)
	c := openapitest.New(t, r, doc)
	daemontest.RegisterCEs(t, r, daemontest.Bundled(t), 2, "")
	_, _, body := c.Send("GET", "/v1/model", "", nil, "", 200)
	for _, empty := range []string{`"ce_partitions_rebuilding":[]`, `"ce_partitions_blocked":[]`} {
		if !strings.Contains(string(body), empty) {
			t.Errorf("GET /v1/model at a caught-up replica: no %s in %s", empty, body)
		}
	}
	c.Send("GET", "/v1/counterfactuals?limit=10", "", nil, "", 200)
	// A CE no owner holds: the owner that answered is named in the 404 too.
	if _, h, _ := c.Send("GET", "/v1/counterfactuals/nope", "", nil, "", 404); h.Get("Cfguard-Replica") != "r1" {
		t.Errorf("GET /v1/counterfactuals/nope at a replica: Cfguard-Replica %q, want r1", h.Get("Cfguard-Replica"))
	}
	c.Send("POST", "/v1/audit", "", nil, "{}", 200)
	c.Send("GET", "/v1/audit", "", nil, "", 200)
	// Without a token, what a web page may send is 403, as the spec says of every operation.
	for _, path := range []string{"/v1/model", "/v1/counterfactuals?limit=1", "/metrics"} {
		c.Send("GET", path, "", map[string]string{"Origin": "http://evil.example"}, "", 403)
	}
	// A bulk line a replica sends to its owner is accepted, not stored: the owner judges it.
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	if len(xs) == 0 || len(cfs) == 0 {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	line, _ := json.Marshal(map[string]any{"id": "bulk-0", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"})
	_, _, body = c.Send("POST", "/v1/counterfactuals:bulk", "", map[string]string{"Content-Type": "application/x-ndjson"}, string(line)+"\n", 200)
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
	r := launch.With(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", key)
		c.Replication.RegisterWait = 0
	}), nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	doc := openapitest.Load(t)
	c := openapitest.New(t, r, doc)
	js := func(v any) string { b, _ := json.Marshal(v); return string(b) }
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	if len(xs) == 0 || len(cfs) == 0 {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	c.Send("POST", "/v1/counterfactuals", "", nil, js(map[string]any{"id": "pending-0", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}), 202)
	c.Send("DELETE", "/v1/counterfactuals/pending-0", "", nil, "", 202)
	c.Send("POST", "/v1/explain", "", nil, js(map[string]any{"id": "pending-psce", "x": data.X[xs[0]], "target": "benign"}), 202)
}
