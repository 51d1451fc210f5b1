package owners

import (
	"context"
	"errors"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestCERequestsLostAreCountedByTheirOwner: on a CE topic given a retention, requests deleted
// before any replica read them are reported by one ERROR line per partition and counted in the
// ledger of the partition's first owner (cfguard_records_lost_total for the CE topic, with the
// time); a replica that later takes over some of the partitions finds the same gap and logs it,
// but does not count it again, since an earlier owner claimed each of them.
func TestCERequestsLostAreCountedByTheirOwner(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	t.Parallel() // mostly waits for its replicas to join their groups
	b := daemontest.StartCluster(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := config.Default()
	topic, parts := c.Replication.CETopic, c.Replication.CEPartitions
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()...)}
	res, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: parts, ReplicationFactor: -1,
		ConfigEntries: []kafka.ConfigEntry{{ConfigName: "retention.ms", ConfigValue: "1800000"}}}}})
	if err == nil {
		err = res.Errors[topic]
	}
	if err != nil {
		t.Fatalf("creating %s with a retention: %v", topic, err)
	}
	// Five records an hour old in every partition: retention deletes them unread.
	var old []kafka.Message
	for p := range parts {
		for range 5 {
			old = append(old, kafka.Message{Partition: p, Value: []byte(`{}`), Time: time.Now().Add(-time.Hour)})
		}
	}
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()...), Topic: topic, RequiredAcks: kafka.RequireAll,
		Balancer: kafka.BalancerFunc(func(m kafka.Message, _ ...int) int { return m.Partition })}
	defer w.Close()
	if err := w.WriteMessages(ctx, old...); err != nil {
		t.Fatal(err)
	}
	b.ApplyRetention()
	for p, first := range b.LogStartOffsets(topic) {
		if first != 5 {
			t.Fatalf("partition %d of %s starts at offset %d after retention, want 5", p, topic, first)
		}
	}
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := launch.ReplicaKey(t, b, "r1", key)
	lost := func(r *launch.Running) float64 { return r.Metric(t, "cfguard_records_lost_total", "topic", topic) }
	waitfor.Cond(t, 30*time.Second, "the lost requests counted", func() bool { return lost(r1) == float64(5*parts) })
	if n := r1.Metric(t, "cfguard_records_lost_total", "topic", "cfguard.records"); n != 0 {
		t.Errorf("cfguard_records_lost_total for the input topic = %v, want 0", n)
	}
	if at := r1.Metric(t, "cfguard_records_lost_last_timestamp_seconds", "topic", topic); time.Since(time.Unix(int64(at), 0)) > time.Minute {
		t.Errorf("cfguard_records_lost_last_timestamp_seconds = %v, want the time of the loss", at)
	}
	if n := strings.Count(r1.Logs.String(), "CE requests were deleted before they were read"); n != parts {
		t.Errorf("%d ERROR lines about the lost requests, want %d:\n%s", n, parts, r1.Logs.String())
	}

	r2 := launch.ReplicaKey(t, b, "r2", key)
	waitfor.Cond(t, 60*time.Second, "r2 owning partitions", func() bool { return len(r2.D.Share().Member().Owned()) > 0 })
	moved := len(r2.D.Share().Member().Owned())
	waitfor.Cond(t, 30*time.Second, "r2 to log the gap of each partition it took over", func() bool {
		return strings.Count(r2.Logs.String(), "after an earlier owner of the partition did") == moved
	})
	if n := lost(r2); n != 0 {
		t.Errorf("r2, which took over %d partitions whose first requests r1 counted lost: cfguard_records_lost_total = %v, want 0", moved, n)
	}
	if n := lost(r1); n != float64(5*parts) {
		t.Errorf("r1 after the move: cfguard_records_lost_total = %v, want %d", n, 5*parts)
	}
}

// TestCEsWhoseRequestsWereDeletedAreRestored: a CE topic given a retention deleted the
// registrations r1 had applied; r2, which takes every partition over, restores each CE from the
// state r1 wrote of it on the CE state topic (one at its registration, one at each change) with
// the same status, certificate and creation time, logs each gap, and counts none of it lost (r1
// claimed the partitions before). A CE deleted before the retention stays deleted; a deletion
// after it applies to a restored CE.
func TestCEsWhoseRequestsWereDeletedAreRestored(t *testing.T) {
	b, key, r1 := daemontest.FirstOfTwoReplicas(t, launch.NoWait, "two replicas")
	ids := daemontest.RegisterCEs(t, r1, daemontest.Bundled(t), 10, "")
	if code, body := r1.Do(t, "DELETE", "/v1/counterfactuals/"+ids[0], "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE %s: %d %s", ids[0], code, body)
	}
	waitfor.Cond(t, 30*time.Second, "r1's states written", func() bool {
		return r1.Metric(t, "cfguard_events_pending") == 0 && r1.Metric(t, alerts.NameCEStates, "result", alerts.StateWritten) >= float64(len(ids))
	})
	was := map[string]*ledger.CE{}
	for _, id := range ids[1:] {
		ce, err := r1.D.Ledger().Get(id)
		if err != nil {
			t.Fatal(err)
		}
		was[id] = ce
	}
	r1.Stop(t)

	topic := config.Default().Replication.CETopic
	kafkatest.SetTopicConfig(t, b.Addrs(), topic, "retention.ms", "1")
	time.Sleep(10 * time.Millisecond) // every request is older than 1 ms
	b.ApplyRetention()
	kafkatest.SetTopicConfig(t, b.Addrs(), topic, "retention.ms", "-1")
	starts, ends := b.LogStartOffsets(topic), b.HighWatermarks(topic)
	if !slices.Equal(starts, ends) {
		t.Fatalf("after retention, %s starts at %v and ends at %v; want every request deleted", topic, starts, ends)
	}
	gaps := 0
	for _, end := range ends {
		if end > 0 {
			gaps++
		}
	}

	r2 := launch.ReplicaKey(t, b, "r2", key)
	waitfor.Cond(t, 60*time.Second, "r2 holding every CE r1 held", func() bool {
		return r2.HeldCEs(t) == len(was) && strings.Count(r2.Logs.String(), "after an earlier owner of the partition did") == gaps
	})
	for id, w := range was {
		got, err := r2.D.Ledger().Get(id)
		if err != nil {
			t.Fatal(err)
		}
		w.UpdatedAt, got.UpdatedAt = time.Time{}, time.Time{}
		if !reflect.DeepEqual(w, got) {
			t.Errorf("%s restored at r2 from its state:\n r1 %+v\n r2 %+v", id, w, got)
		}
	}
	if _, err := r2.D.Ledger().Get(ids[0]); !errors.Is(err, ledger.ErrNotFound) {
		t.Errorf("%s, deleted at r1 before the retention: %v, want not found", ids[0], err)
	}
	if n := r2.Metric(t, alerts.NameCEStates, "result", alerts.StateRestored); n != float64(len(was)) {
		t.Errorf("r2 restored %v states, want %d", n, len(was))
	}
	if n := r2.Metric(t, "cfguard_records_lost_total", "topic", topic); n != 0 {
		t.Errorf("r2: cfguard_records_lost_total for %s = %v, want 0 (r1 read the requests)", topic, n)
	}
	if code, body := r2.Do(t, "DELETE", "/v1/counterfactuals/"+ids[1], "", nil); code != http.StatusNoContent {
		t.Fatalf("DELETE %s at r2, after the gap: %d %s", ids[1], code, body)
	}
	if n := r2.HeldCEs(t); n != len(was)-1 {
		t.Errorf("r2 holds %d CEs after deleting a restored one, want %d", n, len(was)-1)
	}
}
