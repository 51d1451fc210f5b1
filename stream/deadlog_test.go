package stream

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// deadBurst produces burst+extra bad records and a good one, and reads them with a consumer
// logging to lines: burst dead letters are logged one by one, extra are only counted.
func deadBurst(t *testing.T, extra int, window time.Duration) (*Consumer, logLines) {
	b := startBroker(t, broker.Config{Topics: []string{recordsTopic, deadTopic}})
	conn := plainConn(b)
	var values []string
	for range deadLogBurst + extra {
		values = append(values, `{"id":"bad"}`)
	}
	produce(t, conn, recordsTopic, 0, append(values, goodRecord("good", 1))...)
	log, lines := newLogLines(nil)
	cfg := consumerConfig(conn, "deadlog")
	cfg.deadLogWindow = window
	c, err := NewConsumer(context.Background(), cfg, testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	collect(t, c, 1, 30*time.Second)
	if n := lines.count(slog.LevelWarn, "record dead-lettered"); n != deadLogBurst {
		t.Fatalf("%d dead letters logged one by one, want %d", n, deadLogBurst)
	}
	return c, lines
}

// TestDeadLetterSummaryWithoutMoreDeadLetters: a burst of dead letters followed by silence is
// summarized when the log window ends, not only when the next dead letter arrives (which may be
// never).
func TestDeadLetterSummaryWithoutMoreDeadLetters(t *testing.T) {
	_, lines := deadBurst(t, 5, 500*time.Millisecond)
	waitfor.Cond(t, 10*time.Second, "the summary line", func() bool {
		return lines.count(slog.LevelWarn, "more records dead-lettered than logged") > 0
	})
	if v, _ := lines.attr(slog.LevelWarn, "more records dead-lettered than logged", "not_logged"); v.Int64() != 5 {
		t.Fatalf("summary says not_logged=%v, want 5", v)
	}
}

// TestDeadLetterSummaryAtClose: the count of dead letters not logged is written at Close.
func TestDeadLetterSummaryAtClose(t *testing.T) {
	c, lines := deadBurst(t, 3, 0)
	c.Close()
	if v, ok := lines.attr(slog.LevelWarn, "more records dead-lettered than logged", "not_logged"); !ok || v.Int64() != 3 {
		t.Fatalf("after Close: summary %v (found %v), want not_logged=3", v, ok)
	}
}
