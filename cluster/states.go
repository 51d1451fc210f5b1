package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync/atomic"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// States carries a replica's CE states to the CE state topic (ceshare.StateTopic): the
// ledger puts the state of every CE a transaction changes in its outbox (Encode, the ledger's
// Options.EncodeState), and the outbox publisher writes them (Write) with the events. A later
// owner of a CE's partition reads them back (ceshare.MemberConfig.StateTopic) and stores the CE
// with its renewals, verdict and history (Share.Apply, ledger.ShareOp.State).
type States struct {
	replica string // this replica's id, named in each state
	log     *slog.Logger
	member  atomic.Pointer[ceshare.Member] // the CE group member, once the share joined
	writer  *ceshare.StateWriter
	metrics *alerts.ReplicaMetrics // nil until the replica is made (after the ledger opened)
}

// NewStates is the CE states of replica, written once SetWriter gave them a writer.
func NewStates(replica string, log *slog.Logger) *States {
	return &States{replica: replica, log: log}
}

// SetMetrics counts the states in m from now on (the replica's metrics exist once the ledger
// opened, which encodes states from its start).
func (st *States) SetMetrics(m *alerts.ReplicaMetrics) { st.metrics = m }

// SetWriter makes Write write to w.
func (st *States) SetWriter(w *ceshare.StateWriter) { st.writer = w }

// Encode is the ledger's Options.EncodeState on a replica: the CE's state as a record of the
// state topic, stamped with the CE group generation this replica took part in last (0 before
// it joined). A state over ceshare.MaxStateBytes becomes a tombstone, counted as too_large and
// logged: the CE's next owner rebuilds it from its registration rather than from an older
// state.
func (st *States) Encode(ce *ledger.CE) (ledger.OutboxEntry, error) {
	raw, err := json.Marshal(ce)
	if err != nil {
		return ledger.OutboxEntry{}, err
	}
	var gen int32
	if m := st.member.Load(); m != nil {
		gen = m.LastGeneration()
	}
	_, v, err := ceshare.EncodeState(ceshare.State{ID: ce.ID, Replica: st.replica, Generation: gen, CE: raw})
	if errors.Is(err, ceshare.ErrStateTooLarge) {
		st.log.Warn("CE state too large for the CE state topic: a tombstone is written instead, and the CE's next owner rebuilds it from its registration",
			"id", ce.ID, "err", err)
		if st.metrics != nil {
			st.metrics.CEStates.WithLabelValues(alerts.StateTooLarge).Inc()
		}
		return ledger.OutboxEntry{Key: ce.ID}, nil
	}
	return ledger.OutboxEntry{Key: ce.ID, Value: v}, err
}

// Write writes states (Encode's records) to the state topic and counts them once written: the
// daemon's outbox publisher calls it after the events of the same entries.
func (st *States) Write(ctx context.Context, states []ceshare.Encoded) error {
	if err := st.writer.WriteEncoded(ctx, states); err != nil {
		return err
	}
	st.metrics.CEStates.WithLabelValues(alerts.StateWritten).Add(float64(len(states)))
	return nil
}
