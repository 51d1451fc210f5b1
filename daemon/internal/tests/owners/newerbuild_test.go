package owners

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestRequestOfANewerBuildBlocksItsPartition writes to the CE topic, signed with the cluster key,
// a registration with a field this build does not know, as a newer replica would during a rolling
// upgrade. Its partition's owner does not skip it: it applies nothing at or after it, says so
// (an ERROR line naming the offset and the writer, the gauge, GET /v1/model), and treats the
// partition as not caught up: a registration landing behind it answers 202, a read of that CE
// 503 naming the block, /readyz 503. The runbook's commands for CfguardCounterfactualsNotCaughtUp
// run as written in this state. (That a build that reads the request applies it and what follows
// it, from the offset the ledger kept, is ceshare's TestUnreadableRequestBlocksItsPartition.)
func TestRequestOfANewerBuildBlocksItsPartition(t *testing.T) {
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key, dir := daemontest.WriteKeyFile(t, daemontest.ClusterKey), t.TempDir()
	var skip []config.CERequest
	replica := func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", key)
		c.StateDir = dir
		c.Replication.RegisterWait = 2 * time.Second
		c.Replication.SkipCERequests = skip
	}
	// An audit would wait an hour for a partition being rebuilt: one that is blocked answers at once.
	opts := func(o *daemon.Options) { o.Hooks.AuditRebuildWait = time.Hour }
	r := launch.With(t, replica, opts, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	data := daemontest.Bundled(t)
	daemontest.RegisterCEs(t, r, data, 2, "")
	topic, parts := r.Config.Replication.CETopic, r.Config.Replication.CEPartitions

	// One request with a field this build does not know, in another partition one whose CE has one.
	const newer, newerCE = "newer-1", "newer-ce-2"
	p, p2 := ceshare.Partition(newer, parts), ceshare.Partition(newerCE, parts)
	if p == p2 {
		t.Fatalf("%s and %s share partition %d", newer, newerCE, p)
	}
	signed := func(id string, p int, value []byte) int64 {
		return daemontest.RawProduce(t, b, topic, p, id, value, kafka.Header{Key: clusterkey.Header, Value: ceshare.Sign(r.D.Replica().Keys(), value)})
	}
	at := time.Now().UTC().Format(time.RFC3339Nano)
	offset := signed(newer, p, fmt.Appendf(nil, `{"kind":"register","id":%q,"replica":"r9","at":%q,"ce":{},"condition":"x"}`, newer, at))
	offset2 := signed(newerCE, p2, fmt.Appendf(nil, `{"kind":"register","id":%q,"replica":"r9","at":%q,"ce":{"x":[1],"condition":"x"}}`, newerCE, at))
	waitfor.Cond(t, 30*time.Second, "both partitions blocked", func() bool { return r.Metric(t, alerts.NameCEBlocked) == 2 })
	for _, want := range []string{fmt.Sprintf("partition=%d offset=%d id=%s writer=r9 reason=json", p, offset, newer), fmt.Sprintf("partition=%d offset=%d id=%s writer=r9 reason=ce", p2, offset2, newerCE)} {
		found := false
		for line := range strings.Lines(r.Logs.String()) {
			found = found || strings.Contains(line, "level=ERROR") && strings.Contains(line, "CE partition blocked at a request this build cannot read") && strings.Contains(line, want)
		}
		if !found {
			t.Errorf("no ERROR line of the block with %q", want)
		}
	}
	if n := r.Metric(t, alerts.NameCERebuilding); n != 2 {
		t.Errorf("%s = %v while partitions %d and %d are blocked, want 2", alerts.NameCERebuilding, n, p, p2)
	}

	// A registration behind it waits in the topic: 202, and its read 503 naming the block.
	behind := ""
	for k := 0; behind == ""; k++ {
		if id := fmt.Sprintf("behind-%d", k); ceshare.Partition(id, parts) == p {
			behind = id
		}
	}
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", map[string]any{"id": behind, "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}); code != http.StatusAccepted {
		t.Errorf("a registration behind the block: %d %s, want 202", code, body)
	}
	want := fmt.Sprintf(`CE partition %d of %s blocked at offset %d by a request this build of cfguard cannot read (written by replica "r9"; json): upgrade the partition's owner, replica "r1", or skip the request (replication.skip_ce_requests)`, p, topic, offset)
	var answer struct{ Error string }
	resp, err := r.Client.Get(r.Base + "/v1/counterfactuals/" + behind)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "60" || json.Unmarshal(body, &answer) != nil || answer.Error != want {
		t.Errorf("GET of the registration behind the block: %d (Retry-After %q) %s; want 503 with Retry-After 60 and %q",
			resp.StatusCode, resp.Header.Get("Retry-After"), body, want)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.Base+"/v1/audit", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	if resp, err := r.Client.Do(req); err != nil {
		t.Errorf("POST /v1/audit while a partition is blocked: %v (an audit must not wait for a block)", err)
	} else {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "60" || !strings.Contains(string(body), "cannot read") {
			t.Errorf("POST /v1/audit while a partition is blocked: %d (Retry-After %q) %s; want 503, Retry-After 60, naming the block",
				resp.StatusCode, resp.Header.Get("Retry-After"), body)
		}
	}
	if code, body := r.Get(t, "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(string(body), "cannot read") {
		t.Errorf("/readyz while partition %d is blocked: %d %s; want 503 naming the block", p, code, body)
	}
	var model struct {
		Replication struct {
			Blocked []map[string]any `json:"ce_partitions_blocked"`
		} `json:"replication"`
	}
	_, body = r.Get(t, "/v1/model")
	if err := json.Unmarshal(body, &model); err != nil || len(model.Replication.Blocked) != 2 {
		t.Fatalf("GET /v1/model's ce_partitions_blocked: %v %s", err, body)
	}
	for _, want := range []map[string]any{{"partition": float64(p), "offset": float64(offset), "id": newer, "reason": ceshare.ReasonJSON, "detail": `json: unknown field "condition"`},
		{"partition": float64(p2), "offset": float64(offset2), "id": newerCE, "reason": ceshare.ReasonCE, "detail": `the registration's CE: json: unknown field "condition"`}} {
		found := false
		for _, got := range model.Replication.Blocked {
			found = found || got["partition"] == want["partition"] && got["offset"] == want["offset"] && got["id"] == want["id"] && got["writer"] == "r9" &&
				got["reason"] == want["reason"] && got["detail"] == want["detail"]
		}
		if !found {
			t.Errorf("GET /v1/model's ce_partitions_blocked has no %v: %s", want, body)
		}
	}

	if runbooktest.Tools(t, true) {
		checks := []runbooktest.Check{
			{Cmd: "ce_partitions_rebuilding}", Want: fmt.Sprintf(`^\{"ce_partitions":\[[0-9,]*\],"ce_partitions_rebuilding":\[%d,%d\]\}$`, min(p, p2), max(p, p2))},
			{Cmd: "partitions_rebuilding|partitions_blocked|requests_applied_total", Want: `(?m)^cfguard_counterfactuals_partitions_blocked 2$[\s\S]*^cfguard_counterfactuals_partitions_rebuilding 2$[\s\S]*^cfguard_counterfactuals_requests_applied_total [0-9]+$`},
			{Cmd: "ce_partitions_blocked[]", Want: fmt.Sprintf(`(?m)^\{"detail":"json: unknown field \\"condition\\"","id":"newer-1","offset":%d,"partition":%d,"reason":"json","since":"[0-9T:.Z-]+","writer":"r9"\}$`, offset, p)},
			{Cmd: "-o beginning", Want: `^0$`},
			{Cmd: "-o -1", Want: fmt.Sprintf(`^%d$`, offset+1)}, // the registration behind the block
			{Cmd: "kcat -L", Want: fmt.Sprintf(`(?m)partition %d, leader \d+, replicas: \d+`, p)},
		}
		s := runbooktest.Named(t, daemontest.RunbookPath(t), "CfguardCounterfactualsNotCaughtUp")
		runbooktest.Covered(t, s, checks)
		runbooktest.Run(t, s, checks, strings.NewReplacer("127.0.0.1:8080", r.D.HTTPAddr(), "BROKER", b.Addrs()[0], "PARTITION", fmt.Sprint(p)), nil)
	}

	// Restarted with the second request named in replication.skip_ce_requests, the replica skips
	// it and applies its partition on; the first still blocks.
	r.Stop(t)
	skip = []config.CERequest{{Partition: p2, Offset: offset2, ID: newerCE}}
	r = launch.With(t, replica, opts, nil)
	// The member reads its partitions apart: partition p blocks again when its read reaches the
	// request, before or after p2 passes the skipped one.
	waitfor.Cond(t, 60*time.Second, fmt.Sprintf("partition %d caught up past the skipped request, and %d blocked again", p2, p), func() bool {
		next, held := r.D.Share().Member().Next(p2)
		return held && next == offset2+1 && r.D.Share().Member().Ready(p2) && len(r.D.Share().Member().Blocked()) > 0
	})
	if bl := r.D.Share().Member().Blocked(); len(bl) != 1 || bl[0].Partition != p {
		t.Errorf("blocked after the restart: %+v, want partition %d only", bl, p)
	}
	if line := loggedLine(r.Logs.String(), "CE request this build cannot read skipped"); !strings.Contains(line, fmt.Sprintf("partition=%d offset=%d id=%s", p2, offset2, newerCE)) {
		t.Errorf("the WARN line of the skip: %q", line)
	}
	if n := r.Metric(t, alerts.NameCERequestsSkip); n != 1 {
		t.Errorf("%s = %v after one request skipped, want 1", alerts.NameCERequestsSkip, n)
	}
}
