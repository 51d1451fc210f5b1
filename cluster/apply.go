package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
)

// Acquire is ceshare.Hooks: partition p is read from the offset the ledger applied. The member
// starts the releases (Release) of the partitions the ledger still holds from before a restart
// and that the group gave to others when the generation starts, and acquires p only once p's
// own release (when p was given back meanwhile) has ended.
func (s *Share) Acquire(ctx context.Context, p int) (int64, *ceshare.Witness, error) {
	off, ok, w, err := s.ledger.ShareStart(p)
	if err != nil {
		return 0, nil, err
	}
	s.lg.Info("CE partition acquired", "partition", p, "from", off, "held_before", ok, "witness", w != nil)
	if w == nil {
		return off, nil, nil
	}
	return off, &ceshare.Witness{Offset: w.Offset, Hash: w.Hash}, nil
}

// Release is ceshare.Hooks: partition p's CEs leave this ledger (their new owner rebuilds them
// from the CE topic). A ledger that cannot be written is retried as every share write is
// (durably), from where the failed write left it; a release cut short (ctx, a crash) leaves p's
// offset at 0 (ledger.ReleaseShare), and a restart that is not given p back releases it again
// (MemberConfig.Held).
func (s *Share) Release(ctx context.Context, p int) error {
	n := 0
	err := s.host.Durably(ctx, func() error {
		deleted, err := s.ledger.ReleaseShare(ctx, p, func(id string) bool { return ceshare.Partition(id, s.partitions) == p })
		n += deleted
		return err
	})
	if err != nil {
		return err
	}
	s.lg.Info("CE partition released", "partition", p, "counterfactuals", n)
	return nil
}

// Lost is ceshare.Hooks: the requests of partition p from `from` to `to` were deleted from the
// CE topic before this replica read them. The ledger moves p's offset past them and counts them
// (cfguard_records_lost_total for the CE topic, CfguardRecordsLost) in one transaction; the CEs
// they registered are not in this share (but for those restored from their states before the
// gap: ceshare.Request.Restored), and those they deleted stay. A ledger that cannot be
// written is retried as every share write is (durably).
func (s *Share) Lost(ctx context.Context, p int, from, to int64) error {
	return s.host.Durably(ctx, func() error { return s.ledger.SkipShare(p, from, to) })
}

// Reset is ceshare.Hooks: partition p of the CE topic ends at end, before what this ledger read,
// or holds another record than one it read (the topic was deleted and created again), so the
// requests that registered p's CEs are gone. The partition's offset goes back to 0 and the
// outcomes of its requests from offset from on (those that may be of the new log) are
// forgotten first, together (ledger.ResetShare: a crash after it leaves the CEs in this
// ledger, no request of the new log skipped, and those of it read before the reset applied
// again in their order), then every CE of p this ledger holds is sent again
// as a registration with its anchor and certificate: reading p from 0, this replica applies them
// as already stored, and a later owner of p stores them from the topic.
// cfguard_counterfactuals_repaired_total counts them; one that cannot be sent stays in this
// ledger only (an ERROR line says how many).
func (s *Share) Reset(ctx context.Context, p int, end, from int64) error {
	if err := s.host.Durably(ctx, func() error { return s.ledger.ResetShare(p, from) }); err != nil {
		return err
	}
	var ces []*ledger.CE
	for after := ""; ; {
		page, err := s.ledger.List(0, 1000, after)
		if err != nil {
			return err
		}
		for _, ce := range page {
			if ceshare.Partition(ce.ID, s.partitions) == p {
				ces = append(ces, ce)
			}
		}
		if len(page) < 1000 {
			break
		}
		after = page[len(page)-1].ID
	}
	sent, failed := 0, 0
	for len(ces) > 0 {
		batch := ces[:min(len(ces), 256)]
		ces = ces[len(batch):]
		errs, _ := s.Send(ctx, batch, make([]ledger.RequestRef, len(batch)))
		for _, err := range errs {
			if err != nil {
				failed++
			} else {
				sent++
			}
		}
	}
	if failed > 0 {
		s.lg.Error("CE partition reset: counterfactuals of this ledger could not be sent to the CE topic again; they stay in this "+
			"ledger only, and a move of the partition loses them", "partition", p, "sent", sent, "not_sent", failed)
	} else {
		s.lg.Warn("CE partition reset: this ledger's counterfactuals of the partition sent to the CE topic again", "partition", p,
			"counterfactuals", sent, "topic_end", end)
	}
	s.metrics.CERepaired.Add(float64(sent)) // after the line: whoever sees the count finds the line
	return nil
}

