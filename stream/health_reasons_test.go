package stream

import (
	"bytes"
	"context"
	"encoding/binary"
	"hash/crc32"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
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

// TestHealthNamesWhyAPartitionIsNotRead: a log that holds a batch no fetch can read (written
// before the embedded broker refused such produces, or a damaged segment on a cluster) stops its
// partition's reader, which retries it; Health must say so with the fetch's error, not only that
// the partition has not fetched. A bare kfake cluster takes the batch: its records section holds
// eleven bytes of 0xff, no record, though its header counts two.
func TestHealthNamesWhyAPartitionIsNotRead(t *testing.T) {
	_, conn := bareCluster(t)
	produce(t, conn, recordsTopic, 0, goodRecord("first", 0))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: kafkatest.Transport(t)}
	now := time.Now().UnixMilli()
	b := kmsg.RecordBatch{PartitionLeaderEpoch: -1, Magic: 2, LastOffsetDelta: 1, FirstTimestamp: now, MaxTimestamp: now,
		ProducerID: -1, ProducerEpoch: -1, FirstSequence: -1, NumRecords: 2, Records: bytes.Repeat([]byte{0xff}, 11)}
	b.Length = int32(len(b.AppendTo(nil)) - 12)
	b.CRC = int32(crc32.Checksum(b.AppendTo(nil)[21:], crc32.MakeTable(crc32.Castagnoli)))
	enc := b.AppendTo(nil)
	batch := append(binary.BigEndian.AppendUint32(nil, uint32(len(enc))), enc...)
	res, err := cl.RawProduce(ctx, &kafka.RawProduceRequest{Topic: recordsTopic, Partition: 0, RequiredAcks: kafka.RequireAll,
		RawRecords: protocol.RawRecordSet{Reader: bytes.NewReader(batch)}})
	if err == nil {
		err = res.Error
	}
	if err != nil {
		t.Fatalf("producing the batch: %v", err)
	}
	cfg := consumerConfig(conn, "unreadable")
	cfg.StallAfter, cfg.RefreshInterval, cfg.RetryMax = time.Second, 200*time.Millisecond, 200*time.Millisecond
	c := newConsumer(t, cfg)
	collect(t, c, 1, 15*time.Second)
	var h Health
	waitfor.Cond(t, 20*time.Second, "unready with the fetch's error", func() bool {
		h = c.Health()
		return !h.Ready && slices.ContainsFunc(h.Reasons, func(r string) bool {
			return strings.Contains(r, "partition 0: no fetch for") && strings.Contains(r, "records to read: ")
		})
	})
	t.Logf("unready: %q", h.Reasons)
}
