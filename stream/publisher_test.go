package stream

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/testnet"
)

type testEvent struct {
	Kind    string  `json:"kind"`
	Version uint64  `json:"version"`
	KL      float64 `json:"kl"`
}

func TestPublisher(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	p, err := NewPublisher(context.Background(), PublisherConfig{Conn: conn, Topic: eventsTopic}, testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx := context.Background()
	want := []testEvent{{"update", 1, 0.01}, {"recertify", 1, 0.01}, {"update", 2, 0.03}}
	if err := p.Publish(ctx, "model", want[0]); err != nil {
		t.Fatal(err)
	}
	if err := p.PublishBatch(ctx, []Event{{Key: "model", Value: want[1]}, {Key: "model", Value: want[2]}}); err != nil {
		t.Fatal(err)
	}
	// A value that cannot be marshalled fails the whole batch before anything is written.
	err = p.PublishBatch(ctx, []Event{{Key: "model", Value: testEvent{"ok", 3, 0}}, {Key: "model", Value: math.NaN()}})
	if err == nil || !strings.Contains(err.Error(), "event 1") {
		t.Fatalf("PublishBatch with NaN: %v, want an error naming event 1", err)
	}
	if hw := b.HighWatermarks(eventsTopic); hw[0] != 3 {
		t.Fatalf("events topic has %d messages, want 3", hw[0])
	}
	for i, m := range readTopic(t, conn, eventsTopic, 3) {
		var got testEvent
		if err := json.Unmarshal(m.Value, &got); err != nil || got != want[i] || string(m.Key) != "model" {
			t.Errorf("event %d = %s (key %q), %v; want %+v", i, m.Value, m.Key, err, want[i])
		}
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(ctx, "k", 1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Publish after Close: %v, want ErrClosed", err)
	}
}

func TestPing(t *testing.T) {
	b := startBroker(t, broker.Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := Ping(ctx, plainConn(b)); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	if err := Ping(ctx, plainConn(b), recordsTopic, eventsTopic); err != nil {
		t.Fatalf("Ping with topics: %v", err)
	}
	if err := Ping(ctx, plainConn(b), "no-such-topic"); err == nil || !strings.Contains(err.Error(), "no-such-topic") {
		t.Fatalf("Ping for a missing topic: %v", err)
	}
	// A second, dead address first: Ping moves on to the live one.
	conn := plainConn(b)
	dead := testnet.Reserve(t).Addr() // held, refusing connections
	conn.Brokers = append([]string{dead}, conn.Brokers...)
	if err := Ping(ctx, conn); err != nil {
		t.Fatalf("Ping with a dead first broker: %v", err)
	}
	b.Close()
	if err := Ping(ctx, plainConn(b)); err == nil {
		t.Fatal("Ping succeeded against a stopped broker")
	}
}
