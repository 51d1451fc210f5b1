package replicas

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// TestReplicaIDTakenRefuses starts a second replica with the id of a running one (another
// state_dir, another address): it waits, as for a previous process of itself whose session has
// not expired, then stops with an error naming replication.replica_id, the id and the other
// member, instead of joining and taking the other's partitions for its own. The first replica
// keeps every partition.
func TestReplicaIDTakenRefuses(t *testing.T) {
	t.Parallel() // mostly waits out the twin check (twice the session timeout, plus 5 s)
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := launch.ReplicaKey(t, b, "r1", key)
	owned := len(r1.D.Share().Member().Owned())

	c := config.Default()
	c.StateDir, c.HTTP.Listen = t.TempDir(), "127.0.0.1:0"
	c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog = 32, 32
	c.Kafka.MaxWait = 300 * time.Millisecond
	c.Certify.Samples = 400
	c.Audit.Schedule = ""
	daemontest.ReplicaConfig(&c, b.Addrs(), "r1", key)
	// Run returns the refusal by itself: a run that joined instead hangs here, and go test's
	// timeout names this test.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- daemon.Run(ctx, daemon.Options{Config: &c, Logger: tooltest.Logger(t),
			Registry: prometheus.NewRegistry(), BundledModel: daemontest.BundledModelOf(t, &c)})
	}()
	err := <-done
	if err == nil || !strings.Contains(err.Error(), `replication.replica_id "r1"`) || !strings.Contains(err.Error(), "another live member") {
		t.Fatalf("a second replica with id r1: Run = %v; want a refusal naming replication.replica_id", err)
	}
	if got := len(r1.D.Share().Member().Owned()); got != owned || got != r1.Config.Replication.CEPartitions {
		t.Errorf("the first r1 owns %d partitions after the twin's attempt, %d before; want all %d", got, owned, r1.Config.Replication.CEPartitions)
	}
}
