package daemon

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
	"github.com/cfguard/cfguard/ui"
)

// OutboxSeqHeader is the Kafka record header that carries an event's outbox sequence number
// (decimal). Delivery is at least once: after a crash between publishing and acknowledging, the
// same events are published again with the same numbers and times, and consumers drop what they
// have seen by the two (a ledger restored from a backup numbers again from the backup's).
const OutboxSeqHeader = "cfguard-outbox-seq"

// ReplicaHeader is the Kafka record header that names, on a replica, the replica whose outbox
// published the event (replication.replica_id, or the host name): outbox numbers are per replica,
// so a consumer dedupes by replica and number.
const ReplicaHeader = "cfguard-replica"

// Outbox publishing defaults.
const (
	outboxBatch      = 256              // entries per publish call
	outboxTimeout    = 10 * time.Second // one publish call
	outboxPoll       = 2 * time.Second  // drain this often even without a wake-up
	outboxBackoffMin = 100 * time.Millisecond
	outboxBackoffMax = 30 * time.Second
)

// eventSink is where the outbox's events go: the events topic (*stream.Publisher).
type eventSink interface {
	PublishBatch(ctx context.Context, events []stream.Event) error
}

// stateSink is where a replica's outbox puts its CE states (ledger.StreamStates): the CE state
// topic (*cluster.States).
type stateSink interface {
	Write(ctx context.Context, states []ceshare.Encoded) error
}

// outboxPublisher moves the ledger's outbox to kafka.events_topic. Every event is written to the
// outbox in the transaction that makes the change it describes (a checkpoint, a confirmation
// batch, an audit batch), so a crash can neither lose an event of a committed change nor publish
// one of a change that was not committed. The publisher reads the outbox in sequence order,
// publishes a batch, then acknowledges it (AckOutbox deletes it): at least once, in order, each
// message carrying OutboxSeqHeader. It is woken after each commit and drains every outboxPoll
// anyway; while the broker refuses events it retries with backoff (backoff.Backoff, from
// outboxBackoffMin doubling to outboxBackoffMax), logging one line when the failure starts and
// one when it ends.
type outboxPublisher struct {
	l       *ledger.Ledger
	sink    eventSink
	metrics *alerts.Metrics
	log     *slog.Logger
	wake    chan struct{}
	replica string // ReplicaHeader's value, "" on a single daemon (no header)
	// states takes the CE states of a replica's outbox; nil on a single daemon, which drops
	// any a replica on the same ledger left.
	states stateSink
	// batch is how many entries an attempt takes: outboxBatch, halved at once each time a topic
	// refuses an attempt of several as too large (its max.message.bytes below kafka-go's batch
	// of the attempt's records), doubled again after outboxRegrow attempts that worked. refused
	// is the entry last named as too large alone; shrunk, whether the shrinking was logged.
	batch, worked int
	refused       uint64
	shrunk        bool
	// state, when set, holds the failing attempts' state while they fail, nil while they work.
	state *atomic.Pointer[ui.Publishing]
	// before, when set (hooks.OutboxPublish, by tests), is called before each attempt; an
	// error fails it.
	before func(ctx context.Context) error
}

// outboxRegrow is how many attempts at a halved batch size work before the size doubles again
// (a topic whose limit was raised gets whole batches back).
const outboxRegrow = 8

func newOutboxPublisher(l *ledger.Ledger, sink eventSink, m *alerts.Metrics, replica string, log *slog.Logger) *outboxPublisher {
	return &outboxPublisher{l: l, sink: sink, metrics: m, log: log, wake: make(chan struct{}, 1), replica: replica}
}

// setState records the attempts' state, when the publisher has somewhere to record it.
func (p *outboxPublisher) setState(s *ui.Publishing) {
	if p.state != nil {
		p.state.Store(s)
	}
}

// notify wakes the publisher (never blocks; wake-ups coalesce).
func (p *outboxPublisher) notify() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// run publishes until ctx ends. It returns an error only when the outbox cannot be read
// (a damaged ledger); failures to publish or to acknowledge are retried.
func (p *outboxPublisher) run(ctx context.Context) error {
	var (
		after    uint64 // last sequence number acknowledged by this publisher
		bo       = backoff.Backoff{Min: outboxBackoffMin, Max: outboxBackoffMax}
		failedAt time.Time
		attempts int
	)
	poll := time.NewTicker(outboxPoll)
	defer poll.Stop()
	for {
		err := p.drain(ctx, &after)
		if ctx.Err() != nil {
			return nil
		}
		wait := time.Duration(0)
		switch {
		case err == nil:
			if !failedAt.IsZero() {
				p.log.Info("outbox published again; drained", "failed_for", time.Since(failedAt).Round(time.Millisecond), "attempts", attempts)
				failedAt, attempts = time.Time{}, 0
				p.setState(nil)
			}
			bo.Reset()
		case errors.Is(err, ledger.ErrCorrupt), errors.Is(err, ledger.ErrClosed):
			return err
		default:
			attempts++
			if failedAt.IsZero() {
				failedAt = time.Now()
				p.log.Warn("publishing outbox entries failed (events, or a replica's CE states: the error names the topic); they stay in the outbox and are retried with backoff", "err", err)
			}
			p.setState(&ui.Publishing{FailingSince: failedAt, Attempts: attempts, Err: err.Error()})
			wait = bo.Next()
		}
		if wait > 0 {
			if backoff.Sleep(ctx, wait) != nil {
				return nil
			}
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-p.wake:
		case <-poll.C:
		}
	}
}

