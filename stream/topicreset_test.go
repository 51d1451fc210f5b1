package stream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// nextErr calls Next until it returns an error (failing if records arrive meanwhile).
func nextErr(t *testing.T, c *Consumer, within time.Duration) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	for {
		inc, err := c.Next(ctx)
		if err != nil {
			return err
		}
		if len(inc.Records) > 0 {
			t.Fatalf("records handed out from a reset partition: %v", ids([]*Increment{inc}))
		}
	}
}

// wantReset checks that err is the consumer's stop by a TopicResetError of partition 0.
func wantReset(t *testing.T, err error, offset, end int64) *TopicResetError {
	t.Helper()
	var re *TopicResetError
	if !errors.Is(err, ErrStopped) || !errors.As(err, &re) {
		t.Fatalf("Next: %v, want ErrStopped with a TopicResetError", err)
	}
	if re.Topic != recordsTopic || re.Partition != 0 || re.Offset != offset || re.End != end || re.LogStart != 0 {
		t.Fatalf("reset %+v, want topic %s partition 0 offset %d log [0, %d)", re, recordsTopic, offset, end)
	}
	for _, s := range []string{recordsTopic, "partition 0", "AcceptTopicReset"} {
		if !strings.Contains(err.Error(), s) {
			t.Fatalf("error %q does not name %q", err, s)
		}
	}
	return re
}

// TestCheckpointPastTheEnd: a checkpoint beyond the partition's end (the topic was recreated,
// or the broker lost records) stops the consumer with a TopicResetError naming the topic,
// partition and offsets, one ERROR line and Health not ready; it neither reads backwards nor
// waits for the log to reach its position (which would skip the records below it in
// silence). With AcceptTopicReset the partition is read from its log start.
func TestCheckpointPastTheEnd(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("new", 10)...)
	log, lines := newLogLines(t)
	cfg := consumerConfig(conn, "ahead")
	cfg.Resume = map[int]int64{0: 30}
	c, err := NewConsumer(context.Background(), cfg, testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	wantReset(t, nextErr(t, c, 20*time.Second), 30, 10)
	if h := c.Health(); h.Ready || !slices.ContainsFunc(h.Reasons, func(s string) bool { return strings.Contains(s, "was reset") }) {
		t.Fatalf("health %+v, want not ready naming the reset", h)
	}
	if n := lines.count(slog.LevelError, "retrying cannot fix"); n != 1 {
		t.Fatalf("%d ERROR lines, want 1", n)
	}

	// The operator confirms: the partition is read from its log start, and the increments
	// carry the new offsets to checkpoint.
	cfg.AcceptTopicReset = true
	c2 := newConsumer(t, cfg)
	incs := collect(t, c2, 10, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, goodIDs("new", 10)) {
		t.Fatalf("after the confirmation read %v, want new0..new9", got)
	}
	if off := checkpoint(incs)[0]; off != 10 {
		t.Fatalf("checkpoint offset %d after the accepted reset, want 10", off)
	}
	// Records past the old position: the confirmed consumer reads them, the stopped one not.
	produce(t, conn, recordsTopic, 0, goodRecords("more", 25)...) // offsets 10..34
	incs = collect(t, c2, 25, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, goodIDs("more", 25)) || checkpoint(incs)[0] != 35 {
		t.Fatalf("read %v up to offset %d, want more0..more24 up to 35", got, checkpoint(incs)[0])
	}
	if err := nextErr(t, c, time.Second); !errors.Is(err, ErrStopped) {
		t.Fatalf("the stopped consumer's Next after more records: %v, want ErrStopped", err)
	}
	if n := lines.count(slog.LevelError, "retrying cannot fix"); n != 1 {
		t.Fatalf("%d ERROR lines, want 1", n)
	}
}

func goodIDs(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = prefix + strconv.Itoa(i)
	}
	return out
}

// readThenRecreate reads n records of a new broker's topic with a consumer of group, then
// deletes and recreates the topic, produces m other records to it, and returns the consumer's
// configuration, the consumer and the error its Next returns (failing if records arrive).
func readThenRecreate(t *testing.T, group string, n, m int) (ConsumerConfig, *Consumer, error) {
	t.Helper()
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("old", n)...)
	cfg := consumerConfig(conn, group)
	c := newConsumer(t, cfg)
	if got := ids(collect(t, c, n, 20*time.Second)); len(got) != n {
		t.Fatalf("read %d records, want %d", len(got), n)
	}
	waitfor.Cond(t, 10*time.Second, "the consumer to be caught up", func() bool { return c.Health().CaughtUp })
	kafkatest.RecreateTopic(t, conn.Brokers, recordsTopic, 1)
	produce(t, conn, recordsTopic, 0, goodRecords("new", m)...)
	return cfg, c, nextErr(t, c, 30*time.Second)
}

