package daemon

import (
	"bytes"
	"context"
	"log/slog"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/stream"
)

// The input topic's watermarks are unknown until first read, then the last ones read with their
// time; partitions are marked reset and unmarked one by one or all at once, and what a reader is
// handed is a copy that the marks' later changes do not touch.
func TestTopicEndsKeepsTheLastReadAndTheResets(t *testing.T) {
	var e topicEnds
	if _, _, reset, ok := e.get(); ok || len(reset) != 0 {
		t.Fatalf("before any read: ok %v, resets %v; want nothing", ok, reset)
	}
	at := time.Unix(1700000000, 0)
	w := map[int]stream.Watermarks{0: {Start: 2, End: 9}}
	e.set(w, at)
	got, gotAt, _, ok := e.get()
	if !ok || !maps.Equal(got, w) || !gotAt.Equal(at) {
		t.Fatalf("after a read: %v at %v (ok %v), want %v at %v", got, gotAt, ok, w, at)
	}
	for _, s := range []struct {
		name  string
		do    func()
		reset map[int]bool
	}{
		{"mark 1", func() { e.setReset(1, true) }, map[int]bool{1: true}},
		{"mark 3", func() { e.setReset(3, true) }, map[int]bool{1: true, 3: true}},
		{"unmark 1", func() { e.setReset(1, false) }, map[int]bool{3: true}},
		{"unmark 2, never marked", func() { e.setReset(2, false) }, map[int]bool{3: true}},
		{"clear", e.clearResets, map[int]bool{}},
		{"mark 0 after the clear", func() { e.setReset(0, true) }, map[int]bool{0: true}},
	} {
		s.do()
		_, _, reset, _ := e.get()
		if !maps.Equal(reset, s.reset) {
			t.Fatalf("%s: resets %v, want %v", s.name, reset, s.reset)
		}
		reset[7] = true // the reader's copy
		if _, _, again, _ := e.get(); again[7] {
			t.Fatalf("%s: a reader's change to its copy marked partition 7", s.name)
		}
	}
}

// Each read of the input topic's watermarks that succeeds replaces the last ones and their time;
// one that fails keeps them. A failure is logged once per episode of failed reads (a WARN line
// when reads start failing, an INFO line when they succeed again), and a read cut short by the
// daemon's stop is no failure.
func TestReadEndsKeepsTheLastWatermarksAndLogsEachEpisodeOnce(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"records"}, Partitions: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	conn := stream.ConnConfig{Brokers: b.Addrs(), DialTimeout: 5 * time.Second}
	good, err := stream.NewOffsetsReader(ctx, conn, "records")
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	bad, err := stream.NewOffsetsReader(ctx, conn, "no.such.topic")
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	var logs bytes.Buffer
	d := &Daemon{cfg: &config.Config{}, log: slog.New(slog.NewTextHandler(&logs, nil))}
	d.cfg.Kafka.Topic = "records"
	lines := func(level string) int { return strings.Count(logs.String(), "level="+level+" ") }
	stopped, stop := context.WithCancel(ctx)
	stop()
	var lastAt time.Time
	for _, s := range []struct {
		name        string
		ctx         context.Context
		r           *stream.OffsetsReader
		warns, info int
	}{
		{"a read", ctx, good, 0, 0},
		{"a failed read", ctx, bad, 1, 0},
		{"another failed read", ctx, bad, 1, 0},
		{"a read again", ctx, good, 1, 1},
		{"a read cut by the stop", stopped, bad, 1, 1},
		{"a failed read after the stop's", ctx, bad, 2, 1},
	} {
		d.readEnds(s.ctx, s.r)
		w, at, _, ok := d.ends.get()
		if !ok || len(w) != 2 || w[0] != (stream.Watermarks{}) || w[1] != (stream.Watermarks{}) {
			t.Fatalf("%s: watermarks %v (ok %v), want the two empty partitions read", s.name, w, ok)
		}
		if s.r == good {
			lastAt = at
		} else if !at.Equal(lastAt) {
			t.Fatalf("%s: the watermarks' time moved from %v to %v on a failed read", s.name, lastAt, at)
		}
		if lines("WARN") != s.warns || lines("INFO") != s.info {
			t.Fatalf("%s: %d WARN and %d INFO lines, want %d and %d:\n%s", s.name, lines("WARN"), lines("INFO"), s.warns, s.info, logs.String())
		}
	}
}
