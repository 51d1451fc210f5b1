package ledger

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// Points are the confirmation points of a replicated posterior log (postlog.Head): the versions
// under which the owners of CEs measure them. A CE is measured at points only, each time at the
// first point after its last judgement at which it waits, judged at that point:
//
//	last = the latest of its anchor a, its verdict's version cv and its history's last change,
//	       and no earlier than Points.KnownAfter
//	due  = min { p point, last < p <= now :
//	             certified             Theorem 1 or 2 fails at KL(q_p || q_a)
//	             verdict with a bound  it does not carry at the slack of KL(q_p || q_cv)
//	             otherwise             (no verdict, or one that decided nothing) every p }
//
// and measured under q_p with p's draws; a failing CE whose bound holds again at a version
// before that is certified again there, as a commit's Rejudge would (duePoint). Which CE is
// measured when, and so every status it takes, is then a function of the log (its points and
// posteriors), the same at every owner whenever it gets to it, and the same as a ledger that
// committed the log version by version and measured every waiting CE at each point (Confirm): a
// CE that waited at a version between two points and no longer waits at the next one is not
// measured by either.
type Points interface {
	// PointsIn returns the points p with after < p <= through, ascending; known is false when
	// not every one of them is known.
	PointsIn(after, through uint64) (points []uint64, known bool)
	// LatestPoint returns the latest known point at or before through.
	LatestPoint(through uint64) (uint64, bool)
	// KnownAfter is the version after which every point is known.
	KnownAfter() uint64
}

// pointReads computes, in one transaction, the points CEs are due at (duePoint), each KL between
// two versions once.
type pointReads struct {
	l      *Ledger
	tx     *bolt.Tx
	now    uint64
	past   Past
	points Points
	kls    map[[2]uint64]float64 // (x, y) -> KL(q_x || q_y); NaN when one of them is not held
}

func (l *Ledger) newPointReads(tx *bolt.Tx, now uint64, past Past, points Points) *pointReads {
	return &pointReads{l: l, tx: tx, now: now, past: past, points: points, kls: map[[2]uint64]float64{}}
}

// judged is the version of the CE id's last judgement: the latest of its anchor, its verdict's
// version and its history's last entry (a status change or renewal; a certificate certified
// again at a commit because its bound held again has no other trace).
func (d *pointReads) judged(id []byte, h *header) (uint64, error) {
	last := h.anchor
	if h.failing() && h.confirmed {
		last = max(last, h.cv)
	}
	raw, err := getSealed(d.tx.Bucket(bBodies), id, "body")
	if err == nil && raw == nil {
		err = corruptf("body is missing")
	}
	if err != nil {
		return 0, inRecord(err, "counterfactual %q", id)
	}
	bd, err := decodeBody(raw, true)
	if err != nil {
		return 0, inRecord(err, "counterfactual %q", id)
	}
	if n := len(bd.history); n > 0 {
		last = max(last, bd.history[n-1].PosteriorVersion)
	}
	return last, nil
}

// kl is KL(q_x || q_y), q_x from the posteriors past holds (x is a version a CE may be
// measured at, under past's posterior), q_y from past or the ledger (posterior: y is a CE's
// anchor or verdict version); ok is false when one of them is not held.
func (d *pointReads) kl(x, y uint64) (float64, bool) {
	k := [2]uint64{x, y}
	v, seen := d.kls[k]
	if !seen {
		v = math.NaN()
		if qx, qy := d.past(x), d.posterior(y); qx != nil && qy != nil {
			if kl, _, err := certify.KL(qx, qy); err == nil {
				v = kl
			}
		}
		d.kls[k] = v
	}
	return v, !math.IsNaN(v)
}

// posterior is q_v: from past (a replica's last 256), else the one the ledger stores when v is
// its current version or a live anchor, so that a CE anchored before the posteriors past holds
// is judged at the points as one anchored within them. nil when neither holds it (a read
// error counts as not held: the CE is then measured at the latest point, and counted inexact).
func (d *pointReads) posterior(v uint64) *bnn.Model {
	if m := d.past(v); m != nil {
		return m
	}
	m, err := d.l.model(d.tx, v)
	if err != nil {
		return nil
	}
	return m
}

// maxKL is the largest KL(q_p || q_y) over the points p in (y, now]; ok is false when a point
// on the way, or a posterior, is not known.
func (d *pointReads) maxKL(y uint64) (float64, bool) {
	ps, known := d.points.PointsIn(max(y, d.points.KnownAfter()), d.now)
	if !known {
		return 0, false
	}
	m := 0.0
	for _, p := range ps {
		kl, ok := d.kl(p, y)
		if !ok {
			return 0, false
		}
		m = math.Max(m, kl)
	}
	return m, true
}

