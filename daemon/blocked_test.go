package daemon

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
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
	b := startCluster(t, 1)
	key := writeKeyFile(t, testClusterKey)
	r := startDaemonWith(t, func(c *config.Config) {
		replicaConfig(c, b, "r1", key)
		c.Replication.RegisterWait = 2 * time.Second
	}, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r.get(t, "/readyz"); return code == 200 })
	data := bundled(t)
	registerCEs(t, r, data, 2)
	topic, parts := r.d.cfg.Replication.CETopic, r.d.cfg.Replication.CEPartitions

	const newer = "newer-1"
	p := ceshare.Partition(newer, parts)
	value := fmt.Appendf(nil, `{"kind":"register","id":%q,"replica":"r9","at":%q,"ce":{},"condition":"x"}`, newer, time.Now().UTC().Format(time.RFC3339Nano))
	offset := rawProduce(t, b, topic, p, newer, value, kafka.Header{Key: clusterkey.Header, Value: ceshare.Sign(r.d.rep.Keys(), value)})
	waitfor.Cond(t, 30*time.Second, "the partition blocked", func() bool { return r.metric(t, alerts.NameCEBlocked) == 1 })
	if line := loggedLine(r.logs.String(), "CE partition blocked at a request this build cannot read"); !strings.Contains(line, "level=ERROR") ||
		!strings.Contains(line, fmt.Sprintf("partition=%d offset=%d writer=r9 reason=json", p, offset)) {
		t.Errorf("the ERROR line of the block: %q", line)
	}
	if n := r.metric(t, alerts.NameCERebuilding); n != 1 {
		t.Errorf("%s = %v while partition %d is blocked, want 1", alerts.NameCERebuilding, n, p)
	}

	// A registration behind it waits in the topic: 202, and its read 503 naming the block.
	behind := ""
	for k := 0; behind == ""; k++ {
		if id := fmt.Sprintf("behind-%d", k); ceshare.Partition(id, parts) == p {
			behind = id
		}
	}
	_, xs, cfs := candidatePairs(t, r.d.current(), data, 400, 1)
	if code, body := r.do(t, "POST", "/v1/counterfactuals", "", map[string]any{"id": behind, "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}); code != http.StatusAccepted {
		t.Errorf("a registration behind the block: %d %s, want 202", code, body)
	}
	want := fmt.Sprintf(`CE partition %d of %s blocked at offset %d by a request this build of cfguard cannot read (written by replica "r9"; json): upgrade the partition's owner, replica "r1"`, p, topic, offset)
	var answer struct{ Error string }
	if code, body := r.get(t, "/v1/counterfactuals/"+behind); code != http.StatusServiceUnavailable || json.Unmarshal(body, &answer) != nil || answer.Error != want {
		t.Errorf("GET of the registration behind the block: %d %s; want 503 with %q", code, body, want)
	}
	if code, body := r.get(t, "/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz while partition %d is blocked: %d %s", p, code, body)
	}
	var model struct {
		Replication struct {
			Blocked []map[string]any `json:"ce_partitions_blocked"`
		} `json:"replication"`
	}
	if _, body := r.get(t, "/v1/model"); json.Unmarshal(body, &model) != nil || len(model.Replication.Blocked) != 1 ||
		model.Replication.Blocked[0]["partition"] != float64(p) || model.Replication.Blocked[0]["offset"] != float64(offset) ||
		model.Replication.Blocked[0]["writer"] != "r9" || model.Replication.Blocked[0]["reason"] != ceshare.ReasonJSON {
		t.Errorf("GET /v1/model's ce_partitions_blocked: %s", body)
	}

	if runbooktest.Tools(t, true) {
		checks := []runbooktest.Check{
			{Cmd: "ce_partitions_rebuilding}", Want: fmt.Sprintf(`^\{"ce_partitions":\[[0-9,]*\],"ce_partitions_rebuilding":\[%d\]\}$`, p)},
			{Cmd: "partitions_rebuilding|partitions_blocked|requests_applied_total", Want: `(?m)^cfguard_counterfactuals_partitions_blocked 1$[\s\S]*^cfguard_counterfactuals_partitions_rebuilding 1$[\s\S]*^cfguard_counterfactuals_requests_applied_total [0-9]+$`},
			{Cmd: "ce_partitions_blocked[]", Want: fmt.Sprintf(`^\{"detail":"json: unknown field \\"condition\\"","offset":%d,"partition":%d,"reason":"json","since":"[0-9T:.Z-]+","writer":"r9"\}$`, offset, p)},
			{Cmd: "kcat -C", Want: `^0$`},
			{Cmd: "kcat -L", Want: fmt.Sprintf(`(?m)partition %d, leader \d+, replicas: \d+`, p)},
		}
		s := runbooktest.Named(t, runbookPath, "CfguardCounterfactualsNotCaughtUp")
		runbooktest.Covered(t, s, checks)
		runbooktest.Run(t, s, checks, strings.NewReplacer("127.0.0.1:8080", r.d.HTTPAddr(), "BROKER", b.Addrs()[0], "PARTITION", fmt.Sprint(p)), nil)
	}
}
