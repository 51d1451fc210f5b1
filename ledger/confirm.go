package ledger

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// Predictor estimates the posterior predictive of one posterior version: Predict returns, for
// each raw input, the Monte-Carlo mean and variance of p(c | x, w) over weight draws w ~ q
// (bnn.Predictive), and Version is the posterior version q is. A Predictor must give each input
// a result that does not depend on the other inputs of the call (bnn shares weight draws across
// inputs, so this holds for (*bnn.Model).Predict with a fixed seed).
type Predictor interface {
	Version() uint64
	Predict(ctx context.Context, X [][]float64) (*bnn.Predictive, error)
}

// PosteriorPredictor is a Predictor that also gives the posterior it samples. Confirm uses one
// even after ingestion replaced that posterior: a measurement started under version v is kept as
// of v (renewals anchored to it, verdicts measured again later), so that measuring keeps up with
// updates that come faster than a pool of draws can be made.
type PosteriorPredictor interface {
	Predictor
	Posterior() *bnn.Model
}

// ModelPredictor is a Predictor over (*bnn.Model).Predict with a fixed number of draws and
// seed.
type ModelPredictor struct {
	m       *bnn.Model
	samples int
	seed    uint64
}

// predictChunk bounds the inputs of one bnn Predict call (memory: inputs x classes x 2 floats,
// plus the network's activations).
const predictChunk = 4096

// NewModelPredictor predicts with m, `samples` posterior draws (0: certify.DefaultSamples) and
// seed.
func NewModelPredictor(m *bnn.Model, samples int, seed uint64) *ModelPredictor {
	samples = cmp.Or(samples, certify.DefaultSamples)
	return &ModelPredictor{m: m, samples: samples, seed: seed}
}

// Version is the model's posterior version.
func (p *ModelPredictor) Version() uint64 { return p.m.Version }

// Predict runs m.Predict in chunks, stopping when ctx ends. Every chunk uses the same seed, so
// with bnn's shared weight draws the result does not depend on the chunking.
func (p *ModelPredictor) Predict(ctx context.Context, X [][]float64) (*bnn.Predictive, error) {
	out := &bnn.Predictive{N: len(X), C: p.m.NumClasses(), S: p.samples}
	for lo := 0; lo < len(X); lo += predictChunk {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		pr, err := p.m.Predict(X[lo:min(lo+predictChunk, len(X))], p.samples, p.seed)
		if err != nil {
			return nil, fmt.Errorf("monte-carlo: %w", err)
		}
		out.Mean = append(out.Mean, pr.Mean...)
		out.Var = append(out.Var, pr.Var...)
	}
	return out, nil
}

// ConfirmReport summarises one Confirm call.
type ConfirmReport struct {
	PosteriorVersion uint64 `json:"posterior_version"`
	// Picked CEs were read and sampled; Confirmed of them got a verdict written, Changed of
	// those changed status; Skipped were left alone when writing (deleted, re-anchored, bound
	// holding again, or confirmed meanwhile).
	Picked    int `json:"picked"`
	Confirmed int `json:"confirmed"`
	Changed   int `json:"changed"`
	Skipped   int `json:"skipped"`
	// Renewed of the Confirmed were re-anchored to the predictor's posterior (certified again
	// with a fresh certificate); the others got a verdict.
	Renewed int `json:"renewed"`
	// Discarded: the current posterior was not the predictor's version when reading; nothing
	// was read or written.
	Discarded bool `json:"discarded"`
	// Behind: ingestion promoted a newer posterior while the batch was sampled; its results were
	// written all the same (renewals anchored to the sampled posterior, verdicts recorded as of
	// it, to be measured again under the newer one unless they carry to it).
	Behind bool `json:"behind"`
	// More: CEs beyond this batch still lack a verdict at this version.
	More bool `json:"more"`
	// Inexact of the Confirmed were measured at a confirmation point (ConfirmAtPoint) and
	// certified again at the current version although a point between had them wait, or with
	// posteriors on the way not held: their statuses since may differ from another owner's.
	Inexact int `json:"inexact,omitempty"`
	// Measurements is what became of the Picked CEs' Monte-Carlo measurements.
	Measurements Measurements  `json:"measurements"`
	Duration     time.Duration `json:"duration_ns"`
}

// Measurements sorts the Monte-Carlo measurements of CEs (one CE's (p2, V2) under one posterior)
// by what became of them, judged when they are written:
//
//	Kept        written, and in force for the posterior current at the write: the CE does not
//	            wait for another measurement under it. A verdict measured under the current
//	            posterior, or under an older one from which it carries (certify.Carries at
//	            KL(q_now || q_sampled)); or a renewal whose certificate holds at that KL.
//	Superseded  written, but out of date at once: the batch was sampled under an older posterior
//	            (ingestion promoted one while it was sampled, or it was the version the CEs
//	            became due at: ConfirmDue), and the verdict does not carry to the current one (it
//	            decided nothing, its margin is smaller than the slack, or
//	            Options.RemeasureVerdicts), or the renewed certificate already lapses there. The
//	            CE is measured again under a newer posterior; the measurement still stood as of
//	            the posterior it was made under.
//	Discarded   never written: the batch was sampled under a posterior that was not the current
//	            one, or the CE changed while it was sampled (deleted, re-anchored, measured).
//
// Kept / (Kept + Superseded + Discarded) is the fraction of the confirmer's Monte-Carlo that is
// not thrown away.
type Measurements struct {
	Kept       int `json:"kept"`
	Superseded int `json:"superseded"`
	Discarded  int `json:"discarded"`
}

