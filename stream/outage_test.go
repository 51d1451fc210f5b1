package stream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestBrokerRestart stops the broker under a running consumer and starts it again on the
// same address and data directory: Next rides out the outage (kafka-go reconnects) and delivers
// exactly what is produced afterwards, without delivering again what it handed out before.
func TestBrokerRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("broker restart takes a few seconds")
	}
	dir := t.TempDir()
	port := testnet.Reserve(t) // the same address across the restart, nobody else's meanwhile
	cfg := broker.Config{Listen: port.Addr(), DataDir: dir, Topics: []string{recordsTopic, deadTopic}}
	cfg.Listener = port.Listen(t)
	b := startBroker(t, cfg)
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("before", 3)...)
	ccfg := consumerConfig(conn, "restart")
	c := newConsumer(t, ccfg)
	for _, inc := range collect(t, c, 3, 20*time.Second) {
		c.MarkDurable(inc)
	}

	b.Close()
	got := make(chan []string, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		var out []string
		for len(out) < 2 {
			inc, err := c.Next(ctx)
			if err != nil {
				t.Errorf("Next across the outage: %v", err)
				break
			}
			for _, r := range inc.Records {
				out = append(out, r.ID)
			}
		}
		got <- out
	}()
	cfg.Listener = port.Listen(t)
	b2 := startBroker(t, cfg)
	produce(t, plainConn(b2), recordsTopic, 0, goodRecords("after", 2)...)
	select {
	case ids := <-got:
		if !slices.Equal(ids, []string{"after0", "after1"}) {
			t.Fatalf("after the restart got %v, want [after0 after1]", ids)
		}
	case <-time.After(70 * time.Second):
		t.Fatal("no records within 70s of the broker restart")
	}
	t.Logf("consumer stats after the outage: %+v", c.Stats())
}

// TestDeadLetterTopicMissing: while the dead-letter topic cannot be written, Next retries and
// hands out nothing (so nothing can be committed past the bad record); once the topic exists
// the same increment comes out, the bad record dead-lettered and the good one decoded.
func TestDeadLetterTopicMissing(t *testing.T) {
	b := startBroker(t, broker.Config{Topics: []string{recordsTopic}})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, `{"id":"bad"}`, goodRecord("good", 1))
	c := newConsumer(t, consumerConfig(conn, "nodlq"))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if inc, err := c.Next(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Next without a dead-letter topic = %+v, %v; want DeadlineExceeded", inc, err)
	}
	if s := c.Stats(); s.Retries == 0 || s.DeadLettered[ReasonMissingField] != 0 || s.Increments != 0 {
		t.Fatalf("stats while the dead-letter topic is missing: %+v", s)
	}
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(conn.Brokers...)}
	res, err := cl.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{Topic: deadTopic, NumPartitions: 1, ReplicationFactor: 1}}})
	if err != nil || res.Errors[deadTopic] != nil {
		t.Fatalf("creating %s: %v %v", deadTopic, err, res.Errors)
	}
	incs := collect(t, c, 1, 30*time.Second)
	if got := ids(incs); !slices.Equal(got, []string{"good"}) || incs[0].DeadLettered != 1 || incs[0].NextOffsets[0] != 2 {
		t.Fatalf("after creating the topic: %v, %d dead letters, next %v", got, incs[0].DeadLettered, incs[0].NextOffsets)
	}
	if m := readTopic(t, conn, deadTopic, 1)[0]; header(m, HeaderReason) != ReasonMissingField {
		t.Fatalf("dead letter reason %q", header(m, HeaderReason))
	}
}