// Apply is ceshare.Hooks: registrations and deletions of partition p, in order, and the offset
// after them, in one ledger transaction (ledger.ApplyShare): a crash leaves all of them applied
// with the offset after them, or none with the offset before them, so that the member reads
// them again. A request applied before (its request id has an outcome: a producer's retry, a
// client's retry with its Idempotency-Key) is not applied again; a registration of a stored id
// and a deletion of a missing one change nothing. Each request's outcome, stored under its id,
// is what the replica that accepted it answers (AwaitOutcome). A registration rebuilt from a CE
// state at a gap of deleted requests (ceshare.Request.Restored) is stored from its state
// (restoredOp), with no outcome, and p's offset stays at next.
//
// Each registration is anchored to the posterior it was measured under: the current one, a
// live anchor, or a past version taken from the posterior log (replica.Replica.Past). A CE measured
// under a version this replica has not applied yet waits for it (at most AwaitOwner), and so does
// the state its previous owner left of it (up to its verdict's and history's versions, which
// checkState wants applied; a replica that joined while its follower still plays the log gets
// there within the wait): a CE whose version it still lacks then is measured again under the
// current posterior, as a registration here would be, and a state past it is not used.
func (s *Share) Apply(ctx context.Context, p int, reqs []ceshare.Request, next int64, w *ceshare.Witness) error {
	ops := make([]ledger.ShareOp, len(reqs))
	newest := uint64(0)
	for i, r := range reqs {
		if r.Restored {
			if ops[i] = s.restoredOp(p, r); ops[i].State != nil {
				newest = max(newest, ops[i].State.NewestVersion())
			}
			continue
		}
		ops[i] = ledger.ShareOp{RID: r.RID, Fingerprint: r.Fingerprint, Offset: r.Offset, ID: r.ID, IfMatch: r.IfMatch}
		if r.Kind != ceshare.KindRegister {
			continue
		}
		ce, err := decodeMeasured(r.CE) // the member read it whole before (readable)
		if err != nil {
			s.lg.Error("CE registration refused: its CE does not decode", "partition", p, "offset", r.Offset, "id", r.ID, "err", err)
			ops[i].Refuse = "the registration's CE does not decode: " + err.Error()
			continue
		}
		// What the owner's ledger judges is its own to fill in.
		ops[i].CE = &ledger.CE{ID: r.ID, X: ce.X, XCF: ce.XCF, Target: ce.Target, AnchorVersion: ce.AnchorVersion,
			P1: ce.P1, Var1: ce.Var1, Samples: ce.Samples, Delta: ce.Delta, Epsilon: ce.Epsilon, CreatedAt: r.At}
		newest = max(newest, ce.AnchorVersion)
		if r.State != nil {
			if ops[i].State = s.stateOf(p, r); ops[i].State != nil {
				newest = max(newest, ops[i].State.NewestVersion())
			}
		}
	}
	if s.beforeAwait != nil {
		s.beforeAwait(newest)
	}
	s.awaitVersion(ctx, newest)
	var lw *ledger.ShareWitness
	if w != nil {
		lw = &ledger.ShareWitness{Offset: w.Offset, Hash: w.Hash}
	}
	outs, err := s.applyOps(ctx, p, ops, next, lw)
	if err != nil {
		return err
	}
	applied := 0 // requests, not registrations rebuilt from states
	var waiting []ledger.PendingReissue
	for i, o := range outs {
		s.noteOutcome(p, reqs[i], o)
		if !reqs[i].Restored {
			applied++
		}
		if st := ops[i].State; o.State == ledger.StateRestored && st != nil && st.ReissuePendingSince != nil {
			waiting = append(waiting, ledger.PendingReissue{ID: o.ID, Version: *st.ReissuePendingSince})
		}
	}
	s.metrics.CEApplied.Add(float64(applied))
	s.host.Applied(waiting)
	s.applied.signal()
	return nil
}

