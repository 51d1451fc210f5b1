package daemon

import (
	"context"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
)

// event is one JSON message on kafka.events_topic. Type is one of:
//
//	status_changed   a stored counterfactual changed status (ID, From, To, KL from its anchor, Bound, P2)
//	kl_over_budget   a step's KL(q_new || q_prev) exceeded the budget (KL, Budget, Policy)
//	increment_held   on_breach: reject kept the posterior; Held carries the records for replay
//	update_failed    the update failed and the posterior was kept (Records, Error)
//	audit_completed  a full audit ran (Counts)
//
// Events of one counterfactual share its ID as the message key, so they stay in order.
type event struct {
	Type             string         `json:"type"`
	At               time.Time      `json:"at"`
	ID               string         `json:"id,omitempty"`
	From             string         `json:"from,omitempty"`
	To               string         `json:"to,omitempty"`
	PosteriorVersion uint64         `json:"posterior_version"`
	KL               float64        `json:"kl,omitempty"`
	Bound            *float64       `json:"bound,omitempty"`
	VarBound         *float64       `json:"var_bound,omitempty"`
	P2               *float64       `json:"p2,omitempty"`
	Budget           float64        `json:"budget,omitempty"`
	Policy           string         `json:"policy,omitempty"`
	Records          []string       `json:"records,omitempty"`
	Held             []heldRecord   `json:"held,omitempty"`
	Error            string         `json:"error,omitempty"`
	Counts           map[string]int `json:"counts,omitempty"`
}

type heldRecord struct {
	ID        string    `json:"id"`
	Features  []float64 `json:"features"`
	Label     int       `json:"label"`
	Partition int       `json:"partition"`
	Offset    int64     `json:"offset"`
}

func changeEvents(changes []ledger.StatusChange) []event {
	out := make([]event, len(changes))
	for i, ch := range changes {
		b, vb := ch.Bound, ch.VarBound
		out[i] = event{Type: "status_changed", At: ch.At, ID: ch.ID, From: ch.From.String(), To: ch.To.String(),
			PosteriorVersion: ch.PosteriorVersion, KL: ch.KL, Bound: &b, VarBound: &vb, P2: ch.P2}
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

// publish sends events after the checkpoint that caused them is durable. A failure is logged
// and counted, never fatal: the state store holds every CE's status and history, so an
// application can always re-read what an event would have told it.
func (d *Daemon) publish(ctx context.Context, events []event) {
	if len(events) == 0 {
		return
	}
	batch := make([]stream.Event, len(events))
	now := time.Now().UTC()
	for i, e := range events {
		if e.At.IsZero() {
			e.At = now
		}
		batch[i] = stream.Event{Key: e.ID, Value: e}
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := d.pub.PublishBatch(pctx, batch); err != nil {
		d.own.events.WithLabelValues("failed").Add(float64(len(events)))
		d.log.Error("publishing events failed", "events", len(events), "err", err)
		return
	}
	d.own.events.WithLabelValues("published").Add(float64(len(events)))
}