// action is what a CE is due for next at a version (duePoint).
type action int

const (
	notDue       action = iota
	measureAt           // a measurement at a point
	certifyAgain        // at_risk or invalidated, its bound holds again: certified (a commit's Rejudge)
)

// duePoint is what the CE id (header h) is due for next, and at which version (Points): a
// measurement at the first point after its last judgement at which it waits, or, for a failing
// CE, being certified again at the first version at which its bound holds again when that comes
// first (a commit of that version does it to a ledger that measured the CE in time: Rejudge).
// exact is false when the points or posteriors on the way are not all known: a measurement is
// then due at the latest point after its last judgement whose posterior past holds, if there is
// one, which depends on when it is made.
func (d *pointReads) duePoint(id []byte, h *header) (v uint64, act action, exact bool, err error) {
	if h.status != certify.Certified && !h.failing() {
		return 0, notDue, true, nil
	}
	last, err := d.judged(id, h)
	if err != nil {
		return 0, notDue, false, err
	}
	v, act, exact = d.dueAfter(h, last)
	return v, act, exact, nil
}

// dueAfter is duePoint for a CE last judged at version last. A CE last judged before the points
// known (Points.KnownAfter: a head keeps the latest 256) is judged from them on: an owner that
// kept within them judged it at the points before, and found it due at none (it would have been
// judged since), so that a CE that stays certified or keeps its verdict for long is not measured
// again because its points are forgotten.
func (d *pointReads) dueAfter(h *header, last uint64) (v uint64, act action, exact bool) {
	last = max(last, d.points.KnownAfter())
	ps, known := d.points.PointsIn(last, d.now)
	if !known {
		return d.fallback(last)
	}
	if h.status == certify.Certified {
		for _, p := range ps {
			waits, ok := d.waitsAt(h, p)
			if !ok {
				return d.fallback(last)
			}
			if waits {
				return p, measureAt, true
			}
		}
		return 0, notDue, true
	}
	for u := last + 1; u <= d.now; u++ {
		kl, ok := d.kl(u, h.anchor)
		if !ok {
			return d.fallback(last)
		}
		if d.l.opts.Policy.Bounds(h.certificate(), kl).Certified {
			return u, certifyAgain, true
		}
		if len(ps) == 0 || ps[0] != u {
			continue
		}
		ps = ps[1:]
		waits, ok := d.waitsAt(h, u)
		if !ok {
			return d.fallback(last)
		}
		if waits {
			return u, measureAt, true
		}
	}
	return 0, notDue, true
}

// waitsAt reports whether the CE h waits for a measurement at point p (Points); ok is false
// when a posterior it needs is not held.
func (d *pointReads) waitsAt(h *header, p uint64) (waits, ok bool) {
	switch {
	case h.status == certify.Certified:
		kl, ok := d.kl(p, h.anchor)
		return ok && !d.l.opts.Policy.Bounds(h.certificate(), kl).Certified, ok
	case !h.confirmed || !h.carry || d.l.opts.RemeasureVerdicts:
		return true, true
	}
	kl, ok := d.kl(p, h.cv)
	return ok && !h.carries(d.l.opts.Policy.Slack(kl)), ok
}

// certifiedAgainAt is the version at which the failing CE h, given a verdict measured under v
// behind the current version, is certified again when its bound holds at the current version,
// where a failing CE's bound may not hold (a commit's Rejudge certifies it): the first version
// after v at which its bound holds. exact is false when a point before it has the CE wait (a
// ledger that measured it in time measured it there before), or when the posteriors on the way
// are not all held (the current version is then taken).
func (d *pointReads) certifiedAgainAt(h *header, v uint64) (x uint64, exact bool) {
	if next, act, exact := d.dueAfter(h, v); act == certifyAgain {
		return next, exact
	}
	for u := v + 1; u < d.now; u++ {
		kl, ok := d.kl(u, h.anchor)
		if !ok {
			return d.now, false
		}
		if d.l.opts.Policy.Bounds(h.certificate(), kl).Certified {
			return u, false
		}
	}
	return d.now, false
}

// fallback is a measurement at the latest point after last whose posterior past holds (duePoint,
// not exact).
func (d *pointReads) fallback(last uint64) (uint64, action, bool) {
	p, ok := d.points.LatestPoint(d.now)
	if !ok || p <= last || d.past(p) == nil {
		return 0, notDue, false
	}
	return p, measureAt, false
}

// Due is what DueAtPoints found: CEs due for a measurement, by point, and CEs due to be
// certified again (their bound held again at a version before a point at which they wait).
type Due struct {
	Measure map[uint64][][]byte
	Again   [][]byte
	// Inexact of the CEs due for a measurement are due at the latest point instead of the one
	// the posteriors and points known do not tell (duePoint).
	Inexact int
	// More: others follow the max returned.
	More bool
}

