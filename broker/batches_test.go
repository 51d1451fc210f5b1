package broker

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/binary"
	"hash/crc32"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// rawBatch is a record batch of n records whose (already compressed) records section is
// records, with codec in its attributes and a correct CRC: kfake takes any such batch.
func rawBatch(codec int16, n int32, records []byte) []byte {
	now := time.Now().UnixMilli()
	b := kmsg.RecordBatch{PartitionLeaderEpoch: -1, Magic: 2, Attributes: codec, LastOffsetDelta: n - 1,
		FirstTimestamp: now, MaxTimestamp: now, ProducerID: -1, ProducerEpoch: -1, FirstSequence: -1,
		NumRecords: n, Records: records}
	b.Length = int32(len(b.AppendTo(nil)) - 12)
	b.CRC = int32(crc32.Checksum(b.AppendTo(nil)[21:], crc32.MakeTable(crc32.Castagnoli)))
	return b.AppendTo(nil)
}

// record is one record's bytes with offset delta delta and value v.
func record(delta int32, v string) []byte {
	r := kmsg.Record{OffsetDelta: delta, Value: []byte(v)}
	r.Length = int32(len(r.AppendTo(nil)) - 1)
	return r.AppendTo(nil)
}

func gzipped(t *testing.T, b []byte) []byte {
	var buf bytes.Buffer
	w := gzip.NewWriter(&buf)
	if _, err := w.Write(b); err != nil {
		t.Fatal(err)
	}
	w.Close()
	return buf.Bytes()
}

// produceRequest is a Produce (acks=all) of batch to topic "t" partition 0.
func produceRequest(batch []byte) *kmsg.ProduceRequest {
	r := kmsg.NewPtrProduceRequest()
	r.Acks, r.TimeoutMillis = -1, 5000
	topic := kmsg.NewProduceRequestTopic()
	topic.Topic = "t"
	p := kmsg.NewProduceRequestTopicPartition()
	p.Records = batch
	topic.Partitions = append(topic.Partitions, p)
	r.Topics = append(r.Topics, topic)
	return r
}

// produceFrame is produceRequest(batch) at version 7, as written on the wire.
func produceFrame(batch []byte) []byte { return request(produceRequest(batch), 7) }

// TestProduceOfUnreadableBatchIsRefused: a batch whose header and CRC are right but whose
// records no consumer can read (kafka-go's fetch fails on it for good: cfguard's consumer
// retries it for ever and reads its partition no further) closes its connection, as the
// gate's other refusals do, and nothing is appended; the broker goes on serving.
func TestProduceOfUnreadableBatchIsRefused(t *testing.T) {
	b, addr := startGated(t)
	good := append(record(0, "a"), record(1, "b")...)
	var zeros bytes.Buffer
	zw, err := zstd.NewWriter(&zeros)
	if err != nil {
		t.Fatal(err)
	}
	big := make([]byte, 1<<20)
	for range MaxDecompressedBatchBytes/len(big) + 1 {
		zw.Write(big)
	}
	zw.Close()
	cases := []struct {
		name  string
		batch []byte
	}{
		{"gzip that is not gzip", rawBatch(1, 1, []byte("this is not gzip data at all"))},
		{"gzip of records cut short", rawBatch(1, 2, gzipped(t, good[:len(good)-2]))},
		{"snappy that is not snappy", rawBatch(2, 1, []byte{0xff, 0xff, 0xff, 0xff, 0x0f, 1, 2, 3})},
		{"lz4 that is not lz4", rawBatch(3, 1, []byte("not an lz4 frame"))},
		{"zstd that is not zstd", rawBatch(4, 1, []byte("not a zstd frame"))},
		{"zstd decompressing past the bound", rawBatch(4, 1, zeros.Bytes())},
		{"a record length that is no varint", rawBatch(0, 1, bytes.Repeat([]byte{0xff}, 11))},
		{"a record past the batch's end", rawBatch(0, 1, record(0, "a")[:4])},
		{"fewer records than the header says", rawBatch(0, 3, good)},
		{"more records than the header says", rawBatch(0, 1, good)},
		{"offset deltas out of order", rawBatch(0, 2, append(record(1, "a"), record(0, "b")...))},
		{"a key longer than its record", rawBatch(0, 1, []byte{0x0e, 0, 0, 0, 0x7e, 'k', 0, 0})},
	}
	for i, tc := range cases {
		if _, err := gate(produceFrame(tc.batch)); err == nil {
			t.Errorf("%s: the gate takes it", tc.name)
			continue
		}
		c := dialIdle(t, addr)
		send(t, c, produceFrame(tc.batch))
		closedByPeer(t, c, tc.name)
		waitfor.Cond(t, 10*time.Second, tc.name+" counted", func() bool { return b.Connections().Invalid == int64(i+1) })
	}
	if hw := b.HighWatermarks("t"); hw[0] != 0 {
		t.Fatalf("partition 0 holds %d records after the refused batches", hw[0])
	}
	// Well-formed batches pass, uncompressed and gzipped, written here or by clients.
	for _, batch := range [][]byte{rawBatch(0, 2, good), rawBatch(1, 2, gzipped(t, good))} {
		if _, err := gate(produceFrame(batch)); err != nil {
			t.Errorf("a well-formed batch: %v", err)
		}
	}
}

