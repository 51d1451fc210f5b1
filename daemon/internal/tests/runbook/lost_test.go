package runbook

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// The records of lostInput: applied before its daemon stops, deleted by retention unread, and
// produced after them.
const lostApplied, lostDeleted, lostAfter = 64, 32, 16

// lostInput starts a daemon (mutate's configuration, on a broker of the test's own whose input
// topic keeps records 30 minutes, and a state directory of its own) whose input topic's
// retention deleted records it had not read: it applies lostApplied records and stops; then
// lostDeleted records stamped an hour ago and lostAfter new ones are produced, and the broker
// applies its retention; started again, it applies the new ones and counts the others lost.
// start starts it again on the same state directory.
func lostInput(t *testing.T, mutate func(c *config.Config)) (r *launch.Running, b *broker.Broker, start func() *launch.Running) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"cfguard.records", "cfguard.records.dlq", "cfguard.events"},
		Partitions: 1, Retention: 30 * time.Minute, RetentionCheckInterval: time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	dir := t.TempDir()
	start = func() *launch.Running {
		r := launch.With(t, func(c *config.Config) {
			c.Kafka.Brokers, c.StateDir = b.Addrs(), dir
			if mutate != nil {
				mutate(c)
			}
		}, nil, nil)
		waitfor.Cond(t, 60*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
		return r
	}
	data := daemontest.Bundled(t)
	produce := func(prefix string, n int, at time.Time) {
		t.Helper()
		msgs := make([]kafka.Message, n)
		for i := range msgs {
			msgs[i] = kafka.Message{Value: daemontest.Record(fmt.Sprintf("%s%d", prefix, i), data.X[i], data.Y[i]), Time: at}
		}
		w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()...), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll,
			BatchSize: n}
		defer w.Close()
		wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
		defer wcancel()
		if err := w.WriteMessages(wctx, msgs...); err != nil {
			t.Fatal(err)
		}
	}
	r = start()
	produce("applied", lostApplied, time.Time{})
	waitfor.Cond(t, 60*time.Second, fmt.Sprintf("%d applied records", lostApplied), func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == lostApplied
	})
	r.Stop(t)
	produce("deleted", lostDeleted, time.Now().Add(-time.Hour))
	produce("after", lostAfter, time.Time{})
	b.ApplyRetention()
	if first := b.LogStartOffsets("cfguard.records")[0]; first != lostApplied+lostDeleted {
		t.Fatalf("the topic starts at offset %d after retention, want %d", first, lostApplied+lostDeleted)
	}
	r = start()
	waitfor.Cond(t, 60*time.Second, fmt.Sprintf("the %d records after the loss applied", lostAfter), func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == lostAfter
	})
	return r, b, start
}

// lostDaemon is lostInput's single daemon, in the state of CfguardRecordsLost.
func lostDaemon(t *testing.T) (st *state, start func() *launch.Running) {
	t.Helper()
	r, b, start := lostInput(t, nil)
	return &state{R: r, Subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", b.Addrs()[0],
		"STATE_DIR", ledger.ShellQuote(r.Config.StateDir),
	)}, start
}

