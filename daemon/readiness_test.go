package daemon

import (
	"context"
	"errors"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestReadinessReportsADeadBroker: once the embedded broker stops accepting connections,
// /readyz answers 503 naming it, while /healthz (the process lives) stays 200, and the web UI's
// overview, ready before, says it is not ready and why; its events page says that an event
// cannot be published.
func TestReadinessReportsADeadBroker(t *testing.T) {
	r := startDaemon(t, nil)
	if _, page := r.Get(t, "/ui/"); !strings.Contains(string(page), `<dd id="ready">yes</dd>`) {
		t.Fatalf("the overview of a ready daemon does not say it is ready")
	}
	r.D.broker.Close()
	waitfor.Cond(t, 10*time.Second, "readyz to fail", func() bool { code, _ := r.Get(t, "/readyz"); return code == http.StatusServiceUnavailable })
	if _, body := r.Get(t, "/readyz"); !strings.Contains(string(body), "embedded broker") {
		t.Fatalf("readyz body %q does not name the embedded broker", body)
	}
	if _, page := r.Get(t, "/ui/"); !strings.Contains(string(page), `<dd id="ready">no: embedded broker`) {
		t.Errorf("the overview does not say the daemon is not ready because of its broker")
	}
	if code, _ := r.Get(t, "/healthz"); code != http.StatusOK {
		t.Fatalf("healthz %d with the broker down, want 200", code)
	}
	// An audit's event cannot be published: the events page says so, with the error.
	if _, page := r.Get(t, "/ui/events"); strings.Contains(string(page), `id="failing"`) {
		t.Fatalf("the events page says publishing fails before any attempt failed")
	}
	if code, body := r.Do(t, "POST", "/v1/audit", "", nil); code != http.StatusOK {
		t.Fatalf("POST /v1/audit: %d %s", code, body)
	}
	waitfor.Cond(t, 30*time.Second, "the events page to say publishing fails", func() bool {
		_, page := r.Get(t, "/ui/events")
		return strings.Contains(string(page), `<p id="failing" class="flag">Publishing fails: every attempt since `) &&
			strings.Contains(string(page), "audit_completed")
	})
}

// TestRecreatedTopicStopsIngestUntilConfirmed: n records applied, the topic deleted and
// recreated, m > n records produced to it. Ingest stops with an error naming the topic, the
// partition, the offsets and the confirming command; /readyz is false with that reason, the
// mismatch gauge is 1, nothing of the new topic is applied, and the API keeps serving. A
// plain restart keeps ingest stopped (the ledger's offset n is inside the new log, so offsets
// alone could not tell); a restart with the confirmation applies all m records.
func TestRecreatedTopicStopsIngestUntilConfirmed(t *testing.T) {
	dir := t.TempDir()
	mutate := func(c *config.Config) { c.StateDir = dir }
	data := daemontest.Bundled(t)
	records := func(prefix string, n int) [][]byte { return daemontest.RowRecords(data, prefix, n) }
	const n, m = 64, 96
	const command = "cfguard run --config config.yaml --accept-topic-reset"
	offset := func(r *running) int64 {
		offs, err := r.D.ledger.Offsets()
		if err != nil {
			t.Fatal(err)
		}
		return offs[0]
	}
	stoppedForReset := func(r *running) {
		t.Helper()
		waitfor.Cond(t, 30*time.Second, "readyz to report the reset", func() bool {
			code, body := r.Get(t, "/readyz")
			return code == http.StatusServiceUnavailable && strings.Contains(string(body), "was reset")
		})
		_, body := r.Get(t, "/readyz")
		for _, s := range []string{r.D.cfg.Kafka.Topic, "partition 0", command} {
			if !strings.Contains(string(body), s) {
				t.Fatalf("readyz %q does not name %q", body, s)
			}
		}
		if g := r.Metric(t, "cfguard_consumer_topic_mismatch"); g != 1 {
			t.Fatalf("cfguard_consumer_topic_mismatch %v, want 1", g)
		}
		if code, _ := r.Get(t, "/v1/model"); code != http.StatusOK {
			t.Fatalf("GET /v1/model %d while ingest is stopped, want 200", code)
		}
		if off := offset(r); off != n {
			t.Fatalf("ledger offset %d, want %d (nothing of the new topic applied)", off, n)
		}
	}

	r := startDaemon(t, mutate)
	r.Produce(t, records("old", n)...)
	waitfor.Cond(t, 30*time.Second, "n applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == n })
	kafkatest.RecreateTopic(t, r.D.BrokerAddrs(), r.D.cfg.Kafka.Topic, 1)
	r.Produce(t, records("new", m)...)
	stoppedForReset(r)
	if a := r.Metric(t, "cfguard_records_total", "result", "applied"); a != n {
		t.Fatalf("%v records applied, want %d", a, n)
	}
	r.Stop(t)

	r = startDaemonWith(t, mutate, nil, nil)
	stoppedForReset(r)
	r.Stop(t)
	recorded, err := os.ReadFile(filepath.Join(dir, topicResetFile))
	if err != nil {
		t.Fatal(err)
	}

	r = startDaemonWith(t, mutate, func(o *Options) { o.AcceptTopicReset = true }, nil)
	waitfor.Cond(t, 30*time.Second, "m applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == m })
	waitfor.Cond(t, 10*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == http.StatusOK })
	if off := offset(r); off != m {
		t.Fatalf("ledger offset %d after the confirmation, want %d", off, m)
	}
	if _, err := os.Stat(filepath.Join(dir, topicResetFile)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("%s after the confirmed reset was checkpointed: %v", topicResetFile, err)
	}
	if g := r.Metric(t, "cfguard_consumer_topic_mismatch"); g != 0 {
		t.Fatalf("cfguard_consumer_topic_mismatch %v after the confirmation, want 0", g)
	}
	r.Stop(t)

	// A stop between the checkpoint of the confirmed reset and the file's removal leaves the
	// file: the next start (with the confirmation, as the file asks, or without) finds the
	// ledger past the point the file recorded, removes it, and applies nothing twice.
	if err := os.WriteFile(filepath.Join(dir, topicResetFile), recorded, 0o600); err != nil {
		t.Fatal(err)
	}
	r = startDaemonWith(t, mutate, func(o *Options) { o.AcceptTopicReset = true }, nil)
	r.Produce(t, records("after", 32)...)
	// The counter follows the checkpoint that moves the offset: wait for both.
	waitfor.Cond(t, 30*time.Second, "the 32 new records applied", func() bool {
		return offset(r) == m+32 && r.Metric(t, "cfguard_records_total", "result", "applied") >= 32
	})
	if a := r.Metric(t, "cfguard_records_total", "result", "applied"); a != 32 {
		t.Fatalf("%v records applied after a restart on the stale file, want the 32 new ones", a)
	}
	if _, err := os.Stat(filepath.Join(dir, topicResetFile)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("%s left after a start found its reset done: %v", topicResetFile, err)
	}
}

// A reset recorded in topic-reset.json still waits after the ledger is restored from a backup
// taken before it: the restored ledger's offsets differ from those the reset was found at, but
// it has checkpointed no reset of the partition since, so ingest stays stopped.
func TestRecordedResetSurvivesARestore(t *testing.T) {
	dir := t.TempDir()
	mutate := func(c *config.Config) { c.StateDir = dir }
	data := daemontest.Bundled(t)
	records := func(prefix string, n int) [][]byte { return daemontest.RowRecords(data, prefix, n) }
	r := startDaemon(t, mutate)
	r.Produce(t, records("a", 32)...)
	waitfor.Cond(t, 30*time.Second, "32 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 32 })
	backup := filepath.Join(t.TempDir(), "backup.db")
	f, err := os.Create(backup)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.D.ledger.Backup(context.Background(), f); err != nil {
		t.Fatal(err)
	}
	f.Close()
	r.Produce(t, records("b", 32)...)
	waitfor.Cond(t, 30*time.Second, "64 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 64 })
	kafkatest.RecreateTopic(t, r.D.BrokerAddrs(), r.D.cfg.Kafka.Topic, 1)
	r.Produce(t, records("new", 96)...)
	r.WaitResetReported(t, "readyz to report the reset")
	r.Stop(t)
	recorded, err := os.ReadFile(filepath.Join(dir, topicResetFile))
	if err != nil {
		t.Fatal(err)
	}

	// The ledger restored from the backup (offset 32 of the old log), topic-reset.json kept.
	if err := os.Rename(filepath.Join(dir, ledger.FileName), filepath.Join(dir, ledger.FileName+".aside")); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(backup)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ledger.FileName), b, 0o600); err != nil {
		t.Fatal(err)
	}
	r = startDaemonWith(t, mutate, nil, nil)
	r.WaitResetReported(t, "readyz to report the reset after the restore")
	// Kept as it was: not taken for done and found again by the start's mark check (which a
	// backup without a mark, or one whose marked record is gone, would not make).
	if now, err := os.ReadFile(filepath.Join(dir, topicResetFile)); err != nil || string(now) != string(recorded) {
		t.Fatalf("%s after a restore: %v\n%s\nwant it kept as it was:\n%s", topicResetFile, err, now, recorded)
	}
}
