package daemon

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestTopicRecreatedWhileStopped: the daemon reads from a broker that outlives it. A plain
// restart after more records were produced resumes at the ledger's offset with no alarm. Then,
// with the daemon stopped, the topic is deleted and recreated and m > n records are produced:
// the ledger's offset is inside the new log, so offsets cannot tell, but the record the
// ledger's mark names is not the one the partition now holds. The next start stops ingest
// naming the topic, partition, offset and the confirming command (/readyz 503, the mismatch
// gauge 1, nothing applied); a start with --accept-topic-reset applies the m new records.
func TestTopicRecreatedWhileStopped(t *testing.T) {
	b := daemontest.StartCluster(t, 1)
	dir := t.TempDir()
	mutate := func(c *config.Config) { c.StateDir, c.Kafka.Brokers = dir, b.Addrs() }
	data := daemontest.Bundled(t)
	produce := func(prefix string, n int) {
		t.Helper()
		// One batch of n records, sent once queued (a batch that is not full waits for kafka-go's
		// BatchTimeout, 1 s).
		w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()...), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll, BatchSize: min(n, 500)}
		defer w.Close()
		msgs := make([]kafka.Message, n)
		for i := range msgs {
			msgs[i] = kafka.Message{Value: daemontest.Record(fmt.Sprintf("%s%d", prefix, i), data.X[i], data.Y[i])}
		}
		pctx, pcancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer pcancel()
		if err := w.WriteMessages(pctx, msgs...); err != nil {
			t.Fatal(err)
		}
	}
	applied := func(r *running) float64 { return r.Metric(t, "cfguard_records_total", "result", "applied") }
	offset := func(r *running) int64 {
		offs, err := r.D.ledger.Offsets()
		if err != nil {
			t.Fatal(err)
		}
		return offs[0]
	}
	const n, k, m = 64, 32, 160

	r := startDaemon(t, mutate)
	produce("old", n)
	waitfor.Cond(t, 30*time.Second, "n applied records", func() bool { return applied(r) == n })
	if _, marks, err := r.D.ledger.ResumePoint(); err != nil || marks[0].Offset != n-1 {
		t.Fatalf("ledger mark %+v (%v), want one at offset %d", marks[0], err, n-1)
	}
	r.Stop(t)

	// A plain restart: the same log, written on.
	produce("more", k)
	r = startDaemon(t, mutate)
	waitfor.Cond(t, 30*time.Second, "k applied records", func() bool { return applied(r) == k })
	if off := offset(r); off != n+k {
		t.Fatalf("ledger offset %d after the restart, want %d", off, n+k)
	}
	if g := r.Metric(t, "cfguard_consumer_topic_mismatch"); g != 0 {
		t.Fatalf("cfguard_consumer_topic_mismatch %v after a plain restart, want 0", g)
	}
	r.Stop(t)

	// Recreated while the daemon is stopped, and written past the ledger's offset.
	kafkatest.RecreateTopic(t, b.Addrs(), "cfguard.records", 1)
	produce("new", m)
	r = startDaemonWith(t, mutate, nil, nil)
	const command = "--accept-topic-reset"
	waitfor.Cond(t, 30*time.Second, "readyz to report the reset", func() bool {
		code, body := r.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "was reset")
	})
	_, body := r.Get(t, "/readyz")
	for _, s := range []string{"topic cfguard.records partition 0", fmt.Sprintf("next offset %d", n+k), "not the one read there", command} {
		if !strings.Contains(string(body), s) {
			t.Fatalf("readyz %q does not name %q", body, s)
		}
	}
	// The consumer's Health reports the reset first; the ingest loop sets the gauge when the
	// consumer's error reaches it.
	waitfor.Cond(t, 30*time.Second, "cfguard_consumer_topic_mismatch 1", func() bool { return r.Metric(t, "cfguard_consumer_topic_mismatch") == 1 })
	if a, off := applied(r), offset(r); a != 0 || off != n+k {
		t.Fatalf("%v records applied, ledger offset %d; want none of the new topic, offset %d", a, off, n+k)
	}
	r.Stop(t)

	r = startDaemonWith(t, mutate, func(o *Options) { o.AcceptTopicReset = true }, nil)
	waitfor.Cond(t, 30*time.Second, "m applied records", func() bool { return applied(r) == m })
	waitfor.Cond(t, 10*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == http.StatusOK })
	if off := offset(r); off != m {
		t.Fatalf("ledger offset %d after the confirmation, want %d", off, m)
	}
	if _, marks, err := r.D.ledger.ResumePoint(); err != nil || marks[0].Offset != m-1 {
		t.Fatalf("ledger mark %+v (%v) after the confirmation, want one of the new log at offset %d", marks[0], err, m-1)
	}
	if _, err := os.Stat(filepath.Join(dir, topicResetFile)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("%s after the confirmed reset was checkpointed: %v", topicResetFile, err)
	}
	if g := r.Metric(t, "cfguard_consumer_topic_mismatch"); g != 0 {
		t.Fatalf("cfguard_consumer_topic_mismatch %v after the confirmation, want 0", g)
	}
	r.Stop(t)

	// Recreated again, and the confirmed reset's first increment reads past the mark of the log
	// before (offset m-1) without taking the new log's whole fetch (m2 - 8 of its m2 records):
	// it carries no mark of the new log, so the old log's mark must go with it, or the next
	// plain start would take the new log for a reset one. The next increment waits for
	// kafka.max_wait (a minute), and every commit after the first increment fails, so the
	// ledger stays there when the daemon stops.
	const m2 = 200
	kafkatest.RecreateTopic(t, b.Addrs(), "cfguard.records", 1)
	produce("again", m2)
	var failing atomic.Bool
	r = startDaemonWith(t, func(c *config.Config) {
		mutate(c)
		c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog, c.Kafka.MaxWait = m2-8, m2-8, time.Minute
	}, func(o *Options) {
		o.AcceptTopicReset = true
		o.Hooks.LedgerAfterCommit = func() error {
			if failing.Load() {
				return errors.New("injected: the disk refused the commit")
			}
			return nil
		}
	}, nil)
	waitfor.Cond(t, 30*time.Second, "the reset's first increment applied", func() bool { return applied(r) == m2-8 })
	failing.Store(true)
	if _, marks, err := r.D.ledger.ResumePoint(); err != nil || len(marks) != 0 {
		t.Fatalf("ledger marks %+v (%v) after an increment that took no whole fetch of the new log, want none", marks, err)
	}
	r.Stop(t)
	r = startDaemon(t, mutate)
	waitfor.Cond(t, 30*time.Second, "the rest of the new log applied after a plain restart", func() bool { return applied(r) == 8 })
	if off := offset(r); off != m2 {
		t.Fatalf("ledger offset %d after the plain restart, want %d", off, m2)
	}
	if g := r.Metric(t, "cfguard_consumer_topic_mismatch"); g != 0 {
		t.Fatalf("cfguard_consumer_topic_mismatch %v after a plain restart on the confirmed new log, want 0", g)
	}
}
