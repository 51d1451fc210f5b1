package stream

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/segmentio/kafka-go"
)

// TestHealthNamesAFailingDeadLetterTopic: a bad record whose dead letter cannot be written (the
// dead-letter topic is missing) holds its partition back, so nothing after it is applied. With
// no further record produced, the partition looks read to its end; Health must still turn
// unready within StallAfter of the first failed write, naming the dead-letter topic, and ready
// again once the dead letter is written.
func TestHealthNamesAFailingDeadLetterTopic(t *testing.T) {
	b := startBroker(t, broker.Config{Topics: []string{recordsTopic}})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, `{"id":"bad"}`)
	cfg := consumerConfig(conn, "health-dlq")
	cfg.StallAfter, cfg.RefreshInterval = time.Second, 200*time.Millisecond
	c := newConsumer(t, cfg)
	waitfor.Cond(t, 20*time.Second, "a failed dead-letter write", func() bool { return c.Stats().Retries > 0 })
	var h Health
	waitfor.Cond(t, 20*time.Second, "unready naming the dead-letter topic", func() bool {
		h = c.Health()
		return !h.Ready && slices.ContainsFunc(h.Reasons, func(r string) bool { return strings.Contains(r, deadTopic) })
	})
	t.Logf("unready: %q", h.Reasons)

	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(conn.Brokers...)}
	res, err := cl.CreateTopics(context.Background(), &kafka.CreateTopicsRequest{
		Topics: []kafka.TopicConfig{{Topic: deadTopic, NumPartitions: 1, ReplicationFactor: 1}}})
	if err != nil || res.Errors[deadTopic] != nil {
		t.Fatalf("creating %s: %v %v", deadTopic, err, res.Errors)
	}
	if m := readTopic(t, conn, deadTopic, 1)[0]; header(m, HeaderReason) != ReasonMissingField {
		t.Fatalf("dead letter reason %q", header(m, HeaderReason))
	}
	waitfor.Cond(t, 20*time.Second, "ready again", func() bool { return c.Health().Ready })
}