// DueAtPoints returns up to max CEs of lane (of lanes, Lane) that are due at a confirmation point
// (Points) whose posterior past holds, or due to be certified again at a version the ledger has
// reached (duePoint). Its candidates are the CEs that wait at some point after their last
// measurement, or whose bound holds again at some version: the certified CEs whose bound fails at
// the largest KL of a point from their anchor, the failing CEs whose verdict does not carry at the
// largest slack of a point from its version (eachWaiting at those KLs), and the failing CEs whose
// Theorem 1 bound holds at the smallest KL of a version from their anchor.
func (l *Ledger) DueAtPoints(max, lane, lanes int, past Past, points Points) (Due, error) {
	due := Due{Measure: map[uint64][][]byte{}}
	if max <= 0 || lanes < 1 || lane < 0 || lane >= lanes || past == nil || points == nil {
		return due, fmt.Errorf("ledger: due at points: %w", invalidf("max %d, lane %d of %d, past and points given %t, want max >= 1, 0 <= lane < lanes and both",
			max, lane, lanes, past != nil && points != nil))
	}
	n := 0
	err := l.view(func(tx *bolt.Tx) error {
		c, err := readCur(tx)
		if err != nil || !c.ok {
			return err
		}
		d := l.newPointReads(tx, c.version, past, points)
		seen := map[string]bool{}
		return l.eachCandidate(tx, c, d, func(id []byte) (bool, error) {
			if Lane(id, lanes) != lane || seen[string(id)] {
				return false, nil
			}
			seen[string(id)] = true
			h, ok, err := readHeader(tx, id)
			if err != nil || !ok {
				return err != nil, err
			}
			v, act, exact, err := d.duePoint(id, &h)
			if err != nil || act == notDue {
				return err != nil, err
			}
			if n == max {
				due.More = true
				return true, nil
			}
			n++
			id = append([]byte(nil), id...)
			if act == certifyAgain {
				due.Again = append(due.Again, id)
				return false, nil
			}
			due.Measure[v] = append(due.Measure[v], id)
			if !exact {
				due.Inexact++
			}
			return false, nil
		})
	})
	if err != nil {
		return Due{}, fmt.Errorf("ledger: due at points: %w", err)
	}
	return due, nil
}

// minKL is the smallest KL(q_u || q_y) over the versions u in (y, now]; ok is false when a
// posterior on the way is not held.
func (d *pointReads) minKL(y uint64) (float64, bool) {
	m := math.Inf(1)
	for u := y + 1; u <= d.now; u++ {
		kl, ok := d.kl(u, y)
		if !ok {
			return 0, false
		}
		m = math.Min(m, kl)
	}
	return m, true
}

// eachCandidate calls fn, until it returns stop, with the id of every CE that may be due at a
// point (DueAtPoints), and possibly others: the certified CEs whose bound fails at their
// anchor's stored KL or at the largest KL of a point from it (eachLapsedAt), every failing CE
// without a carried verdict, and each carried verdict whose margin is within scanMargin of the
// larger of the slacks at its version's largest point KL and at the current posterior, or below
// (every one of a version whose posterior is not held).
func (l *Ledger) eachCandidate(tx *bolt.Tx, now cur, d *pointReads, fn func(id []byte) (stop bool, err error)) error {
	stopped := false
	visit := func(id []byte) error { // fn for the index scans, which end at errStop
		stop, err := fn(id)
		if stop && err == nil {
			stopped = true
			return errStop
		}
		return err
	}
	err := eachLapsedAt(tx, l.opts.Policy, func(v uint64, a anchorMeta) float64 {
		if m, ok := d.maxKL(v); ok {
			return math.Max(a.kl, m)
		}
		return a.kl
	}, visit)
	if stopped || err != nil {
		return err
	}
	err = forEachAnchor(tx, func(v uint64, a anchorMeta) error {
		if a.refs == 0 || v >= now.version || !holdsFailing(tx, v) {
			return nil
		}
		m, ok := d.minKL(v)
		if !ok {
			return nil // its failing CEs are certified again at a commit's Rejudge only
		}
		lo := 0.5 + l.opts.Policy.Slack(m).Mean
		return scanIndex(tx, bIdxP1, v, classFailing, lo-margin(lo), math.Inf(1), func(e idxEntry) error { return visit(e.id) })
	})
	if err == errStop {
		err = nil
	}
	if stopped || err != nil {
		return err
	}
	c := tx.Bucket(bIdxFail).Cursor()
	if stop, err := eachUncarried(c, carriedPrefix, fn); stop || err != nil {
		return err
	}
	for k, val := c.Seek(u64bytes(carriedPrefix)); k != nil; {
		if _, ok := unseal(k, val); !ok || len(k) < 24 {
			return corruptf("idx_fail entry %x is damaged", k)
		}
		cv := binary.BigEndian.Uint64(k[8:])
		limit := math.Inf(1)
		if m, ok := d.maxKL(cv); ok && !l.opts.RemeasureVerdicts {
			s := l.opts.Policy.Slack(m).Mean
			if sn, known, err := l.verdictSlack(tx, now, cv); err != nil {
				return err
			} else if known {
				s = math.Max(s, sn.Mean)
			}
			limit = s + margin(s)
		}
		next := carriedKey(cv+1, math.Inf(-1), nil)
		for ; k != nil && bytes.HasPrefix(k, next[:8]) && binary.BigEndian.Uint64(k[8:]) == cv; k, val = c.Next() {
			if _, ok := unseal(k, val); !ok || len(k) < 24 {
				return corruptf("idx_fail entry %x is damaged", k)
			}
			if keyFloat(k[16:24]) > limit {
				break // this version's other verdicts carry at every point
			}
			if stop, err := fn(k[24:]); stop || err != nil {
				return err
			}
		}
		if cv == math.MaxUint64 {
			return nil
		}
		k, val = c.Seek(next)
	}
	return nil
}

