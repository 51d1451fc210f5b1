package broker

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// emptied starts a broker on dir with topic "records", produces n records, lets every one
// expire and returns the broker (running).
func emptied(t *testing.T, dir string, n int) *Broker {
	t.Helper()
	b, err := Start(context.Background(), Config{DataDir: dir, Topics: []string{"records"}, Retention: 300 * time.Millisecond,
		RetentionCheckInterval: time.Hour}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()[0]), Topic: "records", RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	defer w.Close()
	msgs := make([]kafka.Message, n)
	for i := range msgs {
		msgs[i] = kafka.Message{Value: []byte("r")}
	}
	if err := w.WriteMessages(context.Background(), msgs...); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 10*time.Second, "every record to expire", func() bool {
		b.ApplyRetention()
		return b.LogStartOffsets("records")[0] == int64(n)
	})
	return b
}

// restart starts a broker on dir with cfg and returns partition 0 of "records" as "log start L,
// high watermark H", or Start's error.
func restart(t *testing.T, dir string, cfg Config) (string, error) {
	t.Helper()
	cfg.DataDir, cfg.Topics, cfg.Retention = dir, []string{"records"}, time.Hour
	b, err := Start(context.Background(), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		return "", err
	}
	defer b.Close()
	return fmt.Sprintf("log start %d, high watermark %d", b.LogStartOffsets("records")[0], b.HighWatermarks("records")[0]), nil
}

// A topic deleted and created again begins at offset 0, as Kafka's does: the broker's record of
// the deleted topic's offsets does not outlive it.
func TestRecreatedTopicBeginsAtZero(t *testing.T) {
	dir := t.TempDir()
	b := emptied(t, dir, 20)
	if err := b.c.DeleteTopic("records"); err != nil {
		t.Fatal(err)
	}
	b.Close()
	for i := range 2 { // the first start creates the topic again
		if got, err := restart(t, dir, Config{}); err != nil || got != "log start 0, high watermark 0" {
			t.Fatalf("start %d after the topic was deleted: %s, %v; want 0 and 0", i, got, err)
		}
	}
}

// A partition whose offsets the start cannot keep (its files cannot be written, as on a full
// disk) stops the start, naming the partition and the way out, and changes nothing: the next
// start on a working disk keeps the offsets.
func TestOffsetsThatCannotBeKeptStopTheStart(t *testing.T) {
	dir := t.TempDir()
	emptied(t, dir, 20).Close()
	full := func(path string, _ []byte) error {
		return &fs.PathError{Op: "write", Path: path, Err: syscall.ENOSPC}
	}
	_, err := restart(t, dir, Config{writeFile: full})
	if err == nil || !errors.Is(err, syscall.ENOSPC) || !strings.Contains(err.Error(), "cannot keep the offsets of partition records-0") ||
		!strings.Contains(err.Error(), "Nothing was changed: make "+dir+" writable") {
		t.Fatalf("a start that cannot write: %v", err)
	}
	if got, err := restart(t, dir, Config{}); err != nil || got != "log start 20, high watermark 20" {
		t.Fatalf("the next start: %s, %v; want 20 and 20", got, err)
	}
}
