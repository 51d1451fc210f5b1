package ledger

import (
	"context"
	"fmt"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// Past gives the posterior of a past version, nil when the caller does not hold it (the ledger
// stores only its anchors'): what the version at which a verdict stopped carrying is computed
// from, and the history of an anchor renewed under a past posterior.
type Past func(v uint64) *bnn.Model

// A CE waiting for a measurement is due at a version that does not depend on when it is
// measured:
//
//	a certified CE whose bound lapsed      its lapse version (CE.RenewalPendingSince): the
//	                                       version after the last one at which its bound held
//	an at_risk or invalidated CE whose     the first version after its verdict's, cv, at which
//	decided verdict no longer carries      certify.Carries fails: min { x > cv : the verdict
//	                                       does not carry at the slack of KL(q_x || q_cv) }
//
// A measurement under its due version, with that version's draws, is then the same whenever and
// at whichever replica it is made (DueLane, ConfirmDue). A CE with no verdict, or whose verdict
// decided nothing (kept by hysteresis), is due at every version and has no due version here: it
// is measured under the newest posterior.

// dueReads computes the due versions of one read transaction's CEs, reading each anchor's history
// once and computing each verdict version's slacks once.
type dueReads struct {
	l      *Ledger
	tx     *bolt.Tx
	now    cur
	past   Past
	reads  klReads
	slacks map[uint64][]certify.Slack // verdict version cv -> slack of versions cv+1, cv+2, ...
}

func (l *Ledger) newDueReads(tx *bolt.Tx, now cur, past Past) *dueReads {
	return &dueReads{l: l, tx: tx, now: now, past: past, slacks: map[uint64][]certify.Slack{}}
}

// dueAt is the version at which h became due for a measurement; ok is false when h is not due
// or the version is not known.
func (d *dueReads) dueAt(h *header) (uint64, bool, error) {
	if h.status == certify.Certified {
		return d.l.lapsedAt(d.tx, h, &d.reads)
	}
	u, ok := d.stoppedAt(h)
	return u, ok, nil
}

// stoppedAt is the first version after h's verdict version at which its decided verdict does
// not carry, from the posteriors past gives (through the current one); ok is false when h has no
// decided verdict, when it carries through the current version, or when a posterior on the way
// is not at hand.
func (d *dueReads) stoppedAt(h *header) (uint64, bool) {
	if !h.failing() || !h.confirmed || !h.carry || d.past == nil || h.cv >= d.now.version {
		return 0, false
	}
	slacks, ok := d.slacks[h.cv]
	if !ok {
		if qcv := d.past(h.cv); qcv != nil {
			for x := h.cv + 1; x <= d.now.version; x++ {
				qx := d.past(x)
				if qx == nil {
					break
				}
				kl, _, err := certify.KL(qx, qcv)
				if err != nil {
					break
				}
				slacks = append(slacks, d.l.opts.Policy.Slack(kl))
			}
		}
		d.slacks[h.cv] = slacks
	}
	for i, s := range slacks {
		if !h.carries(s) {
			return h.cv + 1 + uint64(i), true
		}
	}
	return 0, false
}

// lapsedAt is the lapse version of the certified CE h (failingSince at its anchor's stored KL);
// ok is false when its bound holds or the version is not known.
func (l *Ledger) lapsedAt(tx *bolt.Tx, h *header, reads *klReads) (u uint64, ok bool, err error) {
	a, found, err := readAnchor(tx, h.anchor)
	if err == nil && !found {
		err = corruptf("a certified counterfactual refers to anchor %d, which is not stored", h.anchor)
	}
	if err != nil {
		return 0, false, err
	}
	u, ok = failingSince(tx, l.opts.Policy, h.certificate(), h.anchor, a, reads)
	return u, ok, nil
}

// DueLane returns the ids of up to max CEs of lane (of lanes, Lane) that wait for a measurement
// and whose due version u is known and for which at(u) is true, grouped by u; more reports
// whether others follow. past gives the posteriors the due versions of verdicts are computed
// from. It reads the waiting CEs of the ledger once (eachWaiting), each anchor's history once,
// and computes each verdict version's KLs once.
func (l *Ledger) DueLane(max, lane, lanes int, past Past, at func(due uint64) bool) (byVersion map[uint64][][]byte, more bool, err error) {
	if max <= 0 || lanes < 1 || lane < 0 || lane >= lanes {
		return nil, false, fmt.Errorf("ledger: due: %w", invalidf("max %d, lane %d of %d, want max >= 1 and 0 <= lane < lanes", max, lane, lanes))
	}
	byVersion = map[uint64][][]byte{}
	n := 0
	err = l.view(func(tx *bolt.Tx) error {
		c, err := readCur(tx)
		if err != nil || !c.ok {
			return err
		}
		d := l.newDueReads(tx, c, past)
		return l.eachWaiting(tx, c, c.version, func(id []byte) (bool, error) {
			if Lane(id, lanes) != lane {
				return false, nil
			}
			h, ok, err := readHeader(tx, id)
			if err == nil && !ok {
				err = corruptf("the indexes list counterfactual %q as waiting, yet it is not stored", id)
			}
			if err != nil {
				return true, err
			}
			u, ok, err := d.dueAt(&h)
			if err != nil || !ok || !at(u) {
				return err != nil, err
			}
			if n == max {
				more = true
				return true, nil
			}
			byVersion[u] = append(byVersion[u], append([]byte(nil), id...))
			n++
			return false, nil
		})
	})
	if err != nil {
		return nil, false, fmt.Errorf("ledger: due: %w", err)
	}
	return byVersion, more, nil
}

// ConfirmDue measures with p, as Confirm does, those of the CEs named by ids whose due version
// (DueLane) is p's version u, with past as DueLane was given it. The others (no longer stored,
// no longer waiting, due at another version or at one not known) are left as they are and not
// counted. A CE's measurement after its certificate lapsed or its verdict stopped carrying is
// then a function of the log: the version, its posterior, and the predictor's draws for it (a
// pool seeded by the version), not of when the confirmer got to it. A certificate renewed under
// u, before the current version, gets the history of its new anchor from past (every version
// from u on), so that its own lapse version is known as it would be had it been renewed when u
// was current.
func (l *Ledger) ConfirmDue(ctx context.Context, p Predictor, ids [][]byte, past Past) (ConfirmReport, []StatusChange, error) {
	return l.confirmPicked(ctx, p, past, func(tx *bolt.Tx, c cur, v uint64) ([]confirmItem, bool, error) {
		d := l.newDueReads(tx, c, past)
		var items []confirmItem
		for _, id := range ids {
			h, ok, err := readHeader(tx, id)
			if err != nil {
				return nil, false, err
			}
			if !ok {
				continue
			}
			if pending, err := l.pending(tx, &h); err != nil || !pending {
				if err != nil {
					return nil, false, err
				}
				continue
			}
			if u, ok, err := d.dueAt(&h); err != nil || !ok || u != v {
				if err != nil {
					return nil, false, err
				}
				continue
			}
			it, err := readItem(tx, id, h)
			if err != nil {
				return nil, false, err
			}
			it.due = true
			items = append(items, it)
		}
		return items, false, nil
	})
}

// pastSince collects past's posteriors of versions v to cur-1, as pastAnchorKL takes them.
func pastSince(past Past, v, cur uint64) map[uint64]*bnn.Model {
	out := map[uint64]*bnn.Model{}
	for x := v; x < cur; x++ {
		if m := past(x); m != nil {
			out[x] = m
		}
	}
	return out
}
