package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
	"github.com/cfguard/cfguard/ui"
)

// scriptedSink is an eventSink whose answer to its call-th attempt of n events is
// refuse(call, n) (nil: taken; call counts from 0 over the sink's life); it records each
// attempt's size.
type scriptedSink struct {
	refuse func(call, n int) error
	calls  int
	sizes  []int
}

func (s *scriptedSink) PublishBatch(_ context.Context, evs []stream.Event) error {
	s.calls++
	s.sizes = append(s.sizes, len(evs))
	return s.refuse(s.calls-1, len(evs))
}

// tooLargeOver refuses, as too large, an attempt of more than limit events.
func tooLargeOver(limit, n int) error {
	if n > limit {
		return fmt.Errorf("the topic refuses %d events: %w", n, kafka.MessageSizeTooLarge)
	}
	return nil
}

// sizes expands (size, count) pairs into a list of attempt sizes.
func sizes(pairs ...int) []int {
	var out []int
	for i := 0; i < len(pairs); i += 2 {
		for range pairs[i+1] {
			out = append(out, pairs[i])
		}
	}
	return out
}

// putEvents writes n small events to l's outbox in one checkpoint.
func putEvents(t *testing.T, l *ledger.Ledger, n int) {
	t.Helper()
	if n == 0 {
		return
	}
	evs := make([]Event, n)
	for i := range evs {
		evs[i] = Event{Type: "audit_completed", PosteriorVersion: uint64(i)}
	}
	if err := l.Checkpoint(&ledger.Checkpoint{Events: outboxEntries(evs)}); err != nil {
		t.Fatal(err)
	}
}

// The number of entries an attempt takes follows what the events topic takes: outboxBatch at
// first; half the refused attempt's entries, at once within the same drain, each time the topic
// refuses an attempt of several as too large (whatever attempts worked before at that size);
// twice as many after outboxRegrow attempts that worked, never more than outboxBatch. Any other
// failure ends the drain with an error and leaves the size as it was.
func TestOutboxBatchSizeFollowsTheTopic(t *testing.T) {
	type drain struct {
		add       int                     // entries written to the outbox before the drain
		refuse    func(call, n int) error // nil: as the drain before
		wantErr   bool
		wantSizes []int
	}
	for _, tc := range []struct {
		name   string
		drains []drain
	}{
		{"shrinks and grows back", []drain{{
			add: 2624,
			refuse: func(call, n int) error {
				switch {
				case call < 7:
					return tooLargeOver(100, n)
				case call < 16:
					return tooLargeOver(40, n)
				}
				return nil
			},
			// 5 attempts of 64 work before the topic takes at most 40: the 8 that double the
			// size again are counted from the refusal.
			wantSizes: sizes(256, 1, 128, 1, 64, 5, 64, 1, 32, 8, 64, 8, 128, 8, 256, 2),
		}}},
		{"grows from an odd size", []drain{
			{add: 6, refuse: func(call, n int) error { return tooLargeOver(5, n) }, wantSizes: sizes(6, 1, 3, 2)},
			{add: 3554, refuse: func(int, int) error { return nil },
				wantSizes: sizes(3, 6, 6, 8, 12, 8, 24, 8, 48, 8, 96, 8, 192, 8, 256, 2)},
		}},
		{"another failure", []drain{
			{add: 300, refuse: func(call, n int) error {
				if call == 0 {
					return errors.New("the broker is away")
				}
				return nil
			}, wantErr: true, wantSizes: []int{256}},
			{wantSizes: []int{256, 44}},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := openOutboxLedger(t)
			sink := &scriptedSink{}
			p := newOutboxPublisher(l, sink, alerts.NewMetrics(prometheus.NewRegistry()), "", slog.New(slog.DiscardHandler))
			var after uint64
			for i, d := range tc.drains {
				putEvents(t, l, d.add)
				if d.refuse != nil {
					sink.refuse = d.refuse
				}
				sink.sizes = sink.sizes[:0:0]
				err := p.drain(context.Background(), &after)
				if (err != nil) != d.wantErr {
					t.Fatalf("drain %d: %v, want an error: %v", i, err, d.wantErr)
				}
				if !slices.Equal(sink.sizes, d.wantSizes) {
					t.Fatalf("drain %d: attempts of %v entries; want %v", i, sink.sizes, d.wantSizes)
				}
			}
			if n, err := l.OutboxLen(); err != nil || n != 0 {
				t.Fatalf("%d entries left in the outbox (%v), want none", n, err)
			}
		})
	}
}