// confirmItem is one CE picked for a Monte-Carlo verdict.
type confirmItem struct {
	id  []byte
	h   header
	xcf []float64
	// recheckLapse: picked by ConfirmDue at a certificate's lapse version read from its
	// anchor's history, to be measured only while that is still the version sampled (the other
	// due versions cannot change while the header does not: dueReads.dueAt).
	recheckLapse bool
	// points: picked by ConfirmAtPoint, to be measured only while it is still due at the
	// version sampled (duePoint), not judged by whether it waits under the current posterior.
	points Points
}

// Confirm measures up to max CEs that wait for a measurement under p's posterior version, which
// must be the current one (or a PosteriorPredictor's older one): certified CEs whose bound has
// lapsed, and at_risk or invalidated CEs whose last verdict is missing, or older and not carried
// to the current posterior (certify.Carries; see eachWaiting). With e = (p2, V2, S) from p's draws,
// f(w) = p(target | x', w), and alpha = Options.VerdictAlpha:
//
//	renewed      if certify.Renewable(e, delta, eps, alpha): lower(p2) >= 1 - delta and V2 <= eps
//	             (certify.Reenters, one margin more, for an at_risk or invalidated CE).
//	             The CE is re-anchored to the version s its draws came from: (anchor, p1, V1, S) =
//	             (s, p2, V2, S), certified, its bound judged at KL(q_now || q_s) (0 when s is current). A certified CE's renewal is kept in its history but is no status change.
//	a verdict    otherwise: certify.Verdict (invalidated when upper(p2) < 1/2, at_risk when
//	             lower(p2) >= 1/2, the previous status in between; a lapsed certificate with no
//	             verdict yet becomes at_risk).
func (l *Ledger) Confirm(ctx context.Context, p Predictor, max int) (ConfirmReport, []StatusChange, error) {
	return l.ConfirmLane(ctx, p, max, 0, 1)
}

// ConfirmLane is Confirm for the CEs of one lane of lanes (Lane): lanes that run at once measure
// disjoint CEs, each in its own batches, and together give every CE the measurement Confirm would
// (a CE's estimate depends only on its own input and p's draws). More is about the lane's CEs.
func (l *Ledger) ConfirmLane(ctx context.Context, p Predictor, max, lane, lanes int) (ConfirmReport, []StatusChange, error) {
	return l.ConfirmLaneLeaving(ctx, p, max, lane, lanes, nil, nil)
}

// ConfirmLaneLeaving is ConfirmLane that leaves out each CE whose due version u (DueLane) is
// known and for which leave(u) is true: those are for ConfirmDue to measure under u. past gives
// the posteriors the due versions of verdicts are computed from, and the history of an anchor
// renewed under a past posterior (nil: none). A nil leave leaves out none.
func (l *Ledger) ConfirmLaneLeaving(ctx context.Context, p Predictor, max, lane, lanes int, past Past, leave func(due uint64) bool) (ConfirmReport, []StatusChange, error) {
	if max <= 0 {
		return ConfirmReport{PosteriorVersion: p.Version()}, nil, fmt.Errorf("ledger: confirm: %w", invalidf("max = %d, want >= 1", max))
	}
	if lanes < 1 || lane < 0 || lane >= lanes {
		return ConfirmReport{PosteriorVersion: p.Version()}, nil, fmt.Errorf("ledger: confirm: %w", invalidf("lane %d of %d, want 0 <= lane < lanes", lane, lanes))
	}
	return l.confirmPicked(ctx, p, past, func(tx *bolt.Tx, c cur, v uint64) ([]confirmItem, bool, error) {
		return l.pickUnconfirmed(tx, c, v, max, lane, lanes, past, leave)
	})
}

