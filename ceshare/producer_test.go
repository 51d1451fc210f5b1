package ceshare

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/stream"
)

// NewProducer refuses a producer of no topic, or without the cluster key it signs with.
func TestNewProducerRefusesNoTopicOrKey(t *testing.T) {
	conn := stream.ConnConfig{Brokers: []string{"127.0.0.1:1"}}
	for _, tc := range []struct {
		name, topic string
		keys        bool
	}{{"no topic", "", true}, {"no key", testTopic, false}} {
		t.Run(tc.name, func(t *testing.T) {
			keys := testKeys()
			if !tc.keys {
				keys = nil
			}
			if p, err := NewProducer(context.Background(), conn, tc.topic, keys, nil); err == nil {
				p.Close()
				t.Errorf("NewProducer(%q, keys %v) made a producer", tc.topic, tc.keys)
			}
		})
	}
}

// A producer of a topic that does not exist yet fails (a retryable UnknownTopicOrPartition: the
// first member creates it) without caching a partition count; once the topic exists, Send puts
// each request in its id's partition and returns the offset it landed at.
func TestProducerSendsWhereItSays(t *testing.T) {
	_, conn := startBroker(t)
	pr := testProducer(t, conn)
	ctx := context.Background()
	if n, err := pr.partitionCount(ctx); !errors.Is(err, kafka.UnknownTopicOrPartition) || !stream.Retryable(err) {
		t.Fatalf("the partition count of a topic not created yet: %d, %v; want a retryable UnknownTopicOrPartition", n, err)
	}
	createTopic(t, conn)
	cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: kafkatest.Transport(t)}
	at := time.Now()
	var offsets []int64
	for i, kind := range []string{KindRegister, KindDelete, KindRegister} {
		r := Request{Kind: kind, ID: "ce-1", Replica: "r1", At: at.Add(time.Duration(i))}
		if kind == KindRegister {
			r.CE = json.RawMessage(`{"i":1}`)
		}
		p, off, err := pr.Send(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		if want := Partition(r.ID, testPartitions); p != want {
			t.Fatalf("sent to partition %d, want %d", p, want)
		}
		offsets = append(offsets, off)
	}
	p := Partition("ce-1", testPartitions)
	first, end, err := partitionOffsets(ctx, cl, testTopic, p)
	if err != nil {
		t.Fatal(err)
	}
	for i, off := range offsets {
		if want := end - int64(len(offsets)-i); off != want || off < first {
			t.Errorf("request %d landed at offset %d, want %d (the partition holds %d to %d)", i, off, want, first, end)
		}
	}
}

// A broker's refusal that retrying cannot fix (the producer may not write the topic) ends Send
// at once, after one attempt.
func TestProducerGivesUpOnPermanentErrors(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(testPartitions, testTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	attempts := 0
	failPartitions(t, kc, kmsg.Produce, kafka.TopicAuthorizationFailed, func() {
		mu.Lock()
		defer mu.Unlock()
		if attempts++; attempts > 1 {
			cancel() // a retry: stop it
		}
	})
	pr := testProducer(t, stream.ConnConfig{Brokers: kc.ListenAddrs(), DialTimeout: 5 * time.Second})
	_, _, err = pr.Send(ctx, Request{Kind: KindDelete, ID: "ce-1", Replica: "r1", At: time.Now()})
	mu.Lock()
	defer mu.Unlock()
	if !errors.Is(err, kafka.TopicAuthorizationFailed) || attempts != 1 {
		t.Errorf("Send refused for authorization: %v after %d attempts; want the broker's error after 1", err, attempts)
	}
}