// TestAcceptTopicResetCoversItsStartOnly: a consumer started with AcceptTopicReset that read
// records finds the topic recreated while it runs: that reset is a new one, found after its
// start, and stops it as without the confirmation.
func TestAcceptTopicResetCoversItsStartOnly(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("old", 30)...)
	cfg := consumerConfig(conn, "accepting")
	cfg.AcceptTopicReset = true
	c := newConsumer(t, cfg)
	if got := ids(collect(t, c, 30, 20*time.Second)); len(got) != 30 {
		t.Fatalf("read %d records, want 30", len(got))
	}
	waitfor.Cond(t, 10*time.Second, "the consumer to be caught up", func() bool { return c.Health().CaughtUp })
	kafkatest.RecreateTopic(t, conn.Brokers, recordsTopic, 1)
	produce(t, conn, recordsTopic, 0, goodRecords("new", 80)...)
	err := nextErr(t, c, 30*time.Second)
	var re *TopicResetError
	if !errors.As(err, &re) || !errors.Is(err, ErrStopped) {
		t.Fatalf("a reset found while running, with AcceptTopicReset: Next = %v, want the consumer stopped with a TopicResetError", err)
	}
}

// TestRecreatedTopicStopsTheConsumer: N records read, the topic deleted and recreated, M > N
// records produced to the new topic (so that the old position is inside the new log): the
// consumer stops with a TopicResetError and hands out nothing of the new topic.
func TestRecreatedTopicStopsTheConsumer(t *testing.T) {
	const n, m = 30, 80
	cfg, c, err := readThenRecreate(t, "recreated", n, m)
	// The consumer may fetch between the recreation and the produce: it then finds the new
	// partition empty, past-the-end (end 0), a reset too. Otherwise the new log holds offset n
	// and only the record read last tells: end m. Either way nothing of the new topic is read.
	var re *TopicResetError
	if errors.As(err, &re) && re.End == 0 {
		re = wantReset(t, err, n, 0)
	} else {
		re = wantReset(t, err, n, m)
	}
	t.Logf("%v", re)
	if h := c.Health(); h.Ready {
		t.Fatalf("health ready after a reset: %+v", h)
	}

	// A consumer started from the checkpoint (offset n, inside the new log: offsets alone
	// cannot tell) with the reset confirmed reads the whole new log.
	cfg.Resume, cfg.ResetPartitions = map[int]int64{0: n}, []int{0}
	c2 := newConsumer(t, cfg)
	incs := collect(t, c2, m, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, goodIDs("new", m)) || checkpoint(incs)[0] != m || !incs[0].Reset(0) {
		t.Fatalf("after the confirmation read %d records up to offset %d (first increment a reset: %v), want new0..new%d up to %d",
			len(got), checkpoint(incs)[0], incs[0].Reset(0), m-1, m)
	}
}

// TestRecreatedAsLongStopsTheConsumer: n records read, the topic deleted and recreated, and
// exactly n records produced to the new topic, so that no record lies past the reader's
// position and a fetch there brings nothing: the consumer stops with a TopicResetError all the
// same, without waiting for a record past the old position, instead of taking the new log's n
// records for read.
func TestRecreatedAsLongStopsTheConsumer(t *testing.T) {
	const n = 30
	_, _, err := readThenRecreate(t, "as-long", n, n)
	// Fetched between the recreation and the produce, the new partition is empty: a reset
	// past its end (end 0). Otherwise the record at offset n-1 tells: end n.
	var re *TopicResetError
	if errors.As(err, &re) && re.End == 0 {
		wantReset(t, err, n, 0)
	} else {
		wantReset(t, err, n, n)
	}
}

// resumePoint folds increments as the daemon checkpoints them: the last offset and the last
// mark per partition (a reset forgets the mark of the old log).
func resumePoint(incs []*Increment) (map[int]int64, map[int]RecordMark) {
	next, marks := map[int]int64{}, map[int]RecordMark{}
	for _, inc := range incs {
		for p, off := range inc.NextOffsets {
			next[p] = off
			if m, ok := inc.Mark(p); ok {
				marks[p] = m
			} else if inc.Reset(p) {
				delete(marks, p)
			}
		}
	}
	return next, marks
}

