package broker

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"
)

// A write to the data directory that fails makes the broker unhealthy, naming the directory and
// kfake's error, for a minute after the last one: kfake reports failures, never recoveries. A
// partition directory that cannot be made (a file in its place, as a full or read-only disk
// would refuse it) fails the first write of a new topic; once it can be made, records are taken
// again.
func TestFailedWritesMakeTheBrokerUnhealthy(t *testing.T) {
	dir := t.TempDir()
	b, err := Start(context.Background(), Config{DataDir: dir, SyncWrites: true}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	if err := b.Healthy(); err != nil || b.WriteFailing() {
		t.Fatalf("a fresh broker: healthy %v, write failing %t", err, b.WriteFailing())
	}
	blocker := filepath.Join(dir, "partitions", "late-0")
	if err := os.MkdirAll(filepath.Dir(blocker), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(blocker, []byte("not a directory"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := b.ensureTopics([]string{"late"}, 1, 1); err != nil {
		t.Fatal(err)
	}
	write := func() error {
		w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()[0]), Topic: "late", RequiredAcks: kafka.RequireAll,
			BatchTimeout: time.Millisecond, MaxAttempts: 1}
		defer w.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return w.WriteMessages(ctx, kafka.Message{Value: []byte("r")})
	}
	if err := write(); err == nil {
		t.Fatal("a record whose partition directory cannot be made was acknowledged")
	}
	err = b.Healthy()
	if err == nil || !strings.Contains(err.Error(), "embedded broker cannot write its data directory "+dir) ||
		!strings.Contains(err.Error(), "persist batch mkdir") || !b.WriteFailing() {
		t.Fatalf("after a failed write: healthy %v, write failing %t; want the directory and kfake's error named", err, b.WriteFailing())
	}
	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	if err := write(); err != nil {
		t.Fatalf("a record once its partition directory can be made: %v", err)
	}
}

// A failure stands for writeHealth.hold after the latest one, and only kfake's lines of failed
// writes count.
func TestWriteHealthHoldsAFailureForItsHold(t *testing.T) {
	h := &writeHealth{hold: time.Minute}
	t0 := time.Unix(1_800_000_000, 0)
	for _, line := range []string{"consumerHeartbeatLate: group=g member=m gap=1ms interval=1ms", "compact groups.log: read: EOF",
		"load session state: open d/session_state.json: no such file or directory"} {
		h.logged(line, t0)
		if err := h.err("d", t0); err != nil {
			t.Fatalf("%q, no failed write: %v", line, err)
		}
	}
	h.logged("persist group entry write: write d/groups.log: no space left on device", t0.Add(-50*time.Second))
	if err := h.err("d", t0); err == nil || !strings.Contains(err.Error(), "persist group entry write") {
		t.Errorf("10 s after a group commit failed to persist: %v, want it reported", err)
	}
	h.logged("persist batch records-0: write records-0/00000000000000000000.log: no space left on device", t0)
	if err := h.err("d", t0.Add(59*time.Second)); err == nil || !strings.Contains(err.Error(), "no space left on device") {
		t.Errorf("59 s after the failure: %v, want it reported", err)
	}
	if err := h.err("d", t0.Add(time.Minute)); err != nil {
		t.Errorf("a minute after the failure: %v, want none", err)
	}
	h.logged("save session state: open d/session.json: read-only file system", t0.Add(90*time.Second))
	if err := h.err("d", t0.Add(100*time.Second)); err == nil || !strings.Contains(err.Error(), "read-only file system") {
		t.Errorf("10 s after a failed save: %v, want it reported", err)
	}
}