// ConfirmAtPoint measures with p, as Confirm does, those of the CEs named by ids that are due at
// p's version (DueAtPoints, with the same past and points); the others are left as they are and
// not counted. Each is judged again in the transaction that writes its measurement, so that a CE
// that changed meanwhile, or no longer waits at that point, is not written.
func (l *Ledger) ConfirmAtPoint(ctx context.Context, p Predictor, ids [][]byte, past Past, points Points) (ConfirmReport, []StatusChange, error) {
	if past == nil || points == nil {
		return ConfirmReport{PosteriorVersion: p.Version()}, nil, fmt.Errorf("ledger: confirm at point: %w", invalidf("past and points must be given"))
	}
	return l.confirmPicked(ctx, p, past, func(tx *bolt.Tx, c cur, v uint64) ([]confirmItem, bool, error) {
		d := l.newPointReads(tx, c.version, past, points)
		var items []confirmItem
		for _, id := range ids {
			h, ok, err := readHeader(tx, id)
			if err != nil {
				return nil, false, err
			}
			if !ok {
				continue
			}
			if u, act, _, err := d.duePoint(id, &h); err != nil || act != measureAt || u != v {
				if err != nil {
					return nil, false, err
				}
				continue
			}
			it, err := readItem(tx, id, h)
			if err != nil {
				return nil, false, err
			}
			it.points = points
			items = append(items, it)
		}
		return items, false, nil
	})
}

// CertifyAgainAtPoints certifies again those of the CEs named by ids that DueAtPoints (with the
// same past and points) finds due for it: at_risk or invalidated CEs whose bound held again at a
// version before a point at which they wait, each at that version with the status change a commit
// of it records to a ledger that measured the CE in time (Rejudge). The others are left as they
// are.
func (l *Ledger) CertifyAgainAtPoints(ctx context.Context, ids [][]byte, past Past, points Points) ([]StatusChange, error) {
	if past == nil || points == nil {
		return nil, fmt.Errorf("ledger: certify again at points: %w", invalidf("past and points must be given"))
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var changes []StatusChange
	err := l.update(func(tx *bolt.Tx) error {
		changes = nil
		c, err := readCur(tx)
		if err != nil || !c.ok {
			return err
		}
		w, err := l.newWriteTx(tx, l.opts.Now().UTC())
		if err != nil {
			return err
		}
		d := l.newPointReads(tx, c.version, past, points)
		for _, id := range ids {
			h, ok, err := readHeader(tx, id)
			if err != nil {
				return err
			}
			if !ok {
				continue
			}
			x, act, _, err := d.duePoint(id, &h)
			if err != nil {
				return err
			}
			if act == certifyAgain {
				if err := w.recertifyAt(id, &h, x, d); err != nil {
					return err
				}
			}
		}
		changes = w.changes
		if len(changes) == 0 {
			return nil
		}
		return w.finish()
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: certify again at points: %w", err)
	}
	return changes, nil
}

// holdsFailing reports whether anchor v holds an at_risk or invalidated CE (an idx_p1 entry of
// the failing class): only then does eachCandidate compute its smallest KL, one per version.
func holdsFailing(tx *bolt.Tx, v uint64) bool {
	k, _ := tx.Bucket(bIdxP1).Cursor().Seek(idxKey(v, classFailing, math.Inf(-1), nil))
	return len(k) >= idxPrefix && binary.BigEndian.Uint64(k) == v && k[8] == classFailing
}
