package owners

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestRebuildThatCannotFetch puts a replica in the state of CfguardCounterfactualsNotCaughtUp:
// r2 joins r1 and takes over CE partitions whose requests the broker does not serve (every fetch
// of the CE topic below a partition's end is answered NOT_LEADER_OR_FOLLOWER, as a partition
// whose only broker is down would be). r2 retries; the partitions it was given that hold
// requests stay not caught up: the gauge counts them, /readyz and reads of their CEs answer
// 503; the runbook's commands for the alert run as written against r2; and once the fetches have
// failed for fetchWarnAfter a WARN line names the partition and the broker's error. Then the
// broker serves the partitions again and r2 catches up by itself, without a restart.
func TestRebuildThatCannotFetch(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas and a rebuild held for more than 10 s: not with -short")
	}
	t.Parallel()
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "cfguard.records", "cfguard.records.dlq", "cfguard.events"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the replicas' cleanups
	addrs := kc.ListenAddrs()
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := launch.ReplicaAt(t, addrs, "r1", key)
	ids := daemontest.RegisterCEs(t, r1, daemontest.Bundled(t), 8, "")
	topic, parts := r1.Config.Replication.CETopic, r1.Config.Replication.CEPartitions
	ends := ceTopicEnds(t, addrs, topic, parts)

	var refusing atomic.Bool
	var refused atomic.Int64
	refusing.Store(true)
	kc.ControlKey(int16(kmsg.Fetch), func(req kmsg.Request) (kmsg.Response, error, bool) {
		if !refusing.Load() {
			return nil, nil, false
		}
		f := req.(*kmsg.FetchRequest)
		held := false
		for _, ft := range f.Topics {
			for _, fp := range ft.Partitions {
				if ft.Topic == topic && fp.FetchOffset < ends[fp.Partition] {
					held = true
				}
			}
		}
		if !held {
			return nil, nil, false
		}
		kc.KeepControl()
		refused.Add(1)
		resp := f.ResponseKind().(*kmsg.FetchResponse)
		for _, ft := range f.Topics {
			rt := kmsg.NewFetchResponseTopic()
			rt.Topic, rt.TopicID = ft.Topic, ft.TopicID
			for _, fp := range ft.Partitions {
				rp := kmsg.NewFetchResponseTopicPartition()
				rp.Partition, rp.ErrorCode, rp.HighWatermark = fp.Partition, kerr.NotLeaderForPartition.Code, -1
				rp.RecordBatches = []byte{} // no records (nil would be encoded as a null set)
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})

	// An audit waits a second, not two minutes, for r2's partitions to be rebuilt.
	r2 := launch.With(t, func(c *config.Config) { daemontest.ReplicaConfig(c, addrs, "r2", key) },
		func(o *daemon.Options) { o.Hooks.AuditRebuildWait = time.Second }, nil)
	var stuck []int // r2's partitions that hold requests
	waitfor.Cond(t, 60*time.Second, "r2 given CE partitions, some of them not caught up", func() bool {
		stuck = stuck[:0]
		for _, p := range r2.D.Share().NotCaughtUp() {
			if ends[int32(p)] > 0 {
				stuck = append(stuck, p)
			}
		}
		return len(stuck) > 0 && r2.Metric(t, alerts.NameCERebuilding) >= float64(len(stuck))
	})
	var held string // a CE of a partition not caught up
	for _, id := range ids {
		if slices.Contains(stuck, ceshare.Partition(id, parts)) {
			held = id
		}
	}
	if code, body := r2.Get(t, "/v1/counterfactuals/"+held); code != http.StatusServiceUnavailable || !strings.Contains(string(body), "being rebuilt") {
		t.Errorf("GET %s, of partition %v not caught up: %d %s; want 503 being rebuilt", held, stuck, code, body)
	}
	if code, body := r2.Get(t, "/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz while partitions %v are not caught up: %d %s", stuck, code, body)
	}
	// An audit asked for at either replica cannot cover r2's share: 503 with Retry-After, naming
	// r2 (r1's own audit ran).
	for _, r := range []*launch.Running{r1, r2} {
		resp, err := r.Client.Post(r.Base+"/v1/audit", "application/json", strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
			!strings.Contains(string(body), "being rebuilt") || !strings.Contains(string(body), `r2: `) {
			t.Errorf("POST /v1/audit at %s while r2 rebuilds %v: %d (Retry-After %q) %s; want 503 naming r2, being rebuilt",
				r.Config.Replication.ReplicaID, stuck, resp.StatusCode, resp.Header.Get("Retry-After"), body)
		}
	}
	if runbooktest.Tools(t, true) {
		p := stuck[0]
		checks := []runbooktest.Check{
			{Cmd: "ce_partitions_rebuilding}", Want: fmt.Sprintf(`^\{"ce_partitions":\[[0-9,]*\],"ce_partitions_rebuilding":\[([0-9]+,)*%d(,[0-9]+)*\]\}$`, p)},
			{Cmd: "partitions_rebuilding|partitions_blocked|requests_applied_total", Want: `(?m)^cfguard_counterfactuals_partitions_blocked 0$[\s\S]*^cfguard_counterfactuals_partitions_rebuilding [1-9][0-9]*$[\s\S]*^cfguard_counterfactuals_requests_applied_total [0-9]+$`},
			{Cmd: "ce_partitions_blocked[]", Want: `^$`},
			// kcat's own diagnostics ("% ERROR: ...", such as a metadata request that timed out
			// on a starved broker) may come before the echo.
			{Cmd: "-o beginning", Want: `^(% [^\n]*\n)*no record within 10 s$`},
			{Cmd: "-o -1", Want: `^(% [^\n]*\n)*no record within 10 s$`},
			{Cmd: "kcat -L", Want: fmt.Sprintf(`(?m)partition %d, leader \d+, replicas: \d+`, p)},
		}
		s := runbooktest.Named(t, daemontest.RunbookPath(t), "CfguardCounterfactualsNotCaughtUp")
		runbooktest.Covered(t, s, checks)
		runbooktest.Run(t, s, checks, strings.NewReplacer("127.0.0.1:8080", r2.D.HTTPAddr(), "BROKER", addrs[0], "PARTITION", fmt.Sprint(p)), nil)
	}

	warned := "fetching CE requests of a partition keeps failing"
	waitfor.Cond(t, fetchWarnAfterWait, "the WARN line of failing fetches", func() bool {
		return strings.Contains(r2.Logs.String(), warned)
	})
	if line := loggedLine(r2.Logs.String(), warned); !strings.Contains(line, "partition=") || !strings.Contains(line, "NOT_LEADER_FOR_PARTITION") && !strings.Contains(line, "Not Leader For Partition") {
		t.Errorf("the WARN line names no partition or no broker error: %s", line)
	}
	t.Logf("%d fetches refused by the time of the WARN line", refused.Load())

	// The broker serves the partitions again: r2 catches up without a restart.
	refusing.Store(false)
	waitfor.Cond(t, 60*time.Second, "r2 ready", func() bool { code, _ := r2.Get(t, "/readyz"); return code == 200 })
	if n := r2.Metric(t, alerts.NameCERebuilding); n != 0 {
		t.Errorf("%s = %v once r2 is ready", alerts.NameCERebuilding, n)
	}
	if code, body := r2.Get(t, "/v1/counterfactuals/"+held); code != http.StatusOK {
		t.Errorf("GET %s once caught up: %d %s", held, code, body)
	}
	t.Logf("%d fetches refused; r2 held partitions %v not caught up", refused.Load(), stuck)
}

// fetchWarnAfterWait bounds the wait for the WARN line of a partition whose fetches fail: it
// comes after fetchWarnAfter of failures, at the next failed fetch (at most RetryMax later).
const fetchWarnAfterWait = 60 * time.Second

// ceTopicEnds reads the end offset of each partition of the CE topic.
func ceTopicEnds(t *testing.T, addrs []string, topic string, parts int) map[int32]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(addrs...), Transport: kafkatest.Transport(t)}
	var req []kafka.OffsetRequest
	for p := range parts {
		req = append(req, kafka.LastOffsetOf(p))
	}
	res, err := cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: req}})
	if err != nil {
		t.Fatal(err)
	}
	ends := make(map[int32]int64, parts)
	for _, po := range res.Topics[topic] {
		if po.Error != nil {
			t.Fatalf("the end of partition %d of %s: %v", po.Partition, topic, po.Error)
		}
		ends[int32(po.Partition)] = po.LastOffset
	}
	return ends
}

// loggedLine is the first line of logs that contains msg ("" if none).
func loggedLine(logs, msg string) string {
	for line := range strings.Lines(logs) {
		if strings.Contains(line, msg) {
			return line
		}
	}
	return ""
}
