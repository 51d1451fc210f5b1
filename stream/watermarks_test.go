package stream

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
)

func TestWaiting(t *testing.T) {
	w := map[int]Watermarks{0: {Start: 0, End: 100}, 1: {Start: 40, End: 60}}
	for _, c := range []struct {
		name string
		w    map[int]Watermarks
		next map[int]int64
		want int64
	}{
		{"nothing read yet: every partition's whole log", w, nil, 100 + 20},
		{"caught up", w, map[int]int64{0: 100, 1: 60}, 0},
		{"partly applied", w, map[int]int64{0: 90, 1: 50}, 10 + 10},
		{"offset below the log start (retention deleted records): from the start", w, map[int]int64{0: 100, 1: 10}, 20},
		{"offset past the end (watermarks read before the consumer passed them): nothing", w, map[int]int64{0: 100, 1: 75}, 0},
		{"a partition the offsets do not know yet", w, map[int]int64{0: 100}, 20},
		{"an offset of a partition the topic no longer has", w, map[int]int64{0: 100, 1: 60, 7: 3}, 0},
		{"empty partitions", map[int]Watermarks{0: {5, 5}, 1: {0, 0}}, map[int]int64{0: 5}, 0},
		{"no watermarks", nil, map[int]int64{0: 5}, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := Waiting(c.w, c.next); got != c.want {
				t.Errorf("Waiting(%v, %v) = %d, want %d", c.w, c.next, got, c.want)
			}
		})
	}
}

// TestOffsetsReaderReadsWatermarks reads a topic's watermarks from a broker over TCP, before and
// after records are produced and retention deleted some, and fails clearly on a topic the broker
// does not have.
func TestOffsetsReaderReadsWatermarks(t *testing.T) {
	b := startBroker(t, broker.Config{Partitions: 2, RetentionBytes: 64 << 10, RetentionCheckInterval: time.Hour})
	conn := plainConn(b)
	ctx := t.Context()
	r, err := NewOffsetsReader(ctx, conn, recordsTopic)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	read := func() map[int]Watermarks {
		t.Helper()
		rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		w, err := r.Read(rctx)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	if w := read(); len(w) != 2 || w[0] != (Watermarks{0, 0}) || w[1] != (Watermarks{0, 0}) {
		t.Fatalf("an empty topic of 2 partitions: %v", w)
	}
	produce(t, conn, recordsTopic, 1, goodRecords("a", 7)...)
	if w := read(); w[0] != (Watermarks{0, 0}) || w[1] != (Watermarks{0, 7}) {
		t.Fatalf("after 7 records to partition 1: %v", w)
	}
	for range 20 {
		produce(t, conn, recordsTopic, 0, goodRecords("r", 100)...)
	}
	b.ApplyRetention()
	start := b.LogStartOffsets(recordsTopic)[0]
	if w := read(); w[0] != (Watermarks{start, 2000}) || start == 0 {
		t.Fatalf("after 2000 records to partition 0 and retention (log start %d): %v", start, w)
	}

	other, err := NewOffsetsReader(ctx, conn, "no.such.topic")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if w, err := other.Read(rctx); err == nil || !strings.Contains(err.Error(), "no.such.topic") {
		t.Fatalf("reading a topic the broker does not have: %v, %v; want an error naming it", w, err)
	}
	if _, err := NewOffsetsReader(ctx, ConnConfig{}, recordsTopic); err == nil {
		t.Fatal("a reader without brokers was made")
	}
}
