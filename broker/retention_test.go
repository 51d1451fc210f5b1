package broker_test

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// dirBytes is the total size of the regular files under dir.
func dirBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			info, err := d.Info()
			if err != nil {
				return err
			}
			n += info.Size()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// record is a value of the size cfguard's records have (30 features as JSON).
func record(i int) string {
	return fmt.Sprintf(`{"id":"r%d","features":[%s],"label":%d}`, i, strings.TrimSuffix(strings.Repeat("-12.345678,", 30), ","), i%2)
}

// churn produces rounds of n records to topic and reads each round back with a group reader
// (as cfguard does: what is read is behind the consumer), returning the data directory's size
// after each round.
func churn(t *testing.T, b *broker.Broker, dir string, rounds, n int) []int64 {
	t.Helper()
	addr := b.Addrs()[0]
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(addr), Topic: "records", RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond, BatchSize: 500}
	defer w.Close()
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: []string{addr}, Topic: "records", GroupID: "churn", MaxWait: kafkatest.MaxWait})
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var sizes []int64
	for round := range rounds {
		msgs := make([]kafka.Message, n)
		for i := range msgs {
			msgs[i] = kafka.Message{Value: []byte(record(round*n + i))}
		}
		if err := w.WriteMessages(ctx, msgs...); err != nil {
			t.Fatalf("round %d: produce: %v", round, err)
		}
		var m kafka.Message
		for range n {
			var err error
			if m, err = r.FetchMessage(ctx); err != nil {
				t.Fatalf("round %d: consume: %v", round, err)
			}
		}
		if err := r.CommitMessages(ctx, m); err != nil { // once per round, as cfguard's commits are coalesced
			t.Fatal(err)
		}
		b.ApplyRetention()
		sizes = append(sizes, dirBytes(t, dir))
	}
	return sizes
}

// TestRetentionBoundsDataDir produces and consumes many times the retention size through a
// broker with a data directory: with retention the directory stays below the bound the
// package documents (RetentionBytes plus one segment, plus metadata), segment files are
// deleted and the log start offset moves; without retention (the control) it grows past it.
func TestRetentionBoundsDataDir(t *testing.T) {
	rounds, n := 10, 2000 // ~6 MB through a 256 KiB retention
	if !testing.Short() {
		rounds = 60 // ~38 MB
	}
	const retention = 256 << 10
	run := func(t *testing.T, retentionBytes int64) (sizes []int64, logStart, hw int64) {
		dir := t.TempDir()
		b := start(t, context.Background(), broker.Config{DataDir: dir, Topics: []string{"records"},
			RetentionBytes: retentionBytes, RetentionCheckInterval: time.Hour})
		sizes = churn(t, b, dir, rounds, n)
		return sizes, b.LogStartOffsets("records")[0], b.HighWatermarks("records")[0]
	}
	bound := int64(retention + retention/4 + 64<<10) // retention, one segment, metadata files
	sizes, logStart, hw := run(t, retention)
	t.Logf("retention %d B: data dir after each round of %d records: %v bytes (log start %d of %d)", retention, n, sizes, logStart, hw)
	for i, sz := range sizes {
		if sz > bound {
			t.Fatalf("round %d: data dir is %d bytes, over the bound %d", i, sz, bound)
		}
	}
	if total := int64(rounds * n * len(record(0))); total < 10*bound {
		t.Fatalf("the test moves only %d bytes; it needs many times the bound %d", total, bound)
	}
	if logStart == 0 || hw != int64(rounds*n) {
		t.Fatalf("log start %d, high watermark %d: retention deleted nothing, or offsets changed", logStart, hw)
	}
	controlSizes, _, _ := run(t, -1)
	if last := controlSizes[len(controlSizes)-1]; last <= bound {
		t.Fatalf("without retention the data dir is %d bytes, within the bound %d: the test cannot tell", last, bound)
	}
	t.Logf("without retention: %v bytes", controlSizes)
}

// TestRetentionByAge deletes records older than Retention (by timestamp), on the broker's own
// schedule, and their segment files with them.
func TestRetentionByAge(t *testing.T) {
	dir := t.TempDir()
	b := start(t, context.Background(), broker.Config{DataDir: dir, Topics: []string{"records"},
		Retention: 300 * time.Millisecond, RetentionCheckInterval: 100 * time.Millisecond})
	var values []string
	for i := range 3000 { // ~1 MB: several 64 KiB segments
		values = append(values, record(i))
	}
	produce(t, b.Addrs()[0], "records", values...)
	before := dirBytes(t, dir)
	waitfor.Cond(t, 10*time.Second, "the log start to reach 3000 (every record expired)", func() bool {
		return b.LogStartOffsets("records")[0] >= 3000
	})
	after := dirBytes(t, dir)
	t.Logf("data dir %d bytes before, %d after the records expired", before, after)
	if after > before/4 {
		t.Fatalf("data dir %d bytes after every record expired (was %d): segments not deleted", after, before)
	}
	produce(t, b.Addrs()[0], "records", "fresh")
	if got := readAll(t, b.Addrs()[0], "records", 1); got[0] != "fresh" {
		t.Fatalf("after expiry read %q, want the fresh record", got)
	}
}

