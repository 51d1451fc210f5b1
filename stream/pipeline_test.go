package stream

import (
	"context"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestBacklogGrowsIncrements: with more records fetched and decoded than MaxRecords, the
// consumer is behind and increments take up to MaxRecordsBacklog; once it keeps up they are
// back to MaxRecords or MaxWait. Records stay in order and none is lost or doubled.
func TestBacklogGrowsIncrements(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("r", 250)...)
	cfg := consumerConfig(conn, "backlog")
	cfg.MaxRecords, cfg.MaxRecordsBacklog, cfg.MaxWait = 10, 100, 300*time.Millisecond
	c := newConsumer(t, cfg)
	waitfor.Cond(t, 20*time.Second, "the backlog to be prefetched", func() bool { return c.Stats().Pending >= 200 })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var sizes []int
	var got []string
	for len(got) < 250 {
		inc, err := c.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, len(inc.Records))
		got = append(got, ids([]*Increment{inc})...)
	}
	if !slices.Equal(sizes, []int{100, 100, 50}) {
		t.Fatalf("increment sizes %v behind by 250 records, want [100 100 50]", sizes)
	}
	if !slices.Equal(got, goodRecordIDs("r", 250)) {
		t.Fatalf("records out of order, lost or doubled: %v", got)
	}
	// Keeping up: fewer than MaxRecords records wait for MaxWait, as before.
	t0 := time.Now()
	produce(t, conn, recordsTopic, 0, goodRecords("s", 5)...)
	inc, err := c.Next(ctx)
	if err != nil || len(inc.Records) != 5 || time.Since(t0) < cfg.MaxWait {
		t.Fatalf("5 records while keeping up: %d records after %v (MaxWait %v), %v", len(inc.Records), time.Since(t0), cfg.MaxWait, err)
	}
}

func goodRecordIDs(prefix string, n int) []string {
	var out []string
	for i := range n {
		out = append(out, prefix+itoa(i))
	}
	return out
}

func itoa(i int) string { return string(appendInt(nil, i)) }

func appendInt(b []byte, i int) []byte {
	if i >= 10 {
		b = appendInt(b, i/10)
	}
	return append(b, byte('0'+i%10))
}

// waitsForRoom reports whether partition p's reader waits for Next to make room in the
// prefetch (Consumer.deliver): it fetches nothing more until Next is called.
func waitsForRoom(c *Consumer, p int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	ps := c.parts[p]
	return ps != nil && ps.waiting
}

// TestPrefetchIsBounded: while Next is not called, the readers fetch and decode ahead, but no
// more than 2 x MaxRecordsBacklog records plus one fetch; Next then drains them and the readers
// go on.
func TestPrefetchIsBounded(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	const n = 3000
	values := goodRecords("r", n)
	for i := 0; i < n; i += 50 { // small batches: a fetch returns whole batches
		produce(t, conn, recordsTopic, 0, values[i:i+50]...)
	}
	cfg := consumerConfig(conn, "prefetch")
	cfg.MaxRecords, cfg.MaxRecordsBacklog = 50, 100
	cfg.FetchMaxBytes = 4 << 10 // ~60 records per fetch
	c := newConsumer(t, cfg)
	overfull := func(s Stats) bool {
		return s.Pending >= int64(2*cfg.MaxRecordsBacklog+100) || s.Fetched > int64(2*cfg.MaxRecordsBacklog+200) // one fetch is ~60 records
	}
	// Until Next is called, the reader stops for good once it waits for room: what it fetched by
	// then is all it ever fetches.
	waitfor.Cond(t, 20*time.Second, "the reader to wait for room", func() bool { return waitsForRoom(c, 0) || overfull(c.Stats()) })
	s := c.Stats()
	if overfull(s) {
		t.Fatalf("prefetched %d records (fetched %d) with MaxRecordsBacklog %d", s.Pending, s.Fetched, cfg.MaxRecordsBacklog)
	}
	if s.Pending < int64(2*cfg.MaxRecordsBacklog-70) {
		t.Fatalf("the reader waits for room with %d records prefetched, MaxRecordsBacklog %d", s.Pending, cfg.MaxRecordsBacklog)
	}
	if h := c.Health(); !h.Ready {
		t.Fatalf("a consumer waiting for Next is not ready: %v", h.Reasons)
	}
	t.Logf("prefetched %d records, fetched %d, lag %d", s.Pending, s.Fetched, s.Lag)
	if got := ids(collect(t, c, n, 30*time.Second)); !slices.Equal(got, goodRecordIDs("r", n)) {
		t.Fatal("records out of order, lost or doubled after draining the prefetch")
	}
}