// noteOutcome counts and logs what became of request r of partition p (o): a duplicate, a
// refusal, a state used or not.
func (s *Share) noteOutcome(p int, r ceshare.Request, o ledger.Outcome) {
	if o.Duplicate {
		s.requests.Skipped(r.Kind, 1)
	}
	switch {
	case o.Result == ledger.OutcomeRefused && r.Restored:
		s.lg.Error("CE not restored from its state: the ledger refused it", "partition", p, "id", o.ID, "detail", o.Detail)
	case o.Result == ledger.OutcomeExists && r.Restored:
		s.lg.Warn("CE not restored from its state: its id holds another CE", "partition", p, "id", o.ID, "detail", o.Detail)
	case o.Result == ledger.OutcomeRefused && !o.Duplicate:
		s.lg.Error("CE registration refused by the ledger", "partition", p, "offset", r.Offset, "id", o.ID, "detail", o.Detail)
	}
	switch {
	case o.State == ledger.StateRestored:
		s.metrics.CEStates.WithLabelValues(alerts.StateRestored).Inc()
	case o.State != "" && r.Restored:
		s.lg.Warn("CE restored without its state's renewals, verdict and history", "partition", p, "id", o.ID, "why", o.State)
		s.metrics.CEStates.WithLabelValues(alerts.StateNotUsed).Inc()
	case o.State != "":
		s.lg.Warn("CE stored from its registration", "partition", p, "id", o.ID, "why", o.State)
		s.metrics.CEStates.WithLabelValues(alerts.StateNotUsed).Inc()
	}
}

// applyOps is ledger.ApplyShare under Host.Exclusive (no posterior is committed between the ledger's
// judgement and its write), with the past posteriors its registrations need: first with those
// the batch names (pastVersions), then with any others the ledger still asks for that the
// posterior log has, then with the registrations still lacking theirs measured again under the
// current posterior.
func (s *Share) applyOps(ctx context.Context, p int, ops []ledger.ShareOp, next int64, w *ledger.ShareWitness) ([]ledger.Outcome, error) {
	var outs []ledger.Outcome
	anchors, err := s.ledger.Anchors()
	if err != nil {
		return nil, err
	}
	live := map[uint64]bool{}
	for _, a := range anchors {
		live[a.Version] = true
	}
	stored := func(id string) bool { // a request replayed after a restart, applied before
		_, err := s.ledger.Get(id)
		return !errors.Is(err, ledger.ErrNotFound)
	}
	// Asked for at once, so that one play of the log finds them all (replica.Replica.Past).
	past, err := s.pastRetrying(ctx, p, pastVersions(ops, s.host.Current().Version, live, stored))
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		s.lg.Warn("past posteriors not found in the posterior log: restored verdicts are measured again", "partition", p, "err", err)
		past = nil
	}
	past = withRecent(past, s.rep, pastVersions(ops, s.host.Current().Version, live, stored))
	for attempt := 0; ; attempt++ {
		var need *ledger.AnchorsNeededError
		err := s.host.Durably(ctx, func() error {
			return s.host.Exclusive(func() error {
				var err error
				outs, err = s.ledger.ApplyShare(p, ops, next, w, past)
				if errors.As(err, &need) && attempt > 0 {
					if err := s.remeasure(ctx, ops, need.Ops); err != nil {
						return err
					}
					outs, err = s.ledger.ApplyShare(p, ops, next, w, past)
				}
				return err
			})
		})
		if !errors.As(err, &need) || attempt > 0 {
			return outs, err
		}
		// The past posteriors are found outside Exclusive: finding one may mean playing the log.
		cur := s.host.Current().Version
		var versions []uint64
		for _, v := range need.Versions {
			if _, ok := past[v]; !ok && v < cur {
				versions = append(versions, v)
			}
		}
		more, err := s.pastRetrying(ctx, p, versions)
		if err != nil {
			if ctx.Err() != nil {
				return nil, err
			}
			s.lg.Warn("past posteriors not found in the posterior log: the CEs anchored at them are measured again", "partition", p, "err", err)
			continue // the next attempt measures them again, as when the log does not hold them
		}
		if past == nil {
			past = map[uint64]*bnn.Model{}
		}
		maps.Copy(past, more)
	}
}