func TestRetentionConfigRejected(t *testing.T) {
	if b, err := broker.Start(context.Background(), broker.Config{RetentionCheckInterval: -time.Second}, nil); err == nil {
		b.Close()
		t.Fatal("Start accepted a negative RetentionCheckInterval")
	}
}

// TestExpiredPartitionKeepsItsOffsetsAcrossRestarts: a partition whose every record expired
// keeps its offsets when the broker restarts on its data directory (kfake alone would restart
// it at 0, which cfguard's consumer takes for a recreated topic), through restarts with no new
// record, and a record produced after it takes the next offset and survives a restart.
func TestExpiredPartitionKeepsItsOffsetsAcrossRestarts(t *testing.T) {
	dir := t.TempDir()
	expiring := broker.Config{DataDir: dir, Topics: []string{"records"}, Retention: 300 * time.Millisecond, RetentionCheckInterval: 100 * time.Millisecond}
	b := start(t, context.Background(), expiring)
	var values []string
	for i := range 20 {
		values = append(values, record(i))
	}
	produce(t, b.Addrs()[0], "records", values...)
	waitfor.Cond(t, 10*time.Second, "every record to expire", func() bool { return b.LogStartOffsets("records")[0] == 20 })
	b.Close()

	kept := broker.Config{DataDir: dir, Topics: []string{"records"}, Retention: time.Hour}
	offsets := func(b *broker.Broker) string {
		return fmt.Sprintf("log start %d, high watermark %d", b.LogStartOffsets("records")[0], b.HighWatermarks("records")[0])
	}
	for restart := range 2 {
		b = start(t, context.Background(), kept)
		if got := offsets(b); got != "log start 20, high watermark 20" {
			t.Fatalf("restart %d after every record expired: %s, want 20 and 20", restart, got)
		}
		b.Close()
	}
	b = start(t, context.Background(), kept)
	produce(t, b.Addrs()[0], "records", "fresh")
	b.Close()
	b = start(t, context.Background(), kept)
	if got := offsets(b); got != "log start 20, high watermark 21" {
		t.Fatalf("after a record and a restart: %s, want 20 and 21", got)
	}
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: b.Addrs(), Topic: "records", MaxWait: kafkatest.MaxWait})
	defer r.Close()
	if err := r.SetOffset(20); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := r.FetchMessage(ctx)
	if err != nil || m.Offset != 20 || string(m.Value) != "fresh" {
		t.Fatalf("read at offset 20: %v %d %q, want the fresh record", err, m.Offset, m.Value)
	}
}

// TestExpiredPartitionKeepsItsOffsetsAfterACrash: the data directory as a crash leaves it
// (copied while the broker runs, after a retention pass deleted every record of a partition
// whose snapshot kfake has not written since its creation) starts a broker whose partition
// keeps its offsets, from the broker's own record of them.
func TestExpiredPartitionKeepsItsOffsetsAfterACrash(t *testing.T) {
	dir := t.TempDir()
	b := start(t, context.Background(), broker.Config{DataDir: dir, Topics: []string{"records"}, Retention: 300 * time.Millisecond,
		RetentionCheckInterval: time.Hour})
	var values []string
	for i := range 20 {
		values = append(values, record(i))
	}
	produce(t, b.Addrs()[0], "records", values...)
	waitfor.Cond(t, 10*time.Second, "every record to expire", func() bool {
		b.ApplyRetention()
		return b.LogStartOffsets("records")[0] == 20
	})
	crashed := filepath.Join(t.TempDir(), "data")
	if err := os.CopyFS(crashed, os.DirFS(dir)); err != nil {
		t.Fatal(err)
	}
	b.Close()
	// A record of the offsets that cannot be read does not stop a start: kfake's own state is
	// used, as before there was a record.
	damaged := filepath.Join(t.TempDir(), "data")
	if err := os.CopyFS(damaged, os.DirFS(crashed)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(damaged, "cfguard-offsets.json"), []byte(`{"high_water`), 0o644); err != nil {
		t.Fatal(err)
	}
	start(t, context.Background(), broker.Config{DataDir: damaged, Topics: []string{"records"}, Retention: time.Hour}).Close()
	b = start(t, context.Background(), broker.Config{DataDir: crashed, Topics: []string{"records"}, Retention: time.Hour})
	if ls, hw := b.LogStartOffsets("records")[0], b.HighWatermarks("records")[0]; ls != 20 || hw != 20 {
		t.Fatalf("after a crash with every record expired: log start %d, high watermark %d, want 20 and 20", ls, hw)
	}
	produce(t, b.Addrs()[0], "records", "fresh")
	if hw := b.HighWatermarks("records")[0]; hw != 21 {
		t.Fatalf("a record after the crash: high watermark %d, want 21", hw)
	}
}
