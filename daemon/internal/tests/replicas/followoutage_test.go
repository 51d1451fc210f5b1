package replicas

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestFollowerReadsThroughAnUnreadableLog: the broker answers every fetch of the posterior log
// with an error for a while: KAFKA_STORAGE_ERROR (a broker whose disk fails), which kafka-go hands
// to the follower, or NOT_LEADER_OR_FOLLOWER (a leader moving), which it retries inside its
// reader. The replica keeps running and serving its posterior (a failure handed over is said once
// at WARN), and follows the log again once it reads, without a restart. Records arrive meanwhile:
// the updater appends their entry but cannot read it back, so after resetAfter it gives the role
// up (another replica might read the log) and /readyz says the log cannot be read.
func TestFollowerReadsThroughAnUnreadableLog(t *testing.T) {
	for _, c := range []struct {
		name   string
		code   int16
		handed bool // kafka-go hands the error to the follower
	}{
		{"storage error", kerr.KafkaStorageError.Code, true},
		{"not leader", kerr.NotLeaderForPartition.Code, false},
	} {
		t.Run(c.name, func(t *testing.T) { followThroughFetchErrors(t, c.code, c.handed) })
	}
}

// replicaOnKfake starts one replica on a kfake cluster whose requests a test can control, and
// waits until 8 records of the bundled data set are applied; applied counts the applied records.
func replicaOnKfake(t *testing.T) (kc *kfake.Cluster, r *launch.Running, data *dataset.Set, applied func() float64) {
	t.Helper()
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "cfguard.records", "cfguard.records.dlq", "cfguard.events"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the replica's cleanup
	r = launch.ReplicaAt(t, kc.ListenAddrs(), "r1", daemontest.WriteKeyFile(t, daemontest.ClusterKey))
	data = daemontest.Bundled(t)
	daemontest.ProduceRows(t, r, data, 0, 8)
	applied = func() float64 { return daemontest.GatherCounter(r.Reg, "cfguard_records_total", "result", "applied") }
	waitfor.Cond(t, 60*time.Second, "8 records applied", func() bool { return applied() == 8 })
	return kc, r, data, applied
}

func followThroughFetchErrors(t *testing.T, code int16, handed bool) {
	kc, r, data, applied := replicaOnKfake(t)

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
			rp.Partition, rp.ErrorCode, rp.HighWatermark = fp.Partition, code, -1
			rp.RecordBatches = []byte{}
			rt.Partitions = append(rt.Partitions, rp)
		}
		resp.Topics = append(resp.Topics, rt)
		return resp, nil, true
	})
	waitfor.Cond(t, 60*time.Second, "the follower failing to read the log 5 times", func() bool {
		if returned, err := r.Returned(); returned {
			t.Fatalf("the replica stopped while its posterior log was unreadable: %v", err)
		}
		return refused.Load() >= 5
	})
	const said = "posterior log: reading it failed; reading it again with backoff, serving the last posterior applied"
	if handed {
		// kafka-go's reader keeps fetching while the follower takes the error it handed over:
		// the refusals counted above do not wait for the line.
		waitfor.Cond(t, 60*time.Second, "the follower saying that reading failed", func() bool { return strings.Contains(r.Logs.String(), said) })
	}
	if n := strings.Count(r.Logs.String(), said); handed && n != 1 || !handed && n != 0 {
		t.Errorf("the follower said %d times that reading failed; want once for the episode when kafka-go hands the error over, else never", n)
	}
	if code, body := r.Do(t, "POST", "/v1/predict", "", map[string]any{"x": data.X[0]}); code != 200 {
		t.Errorf("POST /v1/predict while the log is unreadable: %d %s", code, body)
	}
	daemontest.ProduceRows(t, r, data, 8, 8)
	waitfor.Cond(t, 60*time.Second, "/readyz saying the log cannot be read", func() bool {
		code, body := r.Get(t, "/readyz")
		return code == 503 && strings.Contains(string(body), "the posterior log cannot be read")
	})
	waitfor.Cond(t, 60*time.Second, "the updater giving the role up", func() bool {
		return strings.Contains(r.Logs.String(), "this replica's follower has not read it for")
	})
	refusing.Store(false)
	waitfor.Cond(t, 60*time.Second, "16 records applied once the log reads again", func() bool { return applied() == 16 })
	waitfor.Cond(t, 60*time.Second, "/readyz 200 again", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	if returned, err := r.Returned(); returned {
		t.Fatalf("the replica stopped: %v", err)
	}
	t.Logf("fetches of the posterior log refused: %d", refused.Load())
}

