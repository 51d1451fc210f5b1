package replicas

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// mnistReplica configures replica id for the bundled mnist model (784 -> 64 -> 32 -> 10, about
// 53,000 weights): its genesis is over the 1 MiB that brokers accept in one record by default.
func mnistReplica(c *config.Config, addrs []string, id, key string) {
	daemontest.ReplicaConfig(c, addrs, id, key)
	c.Model.Dataset, c.Model.Epochs = "mnist", 1
}

// TestGenesisOfALargeModelStartsALog: a model whose genesis does not fit in a record of the
// broker's default size starts a posterior log that cfguard creates (the topic accepts records
// up to postlog.MaxRecordBytes), and a second replica bootstraps from it to the same posterior.
func TestGenesisOfALargeModelStartsALog(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := launch.With(t, func(c *config.Config) { mnistReplica(c, b.Addrs(), "r1", key) }, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r1.Get(t, "/readyz"); return code == 200 })

	plog := daemontest.KeyHolderLog(t, r1)
	rd, err := plog.Read(0)
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rec, err := rd.Next(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(rec.Value); n <= 1<<20 {
		t.Fatalf("the genesis is %d bytes: the test needs one over 1 MiB", n)
	}

	r2 := launch.With(t, func(c *config.Config) { mnistReplica(c, b.Addrs(), "r2", key) }, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r2 ready", func() bool { code, _ := r2.Get(t, "/readyz"); return code == 200 })
	if got, want := r2.D.Replica().Head().PosteriorSHA256, r1.D.Replica().Head().PosteriorSHA256; got != want {
		t.Fatalf("r2 serves posterior %s, r1 %s", got, want)
	}
}

// TestGenesisOverTheTopicsLimitIsRefused: on a posterior topic created by someone else with the
// default max.message.bytes, the first replica's genesis cannot be appended; the replica does not
// start, and says how large the record is, the topic's limit and how to raise it.
func TestGenesisOverTheTopicsLimitIsRefused(t *testing.T) {
	b := daemontest.StartCluster(t, 1)
	kafkatest.CreateTopic(t, b.Addrs(), "cfguard.posterior", 1)
	c := daemontest.Config(t, func(c *config.Config) {
		mnistReplica(c, b.Addrs(), "r1", daemontest.WriteKeyFile(t, daemontest.ClusterKey))
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	err := daemon.Run(ctx, daemon.Options{Config: &c, Logger: slog.New(slog.DiscardHandler)})
	for _, want := range []string{"cfguard.posterior", "max.message.bytes", "kafka-configs.sh --alter --entity-type topics --entity-name cfguard.posterior --add-config max.message.bytes="} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("a replica whose genesis is over the topic's limit: %v; want an error naming %q", err, want)
		}
	}
}
