package stream

import (
	"context"
	"fmt"

	"github.com/segmentio/kafka-go"
)

// Watermarks are a partition's log start offset (the first offset the broker still holds) and
// high watermark (the offset its next record will get).
type Watermarks struct {
	Start, End int64
}

// Waiting returns the records in partitions with watermarks w that come at or after next, the
// next offset to apply of each partition, summed over partitions:
//
//	waiting = sum_p max(0, End_p - max(next_p, Start_p))
//
// A partition with no next offset has had nothing applied: its whole log waits. A next offset
// past the end counts nothing: the watermarks are read every few seconds and the offsets at
// each scrape, so a consumer that caught up passes the end last read. (A topic deleted and
// created again also ends before the offsets; the caller leaves such a partition out of next
// once the reset is found, and its new log waits whole.)
func Waiting(w map[int]Watermarks, next map[int]int64) int64 {
	var n int64
	for p, pw := range w {
		from, ok := next[p]
		if !ok {
			from = pw.Start
		}
		n += max(0, pw.End-max(from, pw.Start))
	}
	return n
}

// OffsetsReader reads the watermarks of one topic's partitions, with one Metadata and one
// ListOffsets request per Read. It keeps its connections between reads; Close releases them.
type OffsetsReader struct {
	topic string
	tr    *kafka.Transport
	cl    *kafka.Client
}

// NewOffsetsReader returns a reader of topic's watermarks over conn. The transport's background
// goroutines stop when ctx ends.
func NewOffsetsReader(ctx context.Context, conn ConnConfig, topic string) (*OffsetsReader, error) {
	if err := conn.applyDefaults(); err != nil {
		return nil, err
	}
	tr := conn.transport(ctx)
	return &OffsetsReader{topic: topic, tr: tr,
		cl: &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: tr, Timeout: conn.DialTimeout}}, nil
}

// Read returns every partition's watermarks (ReadWatermarks).
func (o *OffsetsReader) Read(ctx context.Context) (map[int]Watermarks, error) {
	return ReadWatermarks(ctx, o.cl, o.topic)
}

// ReadWatermarks returns the watermarks of every partition of topic, with one Metadata and one
// ListOffsets request through cl. It fails when the broker does not answer, the topic is
// unknown, or a partition's offsets carry an error: it never returns a partial map.
func ReadWatermarks(ctx context.Context, cl *kafka.Client, topic string) (map[int]Watermarks, error) {
	md, err := cl.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return nil, fmt.Errorf("stream: topic %s: metadata: %w", topic, err)
	}
	var reqs []kafka.OffsetRequest
	for _, t := range md.Topics {
		if t.Name != topic {
			continue
		}
		if t.Error != nil {
			return nil, fmt.Errorf("stream: topic %s: %w", topic, t.Error)
		}
		for _, p := range t.Partitions {
			reqs = append(reqs, kafka.FirstOffsetOf(p.ID), kafka.LastOffsetOf(p.ID))
		}
	}
	if len(reqs) == 0 {
		return nil, fmt.Errorf("stream: topic %s: not in the broker's metadata, or no partitions", topic)
	}
	res, err := cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		return nil, fmt.Errorf("stream: topic %s: offsets: %w", topic, err)
	}
	out := make(map[int]Watermarks, len(reqs)/2)
	for _, po := range res.Topics[topic] {
		if po.Error != nil {
			return nil, fmt.Errorf("stream: topic %s partition %d: offsets: %w", topic, po.Partition, OffsetsError(po.Error))
		}
		out[po.Partition] = Watermarks{Start: po.FirstOffset, End: po.LastOffset}
	}
	if len(out) != len(reqs)/2 {
		return nil, fmt.Errorf("stream: topic %s: offsets of %d partitions, it has %d", topic, len(out), len(reqs)/2)
	}
	return out, nil
}

// Close closes the reader's idle connections.
func (o *OffsetsReader) Close() { o.tr.CloseIdleConnections() }
