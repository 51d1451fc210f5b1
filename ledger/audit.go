package ledger

import (
	"context"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// AuditOptions tune Audit.
type AuditOptions struct {
	// Progress, if set, is called after each batch with the CEs evaluated so far and the number
	// stored when the audit started.
	Progress func(done, total int)
}

// AuditReport summarises a full audit.
type AuditReport struct {
	// PosteriorVersion is the version the audit started under. Batches evaluated under a
	// posterior that was no longer current when they were written are counted in Behind.
	PosteriorVersion uint64                 `json:"posterior_version"`
	Counts           map[certify.Status]int `json:"counts"`
	// Evaluated is the number of CEs sampled; Reanchored how many were re-certified under the
	// posterior of their batch; Changed how many changed status.
	Evaluated  int           `json:"evaluated"`
	Reanchored int           `json:"reanchored"`
	Changed    int           `json:"changed"`
	Batches    int           `json:"batches"`
	Behind     int           `json:"behind"`
	Duration   time.Duration `json:"duration_ns"`
}

// errMoved: the predictor's posterior changed while it sampled a batch. The batch is read and
// sampled again under the new one, up to maxMoves times in a row.
var errMoved = fmt.Errorf("%w: the predictor moved to another posterior during a batch", ErrStale)

const maxMoves = 8

// auditItem is one CE of an audit batch as read.
type auditItem struct {
	id  []byte
	h   header
	xcf []float64
}

// Audit re-evaluates every stored CE by Monte-Carlo with p, whose posterior must be the current
// one when the audit starts, or an older one that p gives (a PosteriorPredictor: ingestion may
// promote posteriors faster than a pool of draws is made); else ErrStale:
//
//	p2 = E_q[f], V2 = Var_q[f]  (p's S draws),  f(w) = p(target | x', w)
//
// A CE in its <delta, epsilon>-set under q at confidence 1 - Options.VerdictAlpha is re-anchored
// to q (certify.Renewable for a certified CE, the stricter certify.Reenters for one that is not:
// renewable in confirm.go): anchor = q's version, (p1, V1, S) = (p2, V2, S), and
// its status is judged by its bounds at KL(q_now || q). This is how uncertified CEs enter the set
// and how drifted CEs get a fresh budget. A CE outside the set keeps its certificate; if its
// bound fails and q is current it gets a verdict (certify.Verdict, as Confirm gives). A certified
// CE outside the set stays certified (the bound decides) unless the audit measures, under the
// current posterior, p2 < 1/2 at that confidence: then it is judged (see apply).
//
// The audit runs in batches of Options.MCBatch CEs: each is read in a read transaction, sampled
// without any lock, and written in one short transaction under the writer lock, so checkpoints
// interleave. Each batch is evaluated under p's posterior as of its reading (p.Version(), which
// must then be the current posterior or one this audit already used; if it changes while the
// batch is sampled, the batch is read and sampled again). If ingestion promotes a
// new posterior meanwhile, the batch is still written: q is kept as an anchor (its snapshot
// stored if no CE held it), KL(q_now || q) computed with certify.KL, and the re-anchored CEs
// judged at that KL. So an audit is never stale because ingestion continued. Status changes go
// to the outbox in their batch's transaction.
func (l *Ledger) Audit(ctx context.Context, p Predictor, opts AuditOptions) (AuditReport, []StatusChange, error) {
	start := time.Now()
	a := &audit{l: l, p: p, models: map[uint64]*bnn.Model{}}
	a.rep.PosteriorVersion = p.Version()
	err := l.view(func(tx *bolt.Tx) error {
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		v := a.rep.PosteriorVersion
		switch pp, ok := p.(PosteriorPredictor); {
		case !c.ok:
			return ErrNoPosterior
		case c.version == v:
			m, err := l.model(tx, v)
			if err != nil {
				return err
			}
			a.models[v] = m
		case ok && v < c.version && pp.Posterior() != nil && pp.Posterior().Version == v:
			// Ingestion promoted another posterior since p's draws were made: the audit measures
			// under v all the same, and its batches are written as evaluated behind (see write).
			a.models[v] = pp.Posterior()
		default:
			return fmt.Errorf("%w: posterior version %d is not current (current is %d) and the predictor does not give its posterior", ErrStale, v, c.version)
		}
		cnt, err := readCounts(tx)
		a.total = int(cnt[0] + cnt[1] + cnt[2] + cnt[3]) // the statuses, not the lapsed count
		return err
	})
	var after []byte
	for moved := 0; err == nil; {
		if err = ctx.Err(); err != nil {
			break
		}
		var batch []auditItem
		var v uint64
		if batch, v, err = a.read(after); err != nil || len(batch) == 0 {
			break
		}
		var pred *bnn.Predictive
		if pred, err = a.predict(ctx, batch, v); errors.Is(err, errMoved) && moved < maxMoves {
			moved, err = moved+1, nil // the predictor follows a new posterior: read the batch again
			continue
		}
		if err != nil {
			break
		}
		moved, after = 0, batch[len(batch)-1].id
		err = a.write(batch, v, pred)
		a.rep.Evaluated += len(batch)
		a.rep.Batches++
		if err == nil && opts.Progress != nil {
			opts.Progress(a.rep.Evaluated, a.total)
		}
	}
	if err == nil {
		var cnt map[certify.Status]int
		if cnt, err = l.Counts(); err == nil {
			a.rep.Counts = cnt
		}
	}
	a.rep.Changed, a.rep.Duration = len(a.changes), time.Since(start)
	if err != nil {
		return a.rep, a.changes, fmt.Errorf("ledger: audit: %w", err)
	}
	return a.rep, a.changes, nil
}

// audit is one Audit in progress.
type audit struct {
	l       *Ledger
	p       Predictor
	models  map[uint64]*bnn.Model // posteriors batches were evaluated under
	total   int
	rep     AuditReport
	changes []StatusChange
}

// read returns the next batch after `after` and the posterior version it will be evaluated under.
func (a *audit) read(after []byte) ([]auditItem, uint64, error) {
	var batch []auditItem
	v := a.p.Version()
	err := a.l.view(func(tx *bolt.Tx) error {
		if _, held := a.models[v]; !held {
			c, err := readCur(tx)
			if err != nil {
				return err
			}
			if c.version != v {
				return fmt.Errorf("%w: the predictor is for posterior version %d, current is %d", ErrStale, v, c.version)
			}
			m, err := a.l.model(tx, v)
			if err != nil {
				return err
			}
			a.models[v] = m
		}
		c := tx.Bucket(bHeaders).Cursor()
		k, val := c.First()
		if after != nil {
			if k, val = c.Seek(after); k != nil && string(k) == string(after) {
				k, val = c.Next()
			}
		}
		for ; k != nil && len(batch) < a.l.opts.MCBatch; k, val = c.Next() {
			id := append([]byte(nil), k...)
			p, ok := unseal(k, val)
			if !ok {
				return corruptf("counterfactual %q: header checksum mismatch", k)
			}
			h, err := decodeHeader(p)
			if err != nil {
				return inRecord(err, "counterfactual %q: header", k)
			}
			raw, err := getSealed(tx.Bucket(bBodies), id, "body")
			if err == nil && raw == nil {
				err = corruptf("body is missing")
			}
			if err != nil {
				return inRecord(err, "counterfactual %q", id)
			}
			bd, err := decodeBody(raw, false)
			if err != nil {
				return inRecord(err, "counterfactual %q", id)
			}
			batch = append(batch, auditItem{id: id, h: h, xcf: bd.xcf})
		}
		return nil
	})
	return batch, v, err
}

// predict samples a batch with p, which must still be version v afterwards (else once more).
func (a *audit) predict(ctx context.Context, batch []auditItem, v uint64) (*bnn.Predictive, error) {
	xs := make([][]float64, len(batch))
	for i := range batch {
		xs[i] = batch[i].xcf
	}
	pred, err := a.p.Predict(ctx, xs)
	if err == nil && (pred == nil || pred.N != len(xs)) {
		err = fmt.Errorf("predictor returned %v results for %d inputs", pred, len(xs))
	}
	if err == nil && a.p.Version() != v {
		err = fmt.Errorf("%w: from posterior version %d to %d", errMoved, v, a.p.Version())
	}
	return pred, err
}

// write applies one batch's Monte-Carlo results (evaluated under version v) in one transaction.
func (a *audit) write(batch []auditItem, v uint64, pred *bnn.Predictive) error {
	l := a.l
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var changes []StatusChange
	reanchored := 0
	behind := false
	err := l.update(func(tx *bolt.Tx) error {
		changes, reanchored = nil, 0
		now, err := readCur(tx)
		if err != nil {
			return err
		}
		behind = now.version != v
		w, err := l.newWriteTx(tx, l.opts.Now().UTC())
		if err != nil {
			return err
		}
		kl, err := a.anchorKL(tx, now, v)
		if err != nil {
			return err
		}
		for i := range batch {
			moved, err := a.apply(w, now, v, kl, &batch[i], pred, i)
			if err != nil {
				return err
			}
			if moved {
				reanchored++
			}
		}
		if err := l.gcAnchors(tx, now.version); err != nil {
			return err
		}
		changes = w.changes
		return w.finish()
	})
	if err != nil {
		return err
	}
	a.rep.Reanchored += reanchored
	if m := a.models[v]; m != nil {
		l.carry.remember(m) // the posterior of the verdicts it wrote: their carry is judged from it
	}
	if behind {
		a.rep.Behind++
	}
	a.changes = append(a.changes, changes...)
	return nil
}

// anchorKL is KL(q_now || q_v): 0 when v is current, the stored KL when v is a live anchor, and
// otherwise computed from the posterior the audit holds for v.
func (a *audit) anchorKL(tx *bolt.Tx, now cur, v uint64) (float64, error) {
	if now.version == v {
		return 0, nil
	}
	an, ok, err := readAnchor(tx, v)
	if err != nil || ok {
		return an.kl, err
	}
	qNow, err := a.l.model(tx, now.version)
	if err != nil {
		return 0, err
	}
	kl, _, err := certify.KL(qNow, a.models[v])
	if err != nil {
		return 0, fmt.Errorf("KL from posterior version %d to %d: %w", now.version, v, err)
	}
	return kl, nil
}

// apply writes one CE's audit result; it reports whether the CE was re-anchored. The rules are
// Confirm's, with the audit's evidence e = (p2, V2, S) measured under posterior v:
//
//	renewed      renewable(e) (certify.Renewable; certify.Reenters when not certified; holding at KL 0): re-anchored to v and judged by its bounds at KL(q_now || q_v)
//	             (certified, or certified with a lapsed bound when the posterior moved meanwhile);
//	a verdict    when v is current and the CE's bound fails (certify.Verdict);
//	replaced     when v is current, its bound holds and yet upper(p2) < 1/2: the certificate's
//	             premise is contradicted, so the measurement becomes the certificate (anchor v,
//	             KL 0, a bound that fails) and the CE gets its verdict: measured evidence that
//	             p < 1/2 is never left standing as certified;
//	unchanged    otherwise (uncertified outside the set, certified and not contradicted, or
//	             evidence about a posterior that is no longer current).
//
// A CE that changed since the batch read it (another certificate, status or verdict) is left
// alone: the audit never overrides a newer verdict.
func (a *audit) apply(w *writeTx, now cur, v uint64, kl float64, it *auditItem, pred *bnn.Predictive, i int) (bool, error) {
	tx, pol, alpha := w.tx, a.l.opts.Policy, a.l.opts.VerdictAlpha
	h, ok, err := readHeader(tx, it.id)
	if err != nil || !ok || !sameState(&h, &it.h) {
		return false, err // deleted, re-registered, re-anchored or judged since read: its result is moot
	}
	e := certify.Evidence{P: pred.P(i, h.target), Var: pred.V(i, h.target), Samples: pred.S}
	nh := h
	moved := renewable(&h, e, alpha, pol)
	current := v == now.version
	_, hi := e.Interval(alpha)
	// contradicted: the bound holds, yet the audit measures p < 1/2 under the current posterior:
	// the certificate's premise (p1 under its anchor) is wrong, so the measurement replaces it
	// (anchor q_now, KL 0, a bound that fails) and a verdict is given.
	lapsed, err := a.l.lapsed(tx, &h)
	if err != nil {
		return false, err
	}
	holds, pending := h.status == certify.Certified && !lapsed, h.failing() || lapsed
	contradicted := !moved && holds && current && hi < 0.5
	switch {
	case moved, contradicted:
		if h.status != certify.Uncertified {
			if err := a.l.ref(tx, now, h.anchor, -1, 0, w.now); err != nil {
				return false, err
			}
		}
		if err := a.refAnchor(tx, now, v, kl, w.now); err != nil {
			return false, err
		}
		nh.anchor, nh.p1, nh.var1, nh.samples = v, e.P, e.Var, e.Samples
		if contradicted {
			nh.status = certify.Verdict(h.status, e, alpha)
			nh.confirm(v, &e, alpha)
		} else {
			nh.newCertificate() // judged at KL(q_now || q_v), its anchor's KL: lapsed at once if it fails there
		}
	case pending && current:
		nh.status = certify.Verdict(h.status, e, alpha)
		nh.confirm(v, &e, alpha)
	default:
		return false, nil
	}
	nh.updated = w.now.UnixNano()
	if err := w.putHeader(it.id, &h, &nh); err != nil {
		return false, err
	}
	if nh.status == h.status && !moved {
		return false, nil // a verdict that confirms the status
	}
	ch := StatusChange{From: h.status, To: nh.status, PosteriorVersion: now.version, KL: kl, P2: &e.P}
	if !moved && !contradicted {
		an, ok, err := readAnchor(tx, h.anchor)
		if err == nil && !ok {
			err = corruptf("counterfactual %q refers to anchor %d, which is not stored", it.id, h.anchor)
		}
		if err != nil {
			return false, err
		}
		ch.KL = an.kl
	}
	b := pol.Bounds(nh.certificate(), ch.KL)
	ch.Bound, ch.VarBound = b.ProbLower, b.VarUpper
	if nh.status == h.status { // a certified CE renewed by the audit: history, not a status change
		return moved, w.recordHistory(it.id, &ch)
	}
	return moved, w.recordChange(it.id, ch)
}

// refAnchor adds a reference to anchor v, storing the audit's snapshot of it (see refSnapshot).
func (a *audit) refAnchor(tx *bolt.Tx, now cur, v uint64, kl float64, at time.Time) error {
	return a.l.refSnapshot(tx, now, v, kl, a.models[v], at)
}
