// Package kafkatest holds what tests do to a Kafka-protocol broker as an operator would.
package kafkatest

import (
	"context"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// MaxWait is the MaxWait of the tests' kafka-go readers, postlog.ReaderMaxWait (which see): with
// a shorter one, the broker's answer to an empty fetch has so little time to arrive before the
// reader's deadline that a busy core misses it on every fetch.
const MaxWait = 1250 * time.Millisecond

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
	CreateTopic(t, brokers, topic, partitions)
}

// CreateTopic creates topic on brokers with partitions partitions, replication factor 1 and the
// broker's default settings, as an operator's kafka-topics --create would.
func CreateTopic(t testing.TB, brokers []string, topic string, partitions int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: Transport(t)}
	res, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: partitions,
		ReplicationFactor: 1}}})
	if err != nil || res.Errors[topic] != nil {
		t.Fatalf("creating %s: %v %v", topic, err, res)
	}
}

// SetTopicConfig sets topic's configuration name to value on brokers, as an operator's
// kafka-configs --alter would.
func SetTopicConfig(t testing.TB, brokers []string, topic, name, value string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: Transport(t)}
	res, err := cl.IncrementalAlterConfigs(ctx, &kafka.IncrementalAlterConfigsRequest{Resources: []kafka.IncrementalAlterConfigsRequestResource{{
		ResourceType: kafka.ResourceTypeTopic, ResourceName: topic,
		Configs: []kafka.IncrementalAlterConfigsRequestConfig{{Name: name, Value: value, ConfigOperation: kafka.ConfigOperationSet}}}}})
	for i := 0; err == nil && i < len(res.Resources); i++ {
		err = res.Resources[i].Error
	}
	if err != nil {
		t.Fatalf("setting %s of %s to %s: %v", name, topic, value, err)
	}
}

// ReadPartition reads every message of partition p of topic on brokers, from its start to the
// end it has when called. The reader's fetches wait at most 100 ms for records past the end: it
// prefetches beyond the last record it returns, and Close waits for that fetch (at kafka-go's
// default, 10 s per read).
func ReadPartition(t testing.TB, brokers []string, topic string, p int) []kafka.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn, err := kafka.DialLeader(ctx, "tcp", brokers[0], topic, p)
	if err != nil {
		t.Fatal(err)
	}
	end, err := conn.ReadLastOffset()
	conn.Close()
	if err != nil {
		t.Fatal(err)
	}
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: p, MaxBytes: 16 << 20, MaxWait: MaxWait})
	defer rd.Close()
	var out []kafka.Message
	for off := int64(0); off < end; {
		m, err := rd.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("reading %s/%d at offset %d of %d: %v", topic, p, off, end, err)
		}
		off = m.Offset + 1
		out = append(out, m)
	}
	return out
}

// Transport returns a kafka-go transport of the test's own, whose idle connections close when
// the test ends. A writer or client given none uses kafka.DefaultTransport, which the whole test
// binary shares and which caches each broker address's metadata for up to 6 s: once an earlier
// test's broker freed its port and a later test's broker bound it, a writer could route by the
// earlier broker's topics and fail at once with "Unknown Topic Or Partition".
func Transport(t testing.TB) *kafka.Transport {
	tr := &kafka.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

// Header is the value of a Kafka message's header key (empty if absent).
func Header(m kafka.Message, key string) string {
	for _, h := range m.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}