// confirmPicked measures with p the CEs pick chooses (in a read transaction, with the current
// posterior c and p's version v) and writes what it found (Confirm); past, when not nil, gives
// the posteriors a new anchor's history is computed from (renew).
func (l *Ledger) confirmPicked(ctx context.Context, p Predictor, past Past, pick func(tx *bolt.Tx, c cur, v uint64) ([]confirmItem, bool, error)) (ConfirmReport, []StatusChange, error) {
	start := time.Now()
	v := p.Version()
	rep := ConfirmReport{PosteriorVersion: v}
	var (
		items []confirmItem
		qv    *bnn.Model // the posterior sampled: an anchor for renewals written after it is replaced
	)
	err := l.view(func(tx *bolt.Tx) error {
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		if !c.ok {
			return ErrNoPosterior
		}
		if c.version != v {
			// The predictor samples a posterior ingestion has replaced: usable only when it says
			// which (its measurements are then kept as of it).
			pp, ok := p.(PosteriorPredictor)
			if !ok || v > c.version || pp.Posterior() == nil || pp.Posterior().Version != v {
				rep.Discarded = true
				return nil
			}
			qv = pp.Posterior()
		}
		if items, rep.More, err = pick(tx, c, v); err != nil || len(items) == 0 || qv != nil {
			return err
		}
		qv, err = l.model(tx, v)
		return err
	})
	if err != nil || rep.Discarded || len(items) == 0 {
		rep.Duration = time.Since(start)
		return rep, nil, wrapErr("confirm", err)
	}
	rep.Picked = len(items)
	xs := make([][]float64, len(items))
	for i := range items {
		xs[i] = items[i].xcf
	}
	pred, err := p.Predict(ctx, xs)
	if err == nil && (pred == nil || pred.N != len(xs)) {
		err = fmt.Errorf("predictor returned %v results for %d inputs", pred, len(xs))
	}
	if err != nil {
		return rep, nil, fmt.Errorf("ledger: confirm: %w", err)
	}
	if p.Version() != v {
		rep.Discarded, rep.Duration = true, time.Since(start)
		rep.Measurements.Discarded = len(items)
		return rep, nil, nil
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var changes []StatusChange
	err = l.update(func(tx *bolt.Tx) error {
		rep.Confirmed, rep.Skipped, changes, rep.Measurements = 0, 0, nil, Measurements{}
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		// Ingestion may have promoted a newer posterior while the batch was sampled: the results
		// are kept (a measurement is not wasted because versions move faster than batches),
		// judged against KL(q_now || q_v) for renewals.
		rep.Behind = c.version != v
		s := sampled{version: v, model: qv, past: past}
		if rep.Behind {
			qNow, err := l.model(tx, c.version)
			if err != nil {
				return err
			}
			if s.kl, _, err = certify.KL(qNow, qv); err != nil {
				return fmt.Errorf("KL from posterior version %d to %d: %w", c.version, v, err)
			}
		}
		w, err := l.newWriteTx(tx, l.opts.Now().UTC())
		if err != nil {
			return err
		}
		rep.Renewed = 0
		for i := range items {
			done, renewed, kept, err := w.confirm(&items[i], c, s, pred, i)
			if err != nil {
				return err
			}
			switch {
			case !done:
				rep.Skipped++
				rep.Measurements.Discarded++
			case renewed:
				rep.Renewed++
				rep.Confirmed++
			default:
				rep.Confirmed++
			}
			switch {
			case done && kept:
				rep.Measurements.Kept++
			case done:
				rep.Measurements.Superseded++
			}
		}
		if rep.Confirmed > rep.Renewed {
			l.carry.remember(qv) // the verdicts' posterior: their carry is judged from it
		}
		changes, rep.Inexact = w.changes, w.inexact
		if rep.Renewed > 0 {
			if err := l.gcAnchors(tx, c.version); err != nil {
				return err
			}
		}
		if rep.Confirmed == 0 {
			return w.finishNoGen()
		}
		return w.finish()
	})
	rep.Changed, rep.Duration = len(changes), time.Since(start)
	if err != nil {
		return rep, nil, fmt.Errorf("ledger: confirm: %w", err)
	}
	return rep, changes, nil
}

// pickUnconfirmed reads up to max CEs that wait for a measurement by a predictor of version v
// (eachWaiting), leaving out those whose due version u is known and for which leave(u) is true
// (when leave is not nil); more reports whether another follows.
func (l *Ledger) pickUnconfirmed(tx *bolt.Tx, now cur, v uint64, max, lane, lanes int, past Past, leave func(uint64) bool) (items []confirmItem, more bool, err error) {
	d := l.newDueReads(tx, now, past)
	err = l.eachWaiting(tx, now, v, func(id []byte) (bool, error) {
		if Lane(id, lanes) != lane {
			return false, nil
		}
		h, ok, err := readHeader(tx, id)
		pending := false
		if err == nil && ok {
			pending, err = l.pending(tx, &h)
		}
		if err == nil && (!ok || !pending) {
			err = corruptf("the indexes list counterfactual %q as waiting, yet it neither fails nor has a lapsed certificate", id)
		}
		if err != nil {
			return true, err
		}
		if leave != nil {
			if u, ok, _, err := d.dueAt(&h); err != nil || ok && leave(u) {
				return err != nil, err
			}
		}
		if len(items) == max {
			more = true
			return true, nil
		}
		it, err := readItem(tx, id, h)
		items = append(items, it)
		return err != nil, err
	})
	if err != nil {
		return nil, false, err
	}
	return items, more, nil
}

// readItem reads the body of the CE stored under id with header h, for a measurement.
func readItem(tx *bolt.Tx, id []byte, h header) (confirmItem, error) {
	id = append([]byte(nil), id...)
	raw, err := getSealed(tx.Bucket(bBodies), id, "body")
	if err == nil && raw == nil {
		err = corruptf("body is missing")
	}
	if err != nil {
		return confirmItem{}, inRecord(err, "counterfactual %q", id)
	}
	bd, err := decodeBody(raw, false)
	if err != nil {
		return confirmItem{}, inRecord(err, "counterfactual %q", id)
	}
	return confirmItem{id: id, h: h, xcf: bd.xcf}, nil
}

// countWaiting counts the CEs that wait for a measurement under the current posterior now
// (eachWaiting with v = now), stopping at limit when limit > 0.
func (l *Ledger) countWaiting(tx *bolt.Tx, now cur, limit int) (int, error) {
	n := 0
	err := l.eachWaiting(tx, now, now.version, func([]byte) (bool, error) {
		n++
		return limit > 0 && n >= limit, nil
	})
	return n, err
}

// countDecided counts, by status, the CEs whose status is decided (CE.Decided) under the current
// posterior now, from cnt (the stored counts, with the lapsed certificates), and the CEs that wait
// for a measurement (countWaiting), in one walk. An at_risk or invalidated CE is undecided when
// it waits (no verdict, or one that does not carry to now) or when its verdict under now decided
// nothing (kept by hysteresis: an idx_fail entry under now + 1 without a carry bound).
func (l *Ledger) countDecided(tx *bolt.Tx, now cur, cnt counts) (decided map[certify.Status]int, waiting int, err error) {
	undecided := map[certify.Status]int{}
	failing := func(id []byte) error {
		h, ok, err := readHeader(tx, id)
		if err == nil && !ok {
			err = corruptf("idx_fail names counterfactual %q, which is not stored", id)
		}
		if err == nil && h.failing() {
			undecided[h.status]++
		}
		return err
	}
	err = l.eachWaiting(tx, now, now.version, func(id []byte) (bool, error) {
		waiting++
		return false, failing(id)
	})
	if err != nil {
		return nil, 0, err
	}
	if now.ok {
		c := tx.Bucket(bIdxFail).Cursor()
		prefix := u64bytes(now.version + 1)
		for k, _ := c.Seek(prefix); k != nil && bytes.HasPrefix(k, prefix); k, _ = c.Next() {
			if err := failing(k[8:]); err != nil {
				return nil, 0, err
			}
		}
	}
	all := cnt.asMap()
	decided = map[certify.Status]int{certify.Certified: all[certify.Certified] - int(cnt[lapsedSlot])}
	for _, st := range []certify.Status{certify.AtRisk, certify.Invalidated} {
		decided[st] = all[st] - undecided[st]
	}
	return decided, waiting, nil
}

// eachWaiting calls fn, until it returns stop, with the id of every CE that a measurement under
// posterior version v (the current one, now, or an older one a pool was drawn from) would give
// something to. First, anchor by anchor, the certified CEs whose bound has lapsed (eachLapsed);
// then, in idx_fail order, an at_risk or invalidated CE with no verdict, or whose verdict older
// than v has no carry bound; and one whose verdict, older than v, does not carry to now:
// certify.Carries fails at the slack of KL(q_now || q_cv) (or that posterior is not known here,
// or Options.RemeasureVerdicts is set). Carried verdicts are grouped by version and sorted by
// carry margin (failKey), so the ones read are those whose margin is within scanMargin of the
// slack or below; the others are skipped by a seek per version.
func (l *Ledger) eachWaiting(tx *bolt.Tx, now cur, v uint64, fn func(id []byte) (stop bool, err error)) error {
	stopped := false
	err := eachLapsed(tx, l.opts.Policy, func(id []byte) error {
		stop, err := fn(id)
		if stop && err == nil {
			stopped = true
			return errStop
		}
		return err
	})
	if stopped || err != nil {
		return err
	}
	c := tx.Bucket(bIdxFail).Cursor()
	if stop, err := eachUncarried(c, v+1, fn); stop || err != nil {
		return err
	}
	for k, val := c.Seek(u64bytes(carriedPrefix)); k != nil; {
		if _, ok := unseal(k, val); !ok || len(k) < 24 {
			return corruptf("idx_fail entry %x is damaged", k)
		}
		cv := binary.BigEndian.Uint64(k[8:])
		if cv >= v {
			return nil // measured under v or later
		}
		slack, known, err := l.verdictSlack(tx, now, cv)
		if err != nil {
			return err
		}
		next := carriedKey(cv+1, math.Inf(-1), nil)
		for ; k != nil && bytes.HasPrefix(k, next[:8]) && binary.BigEndian.Uint64(k[8:]) == cv; k, val = c.Next() {
			if _, ok := unseal(k, val); !ok || len(k) < 24 {
				return corruptf("idx_fail entry %x is damaged", k)
			}
			if known {
				m := keyFloat(k[16:24])
				if m > slack.Mean+margin(slack.Mean) {
					break // this version's other verdicts carry
				}
				if m >= slack.Mean-margin(slack.Mean) {
					h, ok, err := readHeader(tx, k[24:])
					if err != nil {
						return err
					}
					if ok && h.carries(slack) {
						continue
					}
				}
			}
			if stop, err := fn(k[24:]); stop || err != nil {
				return err
			}
		}
		k, val = c.Seek(next)
	}
	return nil
}

// eachUncarried calls fn, until it returns stop, with the id of each idx_fail entry of a failing
// CE without a carried verdict whose key's first 8 bytes (its verdict version + 1, 0 for none:
// failKey) are below `below`, in key order from c's first entry.
func eachUncarried(c *bolt.Cursor, below uint64, fn func(id []byte) (stop bool, err error)) (stop bool, err error) {
	for k, val := c.First(); k != nil; k, val = c.Next() {
		if _, ok := unseal(k, val); !ok || len(k) < 8 {
			return false, corruptf("idx_fail entry %x is damaged", k)
		}
		if p := binary.BigEndian.Uint64(k); p == carriedPrefix || p >= below {
			return false, nil
		}
		if stop, err := fn(k[8:]); stop || err != nil {
			return true, err
		}
	}
	return false, nil
}

// eachLapsed calls fn with the id of every certified CE whose bound fails at its anchor's stored
// KL, anchor by anchor: in idx_p1's certified class, the entries below the Theorem 1 threshold
// (its front, up to the first that holds), then in idx_var's, those whose Theorem 2 bound fails
// and whose Theorem 1 bound holds (the others were given already). O(lapsed CEs + anchors).
func eachLapsed(tx *bolt.Tx, pol certify.Policy, fn func(id []byte) error) error {
	return eachLapsedAt(tx, pol, func(_ uint64, a anchorMeta) float64 { return a.kl }, fn)
}

// eachLapsedAt is eachLapsed with the bounds of anchor v's CEs judged at klOf(v, a) rather than
// at its stored KL.
func eachLapsedAt(tx *bolt.Tx, pol certify.Policy, klOf func(v uint64, a anchorMeta) float64, fn func(id []byte) error) error {
	err := forEachAnchor(tx, func(v uint64, a anchorMeta) error {
		if a.refs == 0 {
			return nil
		}
		s := pol.Slack(klOf(v, a))
		g := pol.Gate(s)
		err := scanIndex(tx, bIdxP1, v, classCertified, math.Inf(-1), math.Inf(1), func(e idxEntry) error {
			if g.Theorem1(e.terms.p1s) {
				return errThreshold // Theorem 1 holds from here on
			}
			return fn(e.id)
		})
		if err != errThreshold && err != nil {
			return err
		}
		return scanIndex(tx, bIdxVar, v, classCertified, math.Inf(-1), s.Var+margin(s.Var), func(e idxEntry) error {
			if !g.Theorem1(e.terms.p1s) || g.Theorem2(e.terms.v1, e.terms.ceil) {
				return nil
			}
			return fn(e.id)
		})
	})
	if err == errStop {
		return nil
	}
	return err
}

// errThreshold ends a scan of an index class at the threshold where the bound starts to hold.
var errThreshold = errors.New("threshold reached")

// carryCache holds the posteriors recent verdicts were measured under (Confirm remembers the one
// it sampled), and the slack of their KL from the current posterior, computed once per version
// pair. It is memory only: a verdict whose posterior is not here (after a restart, or evicted) is
// not carried but measured again, which costs a measurement and never a status.
type carryCache struct {
	mu     sync.Mutex
	models map[uint64]*bnn.Model
	now    uint64                   // the current posterior the slacks are from
	slacks map[uint64]certify.Slack // verdict version -> slack of KL(q_now || q_cv)
}

// maxCarryModels bounds the verdict posteriors kept; the oldest goes first.
const maxCarryModels = 64

// remember keeps m as the posterior of verdicts measured under it.
func (cc *carryCache) remember(m *bnn.Model) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.models == nil {
		cc.models = map[uint64]*bnn.Model{}
	}
	if _, ok := cc.models[m.Version]; ok {
		return
	}
	if len(cc.models) >= maxCarryModels {
		oldest := uint64(math.MaxUint64)
		for v := range cc.models {
			oldest = min(oldest, v)
		}
		delete(cc.models, oldest)
	}
	cc.models[m.Version] = m
}

