package stream

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"

	"github.com/segmentio/kafka-go"
)

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	Conn ConnConfig
	// Topic receives the events. Required.
	Topic string
}

// Event is one message for PublishBatch: a key (events with the same key keep their order)
// and a value marshalled to JSON (a json.RawMessage is sent as it is), with optional Kafka
// record headers.
type Event struct {
	Key     string
	Value   any
	Headers map[string][]byte
}

// Publisher writes JSON events to a topic, synchronously and acknowledged by all in-sync
// replicas. It is safe for concurrent use.
type Publisher struct {
	topic string
	w     *kafka.Writer
	tr    *kafka.Transport
	out   *outage // keeps kafka-go's error lines to one WARN per outage

	closeOnce sync.Once
	closing   chan struct{}
	closed    chan struct{}
	closeErr  error
}

// NewPublisher validates cfg and returns a Publisher. Its connections and goroutines stop
// when ctx ends or on Close.
func NewPublisher(ctx context.Context, cfg PublisherConfig, log *slog.Logger) (*Publisher, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := cfg.Conn.applyDefaults(); err != nil {
		return nil, err
	}
	if cfg.Topic == "" {
		return nil, errors.New("stream: publisher Topic is required")
	}
	tr := cfg.Conn.transport(ctx)
	out := newOutage(log.With("topic", cfg.Topic), "event publishing")
	p := &Publisher{topic: cfg.Topic, tr: tr, out: out,
		w:       newWriter(cfg.Conn.Brokers, cfg.Topic, tr, out.kafkaLogger("kafka-go event writer")),
		closing: make(chan struct{}), closed: make(chan struct{})}
	go func() {
		defer close(p.closed)
		select {
		case <-ctx.Done():
		case <-p.closing:
		}
		p.closeErr = p.w.Close()
		tr.CloseIdleConnections()
	}()
	return p, nil
}

// Publish writes one event: v marshalled to JSON under key.
func (p *Publisher) Publish(ctx context.Context, key string, v any) error {
	return p.PublishBatch(ctx, []Event{{Key: key, Value: v}})
}

// message is e as PublishBatch writes it.
func (e Event) message() (kafka.Message, error) {
	b, err := json.Marshal(e.Value)
	if err != nil {
		return kafka.Message{}, err
	}
	m := kafka.Message{Key: []byte(e.Key), Value: b}
	for k, v := range e.Headers {
		m.Headers = append(m.Headers, kafka.Header{Key: k, Value: v})
	}
	return m, nil
}

// EventBytes bounds the size of a record batch holding e alone, as PublishBatch writes it: the
// max.message.bytes a topic needs to take it.
func EventBytes(e Event) (int, error) {
	m, err := e.message()
	if err != nil {
		return 0, err
	}
	return batchBytes(m), nil
}

// PublishBatch writes events in one call. Every value is marshalled first; if one fails,
// nothing is written. kafka-go retries transient broker errors; an error return means some
// events may not have been written (and retrying may duplicate others).
func (p *Publisher) PublishBatch(ctx context.Context, events []Event) error {
	msgs := make([]kafka.Message, len(events))
	for i, e := range events {
		m, err := e.message()
		if err != nil {
			return fmt.Errorf("stream: event %d (key %q): %w", i, e.Key, err)
		}
		if len(m.Value) > writerBatchBytes-len(e.Key)-256 {
			return fmt.Errorf("stream: event %d (key %q) is %d bytes, limit about %d", i, e.Key, len(m.Value), writerBatchBytes)
		}
		msgs[i] = m
	}
	if err := p.w.WriteMessages(ctx, msgs...); err != nil {
		if errors.Is(err, io.ErrClosedPipe) {
			return ErrClosed
		}
		err = fmt.Errorf("stream: publishing %d events to %s: %w", len(events), p.topic, err)
		p.out.fail("publish", err)
		return err
	}
	p.out.ok("publish")
	return nil
}

// Close flushes nothing (writes are synchronous), closes the connections and waits for the
// writer's goroutines to stop.
func (p *Publisher) Close() error {
	p.closeOnce.Do(func() { close(p.closing) })
	<-p.closed
	return p.closeErr
}
