// Package kafkatest holds what tests do to a Kafka-protocol broker as an operator would.
package kafkatest

import (
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// RecreateTopic deletes topic on brokers and creates it again, empty, with partitions
// partitions: an operator's reset of the topic under the processes that read it.
func RecreateTopic(t testing.TB, brokers []string, topic string, partitions int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: tr}
	if res, err := cl.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{topic}}); err != nil || res.Errors[topic] != nil {
		t.Fatalf("deleting %s: %v %v", topic, err, res)
	}
	res, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: partitions,
		ReplicationFactor: 1}}})
	if err != nil || res.Errors[topic] != nil {
		t.Fatalf("creating %s: %v %v", topic, err, res)
	}
}