// pastRetrying is Replica.Past, retried while its error is a broker's transient one (a
// connection reset): the partition stays not caught up meanwhile, as it does while its requests
// cannot be fetched. Measuring the CEs again instead would drop the states their previous owner
// left (remeasure), and stopping would stop the replica.
func (s *Share) pastRetrying(ctx context.Context, p int, versions []uint64) (map[uint64]*bnn.Model, error) {
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for {
		past, err := s.rep.Past(ctx, versions)
		if err == nil || !stream.Transient(err) || ctx.Err() != nil {
			return past, err
		}
		s.lg.Debug("reading the posterior log for past posteriors failed; retrying", "partition", p, "err", err)
		if bo.Wait(ctx) != nil {
			return nil, ctx.Err()
		}
	}
}

// pastVersions are the posterior versions before cur that ops need, sorted, once each: those
// their restored verdicts were measured under (without its posterior, a verdict is measured
// again), and the anchors of their registrations and states that are not live anchors of this
// ledger (live), whose posteriors it keeps itself. Registrations of ids the ledger holds
// (stored) need none: they store nothing.
func pastVersions(ops []ledger.ShareOp, cur uint64, live map[uint64]bool, stored func(id string) bool) []uint64 {
	var vs []uint64
	add := func(v uint64) {
		if v < cur && !slices.Contains(vs, v) {
			vs = append(vs, v)
		}
	}
	anchor := func(v uint64) {
		if !live[v] {
			add(v)
		}
	}
	for _, op := range ops {
		if op.CE == nil || stored(op.ID) {
			continue
		}
		anchor(op.CE.AnchorVersion)
		if st := op.State; st != nil {
			anchor(st.AnchorVersion)
			if st.ConfirmedVersion != nil {
				add(*st.ConfirmedVersion)
			}
		}
	}
	slices.Sort(vs)
	return vs
}

// withRecent adds to past the posteriors kept in memory from the oldest of anchors on, so that
// the ledger gives each anchor it stores from a past posterior the KL history its previous owner
// held over those versions (ledger.ApplyShare; renewal_pending_since then agrees across owners).
// past is nil when the posterior log could not give the anchors: the registrations are then
// measured again, and no history is needed.
func withRecent(past map[uint64]*bnn.Model, rep interface {
	Recent(from uint64) map[uint64]*bnn.Model
}, anchors []uint64) map[uint64]*bnn.Model {
	if past == nil || len(anchors) == 0 {
		return past
	}
	for v, m := range rep.Recent(slices.Min(anchors)) {
		if _, ok := past[v]; !ok {
			past[v] = m
		}
	}
	return past
}

// remeasure measures the CEs of ops[which] again under the current posterior (in Exclusive): a
// registration whose anchor the posterior log here does not have (a log begun after it). A
// state the previous owner left is then not used: its anchor lies between its registration's
// and the current version (ledger's checkState), and the log holds every version from its
// genesis on, so a state whose anchor is missing belongs to a registration whose anchor is
// missing too, which, measured again, is newer than the state.
func (s *Share) remeasure(ctx context.Context, ops []ledger.ShareOp, which []int) error {
	m := s.host.Current()
	rows := make([][]float64, len(which))
	for k, i := range which {
		rows[k] = ops[i].CE.XCF
	}
	pr, err := s.host.Predict(ctx, m, rows)
	if err != nil {
		return err
	}
	for k, i := range which {
		ce := ops[i].CE
		s.lg.Warn("CE measured again under the current posterior: the one it was measured under is not in the posterior log here",
			"id", ce.ID, "anchor_version", ce.AnchorVersion, "posterior_version", m.Version)
		ce.AnchorVersion, ce.P1, ce.Var1, ce.Samples = m.Version, pr.P(k, ce.Target), pr.V(k, ce.Target), s.samples
	}
	return nil
}

// awaitVersion waits until this replica has applied posterior version v, at most AwaitOwner.
func (s *Share) awaitVersion(ctx context.Context, v uint64) {
	ctx, cancel := context.WithTimeout(ctx, AwaitOwner)
	defer cancel()
	for s.host.Current().Version < v {
		if s.rep.WaitChange(ctx) != nil {
			return
		}
	}
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
		s.lg.Warn("CE state not used: its CE does not decode", "partition", p, "id", r.ID, "writer", r.State.Replica, "err", err)
		s.metrics.CEStates.WithLabelValues(alerts.StateInvalid).Inc()
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