// drain publishes and acknowledges outbox entries after *after until none are left.
func (p *outboxPublisher) drain(ctx context.Context, after *uint64) error {
	for ctx.Err() == nil {
		entries, err := p.l.Outbox(*after, cmp.Or(p.batch, outboxBatch))
		if err != nil {
			return err
		}
		if len(entries) == 0 {
			return nil
		}
		// A batch's events go before its states, and no state goes while its events fail: a state
		// on the topic then tells its CE's next owner that every change it records was published
		// (ledger's CE states), and the owner publishes none again.
		batch, states := p.split(entries)
		pctx, cancel := context.WithTimeout(ctx, outboxTimeout)
		if p.before != nil {
			err = p.before(pctx)
		}
		if err == nil && len(batch) > 0 {
			err = p.sink.PublishBatch(pctx, batch)
		}
		if err == nil && len(states) > 0 {
			err = p.states.Write(pctx, states)
		}
		cancel()
		if err != nil {
			// Every entry of the attempt stays in the outbox, the events too when only the
			// states failed: they are published again with them.
			p.metrics.PublishFailed(len(batch) + len(states))
			if stream.TooLarge(err) && p.tooLarge(entries, err) {
				continue // again at once, with half the entries
			}
			return fmt.Errorf("publishing outbox entries %d..%d: %w", entries[0].Seq, entries[len(entries)-1].Seq, err)
		}
		p.metrics.EventsPublished(len(batch) + len(states))
		if p.batch != 0 && p.batch < outboxBatch {
			if p.worked++; p.worked >= outboxRegrow {
				p.batch, p.worked = min(outboxBatch, 2*p.batch), 0
			}
		}
		last := entries[len(entries)-1].Seq
		if err := p.l.AckOutbox(last); err != nil {
			// Published but not acknowledged: they are published again (consumers dedupe).
			return fmt.Errorf("acknowledging outbox entries up to %d: %w", last, err)
		}
		*after = last
	}
	return nil
}

// tooLarge takes an attempt a topic refused as too large, and reports whether to try again at
// once: an attempt of several entries is tried again with half of them (said once at INFO, and
// again only after an entry was refused alone: a topic whose limit stays low refuses each batch
// that grows back, which is not news), so that the entries that fit go; one entry alone is named at
// ERROR, once, with the max.message.bytes its topic needs. It and every entry after it stay in
// the outbox (events go in order), retried with backoff, until the topic takes it.
func (p *outboxPublisher) tooLarge(entries []ledger.OutboxEntry, err error) bool {
	if len(entries) > 1 {
		if !p.shrunk {
			p.shrunk = true
			p.log.Info("a topic refused a batch of outbox entries as too large (its max.message.bytes is below the batch): "+
				"publishing fewer entries per batch", "entries", len(entries), "err", err)
		}
		p.batch, p.worked = len(entries)/2, 0
		return true
	}
	p.shrunk = false
	e := entries[0]
	if p.refused == e.Seq {
		return false
	}
	p.refused = e.Seq
	// As an event: for a CE state, whose header is its authenticator rather than the sequence
	// number, the figure is a few dozen bytes short.
	need, nerr := stream.EventBytes(p.event(e))
	if nerr != nil {
		need = len(e.Value)
	}
	p.log.Error("an outbox entry is too large for its topic: it and every entry after it stay in the outbox, retried with backoff, "+
		"until the topic takes it", "seq", e.Seq, "key", e.Key, "bytes", len(e.Value), "err", err,
		"fix", fmt.Sprintf("raise the topic's max.message.bytes to %d or more", need))
	return false
}

// split sorts outbox entries into events for the events topic and CE states for the state
// topic (dropped without a state sink).
func (p *outboxPublisher) split(entries []ledger.OutboxEntry) ([]stream.Event, []ceshare.Encoded) {
	var (
		batch  []stream.Event
		states []ceshare.Encoded
	)
	for _, e := range entries {
		if e.Stream == ledger.StreamStates {
			if p.states != nil {
				states = append(states, ceshare.Encoded{Key: []byte(e.Key), Value: e.Value})
			}
			continue
		}
		batch = append(batch, p.event(e))
	}
	return batch, states
}

// event is the outbox entry e as the events topic gets it: its sequence number, and on a
// replica its writer, in headers.
func (p *outboxPublisher) event(e ledger.OutboxEntry) stream.Event {
	ev := stream.Event{Key: e.Key, Value: json.RawMessage(e.Value),
		Headers: map[string][]byte{OutboxSeqHeader: []byte(strconv.FormatUint(e.Seq, 10))}}
	if p.replica != "" {
		ev.Headers[ReplicaHeader] = []byte(p.replica)
	}
	return ev
}