// TestRecreatedWhileStopped: n records read and checkpointed with their mark, the consumer
// stopped, the topic deleted and recreated, m > n records produced (the checkpoint's offset is
// inside the new log, so offsets cannot tell): the next consumer, started from the checkpoint,
// finds that the partition holds another record at the mark's offset and stops with a
// TopicResetError before handing out anything. The new records may be other data, or the same
// keys and values written again (a replay), which only their timestamps tell apart. With
// AcceptTopicReset it reads the new log from its start, and its increments carry a mark of the
// new log.
func TestRecreatedWhileStopped(t *testing.T) {
	for _, tc := range []struct {
		name, prefix, why string
	}{
		{"other data", "new", "its key or value differs"},
		{"same data replayed", "old", "it has the same key and value, written at"},
	} {
		t.Run(tc.name, func(t *testing.T) { recreatedWhileStopped(t, tc.prefix, tc.why) })
	}
}

func recreatedWhileStopped(t *testing.T, prefix, why string) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	const n, m = 30, 80
	produce(t, conn, recordsTopic, 0, goodRecords("old", n)...)
	cfg := consumerConfig(conn, "stopped")
	c := newConsumer(t, cfg)
	next, marks := resumePoint(collect(t, c, n, 20*time.Second))
	if next[0] != n || marks[0].Offset != n-1 {
		t.Fatalf("checkpoint offset %d with mark %+v, want %d with a mark at %d", next[0], marks[0], n, n-1)
	}
	c.Close()

	kafkatest.RecreateTopic(t, conn.Brokers, recordsTopic, 1)
	// Timestamps have millisecond resolution: the replay must not share the old record's.
	waitfor.Cond(t, time.Second, "a new millisecond", func() bool { return time.Now().UnixMilli() > marks[0].Timestamp })
	produce(t, conn, recordsTopic, 0, goodRecords(prefix, m)...)
	log, lines := newLogLines(t)
	cfg.Resume, cfg.ResumeMarks = next, marks
	c2, err := NewConsumer(context.Background(), cfg, testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	re := wantReset(t, nextErr(t, c2, 20*time.Second), n, m)
	if !strings.Contains(re.Why, "offset 29 is not the one read there") || !strings.Contains(re.Why, why) {
		t.Fatalf("reset %q does not say which record differs and how (%q)", re.Why, why)
	}
	if h := c2.Health(); h.Ready {
		t.Fatalf("health ready after a reset: %+v", h)
	}
	if n := lines.count(slog.LevelError, "retrying cannot fix"); n != 1 {
		t.Fatalf("%d ERROR lines, want 1", n)
	}

	cfg.AcceptTopicReset = true
	c3 := newConsumer(t, cfg)
	incs := collect(t, c3, m, 20*time.Second)
	next, marks = resumePoint(incs)
	if got := ids(incs); !slices.Equal(got, goodIDs(prefix, m)) || next[0] != m || !incs[0].Reset(0) {
		t.Fatalf("after the confirmation read %d records up to offset %d (first increment a reset: %v), want %s0..%s%d up to %d",
			len(got), next[0], incs[0].Reset(0), prefix, prefix, m-1, m)
	}
	if marks[0].Offset != m-1 {
		t.Fatalf("mark %+v after reading the new log, want one at offset %d", marks[0], m-1)
	}
}

// TestResetForgetsTheOldMark: an increment that holds a fetch of the old log and then the
// partition's reset to a new log carries no mark of the old log: its offset counts in the new.
func TestResetForgetsTheOldMark(t *testing.T) {
	var p pending
	old := markOf(41, []byte("k"), []byte("v"), time.UnixMilli(5))
	p.take(&chunk{part: 0, at: time.Now(), next: 42, last: old, recs: []Record{{Partition: 0, Offset: 41}}}, 100)
	p.take(&chunk{part: 0, at: time.Now(), next: 0, reset: true}, 100)
	p.take(&chunk{part: 1, at: time.Now(), next: 8, last: markOf(7, nil, []byte("w"), time.UnixMilli(6)), recs: []Record{{Partition: 1, Offset: 7}}}, 100)
	inc := &Increment{NextOffsets: p.next, resets: p.reset, marks: p.marks}
	if m, ok := inc.Mark(0); ok || !inc.Reset(0) || inc.NextOffsets[0] != 0 {
		t.Fatalf("partition 0: mark %+v (%v), reset %v, offset %d; want no mark, a reset to 0", m, ok, inc.Reset(0), inc.NextOffsets[0])
	}
	if m, ok := inc.Mark(1); !ok || m.Offset != 7 {
		t.Fatalf("partition 1: mark %+v (%v), want the one at offset 7", m, ok)
	}
}

