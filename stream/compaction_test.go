package stream

import (
	"bytes"
	"context"
	"encoding/binary"
	"hash/crc32"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/internal/kafkatest"
)

// fetchedBatch is a v2 batch as kafka-go decodes it from a fetch response: its base offset and
// the records it still holds (their values are good records).
func fetchedBatch(base int64, offsets ...int64) *protocol.RecordBatch {
	recs := make([]kafka.Record, len(offsets))
	for i, o := range offsets {
		recs[i] = kafka.Record{Offset: o, Time: time.Now(), Value: kafka.NewBytes([]byte(goodRecord("r", int(o))))}
	}
	return &protocol.RecordBatch{BaseOffset: base, Records: kafka.NewRecordReader(recs...)}
}

// TestChunkReaderPassesACompactedTail: a fetch at an offset whose batch lost its tail to
// compaction (the batch keeps its last offset; its records all lie below the offset asked for)
// still moves the partition's position on, past the offsets the response proves empty, rather
// than leaving it where the same fetch brings the same batch again.
func TestChunkReaderPassesACompactedTail(t *testing.T) {
	c := &Consumer{cfg: ConsumerConfig{Topic: recordsTopic}, schema: testSchema(t), log: testLog(t)}
	for _, tc := range []struct {
		name    string
		batches []kafka.RecordReader
		from    int64
		next    int64
		offsets []int64 // of the records read
	}{
		{"records from the offset on", []kafka.RecordReader{fetchedBatch(0, 0, 1, 2, 3, 4, 5, 6)}, 5, 7, []int64{5, 6}},
		{"nothing new", nil, 5, 5, nil},
		{"the batch's tail compacted away", []kafka.RecordReader{fetchedBatch(0, 0, 1, 2, 3, 4)}, 5, 6, nil},
		{"an empty batch after it", []kafka.RecordReader{fetchedBatch(0, 0, 1, 2), fetchedBatch(8)}, 5, 9, nil},
		{"a batch emptied by compaction", []kafka.RecordReader{fetchedBatch(7)}, 5, 8, nil},
		{"the offset inside a gap left by compaction", []kafka.RecordReader{fetchedBatch(0, 0, 1), fetchedBatch(6, 9)}, 5, 10, []int64{9}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ch, err := c.readChunk(0, &protocol.RecordStream{Records: tc.batches}, tc.from)
			if err != nil {
				t.Fatal(err)
			}
			var got []int64
			for _, r := range ch.recs {
				got = append(got, r.Offset)
			}
			if ch.next != tc.next || !slices.Equal(got, tc.offsets) {
				t.Fatalf("read from %d: records %v, next offset %d; want %v, %d", tc.from, got, ch.next, tc.offsets, tc.next)
			}
		})
	}
}

// rawBatch encodes a record set of one v2 batch of recs, as a producer sends it (its size
// first), with lastOffsetDelta written as given.
func rawBatch(recs []kmsg.Record, lastOffsetDelta int32) []byte {
	var raw []byte
	for _, r := range recs {
		raw = r.AppendTo(raw)
	}
	now := time.Now().UnixMilli()
	b := kmsg.RecordBatch{PartitionLeaderEpoch: -1, Magic: 2, LastOffsetDelta: lastOffsetDelta,
		FirstTimestamp: now, MaxTimestamp: now, ProducerID: -1, ProducerEpoch: -1, FirstSequence: -1,
		NumRecords: int32(len(recs)), Records: raw}
	b.Length = int32(len(b.AppendTo(nil)) - 12)
	b.CRC = int32(crc32.Checksum(b.AppendTo(nil)[21:], crc32.MakeTable(crc32.Castagnoli))) // from the attributes on
	enc := b.AppendTo(nil)
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(enc))), enc...)
}

// TestCompactedTailDoesNotStallThePartition reads a partition from an offset inside a batch
// whose records all lie below it, as compaction leaves a batch whose tail it removed: Kafka
// keeps such a batch's last offset, and answers a fetch at any offset up to it with that batch.
// The embedded broker rewrites a batch it compacts to end at its last record, and refuses a
// produced batch whose records' offset deltas are not 0, 1, ..., as Kafka does, so the test
// produces such a batch to a bare kfake cluster, which checks the last offset delta against the
// record count only: ten records whose offset deltas stop at 4, then a good record at offset
// 10. With one batch per fetch (FetchMaxBytes 1: a fetch returns its first batch whole), the
// consumer must pass offsets 5 to 9 and hand out the good record.
func TestCompactedTailDoesNotStallThePartition(t *testing.T) {
	_, conn := bareCluster(t)
	var recs []kmsg.Record
	for i := range 10 {
		recs = append(recs, kmsg.Record{OffsetDelta: int32(i % 5), Key: []byte("k"), Value: []byte(goodRecord("old", i))})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: kafkatest.Transport(t)}
	res, err := cl.RawProduce(ctx, &kafka.RawProduceRequest{Topic: recordsTopic, Partition: 0, RequiredAcks: kafka.RequireAll,
		RawRecords: protocol.RawRecordSet{Reader: bytes.NewReader(rawBatch(recs, 9))}})
	if err == nil {
		err = res.Error
	}
	if err != nil {
		t.Fatalf("producing the batch: %v", err)
	}
	produce(t, conn, recordsTopic, 0, goodRecord("after", 10))
	ends, err := cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{recordsTopic: {kafka.LastOffsetOf(0)}}})
	if err != nil {
		t.Fatal(err)
	}
	if po := ends.Topics[recordsTopic]; len(po) != 1 || po[0].Error != nil || po[0].LastOffset != 11 {
		t.Fatalf("the topic's end %+v, want offset 11: the batch does not end at offset 9", po)
	}
	cfg := consumerConfig(conn, "compacted")
	cfg.Resume = map[int]int64{0: 5}
	cfg.FetchMaxBytes = 1
	c := newConsumer(t, cfg)
	incs := collect(t, c, 1, 15*time.Second)
	if got := ids(incs); !slices.Equal(got, []string{"after"}) || incs[0].Records[0].Offset != 10 || checkpoint(incs)[0] != 11 {
		t.Fatalf("got %v (offset %d), next offsets %v; want [after] at offset 10, next 11", got, incs[0].Records[0].Offset, checkpoint(incs))
	}
}
