package replicalog

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/replica"
)

// TestUpdaterReturnsWhenThePosteriorTopicIsCreatedAgain deletes the posterior topic under two
// running replicas, stops one of them meanwhile, so that the updater group forms a generation
// without the topic (no partition to give anyone the updater role), and creates the topic again.
// Once a new epoch begins it from the replica's head (cfguard new-epoch --head-from), the
// replica takes the updater role again and applies the records that waited, without another
// member joining or leaving the group.
func TestUpdaterReturnsWhenThePosteriorTopicIsCreatedAgain(t *testing.T) {
	t.Parallel() // mostly waits for resetAfter
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r := launch.ReplicaKey(t, b, "r1", key)
	other := launch.ReplicaKey(t, b, "r2", key)
	data := daemontest.Bundled(t)
	n := daemontest.ProduceRows(t, r, data, 0, 64)
	waitfor.Cond(t, 60*time.Second, "the log covers the 64 records", func() bool { return r.Model(t).Replication.Covers[0] == int64(n) })

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(b.Addrs()...), Transport: kafkatest.Transport(t)}
	if res, err := cl.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{"cfguard.posterior"}}); err != nil || res.Errors["cfguard.posterior"] != nil {
		t.Fatalf("deleting cfguard.posterior: %v %v", err, res)
	}
	generations := r.Metric(t, "cfguard_updater_group_generations_total")
	n = daemontest.ProduceRows(t, r, data, n, 16)
	other.Stop(t)
	waitfor.Cond(t, 60*time.Second, "a generation of the updater group without the posterior topic", func() bool {
		return r.Metric(t, "cfguard_updater_group_generations_total") > generations && !r.Model(t).Replication.Updater
	})

	kafkatest.CreateTopic(t, b.Addrs(), "cfguard.posterior", 1)
	waitfor.Cond(t, 60*time.Second, "the replica naming the reset", func() bool {
		code, _ := r.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && r.Metric(t, "cfguard_posterior_log_stopped") == 1
	})
	settings, err := replica.ClusterSettings(r.Config)
	if err != nil {
		t.Fatal(err)
	}
	head := r.D.Replica().Head()
	daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, r), epochOn(t, r, head, settings))
	n = daemontest.ProduceRows(t, r, data, n, 16)
	waitfor.Cond(t, 90*time.Second, "the records produced around the reset applied by an updater", func() bool {
		m := r.Model(t)
		return m.Replication.Covers[0] == int64(n) && m.Replication.Updater
	})
}