// verdictSlack is the policy's slack at KL(q_now || q_cv), the distance a verdict measured under
// posterior version cv must be carried; known is false when that posterior is not at hand
// (neither remembered, current, nor a stored anchor) or Options.RemeasureVerdicts is set.
func (l *Ledger) verdictSlack(tx *bolt.Tx, now cur, cv uint64) (s certify.Slack, known bool, err error) {
	if l.opts.RemeasureVerdicts {
		return s, false, nil
	}
	cc := &l.carry
	cc.mu.Lock()
	if cc.now != now.version || cc.slacks == nil {
		cc.now, cc.slacks = now.version, map[uint64]certify.Slack{}
	}
	s, known = cc.slacks[cv]
	qv := cc.models[cv]
	cc.mu.Unlock()
	if known {
		return s, true, nil
	}
	if s, known, err = l.slackFrom(tx, now, cv, qv); err != nil || !known {
		return s, false, err
	}
	cc.mu.Lock()
	if cc.now == now.version {
		cc.slacks[cv] = s
	}
	cc.mu.Unlock()
	return s, true, nil
}

// verdictSlackUncached is verdictSlack for a write transaction: it neither reads nor fills the
// ledger's cache of slacks, which holds only what committed transactions show (it does use the
// posteriors the ledger remembers).
func (l *Ledger) verdictSlackUncached(tx *bolt.Tx, now cur, cv uint64) (certify.Slack, bool, error) {
	if l.opts.RemeasureVerdicts {
		return certify.Slack{}, false, nil
	}
	l.carry.mu.Lock()
	qv := l.carry.models[cv]
	l.carry.mu.Unlock()
	return l.slackFrom(tx, now, cv, qv)
}

