package stream

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/testnet"
)

// TestBrokerRestart stops the broker under a running consumer and starts it again on the
// same address and data directory: Next rides out the outage (kafka-go reconnects, the group
// is joined again) and delivers what is produced afterwards, without redelivering what was
// committed before.
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
