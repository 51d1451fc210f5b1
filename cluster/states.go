package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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
func (cs *States) SetMetrics(m *alerts.ReplicaMetrics) { cs.metrics = m }

// SetWriter makes Write write to w.
func (cs *States) SetWriter(w *ceshare.StateWriter) { cs.writer = w }

// Encode is the ledger's Options.EncodeState on a replica: the CE's state as a record of the
// state topic, stamped with the CE group generation this replica took part in last (0 before
// it joined). A state over ceshare.MaxStateBytes becomes a tombstone, counted as too_large and
// logged: the CE's next owner rebuilds it from its registration rather than from an older
// state.
func (cs *States) Encode(ce *ledger.CE) (ledger.OutboxEntry, error) {
	raw, err := json.Marshal(ce)
	if err != nil {
		return ledger.OutboxEntry{}, err
	}
	var gen int32
	if m := cs.member.Load(); m != nil {
		gen = m.LastGeneration()
	}
	_, v, err := ceshare.EncodeState(ceshare.State{ID: ce.ID, Replica: cs.replica, Generation: gen, CE: raw})
	if errors.Is(err, ceshare.ErrStateTooLarge) {
		if cs.metrics != nil {
			cs.metrics.CEStates.WithLabelValues(alerts.StateTooLarge).Inc()
		}
		cs.log.Warn("CE state too large for the CE state topic: a tombstone is written instead, and the CE's next owner rebuilds it from its registration",
			"id", ce.ID, "err", err)
		return ledger.OutboxEntry{Key: ce.ID}, nil
	}
	return ledger.OutboxEntry{Key: ce.ID, Value: v}, err
}

// Write is the outbox publisher's stateSink: the states (Encode's records) to the state topic,
// counted once written.
func (cs *States) Write(ctx context.Context, states []ceshare.Encoded) error {
	if err := cs.writer.WriteEncoded(ctx, states); err != nil {
		return err
	}
	cs.metrics.CEStates.WithLabelValues(alerts.StateWritten).Add(float64(len(states)))
	return nil
}

// stateOf decodes the ledger's CE out of a state read from the state topic for registration r
// (decodeState); nil when it is not one, and nil when it is the state of another registration
// of r's id (one created at another time: the id was deleted and registered again later in
// the partition, and that registration gets the state when it is replayed).
func (s *Share) stateOf(p int, r ceshare.Request) *ledger.CE {
	ce := s.decodeState(p, r)
	if ce == nil || ce.CreatedAt.Equal(r.At) {
		return ce
	}
	s.lg.Debug("CE state of another registration of the id", "partition", p, "id", r.ID, "offset", r.Offset,
		"registered_at", r.At, "state_created_at", ce.CreatedAt)
	return nil
}

// decodeState decodes the ledger's CE out of r.State, a state read from the state topic for
// r's id; nil, counted as invalid and logged, when it is not the CE of that id.
func (s *Share) decodeState(p int, r ceshare.Request) *ledger.CE {
	var ce ledger.CE
	err := json.Unmarshal(r.State.CE, &ce)
	if err == nil && ce.ID != r.ID {
		err = fmt.Errorf("it holds the CE of id %q", ce.ID)
	}
	if err != nil {
		s.metrics.CEStates.WithLabelValues(alerts.StateInvalid).Inc()
		s.lg.Warn("CE state not used: its CE does not decode", "partition", p, "id", r.ID, "writer", r.State.Replica, "err", err)
		return nil
	}
	return &ce
}

// restoredOp is the registration r stands for, a registration rebuilt from its state
// (ceshare.Request.Restored: the partition's first requests were deleted before this replica
// read them): the CE as the state holds it, registered at the state's anchor and time, with
// the state; one refused when the state is not a CE of r's id.
func (s *Share) restoredOp(p int, r ceshare.Request) ledger.ShareOp {
	op := ledger.ShareOp{Offset: r.Offset, ID: r.ID}
	st := s.decodeState(p, r)
	if st == nil {
		op.Refuse = "restoring it from its state on the CE state topic: the state does not decode"
		return op
	}
	op.CE = &ledger.CE{ID: r.ID, X: st.X, XCF: st.XCF, Target: st.Target, AnchorVersion: st.AnchorVersion,
		P1: st.P1, Var1: st.Var1, Samples: st.Samples, Delta: st.Delta, Epsilon: st.Epsilon, CreatedAt: st.CreatedAt}
	op.State = st
	return op
}
