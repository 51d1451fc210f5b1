package stream

import (
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// TestFetchTimeoutsAndEOFAreRetried: a broker that leaves fetches unanswered (the client's
// per-request deadline ends: "kafka.(*Client).Fetch: context deadline exceeded", as on an
// overloaded machine) and then closes connections mid-request (unexpected EOF) does not stop the
// consumer: it retries with backoff, and every record arrives, once, in order.
func TestFetchTimeoutsAndEOFAreRetried(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, recordsTopic, deadTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	conn := ConnConfig{Brokers: c.ListenAddrs(), DialTimeout: 100 * time.Millisecond}
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