// TestFollowerWithoutTheInputEndsIsNotReady: the broker refuses every request for kafka.topic's
// end offsets while the posterior log and the input records read as usual. The next increment's
// entry covers records past the ends the follower knows, so it cannot be checked, and is not
// applied: the replica serves its head, and after resetAfter /readyz says which entry waits and
// why. Once the ends are read again, the entry is applied and the replica is ready again.
func TestFollowerWithoutTheInputEndsIsNotReady(t *testing.T) {
	t.Parallel() // mostly waits for resetAfter
	kc, r, data, applied := replicaOnKfake(t)
	version := r.D.Posterior().Version

	var refusing atomic.Bool
	var refused atomic.Int64
	refusing.Store(true)
	kc.ControlKey(int16(kmsg.ListOffsets), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		for _, tp := range req.(*kmsg.ListOffsetsRequest).Topics {
			if tp.Topic == "cfguard.records" && refusing.Load() {
				refused.Add(1)
				return nil, errors.New("connection closed by the test"), true
			}
		}
		return nil, nil, false
	})
	daemontest.ProduceRows(t, r, data, 8, 8)
	waitfor.Cond(t, 60*time.Second, "/readyz naming the entry that waits for the input's ends", func() bool {
		code, body := r.Get(t, "/readyz")
		return code == 503 && strings.Contains(string(body), "cannot be applied: its coverage is checked against kafka.topic's end offsets")
	})
	if got := r.D.Posterior().Version; got != version || applied() != 8 {
		t.Fatalf("posterior version %d with %v records applied while the entry could not be checked; want version %d, 8", got, applied(), version)
	}
	refusing.Store(false)
	waitfor.Cond(t, 60*time.Second, "16 records applied once the ends are read", func() bool { return applied() == 16 })
	waitfor.Cond(t, 60*time.Second, "/readyz 200 again", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	if n := strings.Count(r.Logs.String(), "cannot read the input topic's end offsets to check an entry's coverage"); n != 1 {
		t.Errorf("the follower said %d times that it cannot read the input's ends; want once for the episode", n)
	}
	t.Logf("requests for the input's end offsets refused: %d", refused.Load())
}

// TestUpdaterOwnLateEntryIsNotBuiltOn: the updater's append of an increment is held at the
// broker while its generation ends (a replica joins); it keeps the role and reads the input
// again from the head's coverage. Its held entry then lands and is accepted. The records that
// entry covers are the ones the updater's new consumer reads next: an increment on the entry
// would apply them a second time. The updater steps down instead, and reads on from the
// entry's coverage: every record is applied once, at every replica.
func TestUpdaterOwnLateEntryIsNotBuiltOn(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas and a rebalance: not with -short")
	}
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "cfguard.records", "cfguard.records.dlq", "cfguard.events"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the replicas' cleanups
	addrs, key := kc.ListenAddrs(), daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := launch.ReplicaAt(t, addrs, "r1", key)
	waitfor.Cond(t, 30*time.Second, "r1 the updater", r1.D.Replica().Updater)

	// Controls: the posterior log's appends, then the input topic's fetches, held until released.
	var holdAppend, holdInput atomic.Bool
	appendHeld := make(chan struct{}, 1)
	releaseAppend, releaseInput := make(chan struct{}), make(chan struct{})
	defer func() {
		for _, ch := range []chan struct{}{releaseAppend, releaseInput} {
			select {
			case <-ch:
			default:
				close(ch)
			}
		}
	}()
	kc.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		for _, tp := range req.(*kmsg.ProduceRequest).Topics {
			if tp.Topic == "cfguard.posterior" && holdAppend.Load() {
				select {
				case appendHeld <- struct{}{}:
				default:
				}
				kc.SleepControl(func() { <-releaseAppend })
			}
		}
		return nil, nil, false
	})
	kc.ControlKey(int16(kmsg.Fetch), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		for _, tp := range req.(*kmsg.FetchRequest).Topics {
			if tp.Topic == "cfguard.records" && holdInput.Load() {
				kc.SleepControl(func() { <-releaseInput })
			}
		}
		return nil, nil, false
	})

	data := daemontest.Bundled(t)
	applied := func(r *launch.Running) float64 {
		return daemontest.GatherCounter(r.Reg, "cfguard_records_total", "result", "applied")
	}
	head := r1.D.Replica().Head().Seq
	holdAppend.Store(true)
	daemontest.ProduceRows(t, r1, data, 0, 8)
	select {
	case <-appendHeld:
	case <-time.After(60 * time.Second):
		t.Fatal("r1 appended no entry for 8 records within 60s")
	}
	holdInput.Store(true) // r1's next consumer reads nothing until its held entry is in the log
	gens := func(r *launch.Running) float64 { return r.Metric(t, alerts.NameGenerations) }
	before := gens(r1)
	r2 := launch.With(t, func(c *config.Config) { daemontest.ReplicaConfig(c, addrs, "r2", key) }, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 the updater of a new generation", func() bool { return gens(r1) > before && r1.D.Replica().Updater() })

	holdAppend.Store(false)
	close(releaseAppend) // the held entry lands
	waitfor.Cond(t, 60*time.Second, "r1's held entry accepted", func() bool { return r1.D.Replica().Head().Seq > head && applied(r1) == 8 })
	holdInput.Store(false)
	close(releaseInput)
	n := daemontest.ProduceRows(t, r1, data, 8, 8)
	for _, r := range []*launch.Running{r1, r2} {
		waitfor.Cond(t, 60*time.Second, "the log covering every record", func() bool {
			return r.D.Replica().Head().Covers[0] == int64(n) && r.D.Replica().Head().Seq == r1.D.Replica().Head().Seq
		})
		if got := applied(r); got != float64(n) {
			t.Errorf("%s applied %v records, %d were produced: the log applied some twice", r.Config.Replication.ReplicaID, got, n)
		}
	}
}