// TestDeadLetterTooLargeForTheTopicStops: a dead letter larger than the dead-letter topic's
// max.message.bytes, alone in its request, is a configuration error: the consumer stops with
// an error that names the source record, the topic and the size to allow, and hands out
// nothing past the record.
func TestDeadLetterTooLargeForTheTopicStops(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	kafkatest.SetTopicConfig(t, conn.Brokers, deadTopic, "max.message.bytes", "1000")
	produce(t, conn, recordsTopic, 0, goodRecord("before", 0), `{"id":"big","pad":"`+strings.Repeat("x", 1000)+`"}`, goodRecord("after", 2))
	c := newConsumer(t, consumerConfig(conn, "toolarge"))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var got []string
	var err error
	for err == nil {
		var inc *Increment
		if inc, err = c.Next(ctx); err == nil {
			got = append(got, ids([]*Increment{inc})...)
		}
	}
	if !errors.Is(err, ErrStopped) || !errors.Is(err, kafka.MessageSizeTooLarge) {
		t.Fatalf("Next: %v; want ErrStopped for MessageSizeTooLarge", err)
	}
	for _, want := range []string{"records partition 0 offset 1", "dead-letter topic " + deadTopic, "max.message.bytes to 1"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if slices.Contains(got, "after") || c.Stats().DeadLettered[ReasonTooLarge] != 0 {
		t.Fatalf("handed out %v, %v dead letters counted: past the record that was not dead-lettered", got, c.Stats().DeadLettered)
	}
	if h := c.Health(); h.Ready {
		t.Fatalf("health %+v after the stop", h)
	}
}

// TestDeadLettersTooLargeTogetherAreWrittenOneByOne: dead letters that fit the dead-letter
// topic's max.message.bytes one by one, but not in one record batch, are all written.
func TestDeadLettersTooLargeTogetherAreWrittenOneByOne(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	kafkatest.SetTopicConfig(t, conn.Brokers, deadTopic, "max.message.bytes", "2000")
	bad := `{"id":"big","pad":"` + strings.Repeat("x", 1000) + `"}`
	produce(t, conn, recordsTopic, 0, bad, bad, bad, goodRecord("after", 3))
	c := newConsumer(t, consumerConfig(conn, "onebyone"))
	incs := collect(t, c, 1, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, []string{"after"}) || incs[0].DeadLettered != 3 || c.Stats().DeadLettered[ReasonTooLarge] != 3 {
		t.Fatalf("got %v with %d dead letters, counted %v; want [after] with 3", got, incs[0].DeadLettered, c.Stats().DeadLettered)
	}
	if hw := b.HighWatermarks(deadTopic); len(hw) != 1 || hw[0] != 3 {
		t.Fatalf("dead-letter topic high watermark %v, want [3]", hw)
	}
}

// TestDeadLetterOutageNamesItsPartition: failed dead-letter writes are an outage source per
// partition, so that one partition's dead letters written do not end the outage of another
// whose dead letters still fail: the WARN line that starts the outage names the partition, and
// the outage ends once its dead letters are written.
func TestDeadLetterOutageNamesItsPartition(t *testing.T) {
	b := startBroker(t, broker.Config{Topics: []string{recordsTopic}, Partitions: 2})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 1, `{"id":"bad"}`, goodRecord("good", 1))
	log, lines := newLogLines(t)
	c, err := NewConsumer(context.Background(), consumerConfig(conn, "dlqoutage"), testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitfor.Cond(t, 20*time.Second, "the outage's WARN line", func() bool { return lines.count(slog.LevelWarn, "operations failing") > 0 })
	if v, _ := lines.attr(slog.LevelWarn, "operations failing", "source"); v.String() != "dead-letter write, partition 1" {
		t.Fatalf("the outage starts with source %q, want the dead-letter write of partition 1", v)
	}
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(conn.Brokers...)}
	res, err := cl.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{Topic: deadTopic, NumPartitions: 1, ReplicationFactor: 1}}})
	if err != nil || res.Errors[deadTopic] != nil {
		t.Fatalf("creating %s: %v %v", deadTopic, err, res.Errors)
	}
	if got := ids(collect(t, c, 1, 30*time.Second)); !slices.Equal(got, []string{"good"}) {
		t.Fatalf("after creating the topic got %v", got)
	}
	waitfor.Cond(t, 20*time.Second, "the outage's INFO line", func() bool { return lines.count(slog.LevelInfo, "succeed again") > 0 })
}

// TestDeadLettersOfTwoPartitionsWrittenOneByOne: two partitions' readers write dead letters one
// by one at once, each fitting the dead-letter topic's max.message.bytes alone but not two
// together: each goes in a record batch of its own, and nothing stops the consumer.
func TestDeadLettersOfTwoPartitionsWrittenOneByOne(t *testing.T) {
	b := startBroker(t, broker.Config{Topics: []string{recordsTopic}, Partitions: 2})
	conn := plainConn(b)
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(conn.Brokers...)}
	res, err := cl.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{Topic: deadTopic, NumPartitions: 1, ReplicationFactor: 1}}})
	if err != nil || res.Errors[deadTopic] != nil {
		t.Fatalf("creating %s: %v %v", deadTopic, err, res.Errors)
	}
	kafkatest.SetTopicConfig(t, conn.Brokers, deadTopic, "max.message.bytes", "2000")
	bad := `{"id":"big","pad":"` + strings.Repeat("x", 1000) + `"}`
	for p := range 2 {
		vals := slices.Repeat([]string{bad}, 20)
		produce(t, conn, recordsTopic, p, append(vals, goodRecord(fmt.Sprintf("after%d", p), p))...)
	}
	c := newConsumer(t, consumerConfig(conn, "twobyone"))
	incs := collect(t, c, 2, 30*time.Second)
	dead := 0
	for _, inc := range incs {
		dead += inc.DeadLettered
	}
	if got := slices.Sorted(slices.Values(ids(incs))); !slices.Equal(got, []string{"after0", "after1"}) || dead != 40 {
		t.Fatalf("got %v with %d dead letters; want after0 and after1 with 40", got, dead)
	}
	if hw := b.HighWatermarks(deadTopic); len(hw) != 1 || hw[0] != 40 {
		t.Fatalf("dead-letter topic high watermark %v, want [40]", hw)
	}
}
