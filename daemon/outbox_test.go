package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
	"github.com/cfguard/cfguard/ui"
)

// TestOutboxPublisherWaitsForTheBroker: events written to the outbox while the events topic's
// broker is down stay there (cfguard_events_pending), each failed attempt is counted and the
// outage logged once; once a broker answers on that address they are published in sequence
// order with their sequence numbers as headers and acknowledged (the outbox empties). An event
// too large for the topic is published without its records instead of blocking the rest.
func TestOutboxPublisherWaitsForTheBroker(t *testing.T) {
	t.Parallel() // waits for its broker's retries
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l := openOutboxLedger(t)
	data := daemontest.Bundled(t)
	m, _, err := bnn.Fit(ctx, data, []string{"malignant", "benign"}, bnn.TrainConfig{Seed: 1, Epochs: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
		t.Fatal(err)
	}
	held := make([]heldRecord, 5000) // about 1.5 MB of JSON
	for i := range held {
		held[i] = heldRecord{ID: fmt.Sprint(i), Features: data.X[i%len(data.X)], Label: 1, Partition: 1 - i%2, Offset: int64(100 + i/2)}
	}
	kl := 0.2
	evs := []Event{
		{Type: "kl_over_budget", PosteriorVersion: 0, KL: &kl, Budget: 0.10125, Policy: "reject"},
		{Type: "increment_held", PosteriorVersion: 0, KL: &kl, Held: held},
		{Type: "update_failed", PosteriorVersion: 0, Records: []string{"a", "b"}, Error: "non-finite loss"},
		{Type: "audit_completed", PosteriorVersion: 0, Counts: map[string]int{"certified": 3}},
	}
	if err := l.Checkpoint(&ledger.Checkpoint{Events: outboxEntries(evs)}); err != nil {
		t.Fatal(err)
	}
	stored, err := l.Outbox(0, 100)
	if err != nil || len(stored) != len(evs) {
		t.Fatalf("outbox holds %d entries (%v), want %d", len(stored), err, len(evs))
	}

	port := testnet.Reserve(t) // an address with no broker behind it (yet), held until one listens there
	addr := port.Addr()
	pub, err := stream.NewPublisher(ctx, stream.PublisherConfig{Conn: stream.ConnConfig{Brokers: []string{addr}}, Topic: "cfguard.events"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	reg := prometheus.NewRegistry()
	// cfguard_events_pending is read from the ledger at each scrape, as the daemon wires it.
	reg.MustRegister(alerts.NewStateCollector(0.1, func() (alerts.State, error) {
		st, err := l.State()
		return alerts.State{Counts: st.Counts, OutboxPending: st.OutboxLen}, err
	}))
	r := &running{Reg: reg}
	logs := &tooltest.Output{}
	p := newOutboxPublisher(l, pub, alerts.NewMetrics(reg), "", slog.New(slog.NewTextHandler(logs, nil)))
	var state atomic.Pointer[ui.Publishing]
	p.state = &state
	runPublisher(t, ctx, p)
	waitfor.Cond(t, 60*time.Second, "a failed publish attempt", func() bool { return r.Metric(t, alerts.NameEvents, "result", "failed") >= float64(len(evs)) })
	// The UI's events page reads the outage from the publisher's state: since when, how many
	// attempts, the latest error (stored after the attempt is counted: waited for).
	waitfor.Cond(t, 30*time.Second, "the publisher's state to say it fails", func() bool { return state.Load() != nil })
	if s := state.Load(); s.FailingSince.IsZero() || s.Attempts < 1 || !strings.Contains(s.Err, addr) {
		t.Fatalf("the publisher's state while the broker is down: %+v, want failing since a time, attempts and an error naming %s", s, addr)
	}
	if got := r.Metric(t, alerts.NameEventsPending); got != float64(len(evs)) {
		t.Fatalf("%s = %v while the broker is down, want %d", alerts.NameEventsPending, got, len(evs))
	}

	b, err := broker.Start(ctx, broker.Config{Listen: addr, Listener: port.Listen(t), Topics: []string{"cfguard.events"}, Partitions: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	p.notify()
	waitfor.Cond(t, 60*time.Second, "the outbox to drain", func() bool { n, err := l.OutboxLen(); return err == nil && n == 0 })
	waitfor.Cond(t, 5*time.Second, "cfguard_events_pending 0", func() bool { return r.Metric(t, alerts.NameEventsPending) == 0 })
	if got := r.Metric(t, alerts.NameEvents, "result", "published"); got != float64(len(evs)) {
		t.Errorf("%s{result=published} = %v after the outbox drained, want %d", alerts.NameEvents, got, len(evs))
	}

	for i, msg := range readTopic(t, ctx, []string{addr}, len(stored)) {
		want := stored[i]
		if seq := kafkatest.Header(msg, OutboxSeqHeader); seq != strconv.FormatUint(want.Seq, 10) || string(msg.Key) != want.Key {
			t.Fatalf("event %d: key %q, %s %q; want %q, %d", i, msg.Key, OutboxSeqHeader, seq, want.Key, want.Seq)
		}
		var e Event
		if err := json.Unmarshal(msg.Value, &e); err != nil || e.Type != evs[i].Type {
			t.Fatalf("event %d: %s (%v), want type %s", i, msg.Value, err, evs[i].Type)
		}
		if e.Type == "increment_held" && (len(e.Held) != 0 || len(msg.Value) > maxEventBytes || !strings.Contains(e.Error, "5000 records")) {
			t.Fatalf("oversized event published as %d bytes: held %d, error %q", len(msg.Value), len(e.Held), e.Error)
		}
		// It names where its records are, for replay.
		if want := []offsetRange{{0, 100, 2599}, {1, 100, 2599}}; e.Type == "increment_held" && !slices.Equal(e.Offsets, want) {
			t.Fatalf("oversized event names offsets %+v, want %+v", e.Offsets, want)
		}
	}
	// The recovery line follows the drain that acknowledged the last entry (the publisher logs it
	// once its loop finds the outbox empty): wait for it rather than read the log at once.
	waitfor.Cond(t, 10*time.Second, "the recovery line", func() bool { return strings.Contains(logs.String(), "outbox published again") })
	if n := strings.Count(logs.String(), "publishing outbox entries failed"); n != 1 {
		t.Fatalf("%d WARN lines for one outage, want 1:\n%s", n, logs.String())
	}
	// Cleared after the recovery line is written: waited for.
	waitfor.Cond(t, 10*time.Second, "the publisher's state cleared after the drain", func() bool { return state.Load() == nil })
}

// openOutboxLedger opens an empty ledger, closed when the test ends.
func openOutboxLedger(t *testing.T) *ledger.Ledger {
	t.Helper()
	l, err := ledger.Open(t.TempDir(), ledger.Options{EncodeChange: encodeChange, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// openLedger opens a ledger in a new temporary directory, closed when the test ends.
func openLedger(t *testing.T) *ledger.Ledger {
	t.Helper()
	l, err := ledger.Open(t.TempDir(), ledger.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// runPublisher runs p until the test ends, and fails the test if run returns an error.
func runPublisher(t *testing.T, ctx context.Context, p *outboxPublisher) {
	done := make(chan error, 1)
	pctx, stop := context.WithCancel(ctx)
	go func() { done <- p.run(pctx) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("publisher: %v", err)
		}
	})
}

// limitedEventsTopic starts a broker with the events topic, whose max.message.bytes is limit,
// and a publisher to it; both are closed when the test ends.
func limitedEventsTopic(t *testing.T, ctx context.Context, limit string) (*broker.Broker, *stream.Publisher) {
	t.Helper()
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"cfguard.events"}, Partitions: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	kafkatest.SetTopicConfig(t, b.Addrs(), "cfguard.events", "max.message.bytes", limit)
	pub, err := stream.NewPublisher(ctx, stream.PublisherConfig{Conn: stream.ConnConfig{Brokers: b.Addrs()}, Topic: "cfguard.events"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	return b, pub
}

// readTopic reads the first n events of cfguard.events on brokers, in order.
func readTopic(t *testing.T, ctx context.Context, brokers []string, n int) []kafka.Message {
	t.Helper()
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: "cfguard.events", MaxWait: kafkatest.MaxWait})
	defer rd.Close()
	rctx, rcancel := context.WithTimeout(ctx, 20*time.Second)
	defer rcancel()
	msgs := make([]kafka.Message, n)
	for i := range msgs {
		msg, err := rd.ReadMessage(rctx)
		if err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		msgs[i] = msg
	}
	return msgs
}

// recordingStates is a stateSink that keeps what it is given.
type recordingStates struct{ got []ceshare.Encoded }

func (r *recordingStates) Write(_ context.Context, states []ceshare.Encoded) error {
	r.got = append(r.got, states...)
	return nil
}

// The outbox's CE states go to the state sink, its events to the events topic; a daemon without
// a state sink (a single node on a replica's ledger) drops the states.
func TestOutboxSplitsStatesFromEvents(t *testing.T) {
	entries := []ledger.OutboxEntry{
		{Seq: 1, Key: "ce-1", Value: []byte(`{"type":"status_changed"}`)},
		{Seq: 2, Stream: ledger.StreamStates, Key: "ce-1", Value: []byte(`{"id":"ce-1"}`)},
		{Seq: 3, Key: "audit_completed", Value: []byte(`{"type":"audit_completed"}`)},
		{Seq: 4, Stream: ledger.StreamStates, Key: "ce-2", Value: []byte(`{"id":"ce-2"}`)},
	}
	p := newOutboxPublisher(nil, nil, nil, "r1", slog.New(slog.DiscardHandler))
	p.states = &recordingStates{}
	events, states := p.split(entries)
	if len(events) != 2 || string(events[0].Key) != "ce-1" || events[1].Key != "audit_completed" ||
		string(events[1].Headers[OutboxSeqHeader]) != "3" || string(events[1].Headers[ReplicaHeader]) != "r1" {
		t.Fatalf("events %+v; want entries 1 and 3 with their headers", events)
	}
	if len(states) != 2 || string(states[0].Key) != "ce-1" || string(states[1].Value) != `{"id":"ce-2"}` {
		t.Fatalf("states %+v; want entries 2 and 4", states)
	}
	p.states = nil
	if events, states = p.split(entries); len(events) != 2 || len(states) != 0 {
		t.Fatalf("without a state sink: %d events, %d states; want 2 and none", len(events), len(states))
	}
}

// orderedSinks records the order in which the outbox publisher hands events and states over,
// and can refuse events.
type orderedSinks struct {
	calls      []string
	failEvents bool
	failStates bool
}

func (o *orderedSinks) PublishBatch(_ context.Context, evs []stream.Event) error {
	if o.failEvents {
		return errors.New("the events topic refuses them")
	}
	for _, e := range evs {
		o.calls = append(o.calls, "event "+e.Key)
	}
	return nil
}

func (o *orderedSinks) Write(_ context.Context, states []ceshare.Encoded) error {
	if o.failStates {
		return errors.New("the state topic refuses them")
	}
	for _, s := range states {
		o.calls = append(o.calls, "state "+string(s.Key))
	}
	return nil
}

// A state reaches the state topic only after every event the outbox held before it was
// published: while the events topic refuses events, no state is written, and a batch's events go
// before its states. A new owner relies on it: every change a state records was published, so it
// publishes none again (ledger's CE states).
func TestOutboxWritesStatesAfterTheirEvents(t *testing.T) {
	l := openLedger(t)
	err := l.Checkpoint(&ledger.Checkpoint{Events: []ledger.OutboxEntry{
		{Key: "ce-1", Value: []byte(`{"type":"status_changed"}`)},
		{Stream: ledger.StreamStates, Key: "ce-1", Value: []byte(`{"id":"ce-1"}`)},
		{Key: "ce-2", Value: []byte(`{"type":"status_changed"}`)},
		{Stream: ledger.StreamStates, Key: "ce-2", Value: []byte(`{"id":"ce-2"}`)},
	}})
	if err != nil {
		t.Fatal(err)
	}
	sinks := &orderedSinks{failEvents: true}
	reg := prometheus.NewRegistry()
	p := newOutboxPublisher(l, sinks, alerts.NewMetrics(reg), "r1", slog.New(slog.DiscardHandler))
	p.states = sinks
	count := func(result string) float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				if mf.GetName() == alerts.NameEvents && len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == result {
					return m.GetCounter().GetValue()
				}
			}
		}
		return -1
	}
	var after uint64
	if err := p.drain(context.Background(), &after); err == nil || len(sinks.calls) != 0 {
		t.Fatalf("with events refused: drain = %v, handed over %v; want an error and nothing", err, sinks.calls)
	}
	// The state topic refuses the states after the events were published: the attempt failed,
	// its four entries stay in the outbox and count as failed (CfguardOutboxBacklog sees it).
	sinks.failEvents, sinks.failStates = false, true
	if err := p.drain(context.Background(), &after); err == nil || !strings.Contains(err.Error(), "state topic") {
		t.Fatalf("with states refused: drain = %v; want the state topic's error", err)
	}
	if f, pub := count("failed"), count("published"); f != 8 || pub != 0 {
		t.Fatalf("after two failed attempts of 4 entries: %v failed, %v published; want 8 and 0", f, pub)
	}
	if n, _ := l.OutboxLen(); n != 4 {
		t.Fatalf("%d entries left in the outbox after the states failed, want 4", n)
	}
	sinks.calls, sinks.failStates = nil, false
	if err := p.drain(context.Background(), &after); err != nil {
		t.Fatal(err)
	}
	want := []string{"event ce-1", "event ce-2", "state ce-1", "state ce-2"}
	if !slices.Equal(sinks.calls, want) {
		t.Fatalf("handed over %v; want %v", sinks.calls, want)
	}
	if pub := count("published"); pub != 4 {
		t.Fatalf("%v entries counted published, want 4", pub)
	}
}

// An event larger than the events topic takes (its max.message.bytes below the event, which is
// under maxEventBytes) does not hold back the events before it: they are published one at a
// time up to it. It is named at ERROR, once, with the max.message.bytes its topic needs, and
// stays in the outbox with every event after it (events go in order) until the topic takes it:
// then all are published, in order.
func TestOutboxEventTooLargeForItsTopic(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l := openOutboxLedger(t)
	data := daemontest.Bundled(t)
	held := make([]heldRecord, 400) // about 120 kB of JSON
	for i := range held {
		held[i] = heldRecord{ID: fmt.Sprint(i), Features: data.X[i%len(data.X)], Label: 1, Offset: int64(i)}
	}
	kl := 0.2
	evs := []Event{
		{Type: "kl_over_budget", PosteriorVersion: 0, KL: &kl, Budget: 0.10125, Policy: "hold"},
		{Type: "audit_completed", PosteriorVersion: 0, Counts: map[string]int{"certified": 1}},
		{Type: "increment_held", PosteriorVersion: 0, KL: &kl, Held: held},
		{Type: "audit_completed", PosteriorVersion: 0, Counts: map[string]int{"certified": 2}},
	}
	if err := l.Checkpoint(&ledger.Checkpoint{Events: outboxEntries(evs)}); err != nil {
		t.Fatal(err)
	}
	stored, err := l.Outbox(0, 100)
	if err != nil || len(stored) != len(evs) || len(stored[2].Value) < 100_000 || len(stored[2].Value) > maxEventBytes {
		t.Fatalf("outbox: %d entries (%v), the third of %d bytes; want %d, the third between 100 kB and %d", len(stored), err, len(stored[2].Value), len(evs), maxEventBytes)
	}
	b, pub := limitedEventsTopic(t, ctx, "100000")
	logs := &tooltest.Output{}
	reg := prometheus.NewRegistry()
	r := &running{Reg: reg}
	p := newOutboxPublisher(l, pub, alerts.NewMetrics(reg), "", slog.New(slog.NewTextHandler(logs, nil)))
	runPublisher(t, ctx, p)
	defer func() {
		if t.Failed() {
			t.Log(logs.String())
		}
	}()
	// The two events before it go; it and the one after stay.
	waitfor.Cond(t, 30*time.Second, "the entries before the large one published and acknowledged", func() bool {
		n, err := l.OutboxLen()
		return err == nil && n == 2
	})
	line := fmt.Sprintf("seq=%d key=%s bytes=%d", stored[2].Seq, stored[2].Key, len(stored[2].Value))
	waitfor.Cond(t, 30*time.Second, "the ERROR line naming the large entry", func() bool {
		return strings.Contains(logs.String(), "an outbox entry is too large for its topic")
	})
	found := ""
	for l := range strings.Lines(logs.String()) {
		if strings.Contains(l, "an outbox entry is too large for its topic") {
			found = l
		}
	}
	fix := regexp.MustCompile(`raise the topic's max.message.bytes to (\d+) or more`).FindStringSubmatch(found)
	if !strings.Contains(found, "level=ERROR") || !strings.Contains(found, line) || fix == nil {
		t.Fatalf("the line naming the large entry: %q; want ERROR with %q and the max.message.bytes to set", found, line)
	}
	// Retried with backoff, named once.
	failed := r.Metric(t, alerts.NameEvents, "result", "failed")
	waitfor.Cond(t, 30*time.Second, "two more attempts", func() bool { return r.Metric(t, alerts.NameEvents, "result", "failed") >= failed+2 })
	if n := strings.Count(logs.String(), "an outbox entry is too large for its topic"); n != 1 {
		t.Errorf("%d ERROR lines for one entry, want 1", n)
	}
	if n, _ := l.OutboxLen(); n != 2 {
		t.Errorf("%d entries left while the topic refuses the large one, want 2 (it and the one after)", n)
	}

	// The size the line says is enough: with it, the entry and the one after go.
	kafkatest.SetTopicConfig(t, b.Addrs(), "cfguard.events", "max.message.bytes", fix[1])
	p.notify()
	waitfor.Cond(t, 60*time.Second, "the outbox to drain once the topic takes what the line says", func() bool {
		n, err := l.OutboxLen()
		return err == nil && n == 0
	})
	for i, msg := range readTopic(t, ctx, b.Addrs(), len(stored)) {
		if seq, want := kafkatest.Header(msg, OutboxSeqHeader), stored[i]; seq != strconv.FormatUint(want.Seq, 10) {
			t.Fatalf("event %d on the topic has %s %s, want %d: events out of order", i, OutboxSeqHeader, seq, want.Seq)
		}
	}
}

// countingSink records the size of each batch it hands on to its eventSink.
type countingSink struct {
	eventSink
	mu    sync.Mutex
	sizes []int
}

func (c *countingSink) PublishBatch(ctx context.Context, events []stream.Event) error {
	c.mu.Lock()
	c.sizes = append(c.sizes, len(events))
	c.mu.Unlock()
	return c.eventSink.PublishBatch(ctx, events)
}

// largest is the largest batch a publish attempt was given since from (an index into sizes).
func (c *countingSink) largest(from int) (most, n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, s := range c.sizes[min(from, len(c.sizes)):] {
		most = max(most, s)
	}
	return most, len(c.sizes)
}

// Events that each fit the events topic but not as a whole batch (its max.message.bytes below
// the writer's batch) go in smaller batches, at once, without an ERROR naming any; once the
// topic takes whole batches again, the batches grow back to outboxBatch.
func TestOutboxBatchesShrinkToFitTheTopic(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l := openOutboxLedger(t)
	events := func(n int) []ledger.OutboxEntry {
		evs := make([]Event, n)
		for i := range evs {
			evs[i] = Event{Type: "audit_completed", PosteriorVersion: uint64(i), Counts: map[string]int{"certified": i}}
		}
		return outboxEntries(evs)
	}
	if err := l.Checkpoint(&ledger.Checkpoint{Events: events(1000)}); err != nil {
		t.Fatal(err)
	}
	b, pub := limitedEventsTopic(t, ctx, "20000")
	sink := &countingSink{eventSink: pub}
	logs := &tooltest.Output{}
	p := newOutboxPublisher(l, sink, alerts.NewMetrics(prometheus.NewRegistry()), "", slog.New(slog.NewTextHandler(logs, nil)))
	runPublisher(t, ctx, p)
	waitfor.Cond(t, 60*time.Second, "1000 small events published in batches the topic takes", func() bool {
		n, err := l.OutboxLen()
		return err == nil && n == 0
	})
	if strings.Contains(logs.String(), "level=ERROR") {
		t.Errorf("an ERROR line while every event fits the topic alone:\n%s", logs.String())
	}
	if n := strings.Count(logs.String(), "publishing fewer entries per batch"); n != 1 {
		t.Errorf("%d lines saying the batches shrink, want 1:\n%s", n, logs.String())
	}
	if most, _ := sink.largest(1); most >= outboxBatch {
		t.Fatalf("a batch of %d after the first was refused, want fewer than %d", most, outboxBatch)
	}

	kafkatest.SetTopicConfig(t, b.Addrs(), "cfguard.events", "max.message.bytes", "1048588")
	_, from := sink.largest(0)
	if err := l.Checkpoint(&ledger.Checkpoint{Events: events(4 * outboxRegrow * outboxBatch)}); err != nil {
		t.Fatal(err)
	}
	p.notify()
	waitfor.Cond(t, 60*time.Second, "the next events published", func() bool {
		n, err := l.OutboxLen()
		return err == nil && n == 0
	})
	if most, _ := sink.largest(from); most != outboxBatch {
		t.Errorf("the largest batch once the topic takes whole batches: %d, want %d", most, outboxBatch)
	}
}
