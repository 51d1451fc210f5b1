package stream

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// groupOffsets is what Kafka tooling sees of a group: its committed offsets for the records
// topic (-1 where none), read with OffsetFetch as consumer-group describe does.
func groupOffsets(t testing.TB, conn ConnConfig, group string, partitions ...int) map[int]int64 {
	t.Helper()
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(conn.Brokers...), Timeout: 5 * time.Second}
	res, err := cl.OffsetFetch(context.Background(), &kafka.OffsetFetchRequest{GroupID: group,
		Topics: map[string][]int{recordsTopic: partitions}})
	out := map[int]int64{}
	if err == nil && errors.Is(res.Error, kafka.GroupIdNotFound) { // nothing committed yet
		for _, p := range partitions {
			out[p] = -1
		}
		return out
	}
	if err != nil || res.Error != nil {
		t.Fatalf("OffsetFetch(%s): %v %v", group, err, res.Error)
	}
	for _, p := range res.Topics[recordsTopic] {
		out[p.Partition] = p.CommittedOffset
	}
	return out
}

// describeGroup returns a group's state and member count.
func describeGroup(t testing.TB, conn ConnConfig, group string) (string, int) {
	t.Helper()
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(conn.Brokers...), Timeout: 5 * time.Second}
	res, err := cl.DescribeGroups(context.Background(), &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
	if err != nil || len(res.Groups) != 1 {
		t.Fatalf("DescribeGroups(%s): %v %+v", group, err, res)
	}
	return res.Groups[0].GroupState, len(res.Groups[0].Members)
}

// TestGroupCommitsFollowMarkDurable: nothing is committed to the group before MarkDurable;
// after it the broker (kfake) stores the offsets of the consumer, which never joins the group
// (OffsetCommit with generation -1 and no member id), so tooling sees its lag. Commits are
// asynchronous and coalesced: three increments marked durable at once make fewer commits.
func TestGroupCommitsFollowMarkDurable(t *testing.T) {
	b := startBroker(t, broker.Config{Topics: []string{recordsTopic, deadTopic}, Partitions: 2})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("p0-", 20)...)
	produce(t, conn, recordsTopic, 1, goodRecords("p1-", 10)...)
	cfg := consumerConfig(conn, "durable")
	cfg.MaxRecords, cfg.MaxRecordsBacklog = 10, 10
	cfg.CommitInterval = 500 * time.Millisecond
	c := newConsumer(t, cfg)
	incs := collect(t, c, 30, 20*time.Second)
	time.Sleep(300 * time.Millisecond)
	if got := groupOffsets(t, conn, "durable", 0, 1); got[0] != -1 || got[1] != -1 {
		t.Fatalf("group offsets %v before MarkDurable, want none", got)
	}
	for _, inc := range incs {
		c.MarkDurable(inc)
	}
	// The consumer records a commit once the broker has acknowledged it: wait for that, then the
	// broker must hold the offsets. (Waiting on the broker and then reading the stats raced with
	// the commit goroutine's bookkeeping after the acknowledgement.)
	waitfor.Cond(t, 10*time.Second, "the consumer's acknowledged commits", func() bool {
		s := c.Stats()
		return s.Committed[0] == 20 && s.Committed[1] == 10
	})
	got := groupOffsets(t, conn, "durable", 0, 1)
	if got[0] != 20 || got[1] != 10 {
		t.Fatalf("group offsets %v after the consumer saw its commits acknowledged, want [20 10]", got)
	}
	s := c.Stats()
	if s.Commits < 1 || s.Commits >= int64(len(incs)) {
		t.Fatalf("%d increments marked durable made %d commits (want fewer: coalesced), committed %v", len(incs), s.Commits, s.Committed)
	}
	if state, members := describeGroup(t, conn, "durable"); members != 0 {
		t.Fatalf("group state %s with %d members: the consumer joined it", state, members)
	}
	// The lag Kafka tooling shows is the high watermark minus the group's committed offset.
	if hw := b.HighWatermarks(recordsTopic); hw[0]-got[0] != 0 || hw[1]-got[1] != 0 {
		t.Fatalf("high watermarks %v, group offsets %v: lag %d and %d, want 0", hw, got, hw[0]-got[0], hw[1]-got[1])
	}
}

// TestCloseCommitsDurableOffsets: offsets marked durable just before Close are committed by
// Close itself.
func TestCloseCommitsDurableOffsets(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("r", 7)...)
	cfg := consumerConfig(conn, "closing")
	cfg.MaxRecords, cfg.MaxRecordsBacklog = 1, 1 // seven increments
	cfg.CommitInterval = time.Hour               // the loop commits once; the rest waits for Close
	c, err := NewConsumer(context.Background(), cfg, testSchema(t), testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	incs := collect(t, c, 7, 20*time.Second)
	// The loop's one commit carries the first increment only, so the other six can only reach
	// the group through Close.
	c.MarkDurable(incs[0])
	waitfor.Cond(t, 10*time.Second, "the commit loop's first commit", func() bool { return c.Stats().Commits == 1 })
	for _, inc := range incs[1:] {
		c.MarkDurable(inc)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if got := groupOffsets(t, conn, "closing", 0); got[0] != 7 {
		t.Fatalf("group offset %d after Close, want 7", got[0])
	}
}

// TestGroupWithMembersRefusesCommits: when kafka.group_id is shared with a group that has an
// active member (here a kafka-go group reader), the broker refuses the simple commits. The
// consumer reads on, logs one WARN that names the cause, and keeps retrying quietly.
func TestGroupWithMembersRefusesCommits(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("r", 3)...)
	member := kafka.NewReader(kafka.ReaderConfig{Brokers: conn.Brokers, GroupID: "shared", Topic: recordsTopic, MaxWait: kafkatest.MaxWait})
	defer member.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := member.FetchMessage(ctx); err != nil { // it has joined once it reads
		t.Fatal(err)
	}
	log, lines := newLogLines(t)
	cfg := consumerConfig(conn, "shared")
	cfg.CommitInterval, cfg.RetryMax = 100*time.Millisecond, 200*time.Millisecond
	c, err := NewConsumer(context.Background(), cfg, testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	incs := collect(t, c, 3, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, []string{"r0", "r1", "r2"}) {
		t.Fatalf("read %v", got)
	}
	c.MarkDurable(incs[len(incs)-1])
	waitfor.Cond(t, 10*time.Second, "refused commits", func() bool { return c.Stats().Retries >= 3 })
	if n := lines.count(slog.LevelWarn, "group offset commits failing"); n != 1 {
		t.Fatalf("%d WARN lines about the refused commits, want 1", n)
	}
	if v, _ := lines.attr(slog.LevelWarn, "group offset commits failing", "err"); !containsAll(v.String(), "kafka.group_id must be unique", "shared") {
		t.Fatalf("the WARN line does not say why: %s", v)
	}
	if s := c.Stats(); s.Commits != 0 {
		t.Fatalf("%d commits accepted by a group with a member", s.Commits)
	}
}

func containsAll(s string, subs ...string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}