// TestNoGenesisBesideRunningReplicas: the posterior topic is deleted and created again, empty,
// under a running replica. A replica started then with an empty state directory does not write a
// genesis of its own (a second history beside the one the running replica follows): it refuses
// to start, naming the updater group's member and how to start a new log, and writes nothing.
func TestNoGenesisBesideRunningReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := launch.ReplicaKey(t, b, "r1", key)
	waitfor.Cond(t, 30*time.Second, "r1 the updater", r1.D.Replica().Updater)
	kafkatest.RecreateTopic(t, b.Addrs(), "cfguard.posterior", 1)
	c := daemontest.Config(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r2", key) })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	err := daemon.Run(ctx, daemon.Options{Config: &c, Logger: slog.New(slog.DiscardHandler)})
	if err == nil || !strings.Contains(err.Error(), "1 replicas run in the updater group") || !strings.Contains(err.Error(), "cfguard new-epoch --head-from") ||
		!strings.Contains(err.Error(), "replication.posterior_topic is not the topic they follow") {
		t.Fatalf("r2's start on an emptied posterior log beside r1: %v; want a refusal naming the running replica and new-epoch", err)
	}
	if got := kafkatest.ReadPartition(t, b.Addrs(), "cfguard.posterior", 0); len(got) != 0 {
		t.Errorf("the emptied posterior log holds %d records after r2's refusal, want none", len(got))
	}
}

// TestUpdaterBacksOffATermThatKeepsFailing: the dead-letter topic refuses a dead letter for good
// (its max.message.bytes is below it), so every term of the updater stops on it. The updater
// gives the role up and rejoins after a pause that doubles with each failed term, instead of
// going round at the speed of rebalances, each term writing the dead letters again.
func TestUpdaterBacksOffATermThatKeepsFailing(t *testing.T) {
	t.Parallel() // waits for terms to fail
	b := daemontest.StartCluster(t, 1)
	kafkatest.SetTopicConfig(t, b.Addrs(), "cfguard.records.dlq", "max.message.bytes", "1000")
	r := launch.Replica(t, b, "r1")
	bad := []byte(`{"id":"big","pad":"` + strings.Repeat("x", 2000) + `"}`)
	r.Produce(t, bad)
	waitfor.Cond(t, 60*time.Second, "a term failing again after a longer pause", func() bool {
		return strings.Contains(r.Logs.String(), "terms keep failing")
	})
	if got := r.Logs.Logged("updater: terms keep failing; rejoining the group after a longer pause", "pause"); got != "2s" {
		t.Errorf("the second failed term's pause is %q, want 2s", got)
	}
}