// TestRestartKeepsTheLog: a consumer started from a checkpoint with its mark, on the same topic
// written on meanwhile, reads on from the checkpoint: the mark matches, no false alarm.
func TestRestartKeepsTheLog(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	const n, k = 30, 45
	produce(t, conn, recordsTopic, 0, goodRecords("old", n)...)
	cfg := consumerConfig(conn, "restart")
	c := newConsumer(t, cfg)
	cfg.Resume, cfg.ResumeMarks = resumePoint(collect(t, c, n, 20*time.Second))
	c.Close()

	produce(t, conn, recordsTopic, 0, goodRecords("more", k)...)
	log, lines := newLogLines(t)
	c2, err := NewConsumer(context.Background(), cfg, testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	incs := collect(t, c2, k, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, goodIDs("more", k)) || checkpoint(incs)[0] != n+k {
		t.Fatalf("after the restart read %v up to offset %d, want more0..more%d up to %d", got, checkpoint(incs)[0], k-1, n+k)
	}
	if e, i := lines.atLeast(slog.LevelWarn), lines.count(slog.LevelInfo, "identity"); e != 0 || i != 0 {
		t.Fatalf("%d WARN or ERROR lines and %d INFO lines about the topic's identity, want none", e, i)
	}
}

// TestRestartKeepsTheLogOfEveryPartition: on two partitions of different lengths, a restart
// checks each partition's mark against that partition (no reset found), and reads on from each
// checkpoint; records without an id are named by their own partition and offset.
func TestRestartKeepsTheLogOfEveryPartition(t *testing.T) {
	b := startBroker(t, broker.Config{Partitions: 2})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("a", 30)...)
	produce(t, conn, recordsTopic, 1, goodRecords("b", 20)...)
	cfg := consumerConfig(conn, "restart-two")
	c := newConsumer(t, cfg)
	cfg.Resume, cfg.ResumeMarks = resumePoint(collect(t, c, 50, 20*time.Second))
	c.Close()
	if len(cfg.ResumeMarks) != 2 || cfg.ResumeMarks[0].Offset != 29 || cfg.ResumeMarks[1].Offset != 19 {
		t.Fatalf("marks %+v, want one per partition at offsets 29 and 19", cfg.ResumeMarks)
	}

	anonymous := func(n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf(`{"features":[%d,1.5,-2],"label":%d}`, i, i%2)
		}
		return out
	}
	produce(t, conn, recordsTopic, 0, anonymous(3)...)
	produce(t, conn, recordsTopic, 1, anonymous(3)...)
	log, lines := newLogLines(t)
	c2, err := NewConsumer(context.Background(), cfg, testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	incs := collect(t, c2, 6, 20*time.Second)
	got := ids(incs)
	slices.Sort(got)
	want := []string{"records/0/30", "records/0/31", "records/0/32", "records/1/20", "records/1/21", "records/1/22"}
	if cp := checkpoint(incs); !slices.Equal(got, want) || cp[0] != 33 || cp[1] != 23 {
		t.Fatalf("after the restart read %v up to %v, want %v up to offsets 33 and 23", got, cp, want)
	}
	if e, i := lines.atLeast(slog.LevelWarn), lines.count(slog.LevelInfo, "identity"); e != 0 || i != 0 {
		t.Fatalf("%d WARN or ERROR lines and %d INFO lines about the topic's identity, want none", e, i)
	}
}

// TestRetentionDeletedTheMarkedRecord: the checkpoint's marked record was deleted by retention
// while the consumer was stopped, but the log reaches the checkpoint's offset: that is no
// reset, and the record cannot be compared. The consumer says so at INFO and reads on from
// the checkpoint (the mark here matches no record at all, so a comparison with any record
// would have cried wolf).
func TestRetentionDeletedTheMarkedRecord(t *testing.T) {
	conn, start := retainedLog(t)
	log, lines := newLogLines(t)
	cfg := consumerConfig(conn, "retained")
	cfg.Resume = map[int]int64{0: start}
	cfg.ResumeMarks = map[int]RecordMark{0: {Offset: start - 1, Timestamp: 1, Sum: 1}}
	cfg.MaxRecordsBacklog = 5000
	c, err := NewConsumer(context.Background(), cfg, testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	incs := collect(t, c, int(2000-start), 20*time.Second)
	if first := incs[0].Records[0]; first.Offset != start || checkpoint(incs)[0] != 2000 || len(incs[0].Gaps) != 0 {
		t.Fatalf("read from offset %d to %d (gaps %v), want %d to 2000 without a gap", first.Offset, checkpoint(incs)[0], incs[0].Gaps, start)
	}
	if n := lines.count(slog.LevelInfo, "could not be checked"); n != 1 || lines.atLeast(slog.LevelWarn) != 0 {
		t.Fatalf("%d INFO lines saying the identity could not be checked, %d WARN or ERROR lines; want 1 and 0", n, lines.atLeast(slog.LevelWarn))
	}
}
