package daemon

import (
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
)

// Event is one JSON message on kafka.events_topic. Type is one of:
//
//	status_changed   a stored counterfactual changed status (ID, From, To, KL from its anchor, Bound,
//	                 VarBound, P2 when a measurement made the change, and whether the new status is
//	                 decided: Decided, VerdictPending, RenewalPending; LapsedSince when a verdict
//	                 ends a lapsed certificate whose lapse version was known)
//	kl_over_budget   a step's KL(q_new || q_prev) exceeded the budget (ParentVersion, KL, Budget,
//	                 Policy, the increment's Labels; with on_breach clip, ClipFraction and ClippedKL)
//	increment_held   on_breach: reject kept the posterior (KL); Records and Held carry the records for
//	                 replay (Offsets, when the event would be too large to carry them)
//	update_failed    the update failed and the posterior was kept (Records, Offsets, Error)
//	audit_completed  a full audit ran (Counts)
//	counterfactual_reissued        with explain.reissue, a replacement was stored (ID, NewID, From:
//	                               the old CE's status, To: the new CE's, P2: the new CE's p1)
//	counterfactual_reissue_failed  with explain.reissue, no replacement was stored (ID, Error)
//
// Events of one counterfactual share its ID as the message key, so they stay in order; other
// events are keyed by their type. An event is written to the ledger's outbox in the transaction
// that makes the change it describes (audit_completed and the reissue events in a write of their
// own after it) and published from there (outbox.go), at least once: each message carries the
// Kafka header cfguard-outbox-seq (the outbox sequence number, decimal), which with At tells a
// copy from a new event (a restored ledger numbers again from the backup's).
type Event struct {
	Type             string    `json:"type"`
	At               time.Time `json:"at"`
	ID               string    `json:"id,omitempty"`
	NewID            string    `json:"new_id,omitempty"`
	From             string    `json:"from,omitempty"`
	To               string    `json:"to,omitempty"`
	PosteriorVersion uint64    `json:"posterior_version"`
	// LogEntry is, on a replica, the seq of the posterior log's entry whose step a posterior
	// event (kl_over_budget, increment_held, update_failed) describes: with Type, the key
	// that tells a copy published again by a later updater from a new event.
	LogEntry      uint64   `json:"log_entry,omitempty"`
	ParentVersion *uint64  `json:"parent_version,omitempty"`
	KL            *float64 `json:"kl,omitempty"` // set for the events that have one, 0 included (a re-anchored CE)
	Bound         *float64 `json:"bound,omitempty"`
	VarBound      *float64 `json:"var_bound,omitempty"`
	P2            *float64 `json:"p2,omitempty"`
	// Decided (status_changed only) is the CE's decided as the ledger's transaction that changed
	// its status left it (ledger.CE.Decided: the new status is backed by a bound that holds under
	// the current posterior); VerdictPending and RenewalPending say why it is not.
	Decided        *bool `json:"decided,omitempty"`
	VerdictPending bool  `json:"verdict_pending,omitempty"`
	RenewalPending bool  `json:"renewal_pending,omitempty"`
	// LapsedSince (status_changed only) is, on a verdict that ends a lapsed certificate, the
	// posterior version since which its bound had failed (ledger.StatusChange.LapsedSince).
	LapsedSince *uint64 `json:"lapsed_since,omitempty"`
	Budget      float64 `json:"budget,omitempty"`
	Policy      string  `json:"policy,omitempty"`
	// ClipFraction and ClippedKL: with on_breach clip, the fraction t of the step from the
	// previous posterior to the converged one that was kept, and the KL of the clipped step.
	ClipFraction *float64 `json:"clip_fraction,omitempty"`
	ClippedKL    *float64 `json:"clipped_kl,omitempty"`
	// Labels (kl_over_budget) is how many of the increment's records carry each label, by class
	// name, every class included.
	Labels  map[string]int `json:"labels,omitempty"`
	Records []string       `json:"records,omitempty"`
	Held    []heldRecord   `json:"held,omitempty"`
	Offsets []offsetRange  `json:"offsets,omitempty"`
	Error   string         `json:"error,omitempty"`
	Counts  map[string]int `json:"counts,omitempty"`
}

// offsetRange is the input records of one partition an event stands for, from First to Last
// (inclusive): an event too large to list its records names them by where they are.
type offsetRange struct {
	Partition int   `json:"partition"`
	First     int64 `json:"first"`
	Last      int64 `json:"last"`
}

type heldRecord struct {
	ID        string    `json:"id,omitempty"` // none when the record was produced without one
	Features  []float64 `json:"features"`
	Label     int       `json:"label"`
	Partition int       `json:"partition"`
	Offset    int64     `json:"offset"`
}

