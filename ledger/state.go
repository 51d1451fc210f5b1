package ledger

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// CE states. The owner of a CE learns more of it than its registration says: renewals
// re-anchor its certificate, verdicts decide its status, its history records both. On a replica,
// every transaction that changes a stored CE puts the CE as the transaction leaves it in the
// outbox (Options.EncodeState, StreamStates), and the replica publishes it to the CE state
// topic. A later owner of the CE's partition reads that topic and gives each registration it
// replays the state its previous owner left (ShareOp.State), so that a CE that moves keeps its
// certificate, verdict and history instead of starting again from its registration.
//
// A state is a claim about measurements, and the new owner checks what it can before it
// keeps one: the same CE (id, creation time, x, x_cf, target), a status a certificate can
// have, a certificate that holds at its anchor (KL 0), a verdict measured under a posterior no
// later than the current one (a confirmer's pool may lag the anchor) with its bound on its
// status's side of 1/2, at most MaxHistory valid history entries. The
// CE is then judged as re-certification judges a stored one: at KL(q_now || q_anchor), its
// bound holding makes it certified, failing keeps its status, and its verdict stays in force
// while it carries (certify.Carries, from the verdict's posterior when the caller gives it).
//
// The new owner publishes no status change of the restored history: a replica's outbox
// publisher writes the states of its outbox only after the events before them (daemon's
// outboxPublisher), so every change a state on the topic records was published by the owner
// that wrote it. A change whose transaction's state never reached the topic is not in the
// state either; the new owner judges the CE from the state it has and publishes what it finds.

// StateRestored is Outcome.State for a registration stored with its previous owner's state.
const StateRestored = "restored"

// stateSet is the CEs a write transaction changed, in the order first changed.
type stateSet struct {
	ids  [][]byte
	seen map[string]bool
}

func (s *stateSet) add(id []byte) {
	if s.seen == nil {
		s.seen = map[string]bool{}
	}
	if !s.seen[string(id)] {
		s.seen[string(id)] = true
		s.ids = append(s.ids, id)
	}
}

// enqueueStates puts the state of every CE the transaction changed in the outbox
// (Options.EncodeState), as the transaction leaves it; a tombstone (an empty value) for one it
// deleted.
func (w *writeTx) enqueueStates() error {
	enc := w.l.opts.EncodeState
	if enc == nil {
		return nil
	}
	hdrs := w.tx.Bucket(bHeaders)
	for _, id := range w.states.ids {
		raw := hdrs.Get(id)
		if raw == nil {
			if err := w.enqueue(OutboxEntry{Stream: StreamStates, Key: string(id)}); err != nil {
				return err
			}
			continue
		}
		ce, _, err := loadStored(w.tx, id, raw)
		if err != nil {
			return err
		}
		e, err := enc(ce)
		if err != nil {
			return fmt.Errorf("counterfactual %q: encoding its state: %w", id, err)
		}
		e.Stream = StreamStates
		if err := w.enqueue(e); err != nil {
			return err
		}
	}
	return nil
}

// SameCE reports whether state is a state of the CE that registration registers: the same id,
// creation time, instance, counterfactual and target.
func SameCE(state, registration *CE) bool {
	return state.ID == registration.ID && state.CreatedAt.Equal(registration.CreatedAt) && state.Target == registration.Target &&
		slices.Equal(state.X, registration.X) && slices.Equal(state.XCF, registration.XCF)
}

// NewestVersion is the newest posterior version c refers to: its anchor's, its verdict's, its
// history's and its reissue wait's. A state is restored only under a current version at or past
// it (checkState), so a replica that takes a partition over waits until it has applied it.
func (c *CE) NewestVersion() uint64 {
	v := c.AnchorVersion
	if c.ConfirmedVersion != nil {
		v = max(v, *c.ConfirmedVersion)
	}
	for _, ch := range c.History {
		v = max(v, ch.PosteriorVersion)
	}
	if c.ReissuePendingSince != nil {
		v = max(v, *c.ReissuePendingSince)
	}
	return v
}

// checkState says why state cannot be restored for the registration reg under the current
// posterior version cur, nil when it can.
func (l *Ledger) checkState(state, reg *CE, cur uint64) error {
	if !SameCE(state, reg) {
		return fmt.Errorf("it is the state of another counterfactual under the id (created %s)", state.CreatedAt.Format(time.RFC3339Nano))
	}
	switch state.Status {
	case certify.Certified, certify.AtRisk, certify.Invalidated:
	default:
		return fmt.Errorf("status %s holds no certificate", state.Status)
	}
	if state.Delta != reg.Delta || state.Epsilon != reg.Epsilon {
		return fmt.Errorf("its set (delta %v, epsilon %v) is not the registration's (%v, %v)", state.Delta, state.Epsilon, reg.Delta, reg.Epsilon)
	}
	if state.AnchorVersion < reg.AnchorVersion || state.AnchorVersion > cur {
		return fmt.Errorf("anchor version %d is not between the registration's %d and the current %d", state.AnchorVersion, reg.AnchorVersion, cur)
	}
	cert := state.Certificate()
	if err := cert.Validate(); err != nil {
		return err
	}
	if !cert.InSet() || !l.opts.Policy.Bounds(cert, 0).Certified {
		return fmt.Errorf("its certificate (p1 %v, var1 %v) is not in its set or does not hold at its own anchor", state.P1, state.Var1)
	}
	if cv := state.ConfirmedVersion; cv != nil {
		if state.Status == certify.Certified {
			return fmt.Errorf("a certified counterfactual with a verdict")
		}
		if *cv > cur {
			return fmt.Errorf("verdict version %d is past the current %d", *cv, cur)
		}
	}
	if b := state.VerdictBound; b != nil && (state.ConfirmedVersion == nil || !(*b >= 0 && *b <= 1) || !certify.Carries(state.Status, *b, certify.Slack{})) {
		return fmt.Errorf("verdict bound %v without a verdict, outside [0, 1], or not on the side of 1/2 its status %s needs", *b, state.Status)
	}
	if v := state.ReissuePendingSince; v != nil && *v > cur {
		return fmt.Errorf("it waits for a reissue since version %d, past the current %d", *v, cur)
	}
	if len(state.History) > MaxHistory {
		return fmt.Errorf("%d history entries (at most %d)", len(state.History), MaxHistory)
	}
	for i, ch := range state.History {
		if !ch.From.Valid() || !ch.To.Valid() || ch.PosteriorVersion > cur || math.IsNaN(ch.KL) {
			return fmt.Errorf("history entry %d (%s to %s at version %d) is not a status change", i, ch.From, ch.To, ch.PosteriorVersion)
		}
	}
	return nil
}

// restoreHeader turns h, the header judgePut gave the registration of state's CE (anchored to
// state's certificate), into the CE as its previous owner left it, judged at its anchor's KL
// kl: certified when the bound holds, else its status and verdict kept. The verdict's posterior,
// when past holds it, is remembered so that the verdict carries as far as its bound absorbs.
func (l *Ledger) restoreHeader(h *header, state *CE, kl float64, past map[uint64]*bnn.Model) {
	h.status = state.Status
	h.unconfirm()
	if cv := state.ConfirmedVersion; cv != nil {
		h.confirmed, h.cv = true, *cv
		if b := state.VerdictBound; b != nil {
			h.carry, h.cbound = true, carryBound(h.status, *b)
		}
		if m := past[*cv]; m != nil && m.Version == *cv {
			l.carry.remember(m)
		}
	}
	h.rejudge(l.opts.Policy.Bounds(h.certificate(), kl).Certified)
}
