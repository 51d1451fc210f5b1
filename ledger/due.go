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
// measured: the first version after its last measurement at which what that measurement gave
// it stopped holding.
//
//	a certified CE whose bound lapsed      the first version after its anchor a at which its
//	                                       bound fails: min { x > a : Theorem 1 or 2 fails at
//	                                       KL(q_x || q_a) }; when past does not hold every
//	                                       posterior since a, its lapse version
//	                                       (CE.RenewalPendingSince) from the anchor's history,
//	                                       which is the same unless the bound held again between
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
	kls    map[uint64][]float64       // anchor a -> KL of versions a+1, ..., now from it; nil when one is not held
}

func (l *Ledger) newDueReads(tx *bolt.Tx, now cur, past Past) *dueReads {
	return &dueReads{l: l, tx: tx, now: now, past: past, slacks: map[uint64][]certify.Slack{}, kls: map[uint64][]float64{}}
}

// dueAt is the version at which h became due for a measurement; ok is false when h is not due
// or the version is not known. byHistory says it is a certificate's lapse version read from its
// anchor's history (past does not hold every posterior since its anchor), which a later commit
// can change (its bound holds again, and fails at another version); the others cannot change
// while h does not.
func (d *dueReads) dueAt(h *header) (u uint64, ok, byHistory bool, err error) {
	if h.status != certify.Certified {
		u, ok = d.stoppedAt(h)
		return u, ok, false, nil
	}
	if u, ok, known := d.failedFirst(h); known {
		return u, ok, false, nil
	}
	u, ok, err = d.l.lapsedAt(d.tx, h, &d.reads)
	return u, ok, true, err
}

// failedFirst is the first version after h's anchor at which its certificate's bound fails, from
// the posteriors past gives (the anchor's through the current one); known is false when past
// does not hold them all, ok is false when the bound holds at every one.
func (d *dueReads) failedFirst(h *header) (u uint64, ok, known bool) {
	kls, seen := d.kls[h.anchor]
	if !seen {
		kls = d.anchorKLs(h.anchor)
		d.kls[h.anchor] = kls
	}
	if kls == nil && h.anchor < d.now.version {
		return 0, false, false
	}
	cert := h.certificate()
	for i, kl := range kls {
		if !d.l.opts.Policy.Bounds(cert, kl).Certified {
			return h.anchor + 1 + uint64(i), true, true
		}
	}
	return 0, false, true
}

// anchorKLs is KL(q_x || q_a) for x = a+1, ..., now from the posteriors past gives, nil when past
// does not hold one of them (or a, or is nil).
func (d *dueReads) anchorKLs(a uint64) []float64 {
	if d.past == nil {
		return nil
	}
	qa := d.past(a)
	if qa == nil {
		return nil
	}
	var kls []float64
	for x := a + 1; x <= d.now.version; x++ {
		qx := d.past(x)
		if qx == nil {
			return nil
		}
		kl, _, err := certify.KL(qx, qa)
		if err != nil {
			return nil
		}
		kls = append(kls, kl)
	}
	return kls
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
	a, err := certifiedAnchor(tx, h)
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
			u, ok, _, err := d.dueAt(&h)
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
// counted. The measurement of a CE that still waits, after its certificate lapsed or its
// verdict stopped carrying, is then a function of the log: the version, its posterior, and the
// predictor's draws for it (a pool seeded by the version), not of when the confirmer got to it.
// A certificate renewed under u, before the current version, onto a new anchor gets that
// anchor's history from past (every version from u on), so that its own lapse version is known
// as it would be had it been renewed when u was current.
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
			u, ok, byHistory, err := d.dueAt(&h)
			if err != nil {
				return nil, false, err
			}
			if !ok || u != v {
				continue
			}
			it, err := readItem(tx, id, h)
			if err != nil {
				return nil, false, err
			}
			it.recheckLapse = byHistory
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
