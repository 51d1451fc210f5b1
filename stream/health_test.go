package stream

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestHealthFollowsTheBroker stops the broker under a running consumer: Health turns unready
// within StallAfter of the broker's last answer, says why, and turns ready again within max(RefreshInterval, RetryMax) +
// FetchWait of the broker's return (plus a second of slack for the restart and the polling).
func TestHealthFollowsTheBroker(t *testing.T) {
	port := testnet.Reserve(t) // the same address across the restart, nobody else's meanwhile
	bcfg := broker.Config{Listen: port.Addr(), DataDir: t.TempDir(), Topics: []string{recordsTopic, deadTopic}}
	bcfg.Listener = port.Listen(t)
	b := startBroker(t, bcfg)
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("before", 3)...)
	cfg := consumerConfig(conn, "health")
	cfg.StallAfter, cfg.RefreshInterval, cfg.RetryMax = 2*time.Second, 200*time.Millisecond, 500*time.Millisecond
	c := newConsumer(t, cfg)
	// The consumer may have fetched the records already (its readers run from the start): ready
	// then, but only once the broker answered and the partition was read to its end.
	if h := c.Health(); h.Ready && (h.LastBrokerReply.IsZero() || !h.CaughtUp || h.Readers == 0) {
		t.Fatalf("ready before the broker answered and the partition was read: %+v", h)
	}
	collect(t, c, 3, 20*time.Second)
	waitfor.Cond(t, 10*time.Second, "ready", func() bool { return c.Health().Ready })
	if h := c.Health(); h.Partitions != 1 || h.Readers != 1 || !h.CaughtUp {
		t.Fatalf("health %+v", h)
	}

	b.Close()
	stopped := time.Now()
	// Health judges from the consumer's record of the broker's last answer, against StallAfter.
	// Every poll is checked against that rule (a poll's window [before, after] contains the
	// instant Health compared): ready only if the broker answered within StallAfter, unready
	// naming the broker only if it did not. The last answer was sent before the broker stopped
	// (the consumer records it when it reads it, which may be a moment after Close returned), so
	// the consumer turns unready about StallAfter after the stop, however late the test polls.
	var h Health
	polls := 0
	waitfor.Cond(t, cfg.StallAfter+time.Minute, "unready", func() bool {
		before := time.Now()
		h = c.Health()
		after := time.Now()
		polls++
		names := slices.ContainsFunc(h.Reasons, func(r string) bool { return strings.Contains(r, "broker has not answered") })
		if h.Ready && before.Sub(h.LastBrokerReply) > cfg.StallAfter {
			t.Fatalf("ready %v after the broker's last answer; the bound is %v", before.Sub(h.LastBrokerReply), cfg.StallAfter)
		}
		if names && after.Sub(h.LastBrokerReply) <= cfg.StallAfter {
			t.Fatalf("unready naming the broker %v after its last answer, within the bound %v: %q", after.Sub(h.LastBrokerReply), cfg.StallAfter, h.Reasons)
		}
		return !h.Ready
	})
	t.Logf("unready %v after the broker stopped (%d polls), its last answer %v before the stop: %q",
		time.Since(stopped).Round(time.Millisecond), polls, stopped.Sub(h.LastBrokerReply).Round(time.Millisecond), h.Reasons)
	// The failed attempts since (one every RetryMax at most) are not answers.
	time.Sleep(2 * cfg.RetryMax)
	if last := c.Health().LastBrokerReply; !last.Equal(h.LastBrokerReply) {
		t.Fatalf("the consumer heard from the stopped broker at %v (its last answer was at %v)", last, h.LastBrokerReply)
	}
	if !slices.ContainsFunc(h.Reasons, func(r string) bool { return strings.Contains(r, "broker has not answered") }) {
		t.Fatalf("reasons %q do not name the broker", h.Reasons)
	}

	bcfg.Listener = port.Listen(t)
	b2 := startBroker(t, bcfg)
	// Ready again, however late: how soon is the retry schedule's property (each wait at most
	// RetryMax, internal/backoff's TestBounds), which a wall-clock bound on a busy core would not
	// measure. The time it took is logged.
	restarted := time.Now()
	waitfor.Cond(t, 2*time.Minute, "ready again", func() bool { return c.Health().Ready })
	t.Logf("ready %v after the broker restarted", time.Since(restarted).Round(time.Millisecond))
	produce(t, plainConn(b2), recordsTopic, 0, goodRecords("after", 2)...)
	if got := ids(collect(t, c, 2, 20*time.Second)); !slices.Equal(got, []string{"after0", "after1"}) {
		t.Fatalf("after the restart read %v", got)
	}
}