// slackFrom is the slack of KL(q_now || q_cv); qv is q_cv when the caller has it (else it is
// read; known = false when the ledger does not hold it).
func (l *Ledger) slackFrom(tx *bolt.Tx, now cur, cv uint64, qv *bnn.Model) (s certify.Slack, known bool, err error) {
	if qv == nil {
		if qv, err = l.model(tx, cv); errors.Is(err, ErrUnknownAnchor) {
			return s, false, nil
		} else if err != nil {
			return s, false, err
		}
	}
	qNow, err := l.model(tx, now.version)
	if err != nil {
		return s, false, err
	}
	kl, _, err := certify.KL(qNow, qv)
	if err != nil {
		return s, false, fmt.Errorf("KL from posterior version %d to %d: %w", now.version, cv, err)
	}
	return l.opts.Policy.Slack(kl), true, nil
}

// confirm records a Monte-Carlo verdict of the CE's status under posterior version v, with the
// carry bound of its evidence when the evidence decides the verdict (certify.VerdictBound).
// Every verdict goes through here, so that no verdict keeps the bound of an older one.
func (h *header) confirm(v uint64, e *certify.Evidence, alpha float64) {
	h.confirmed, h.cv, h.carry, h.cbound = true, v, false, 0
	if e == nil {
		return
	}
	b, ok := certify.VerdictBound(h.status, *e, alpha)
	if !ok {
		return
	}
	h.carry, h.cbound = true, carryBound(h.status, b)
}