// TestRecordsDeletedUnreadAreCountedOnce: input records the broker's retention deleted before
// the daemon read them are reported by one ERROR line naming their offsets and counted in the
// ledger (cfguard_records_lost_total, GET /v1/model's counters); the records after them are
// applied; a restart neither forgets the count nor counts them again.
func TestRecordsDeletedUnreadAreCountedOnce(t *testing.T) {
	t.Parallel() // mostly waits for the daemon to start, three times
	st, start := lostDaemon(t)
	r := st.R
	check := func(r *launch.Running, when string) {
		t.Helper()
		if n := r.Metric(t, "cfguard_records_lost_total", "topic", "cfguard.records"); n != lostDeleted {
			t.Errorf("%s: cfguard_records_lost_total = %v, want %d", when, n, lostDeleted)
		}
		_, body := r.Get(t, "/v1/model")
		var m struct {
			Counters map[string]int64 `json:"counters"`
			Offsets  map[string]int64 `json:"offsets"`
		}
		if err := json.Unmarshal(body, &m); err != nil {
			t.Fatal(err)
		}
		if m.Counters["lost"] != lostDeleted || m.Counters["consumer_lost"] != lostDeleted {
			t.Errorf("%s: /v1/model counters %v, want lost and %s %d", when, m.Counters, "consumer_lost", lostDeleted)
		}
		if m.Offsets["0"] != lostApplied+lostDeleted+lostAfter {
			t.Errorf("%s: /v1/model offsets %v, want partition 0 at %d", when, m.Offsets, lostApplied+lostDeleted+lostAfter)
		}
	}
	check(r, "after the loss")
	lostAt := r.Metric(t, "cfguard_records_lost_last_timestamp_seconds", "topic", "cfguard.records")
	if time.Since(time.Unix(int64(lostAt), 0)) > time.Minute {
		t.Errorf("cfguard_records_lost_last_timestamp_seconds = %v, want the time of the loss", lostAt)
	}
	if _, page := r.Get(t, "/ui/"); !strings.Contains(string(page), "CfguardRecordsLost") {
		t.Error("the UI's overview does not show CfguardRecordsLost's condition")
	}
	want := fmt.Sprintf("partition=0 from=%d to=%d lost=%d", lostApplied, lostApplied+lostDeleted, lostDeleted)
	if n := strings.Count(r.Logs.String(), "records were deleted by the broker (retention) before they were read"); n != 1 ||
		!strings.Contains(r.Logs.String(), want) {
		t.Errorf("%d ERROR lines about the loss, want 1 with %q:\n%s", n, want, r.Logs.String())
	}
	r.Stop(t)
	r = start()
	check(r, "after a restart")
	if at := r.Metric(t, "cfguard_records_lost_last_timestamp_seconds", "topic", "cfguard.records"); at != lostAt {
		t.Errorf("after a restart: cfguard_records_lost_last_timestamp_seconds = %v, want %v (the ledger's)", at, lostAt)
	}
	if n := r.Metric(t, "cfguard_records_total", "result", "applied"); n != 0 {
		t.Errorf("after a restart: %v records applied again", n)
	}
	if strings.Contains(r.Logs.String(), "deleted by the broker") {
		t.Errorf("after a restart the loss is reported again:\n%s", r.Logs.String())
	}
}

// TestInputLossIsCountedByTheReplicaThatReadPastIt: the updater whose consumer found input
// records deleted unread counts them (cfguard_records_lost_total, CfguardRecordsLost); a replica
// that joins later and replays the posterior log learns of the loss from the entry (its counter
// "lost") but does not count it as its own, so that it does not page for a loss an hour old.
func TestInputLossIsCountedByTheReplicaThatReadPastIt(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	t.Parallel() // mostly waits for its replicas to join their groups
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1, b, _ := lostInput(t, func(c *config.Config) { daemontest.ReplicaConfig(c, c.Kafka.Brokers, "r1", key) })
	if n := r1.Metric(t, "cfguard_records_lost_total", "topic", "cfguard.records"); n != lostDeleted {
		t.Errorf("r1, the updater that read past the loss: cfguard_records_lost_total = %v, want %d", n, lostDeleted)
	}
	r2 := launch.ReplicaAt(t, b.Addrs(), "r2", key)
	head := r1.Model(t).Replication.Entry
	waitfor.Cond(t, 60*time.Second, "r2 to replay the posterior log to r1's head", func() bool { return r2.Model(t).Replication.Entry >= head })
	var m struct {
		Counters map[string]int64 `json:"counters"`
	}
	_, body := r2.Get(t, "/v1/model")
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatal(err)
	}
	if m.Counters["lost"] != lostDeleted || m.Counters["consumer_lost"] != 0 {
		t.Errorf("r2's counters %v, want lost %d (the log's) and no %s", m.Counters, lostDeleted, "consumer_lost")
	}
	if n := r2.Metric(t, "cfguard_records_lost_total", "topic", "cfguard.records"); n != 0 {
		t.Errorf("r2, which replayed the loss from the log: cfguard_records_lost_total = %v, want 0", n)
	}
}