// Shrinking batches is said once at INFO, and said again only after an entry was refused
// alone (named once at ERROR): a topic that refuses each batch that grows back is not news.
func TestOutboxShrinkingSaidOncePerEpisode(t *testing.T) {
	l := openOutboxLedger(t)
	limit := 2
	sink := &scriptedSink{refuse: func(_, n int) error { return tooLargeOver(limit, n) }}
	logs := &tooltest.Output{}
	p := newOutboxPublisher(l, sink, alerts.NewMetrics(prometheus.NewRegistry()), "", slog.New(slog.NewTextHandler(logs, nil)))
	var after uint64
	count := func(s string) int { return strings.Count(logs.String(), s) }
	const shrink, alone = "publishing fewer entries per batch", "an outbox entry is too large for its topic"
	step := func(add, lim int, wantErr bool, wantShrink, wantAlone int) {
		t.Helper()
		putEvents(t, l, add)
		limit = lim
		if err := p.drain(context.Background(), &after); (err != nil) != wantErr {
			t.Fatalf("drain: %v, want an error: %v", err, wantErr)
		}
		if count(shrink) != wantShrink || count(alone) != wantAlone {
			t.Fatalf("%d lines saying the batches shrink and %d naming an entry alone, want %d and %d:\n%s", count(shrink), count(alone), wantShrink, wantAlone, logs.String())
		}
	}
	step(4, 2, false, 1, 0) // 4 refused: said
	step(4, 1, false, 1, 0) // 2 refused: shrinking still, not said again
	step(1, 0, true, 1, 1)  // one entry refused alone: named
	step(0, 0, true, 1, 1)  // named once
	// Taken again: once the batches grow back to 2 and are refused, shrinking is said again.
	step(9, 1, false, 2, 1)
	if n, err := l.OutboxLen(); err != nil || n != 0 {
		t.Fatalf("%d entries left in the outbox (%v), want none", n, err)
	}
}

// notify never blocks, and wake-ups coalesce: one is pending however often it is called.
func TestOutboxNotifyCoalesces(t *testing.T) {
	p := newOutboxPublisher(nil, nil, nil, "", slog.New(slog.DiscardHandler))
	for range 3 {
		p.notify()
	}
	if n := len(p.wake); n != 1 {
		t.Fatalf("%d wake-ups pending after three notifications, want 1", n)
	}
}

// switchSink is an eventSink that refuses everything while fail is set.
type switchSink struct{ fail atomic.Bool }

func (s *switchSink) PublishBatch(context.Context, []stream.Event) error {
	if s.fail.Load() {
		return errors.New("the events topic is away")
	}
	return nil
}