// carryBound is the verdict bound b of a CE of the given status rounded to float32 away from
// the side of 1/2 it proves (down for at_risk, up for invalidated), so that the rounded bound
// carries the verdict no further than b does.
func carryBound(status certify.Status, b float64) float32 {
	f := float32(b)
	switch {
	case status == certify.AtRisk && float64(f) > b:
		f = math.Nextafter32(f, 0)
	case status == certify.Invalidated && float64(f) < b:
		f = math.Nextafter32(f, 1)
	}
	return f
}

// unconfirm clears the CE's verdict (a status the bound alone decided).
func (h *header) unconfirm() { h.confirmed, h.cv, h.carry, h.cbound = false, 0, false, 0 }

// carries reports whether the CE's verdict holds under a posterior whose KL from the verdict's
// has the given slack (certify.Carries on the stored carry bound).
func (h *header) carries(s certify.Slack) bool {
	return h.confirmed && h.carry && certify.Carries(h.status, float64(h.cbound), s)
}

// carryMargin is the mean slack the CE's verdict can absorb (-Inf without a carry bound).
func (h *header) carryMargin() float64 {
	if !h.confirmed || !h.carry {
		return math.Inf(-1)
	}
	return certify.CarryMargin(h.status, float64(h.cbound))
}

// sameCertificate reports whether a and b are the same certificate of the same CE.
func sameCertificate(a, b *header) bool {
	return a.target == b.target && a.anchor == b.anchor && a.p1 == b.p1 && a.var1 == b.var1 &&
		a.samples == b.samples && a.delta == b.delta && a.epsilon == b.epsilon
}

// sameState reports whether a and b are the same certificate with the same status and verdict:
// nothing but the time of the last write differs. A measurement taken of a is applied only to a
// CE still in the same state, so that it never overrides a newer verdict or certificate.
func sameState(a, b *header) bool {
	return sameCertificate(a, b) && a.status == b.status &&
		a.confirmed == b.confirmed && a.cv == b.cv && a.carry == b.carry && a.cbound == b.cbound
}

// renewable applies certify.Renewable to a certified CE whose certificate lapsed, and the stricter
// certify.Reenters to one that lost it (at_risk, invalidated) or never had one (uncertified); and
// it asks, of both, that the certificate made of e hold at KL 0 under the ledger's policy pol.
// Without Hoeffding's bound the rules imply it (p >= 1 - delta > 1/2, V <= epsilon <= the
// ceiling); with it (certify.hoeffding_alpha) a certificate starts from p - sqrt(ln(1/alpha_H) /
// (2 S)), whose margin may exceed the Bernstein margin the rules use when delta is near 1/2, and
// a certificate that fails at its own anchor is no renewal: the CE gets a verdict instead.
func renewable(h *header, e certify.Evidence, alpha float64, pol certify.Policy) bool {
	ok := certify.Reenters(e, h.delta, h.epsilon, alpha)
	if h.status == certify.Certified {
		ok = certify.Renewable(e, h.delta, h.epsilon, alpha)
	}
	c := certify.Certificate{P1: e.P, Var1: e.Var, Samples: e.Samples, Delta: h.delta, Epsilon: h.epsilon}
	return ok && pol.Bounds(c, 0).Certified
}