// TestOutageLogsTwoLines stops the broker for a few seconds under a consumer with the default
// retry settings: the outage writes one WARN line when it starts and one INFO line when it
// ends, with its duration, the failed attempts and the suppressed lines; the consumer reads on.
func TestOutageLogsTwoLines(t *testing.T) { outageLines(t, 3*time.Second) }

// TestOutageLogsTwoLines31s is TestOutageLogsTwoLines over a 31 s broker outage: a WARN per failed
// attempt would be hundreds of lines.
func TestOutageLogsTwoLines31s(t *testing.T) {
	if testing.Short() {
		t.Skip("a 31 s broker outage")
	}
	outageLines(t, 31*time.Second)
}

func outageLines(t *testing.T, outage time.Duration) {
	port := testnet.Reserve(t) // the same address across the restart, nobody else's meanwhile
	bcfg := broker.Config{Listen: port.Addr(), DataDir: t.TempDir(), Topics: []string{recordsTopic, deadTopic}}
	bcfg.Listener = port.Listen(t)
	b := startBroker(t, bcfg)
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("before", 3)...)
	log, lines := newLogLines(nil)
	cfg := ConsumerConfig{Conn: conn, Topic: recordsTopic, GroupID: "outage", DeadLetterTopic: deadTopic,
		MaxRecords: 3, MaxWait: 300 * time.Millisecond} // the retry settings are the defaults
	c, err := NewConsumer(context.Background(), cfg, testSchema(t), log)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	collect(t, c, 3, 30*time.Second)
	b.Close()
	time.Sleep(outage)
	bcfg.Listener = port.Listen(t)
	b2 := startBroker(t, bcfg)
	produce(t, plainConn(b2), recordsTopic, 0, goodRecords("after", 2)...)
	if got := ids(collect(t, c, 2, 60*time.Second)); !slices.Equal(got, []string{"after0", "after1"}) {
		t.Fatalf("after the outage read %v", got)
	}
	// The summary is written by the reader that first succeeds again, which may be after the
	// records were handed out: wait for it.
	waitfor.Cond(t, 30*time.Second, "the outage's summary line", func() bool { return lines.count(slog.LevelInfo, "succeed again") > 0 })
	warn, info, errs := lines.count(slog.LevelWarn, ""), lines.count(slog.LevelInfo, ""), lines.atLeast(slog.LevelError)
	t.Logf("%v outage: %d WARN, %d INFO, %d ERROR lines", outage, warn, info, errs)
	for _, l := range []slog.Level{slog.LevelWarn, slog.LevelInfo} {
		if v, ok := lines.attr(l, "", "err"); ok {
			t.Logf("first %s: %s", l, v)
		}
	}
	if warn != 1 || info != 1 || errs != 0 {
		t.Fatalf("%d WARN, %d INFO, %d ERROR lines for one outage; want 1 WARN, 1 INFO", warn, info, errs)
	}
	attempts, _ := lines.attr(slog.LevelInfo, "succeed again", "failed_attempts")
	suppressed, _ := lines.attr(slog.LevelInfo, "succeed again", "suppressed_log_lines")
	took, _ := lines.attr(slog.LevelInfo, "succeed again", "outage")
	t.Logf("summary: outage %v, %v failed attempts, %v lines suppressed", took, attempts, suppressed)
	if attempts.Int64() < 2 || took.Duration() < outage {
		t.Fatalf("summary says %v failed attempts over %v, want >= 2 over >= %v", attempts, took, outage)
	}
}