// Each outage of the events topic is an outage of its own: logged with one WARN line when it
// starts, and its state (failing since, attempts) starts afresh, after the state of the one
// before was cleared.
func TestOutboxEachOutageLoggedAndTimedOnItsOwn(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l := openOutboxLedger(t)
	sink := &switchSink{}
	logs := &tooltest.Output{}
	p := newOutboxPublisher(l, sink, alerts.NewMetrics(prometheus.NewRegistry()), "", slog.New(slog.NewTextHandler(logs, nil)))
	var state atomic.Pointer[ui.Publishing]
	p.state = &state
	const warn = "publishing outbox entries failed"
	outage := func() *ui.Publishing {
		t.Helper()
		sink.fail.Store(true)
		putEvents(t, l, 1)
		p.notify()
		waitfor.Cond(t, 30*time.Second, "the publisher's state to say it fails", func() bool { return state.Load() != nil })
		s := state.Load()
		sink.fail.Store(false)
		p.notify()
		waitfor.Cond(t, 30*time.Second, "the outbox to drain and the state to clear", func() bool {
			n, err := l.OutboxLen()
			return err == nil && n == 0 && state.Load() == nil
		})
		return s
	}
	runPublisher(t, ctx, p)
	first := outage()
	second := outage()
	if !second.FailingSince.After(first.FailingSince) {
		t.Errorf("the second outage failing since %v, the first since %v: want it timed from its own start", second.FailingSince, first.FailingSince)
	}
	if n := strings.Count(logs.String(), warn); n != 2 {
		t.Errorf("%d WARN lines for two outages, want 2:\n%s", n, logs.String())
	}
}

// run returns the ledger's error when the outbox cannot be read (a closed ledger) rather than
// retrying, and records no failing publish for it.
func TestOutboxRunStopsOnAClosedLedger(t *testing.T) {
	l := openOutboxLedger(t)
	putEvents(t, l, 1)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	p := newOutboxPublisher(l, &switchSink{}, alerts.NewMetrics(prometheus.NewRegistry()), "", slog.New(slog.DiscardHandler))
	var state atomic.Pointer[ui.Publishing]
	p.state = &state
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.run(ctx) }()
	var runErr error
	returned := false
	waitfor.Cond(t, 30*time.Second, "run to return or record a failure", func() bool {
		select {
		case runErr = <-done:
			returned = true
			return true
		default:
			return state.Load() != nil
		}
	})
	cancel()
	if !returned {
		runErr = <-done
	}
	if !errors.Is(runErr, ledger.ErrClosed) || state.Load() != nil {
		t.Fatalf("run on a closed ledger: %v, state %+v; want %v and no failing state", runErr, state.Load(), ledger.ErrClosed)
	}
}

// keySink is an eventSink that records the keys it is given.
type keySink struct{ keys []string }

func (s *keySink) PublishBatch(_ context.Context, evs []stream.Event) error {
	for _, e := range evs {
		s.keys = append(s.keys, e.Key)
	}
	return nil
}

// Entries published but not acknowledged (the ledger's write failed) end the drain with the
// ledger's error and stay in the outbox: the next drain publishes them again, then
// acknowledges them.
func TestOutboxUnacknowledgedEntriesArePublishedAgain(t *testing.T) {
	var diskFails atomic.Bool
	l, err := ledger.Open(t.TempDir(), ledger.Options{EncodeChange: encodeChange, Logger: slog.New(slog.DiscardHandler),
		AfterCommit: func() error {
			if diskFails.Load() {
				return errors.New("the disk refuses the write")
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if err := l.Checkpoint(&ledger.Checkpoint{Events: outboxEntries([]Event{{Type: "kl_over_budget"}, {Type: "audit_completed"}})}); err != nil {
		t.Fatal(err)
	}
	sink := &keySink{}
	p := newOutboxPublisher(l, sink, alerts.NewMetrics(prometheus.NewRegistry()), "", slog.New(slog.DiscardHandler))
	var after uint64
	diskFails.Store(true)
	if err := p.drain(context.Background(), &after); err == nil || !strings.Contains(err.Error(), "acknowledging") {
		t.Fatalf("drain while the ledger cannot write: %v; want the acknowledgement's error", err)
	}
	diskFails.Store(false)
	if err := p.drain(context.Background(), &after); err != nil {
		t.Fatal(err)
	}
	want := []string{"kl_over_budget", "audit_completed", "kl_over_budget", "audit_completed"}
	if !slices.Equal(sink.keys, want) {
		t.Fatalf("published %v; want %v (the unacknowledged entries again)", sink.keys, want)
	}
	if n, err := l.OutboxLen(); err != nil || n != 0 {
		t.Fatalf("%d entries left in the outbox (%v), want none", n, err)
	}
}