// sampled is the posterior a batch was measured under: its version, model, and KL(q_now || it)
// (0 while it is the current one).
type sampled struct {
	version uint64
	model   *bnn.Model
	kl      float64
	past    Past // the caller's past posteriors, nil when none (renew)
}

// kept reports whether a verdict h written from this batch is in force for the current
// posterior (see Measurements): measured under it, or carried to it.
func (s sampled) kept(l *Ledger, h *header, behind bool) bool {
	return !behind || !l.opts.RemeasureVerdicts && h.carries(l.opts.Policy.Slack(s.kl))
}

// confirm writes the outcome of prediction i for it (made under the sampled posterior s; now is
// the current one): a renewal or a verdict, unless the CE changed since it was read. It reports
// whether it wrote, whether that was a renewal, and whether the result is kept (Measurements).
func (w *writeTx) confirm(it *confirmItem, now cur, s sampled, pred *bnn.Predictive, i int) (done, renewed, kept bool, err error) {
	h, ok, err := readHeader(w.tx, it.id)
	if err != nil || !ok || !sameState(&h, &it.h) {
		return false, false, false, err
	}
	v := s.version
	if it.points != nil {
		if s.past == nil {
			return false, false, false, nil
		}
		if u, act, _, err := w.l.newPointReads(w.tx, now.version, s.past, it.points).duePoint(it.id, &h); err != nil || act != measureAt || u != v {
			return false, false, false, err // no longer due at this point
		}
	} else if pending, err := w.l.pending(w.tx, &h); err != nil || !pending {
		return false, false, false, err // its bound holds again
	}
	if it.recheckLapse && h.status == certify.Certified {
		if u, ok, err := w.l.lapsedAt(w.tx, &h, nil); err != nil || !ok || u != v {
			return false, false, false, err // it held again, and lapsed at another version
		}
	}
	e := certify.Evidence{P: pred.P(i, h.target), Var: pred.V(i, h.target), Samples: pred.S}
	if renewable(&h, e, w.l.opts.VerdictAlpha, w.l.opts.Policy) {
		holds, err := w.renew(it.id, &h, now, s, e)
		return true, true, holds, err
	}
	nh := h
	nh.status, nh.updated = certify.Verdict(h.status, e, w.l.opts.VerdictAlpha), w.now.UnixNano()
	nh.confirm(v, &e, w.l.opts.VerdictAlpha)
	if err := w.putHeader(it.id, &h, &nh); err != nil {
		return false, false, false, err
	}
	kept = s.kept(w.l, &nh, now.version != v)
	if nh.status == h.status {
		return true, false, kept, nil
	}
	a, ok, err := readAnchor(w.tx, h.anchor)
	if err == nil && !ok {
		err = corruptf("counterfactual %q refers to anchor %d, which is not stored", it.id, h.anchor)
	}
	if err != nil {
		return false, false, false, err
	}
	kl, err := w.anchorKLAt(h.anchor, a, now, s)
	if err != nil {
		return false, false, false, err
	}
	b := w.l.opts.Policy.Bounds(h.certificate(), kl)
	ch := StatusChange{From: h.status, To: nh.status, PosteriorVersion: v, KL: kl, Bound: b.ProbLower, VarBound: b.VarUpper, P2: &e.P}
	if h.status == certify.Certified {
		if since, ok := failingSince(w.tx, w.l.opts.Policy, h.certificate(), h.anchor, a, nil); ok {
			ch.LapsedSince = &since
		}
	}
	if err := w.recordChange(it.id, ch); err != nil {
		return false, false, false, err
	}
	if it.points != nil && nh.failing() && v < now.version && w.l.opts.Policy.Bounds(h.certificate(), a.kl).Certified {
		// Measured at a point behind the current posterior, at which its bound holds again: a
		// ledger that measured it in time certified it again at a commit since (Rejudge), and
		// a failing CE's bound fails at its anchor's stored KL.
		d := w.l.newPointReads(w.tx, now.version, s.past, it.points)
		x, exact := d.certifiedAgainAt(&nh, v)
		if !exact {
			w.inexact++
		}
		return true, false, kept, w.recertifyAt(it.id, &nh, x, d)
	}
	return true, false, kept, nil
}

