package kafkatest

import (
	"context"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
)

// TestRecreateTopic: a topic with records is empty after RecreateTopic, with the partitions asked.
func TestRecreateTopic(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"t"}, Partitions: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	w := &kafka.Writer{Transport: Transport(t), Addr: kafka.TCP(b.Addrs()...), Topic: "t", BatchSize: 1, RequiredAcks: kafka.RequireAll}
	if err := w.WriteMessages(ctx, kafka.Message{Value: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	w.Close()
	RecreateTopic(t, b.Addrs(), "t", 3)
	if hw := b.HighWatermarks("t"); len(hw) != 3 || hw[0]+hw[1]+hw[2] != 0 {
		t.Fatalf("high watermarks after the recreation %v, want 3 empty partitions", hw)
	}
}
