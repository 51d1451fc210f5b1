package stream

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/tooltest"
)

const (
	recordsTopic = "records"
	deadTopic    = "records-dlq"
	eventsTopic  = "events"
)

func testLog(t testing.TB) *slog.Logger {
	return tooltest.Logger(t)
}

// startBroker starts an embedded broker with the test topics; it is closed when the test ends.
func startBroker(t testing.TB, cfg broker.Config) *broker.Broker {
	t.Helper()
	if cfg.Topics == nil {
		cfg.Topics = []string{recordsTopic, deadTopic, eventsTopic}
	}
	b, err := broker.Start(context.Background(), cfg, testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b
}

func plainConn(b *broker.Broker) ConnConfig {
	return ConnConfig{Brokers: b.Addrs(), DialTimeout: 5 * time.Second}
}

// bareCluster starts a kfake cluster of one broker with the records and dead-letter topics of
// one partition, without the embedded broker's gate: a test that needs a log the gate would not
// let a producer write (a batch as compaction leaves it, or one no fetch can read) writes it
// there. It returns the cluster and a ConnConfig to it.
func bareCluster(t testing.TB) (*kfake.Cluster, ConnConfig) {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, recordsTopic, deadTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c, ConnConfig{Brokers: c.ListenAddrs(), DialTimeout: 5 * time.Second}
}

// partitionByKey sends a message with key "p<N>/..." to partition N, others to 0.
var partitionByKey = kafka.BalancerFunc(func(m kafka.Message, partitions ...int) int {
	k := string(m.Key)
	if i := strings.IndexByte(k, '/'); strings.HasPrefix(k, "p") && i > 1 {
		if n, err := strconv.Atoi(k[1:i]); err == nil && n < len(partitions) {
			return partitions[n]
		}
	}
	return partitions[0]
})

// produce writes raw values (key "p<partition>/<i>") and waits for the acknowledgement.
func produce(t testing.TB, conn ConnConfig, topic string, partition int, values ...string) {
	t.Helper()
	msgs := make([]kafka.Message, len(values))
	for i, v := range values {
		msgs[i] = kafka.Message{Key: fmt.Appendf(nil, "p%d/%d", partition, i), Value: []byte(v)}
	}
	produceMessages(t, conn, topic, msgs...)
}

// produceMessages writes msgs (each to the partition its key names: see partitionByKey) and
// waits for the acknowledgement.
func produceMessages(t testing.TB, conn ConnConfig, topic string, msgs ...kafka.Message) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := conn.applyDefaults(); err != nil {
		t.Fatal(err)
	}
	tr := conn.transport(ctx)
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(conn.Brokers...), Topic: topic, Balancer: partitionByKey,
		RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond, BatchSize: 10000, Transport: tr}
	defer w.Close()
	for len(msgs) > 0 {
		n := min(len(msgs), 2000)
		if err := w.WriteMessages(ctx, msgs[:n]...); err != nil {
			t.Fatalf("producing to %s: %v", topic, err)
		}
		msgs = msgs[n:]
	}
}

// goodRecord is a valid record for testSchema.
func goodRecord(id string, i int) string {
	return fmt.Sprintf(`{"id":%q,"features":[%d,%d.5,-%d],"label":%d}`, id, i, i, i, i%2)
}

func goodRecords(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = goodRecord(fmt.Sprintf("%s%d", prefix, i), i)
	}
	return out
}

func consumerConfig(conn ConnConfig, group string) ConsumerConfig {
	return ConsumerConfig{
		Conn: conn, Topic: recordsTopic, GroupID: group, DeadLetterTopic: deadTopic,
		MaxRecords: 1000, MaxWait: 300 * time.Millisecond,
		FetchWait: 100 * time.Millisecond, RetryMin: 20 * time.Millisecond, RetryMax: 500 * time.Millisecond,
	}
}

func newConsumer(t testing.TB, cfg ConsumerConfig) *Consumer {
	t.Helper()
	c, err := NewConsumer(context.Background(), cfg, testSchema(t), testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// collect calls Next until want good records arrived or the deadline passes.
func collect(t testing.TB, c *Consumer, want int, within time.Duration) []*Increment {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	var incs []*Increment
	got := 0
	for got < want {
		inc, err := c.Next(ctx)
		if err != nil {
			t.Fatalf("Next after %d of %d records: %v", got, want, err)
		}
		incs = append(incs, inc)
		got += len(inc.Records)
	}
	return incs
}

func ids(incs []*Increment) []string {
	var out []string
	for _, inc := range incs {
		for _, r := range inc.Records {
			out = append(out, r.ID)
		}
	}
	return out
}