// TestProduceOfEveryCodecPasses: franz-go's and kafka-go's producers, with every codec, write
// batches the gate takes, records with keys, headers and nulls included.
func TestProduceOfEveryCodecPasses(t *testing.T) {
	b, err := Start(context.Background(), Config{Topics: []string{"c"}, Partitions: 1}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	want := int64(0)
	for _, codec := range []kgo.CompressionCodec{kgo.NoCompression(), kgo.GzipCompression(), kgo.SnappyCompression(),
		kgo.Lz4Compression(), kgo.ZstdCompression()} {
		cl, err := kgo.NewClient(kgo.SeedBrokers(b.Addrs()...), kgo.DefaultProduceTopic("c"), kgo.ProducerBatchCompression(codec),
			kgo.ProducerLinger(50*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		var recs []*kgo.Record
		for i := range 50 {
			recs = append(recs, &kgo.Record{Key: []byte{byte(i)}, Value: bytes.Repeat([]byte(`{"x":1}`), i),
				Headers: []kgo.RecordHeader{{Key: "h", Value: []byte("v")}, {Key: "n"}}})
		}
		recs = append(recs, &kgo.Record{}) // null key and value
		if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			t.Fatalf("franz-go, codec %v: %v", codec, err)
		}
		cl.Close()
		want += int64(len(recs))
	}
	for _, codec := range []kafka.Compression{0, kafka.Gzip, kafka.Snappy, kafka.Lz4, kafka.Zstd} {
		w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()...), Topic: "c", Compression: codec, RequiredAcks: kafka.RequireAll,
			BatchTimeout: time.Millisecond, BatchSize: 100}
		var msgs []kafka.Message
		for i := range 20 {
			msgs = append(msgs, kafka.Message{Key: []byte{byte(i)}, Value: bytes.Repeat([]byte("v"), i*100),
				Headers: []kafka.Header{{Key: "h", Value: []byte("v")}}})
		}
		if err := w.WriteMessages(ctx, msgs...); err != nil {
			t.Fatalf("kafka-go, codec %v: %v", codec, err)
		}
		w.Close()
		want += int64(len(msgs))
	}
	if hw := b.HighWatermarks("c"); hw[0] != want {
		t.Fatalf("partition holds %d records, want %d (connections %+v)", hw[0], want, b.Connections())
	}
}

// BenchmarkProduceCheck sets what the gate's check of a produced batch costs (checkBatches,
// uncompressed and gzipped) beside what the produce costs whole: the same request sent to the
// embedded broker over loopback and its answer read, gate and check included. A batch is 64
// records of about 320 bytes (20.4 kB a batch), as the daemon's input records are:
//
//	go test -run '^$' -bench ProduceCheck -count 5 ./broker
func BenchmarkProduceCheck(b *testing.B) {
	value := `{"id":"r-000000","features":[` + strings.TrimSuffix(strings.Repeat("0.123456,", 30), ",") + `],"label":1}`
	var recs []byte
	for i := range 64 {
		recs = append(recs, record(int32(i), value)...)
	}
	var gz bytes.Buffer
	w := gzip.NewWriter(&gz)
	w.Write(recs)
	w.Close()
	for _, c := range []struct {
		name  string
		batch []byte
	}{{"none", rawBatch(0, 64, recs)}, {"gzip", rawBatch(1, 64, gz.Bytes())}} {
		frame, r := produceFrame(c.batch), produceRequest(c.batch)
		b.Run("check/"+c.name, func(b *testing.B) {
			b.SetBytes(int64(len(recs)))
			for b.Loop() {
				if err := checkBatches(r); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("produce/"+c.name, func(b *testing.B) {
			br, err := Start(context.Background(), Config{Topics: []string{"t"}, Partitions: 1}, slog.New(slog.DiscardHandler))
			if err != nil {
				b.Fatal(err)
			}
			defer br.Close()
			conn, err := net.Dial("tcp", br.Addrs()[0])
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			b.SetBytes(int64(len(recs)))
			var size [4]byte
			for b.Loop() {
				if _, err := conn.Write(frame); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(conn, size[:]); err != nil {
					b.Fatal(err)
				}
				if _, err := io.CopyN(io.Discard, conn, int64(binary.BigEndian.Uint32(size[:]))); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
