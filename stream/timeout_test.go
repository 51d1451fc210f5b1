package stream

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestFetchTimeoutsAndEOFAreRetried: a broker that leaves fetches unanswered (the client's
// per-request deadline ends: "kafka.(*Client).Fetch: context deadline exceeded", as on an
// overloaded machine) and then closes connections mid-request (unexpected EOF) does not stop the
// consumer: it retries with backoff, and every record arrives, once, in order.
func TestFetchTimeoutsAndEOFAreRetried(t *testing.T) {
	c, conn := bareCluster(t)
	conn.DialTimeout = 100 * time.Millisecond
	const n = 300
	produce(t, conn, recordsTopic, 0, goodRecords("r", n)...)

	// The first fetches are swallowed (no answer: the client times out), the next ones close
	// the connection (the client reads an unexpected EOF); the rest are served.
	const unanswered, closed = 3, 2
	var fetches atomic.Int32
	c.ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		switch i := fetches.Add(1); {
		case i <= unanswered:
			c.KeepControl()
			return nil, nil, true
		case i <= unanswered+closed:
			c.KeepControl()
			return nil, errors.New("connection closed by the test"), true
		}
		c.DropControl()
		return nil, nil, false
	})

	cfg := consumerConfig(conn, "timeouts")
	cfg.FetchWait = 50 * time.Millisecond // per-request timeout: DialTimeout + 2 x FetchWait = 200 ms
	cons := newConsumer(t, cfg)
	got := ids(collect(t, cons, n, 30*time.Second))
	want := make([]string, n)
	for i := range want {
		want[i] = fmt.Sprintf("r%d", i)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("records after timeouts: got %d (%v ...), want r0..r%d in order", len(got), got[:min(len(got), 5)], n-1)
	}
	if f := fetches.Load(); f <= unanswered+closed {
		t.Fatalf("only %d fetches reached the broker: the faults were not exercised", f)
	}
	if r := cons.Stats().Retries; r < unanswered+closed {
		t.Fatalf("%d retries, want at least %d (one per swallowed or closed fetch)", r, unanswered+closed)
	}
	if h := cons.Health(); slices.ContainsFunc(h.Reasons, func(s string) bool { return len(s) > 7 && s[:8] == "stopped:" }) {
		t.Fatalf("consumer reports itself stopped: %v", h.Reasons)
	}
}

// TestOffsetsCutOffAreTransient: kafka-go splits a ListOffsets request by broker, and answers
// each partition of a part whose connection the broker closed with error -1 (Unknown), not with
// the network error. ReadWatermarks reports it as an error Transient holds for, still matching
// kafka.Unknown, and the next read, answered, returns the watermarks.
func TestOffsetsCutOffAreTransient(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(3), kfake.SeedTopics(3, recordsTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	for p := range int32(3) {
		if err := c.MoveTopicPartition(recordsTopic, p, p); err != nil {
			t.Fatal(err)
		}
	}
	conn := ConnConfig{Brokers: c.ListenAddrs(), DialTimeout: time.Second}
	produce(t, conn, recordsTopic, 1, goodRecords("r", 3)...)
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(conn.Brokers...), Timeout: 5 * time.Second}
	var cut atomic.Bool
	c.ControlKey(int16(kmsg.ListOffsets), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if cut.Load() && c.CurrentNode() == 1 {
			return nil, errors.New("connection closed by the test"), true
		}
		return nil, nil, false
	})
	cut.Store(true)
	_, err = ReadWatermarks(context.Background(), cl, recordsTopic)
	if err == nil || !errors.Is(err, kafka.Unknown) || !Transient(err) {
		t.Fatalf("offsets cut off at one broker: %v (Unknown: %t, transient: %t), want an error matching kafka.Unknown that Transient holds for",
			err, errors.Is(err, kafka.Unknown), Transient(err))
	}
	if Transient(kafka.Unknown) {
		t.Error("kafka.Unknown on its own is transient: only an offsets answer's is")
	}
	cut.Store(false)
	w, err := ReadWatermarks(context.Background(), cl, recordsTopic)
	if err != nil || w[1].End != 3 || w[0].End != 0 || w[2].End != 0 {
		t.Fatalf("offsets answered: %v, %v; want partition 1 ending at 3, the others at 0", w, err)
	}
}