// recertifyAt certifies again the failing CE h at version x, at which its bound holds again,
// with the status change a commit of x would have recorded.
func (w *writeTx) recertifyAt(id []byte, h *header, x uint64, d *pointReads) error {
	kl, ok := d.kl(x, h.anchor)
	if !ok {
		a, found, err := readAnchor(w.tx, h.anchor)
		if err == nil && !found {
			err = corruptf("counterfactual %q refers to anchor %d, which is not stored", id, h.anchor)
		}
		if err != nil {
			return err
		}
		kl = a.kl // x is the current version (certifiedAgainAt)
	}
	nh := *h
	nh.status, nh.updated = certify.Certified, w.now.UnixNano()
	nh.unconfirm()
	if err := w.putHeader(id, h, &nh); err != nil {
		return err
	}
	b := w.l.opts.Policy.Bounds(nh.certificate(), kl)
	return w.recordChange(id, StatusChange{From: h.status, To: certify.Certified, PosteriorVersion: x, KL: kl, Bound: b.ProbLower, VarBound: b.VarUpper})
}

// anchorKLAt is KL(q_s || q_anchor), the anchor's KL at the sampled posterior s, which a verdict's
// change is recorded at: a's stored KL is at the current posterior now, a later one when the
// batch was sampled behind. Computed once per anchor and transaction.
func (w *writeTx) anchorKLAt(anchor uint64, a anchorMeta, now cur, s sampled) (float64, error) {
	if s.version == now.version {
		return a.kl, nil
	}
	if kl, ok := w.klAt[anchor]; ok {
		return kl, nil
	}
	qa, err := w.l.model(w.tx, anchor)
	if err != nil {
		return 0, err
	}
	kl, _, err := certify.KL(s.model, qa)
	if err != nil {
		return 0, fmt.Errorf("KL from posterior version %d to anchor %d: %w", s.version, anchor, err)
	}
	if w.klAt == nil {
		w.klAt = map[uint64]float64{}
	}
	w.klAt[anchor] = kl
	return kl, nil
}

// renew re-anchors a CE h (certified with a lapsed bound, at_risk or invalidated) to the
// posterior s it was measured under, from the evidence e: certified with (p1, V1, S) = e, judged
// at KL(q_now || q_s) (0 when s is current; a bound that already fails there leaves it pending,
// to be measured again under q_now). A CE that was certified keeps its status (the renewal goes
// to its history only); one that was at_risk or invalidated changes status, with an event. It
// reports whether the new certificate holds at KL(q_now || q_s).
func (w *writeTx) renew(id []byte, h *header, now cur, s sampled, e certify.Evidence) (bool, error) {
	if err := w.l.ref(w.tx, now, h.anchor, -1, 0, w.now); err != nil {
		return false, err
	}
	_, existed, err := readAnchor(w.tx, s.version)
	if err != nil {
		return false, err
	}
	if err := w.l.refSnapshot(w.tx, now, s.version, s.kl, s.model, w.now); err != nil {
		return false, err
	}
	if !existed && s.version != now.version && s.past != nil {
		// A new anchor under a past posterior: its history from the posteriors since, every
		// version kept, so that the lapse version of a certificate renewed under it is the
		// one an owner that renewed it at that version would read.
		// The anchor's own posterior is the one sampled, whether or not past still holds it.
		ps := pastSince(s.past, s.version, now.version)
		ps[s.version] = s.model
		hist, err := pastAnchorKL(ps, s.version, now.version, s.kl, w.l.opts.Policy, nil, true)
		if err != nil {
			return false, err
		}
		if err := writeAnchorKL(w.tx, s.version, now.version, hist); err != nil {
			return false, err
		}
	}
	nh := *h
	nh.anchor, nh.p1, nh.var1, nh.samples = s.version, e.P, e.Var, e.Samples
	nh.updated = w.now.UnixNano()
	b0 := w.l.opts.Policy.Bounds(nh.certificate(), 0)
	if !b0.Certified {
		// renewable asks that both bounds hold at KL 0. Anything else is a bug, not a state to
		// store.
		return false, fmt.Errorf("renewing counterfactual %q: its new certificate (p1 %v, V1 %v) does not hold at KL 0", id, e.P, e.Var)
	}
	b := w.l.opts.Policy.Bounds(nh.certificate(), s.kl)
	nh.newCertificate() // lapsed at once if b fails: judged at KL(q_now || q_s), its anchor's KL
	if err := w.putHeader(id, h, &nh); err != nil {
		return false, err
	}
	// Recorded at the version measured, as verdicts are: its new anchor, KL 0.
	ch := StatusChange{From: h.status, To: certify.Certified, PosteriorVersion: s.version, KL: 0,
		Bound: b0.ProbLower, VarBound: b0.VarUpper, P2: &e.P}
	if h.status == certify.Certified {
		return b.Certified, w.recordHistory(id, &ch)
	}
	return b.Certified, w.recordChange(id, ch)
}

// wrapErr prefixes "ledger: <op>: " to a non-nil error.
func wrapErr(op string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("ledger: %s: %w", op, err)
}

// Lane is the lane of lanes a CE id belongs to (ConfirmLane): FNV-1a of the id, modulo lanes.
func Lane(id []byte, lanes int) int {
	if lanes <= 1 {
		return 0
	}
	h := fnv.New32a()
	h.Write(id)
	return int(h.Sum32() % uint32(lanes))
}
