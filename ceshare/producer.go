package ceshare

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/stream"
)

// Producer appends requests to the CE topic, each to its CE's partition (Partition), and
// waits until all in-sync replicas acknowledged it. It is safe for concurrent use.
type Producer struct {
	topic string
	cl    *kafka.Client
	tr    *kafka.Transport
	log   *slog.Logger
	stop  context.CancelFunc
	keys  *clusterkey.Keyring

	mu         sync.Mutex
	partitions int // the topic's partition count, once known
}

// NewProducer returns a Producer for topic that signs each request with keys' signing key. It
// does not connect yet; its connections close on Close or when ctx ends.
func NewProducer(ctx context.Context, conn stream.ConnConfig, topic string, keys *clusterkey.Keyring, log *slog.Logger) (*Producer, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if topic == "" {
		return nil, errors.New("ceshare: producer: the CE topic (replication.ce_topic) is empty")
	}
	if keys == nil {
		return nil, errors.New("ceshare: producer: no cluster key (replication.key_file)")
	}
	ctx, stop := context.WithCancel(ctx)
	tr, err := conn.Transport(ctx)
	if err != nil {
		stop()
		return nil, err
	}
	return &Producer{topic: topic, tr: tr, stop: stop, log: log.With("topic", topic), keys: keys,
		cl: &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: tr}}, nil
}

// Send appends r to its partition with acks=all and returns where it landed. Transient broker
// errors are retried with backoff until ctx ends, with the same record: a retry of a write
// that landed puts the request twice in the partition, and the owner applies a request id
// (Request.RID) once. An error means the request may or may not have been written.
func (p *Producer) Send(ctx context.Context, r Request) (partition int, offset int64, err error) {
	key, value, err := Encode(r)
	if err != nil {
		return 0, 0, err
	}
	bo := backoff.Backoff{Min: 20 * time.Millisecond, Max: time.Second}
	for {
		partition, offset, err = p.send(ctx, key, value)
		if err == nil {
			return partition, offset, nil
		}
		if ctx.Err() != nil || !stream.Retryable(err) {
			return 0, 0, fmt.Errorf("ceshare: sending %s of %q to topic %q: %w", r.Kind, r.ID, p.topic, err)
		}
		p.log.Debug("retrying a CE request", "id", r.ID, "err", err)
		if bo.Wait(ctx) != nil {
			return 0, 0, fmt.Errorf("ceshare: sending %s of %q to topic %q: %w", r.Kind, r.ID, p.topic, err)
		}
	}
}

func (p *Producer) send(ctx context.Context, key, value []byte) (int, int64, error) {
	n, err := p.partitionCount(ctx)
	if err != nil {
		return 0, 0, err
	}
	part := Partition(string(key), n)
	res, err := p.cl.Produce(ctx, &kafka.ProduceRequest{
		Topic: p.topic, Partition: part, RequiredAcks: kafka.RequireAll,
		Records: kafka.NewRecordReader(kafka.Record{Time: time.Now(), Key: kafka.NewBytes(key), Value: kafka.NewBytes(value),
			Headers: []kafka.Header{{Key: clusterkey.Header, Value: Sign(p.keys, value)}}}),
	})
	if err == nil {
		err = res.Error
	}
	if err != nil {
		return 0, 0, err
	}
	return part, res.BaseOffset, nil
}

// partitionCount returns the topic's partition count, asked of the broker once.
func (p *Producer) partitionCount(ctx context.Context) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.partitions > 0 {
		return p.partitions, nil
	}
	n, err := topicPartitions(ctx, p.cl, p.topic)
	if err != nil {
		return 0, err
	}
	if n == 0 {
		// kafka.UnknownTopicOrPartition is retried: the first replica's Member creates it.
		return 0, fmt.Errorf("topic %q does not exist yet (a replica creates it when it joins): %w", p.topic, kafka.UnknownTopicOrPartition)
	}
	p.partitions = n
	return n, nil
}

// Close closes the producer's connections.
func (p *Producer) Close() error {
	p.stop()
	p.tr.CloseIdleConnections()
	return nil
}