// TestPrefetchOfDeadLettersIsBounded: dead letters count in the prefetch's bound as records do,
// so that a stream of bad records is not fetched and written to the dead-letter topic without
// limit ahead of Next (and of the checkpoint: a crash writes again what is ahead); drained, every
// one is handed out once.
func TestPrefetchOfDeadLettersIsBounded(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	const n = 3000
	bad := make([]string, n)
	for i := range bad {
		bad[i] = `{"id":"bad"}`
	}
	for i := 0; i < n; i += 50 {
		produce(t, conn, recordsTopic, 0, bad[i:i+50]...)
	}
	cfg := consumerConfig(conn, "prefetch-dead")
	cfg.MaxRecords, cfg.MaxRecordsBacklog = 50, 100
	cfg.FetchMaxBytes = 1 << 10 // one batch of 50 bad records per fetch
	cfg.MaxWait = 100 * time.Millisecond
	c := newConsumer(t, cfg)
	written := func() int64 {
		var d int64
		for _, v := range c.Stats().DeadLettered {
			d += v
		}
		return d
	}
	overfull := func() bool {
		return c.Stats().Fetched > int64(2*cfg.MaxRecordsBacklog+100) || written() > int64(2*cfg.MaxRecordsBacklog+100)
	}
	waitfor.Cond(t, 20*time.Second, "the reader to wait for room", func() bool { return waitsForRoom(c, 0) || overfull() })
	if overfull() {
		t.Fatalf("fetched %d and dead-lettered %d bad records ahead of Next with MaxRecordsBacklog %d", c.Stats().Fetched, written(), cfg.MaxRecordsBacklog)
	}
	if written() < int64(2*cfg.MaxRecordsBacklog-70) {
		t.Fatalf("the reader waits for room with %d dead letters written, MaxRecordsBacklog %d", written(), cfg.MaxRecordsBacklog)
	}
	t.Logf("ahead of Next: fetched %d, dead-lettered %d", c.Stats().Fetched, written())
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	handed := 0
	for handed < n {
		inc, err := c.Next(ctx)
		if err != nil {
			t.Fatalf("Next after %d of %d dead letters: %v", handed, n, err)
		}
		if len(inc.Records) != 0 {
			t.Fatalf("%d good records among bad ones", len(inc.Records))
		}
		handed += inc.DeadLettered
	}
	if handed != n || written() != n {
		t.Errorf("%d dead letters handed out and %d written, want %d each", handed, written(), n)
	}
}

