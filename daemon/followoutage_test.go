package daemon

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestFollowerReadsThroughAnUnreadableLog: the broker answers every fetch of the posterior log
// with an error for a while (KAFKA_STORAGE_ERROR, as a broker whose disk fails or that
// restarts would). The replica keeps running and serving its posterior, says so once at WARN,
// and follows the log again once it reads, without a restart.
func TestFollowerReadsThroughAnUnreadableLog(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "cfguard.records", "cfguard.records.dlq", "cfguard.events"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the replica's cleanup
	r := startReplicaAt(t, kc.ListenAddrs(), "r1", writeKeyFile(t, testClusterKey))
	data := bundled(t)
	produceRows(t, r, data, 0, 8)
	applied := func() float64 { return gatherCounter(r.reg, "cfguard_records_total", "result", "applied") }
	waitfor.Cond(t, 60*time.Second, "8 records applied", func() bool { return applied() == 8 })

	var refusing atomic.Bool
	var refused atomic.Int64
	refusing.Store(true)
	kc.ControlKey(int16(kmsg.Fetch), func(req kmsg.Request) (kmsg.Response, error, bool) {
		f := req.(*kmsg.FetchRequest)
		if !refusing.Load() || len(f.Topics) != 1 || f.Topics[0].Topic != "cfguard.posterior" {
			return nil, nil, false
		}
		kc.KeepControl()
		refused.Add(1)
		resp := f.ResponseKind().(*kmsg.FetchResponse)
		rt := kmsg.NewFetchResponseTopic()
		rt.Topic, rt.TopicID = f.Topics[0].Topic, f.Topics[0].TopicID
		for _, fp := range f.Topics[0].Partitions {
			rp := kmsg.NewFetchResponseTopicPartition()
			rp.Partition, rp.ErrorCode, rp.HighWatermark = fp.Partition, kerr.KafkaStorageError.Code, -1
			rp.RecordBatches = []byte{}
			rt.Partitions = append(rt.Partitions, rp)
		}
		resp.Topics = append(resp.Topics, rt)
		return resp, nil, true
	})
	waitfor.Cond(t, 60*time.Second, "the follower failing to read the log 5 times", func() bool {
		select {
		case err := <-r.done:
			t.Fatalf("the replica stopped while its posterior log was unreadable: %v", err)
		default:
		}
		return refused.Load() >= 5
	})
	if n := strings.Count(r.logs.String(), "posterior log unreadable: serving the last posterior applied and reading it again"); n != 1 {
		t.Errorf("the follower said %d times that the log is unreadable, want once for the episode", n)
	}
	if code, body := r.do(t, "POST", "/v1/predict", "", map[string]any{"x": data.X[0]}); code != 200 {
		t.Errorf("POST /v1/predict while the log is unreadable: %d %s", code, body)
	}
	refusing.Store(false)
	produceRows(t, r, data, 8, 8)
	waitfor.Cond(t, 60*time.Second, "16 records applied once the log reads again", func() bool { return applied() == 16 })
	select {
	case err := <-r.done:
		t.Fatalf("the replica stopped: %v", err)
	default:
	}
	t.Logf("fetches of the posterior log refused: %d", refused.Load())
}