func changeEvent(ch ledger.StatusChange) Event {
	b, vb, decided, kl := ch.Bound, ch.VarBound, ch.Decided, ch.KL
	return Event{Type: "status_changed", At: ch.At, ID: ch.ID, From: ch.From.String(), To: ch.To.String(),
		PosteriorVersion: ch.PosteriorVersion, KL: &kl, Bound: &b, VarBound: &vb, P2: ch.P2,
		Decided: &decided, VerdictPending: ch.VerdictPending, RenewalPending: ch.RenewalPending, LapsedSince: ch.LapsedSince}
}

// encodeChange is the ledger's Options.EncodeChange: every status change the ledger writes is
// put in its outbox, in the same transaction, as a status_changed event keyed by the CE's id.
func encodeChange(ch ledger.StatusChange) ledger.OutboxEntry {
	return changeEvent(ch).entry(time.Time{})
}

// entry encodes e for the outbox: the key is the CE's id for events about one CE (so they stay
// in order on one partition), else the event type; a zero At becomes now.
func (e Event) entry(now time.Time) ledger.OutboxEntry { return e.encode(now, maxEventBytes) }

// encode is entry for events of at most limit bytes: a larger one loses the records it lists.
func (e Event) encode(now time.Time, limit int) ledger.OutboxEntry {
	if e.At.IsZero() {
		if now.IsZero() {
			now = time.Now()
		}
		e.At = now.UTC()
	}
	key := e.ID
	key = cmp.Or(key, e.Type)
	v, err := json.Marshal(e)
	if err != nil {
		// Only a non-finite float (a KL, a bound) can fail: send the event without its numbers
		// rather than lose it.
		v, _ = json.Marshal(Event{Type: e.Type, At: e.At, ID: e.ID, From: e.From, To: e.To, PosteriorVersion: e.PosteriorVersion,
			Decided: e.Decided, VerdictPending: e.VerdictPending, RenewalPending: e.RenewalPending, Policy: e.Policy, Records: e.Records, Error: fmt.Sprintf("event not encodable as JSON (%v); numbers dropped", err)})
	}
	if len(v) > limit {
		// The events topic takes messages of about 1 MB (stream); an increment_held of many
		// records is larger. The records stay in the input topic (while its retention keeps
		// them), so the event names where they are instead of carrying them.
		n := max(len(e.Held), len(e.Records))
		if len(e.Held) > 0 { // an update_failed carries its offsets already
			e.Offsets = offsetRanges(e.Held)
		}
		e.Held, e.Records = nil, nil
		e.Error = strings.TrimSpace(e.Error + fmt.Sprintf(" (event of %d bytes exceeds %d: the %d records it would list are omitted; offsets names them in the input topic)", len(v), limit, n))
		v, _ = json.Marshal(e)
	}
	return ledger.OutboxEntry{Key: key, Value: v}
}

// offsetRanges is, per partition in order, the first and last offset of held.
func offsetRanges(held []heldRecord) []offsetRange {
	byPart := map[int]offsetRange{}
	for _, r := range held {
		o, ok := byPart[r.Partition]
		if !ok {
			o = offsetRange{Partition: r.Partition, First: r.Offset, Last: r.Offset}
		}
		o.First, o.Last = min(o.First, r.Offset), max(o.Last, r.Offset)
		byPart[r.Partition] = o
	}
	out := slices.Collect(maps.Values(byPart))
	slices.SortFunc(out, func(a, b offsetRange) int { return cmp.Compare(a.Partition, b.Partition) })
	return out
}

// maxEventBytes bounds one event's JSON: the stream publisher refuses messages of about 1 MB,
// and an outbox entry it refuses would block every later one.
const maxEventBytes = 900_000

// maxLogEventBytes bounds the copy of one event a posterior log entry carries (postlog.Entry's
// Events): an increment_held of more records than that lists none in the copy, which only a
// claimant after a writer that died publishes.
const maxLogEventBytes = 64 << 10

// outboxEntries encodes events for Checkpoint.Events, stamped now.
func outboxEntries(events []Event) []ledger.OutboxEntry {
	if len(events) == 0 {
		return nil
	}
	now := time.Now()
	out := make([]ledger.OutboxEntry, len(events))
	for i, e := range events {
		out[i] = e.entry(now)
	}
	return out
}

func countsByName(c map[certify.Status]int) map[string]int {
	out := map[string]int{}
	for s, n := range c {
		out[s.String()] = n
	}
	return out
}