// TestGapReportedOnce: a checkpoint below the partition's log start offset (retention deleted
// records while the daemon was down) is not skipped silently: the first increment carries the
// gap, NextOffsets is past it, Stats.Lost counts it, and one ERROR line names the range.
func TestGapReportedOnce(t *testing.T) {
	conn, start := retainedLog(t)
	log, lines := newLogLines(t)
	cfg := consumerConfig(conn, "gap")
	cfg.Resume = map[int]int64{0: 5}
	cfg.MaxRecordsBacklog = 5000
	c, err := NewConsumer(context.Background(), cfg, testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	incs := collect(t, c, int(2000-start), 20*time.Second)
	want := Gap{Partition: 0, From: 5, To: start}
	if g := incs[0].Gaps; len(g) != 1 || g[0] != want || incs[0].Lost() != start-5 {
		t.Fatalf("first increment's gaps %v, want [%v]", g, want)
	}
	if first := incs[0].Records[0]; first.Offset != start {
		t.Fatalf("first record at offset %d, want the log start %d", first.Offset, start)
	}
	if next := checkpoint(incs); next[0] != 2000 {
		t.Fatalf("next offset %d, want 2000", next[0])
	}
	if s := c.Stats(); s.Lost != start-5 {
		t.Fatalf("Stats().Lost = %d, want %d", s.Lost, start-5)
	}
	if n := lines.count(slog.LevelError, "deleted by the broker"); n != 1 || lines.atLeast(slog.LevelError) != 1 {
		t.Fatalf("%d ERROR lines about the gap (%d in all), want 1", n, lines.atLeast(slog.LevelError))
	}
	if v, _ := lines.attr(slog.LevelError, "deleted by the broker", "lost"); v.Int64() != start-5 {
		t.Fatalf("the ERROR line says %v records lost, want %d", v, start-5)
	}
	// A consumer without a checkpoint starts at the log start: nothing is lost.
	cfg.Resume, cfg.GroupID = nil, "gap-fresh"
	c2 := newConsumer(t, cfg)
	if incs := collect(t, c2, int(2000-start), 20*time.Second); len(incs[0].Gaps) != 0 || c2.Stats().Lost != 0 {
		t.Fatalf("a consumer without a checkpoint reported gaps %v", incs[0].Gaps)
	}
}

// TestFullIncrementsDoNotWaitForRoom: when a fetch brings more records than the prefetch has
// room for, Next must still complete increments of MaxRecords at once, not after MaxWait (the
// reader may not wait for room that the increment Next is building holds).
func TestFullIncrementsDoNotWaitForRoom(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	// Batches of 1900, one per fetch: after an increment of 1000 from the first, 900 are left,
	// fewer than MaxRecords, and 900 + 1900 is more than the 2000 the prefetch holds.
	const batch = 1900
	values := goodRecords("r", 3*batch)
	for i := 0; i < len(values); i += batch {
		produce(t, conn, recordsTopic, 0, values[i:i+batch]...)
	}
	cfg := consumerConfig(conn, "room")
	// MaxWait is an hour, so an increment that waited for it (or for room) would not come back
	// before the context's end: "at once" is told apart by the outcome, not by a clock.
	cfg.MaxRecords, cfg.MaxRecordsBacklog, cfg.MaxWait = 1000, 1000, time.Hour
	cfg.FetchMaxBytes = 1 << 10 // a fetch returns one whole batch
	c := newConsumer(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for got := 0; got < 5000; {
		inc, err := c.Next(ctx)
		if err != nil {
			t.Fatalf("after %d records: %v (an increment waited for MaxWait or for room)", got, err)
		}
		if len(inc.Records) != 1000 {
			t.Fatalf("after %d records: an increment of %d; want 1000 at once", got, len(inc.Records))
		}
		got += len(inc.Records)
	}
}

// retainedLog is a broker whose retention deleted the first records of the input topic's
// partition 0: 2000 records produced, the log starting at start (0 < start < 2000).
func retainedLog(t *testing.T) (ConnConfig, int64) {
	t.Helper()
	b := startBroker(t, broker.Config{RetentionBytes: 64 << 10, RetentionCheckInterval: time.Hour})
	conn := plainConn(b)
	for range 20 { // 20 batches of 100 small records, ~8 KB each: retention keeps the last few
		produce(t, conn, recordsTopic, 0, goodRecords("r", 100)...)
	}
	b.ApplyRetention()
	start := b.LogStartOffsets(recordsTopic)[0]
	if start == 0 || start >= 2000 {
		t.Fatalf("log start offset %d after retention; the test needs 0 < start < 2000", start)
	}
	return conn, start
}
