package kafkatest

import (
	"context"
	"testing"
	"time"

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

// TestSetTopicConfig: a retention.ms set on a topic is the one the broker applies.
func TestSetTopicConfig(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"t"}, Partitions: 1, RetentionCheckInterval: time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	w := &kafka.Writer{Transport: Transport(t), Addr: kafka.TCP(b.Addrs()...), Topic: "t", BatchSize: 1, RequiredAcks: kafka.RequireAll}
	if err := w.WriteMessages(ctx, kafka.Message{Value: []byte("x"), Time: time.Now().Add(-time.Minute)}); err != nil {
		t.Fatal(err)
	}
	w.Close()
	b.ApplyRetention()
	if start := b.LogStartOffsets("t"); len(start) != 1 || start[0] != 0 {
		t.Fatalf("log start %v under the default retention, want [0]", start)
	}
	SetTopicConfig(t, b.Addrs(), "t", "retention.ms", "1000")
	b.ApplyRetention()
	if start := b.LogStartOffsets("t"); len(start) != 1 || start[0] != 1 {
		t.Fatalf("log start %v with retention.ms 1000 and a record a minute old, want [1]", start)
	}
}
