package ledger

import (
	"context"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// AuditReport summarises a full audit.
type AuditReport struct {
	PosteriorVersion uint64                 `json:"posterior_version"`
	Counts           map[certify.Status]int `json:"counts"`
	// Evaluated is the number of CEs sampled; Reanchored how many were re-certified under the
	// current posterior; Changed how many changed status.
	Evaluated  int           `json:"evaluated"`
	Reanchored int           `json:"reanchored"`
	Changed    int           `json:"changed"`
	Duration   time.Duration `json:"duration_ns"`
}

// auditItem is one CE of an audit batch as read.
type auditItem struct {
	id  string
	h   header
	xcf []float64
}

// Audit re-evaluates every stored CE by Monte-Carlo under `current`, which must be the ledger's
// current posterior (else ErrStale), with `samples` draws and `seed`:
//
//	p2 = E_q_now[f], V2 = Var_q_now[f]  (S draws),  f(w) = p(target | x', w)
//
// A CE in its <delta, eps>-set under q_now (p2 >= 1 - delta, V2 <= eps, argmax = target) is
// re-anchored: anchor = current version, (p1, V1, S) = (p2, V2, samples), status certified. This
// is how uncertified CEs enter the set and how drifted CEs get a fresh budget. Any other CE
// that holds a certificate keeps its anchor and becomes at_risk (p2 >= 1/2 and argmax = target)
// or invalidated; uncertified CEs outside the set stay uncertified.
//
// The audit runs in batches of Options.MCBatch CEs, each written in its own transaction under the
// writer lock, so checkpoints can interleave; if one replaces the current posterior the audit
// stops with ErrStale and the batches written so far stand (each is consistent on its own).
func (l *Ledger) Audit(ctx context.Context, current *bnn.Model, samples int, seed uint64) (AuditReport, []StatusChange, error) {
	start := time.Now()
	if samples < 2 {
		return AuditReport{}, nil, fmt.Errorf("ledger: audit: %w: samples = %d, want >= 2", ErrInvalid, samples)
	}
	blob, err := encodeModel(current)
	if err != nil {
		return AuditReport{}, nil, fmt.Errorf("ledger: audit: %w", err)
	}
	want := cur{ok: true, version: current.Version, sha: fingerprint(blob)}
	rep := AuditReport{PosteriorVersion: current.Version}
	var changes []StatusChange
	after := ""
	for {
		if err := ctx.Err(); err != nil {
			return rep, changes, fmt.Errorf("ledger: audit: %w", err)
		}
		batch, err := l.auditRead(want, after)
		if err != nil {
			return rep, changes, fmt.Errorf("ledger: audit: %w", err)
		}
		if len(batch) == 0 {
			break
		}
		after = batch[len(batch)-1].id
		xs := make([][]float64, len(batch))
		for i := range batch {
			xs[i] = batch[i].xcf
		}
		pred, err := current.Predict(xs, samples, seed)
		if err != nil {
			return rep, changes, fmt.Errorf("ledger: audit: monte-carlo: %w", err)
		}
		ch, err := l.auditWrite(want, batch, pred, samples, &rep)
		changes = append(changes, ch...)
		if err != nil {
			return rep, changes, fmt.Errorf("ledger: audit: %w", err)
		}
	}
	cnts, err := l.Counts()
	if err != nil {
		return rep, changes, fmt.Errorf("ledger: audit: %w", err)
	}
	rep.Counts, rep.Changed, rep.Duration = cnts, len(changes), time.Since(start)
	return rep, changes, nil
}

// auditRead reads the next batch of CEs after `after`, checking the current posterior.
func (l *Ledger) auditRead(want cur, after string) ([]auditItem, error) {
	var batch []auditItem
	err := l.db.View(func(tx *bolt.Tx) error {
		if readCur(tx) != want {
			return fmt.Errorf("%w: posterior version %d is not current", ErrStale, want.version)
		}
		c := tx.Bucket(bHeaders).Cursor()
		bodies := tx.Bucket(bBodies)
		k, v := c.First()
		if after != "" {
			if k, v = c.Seek([]byte(after)); k != nil && string(k) == after {
				k, v = c.Next()
			}
		}
		for ; k != nil && len(batch) < l.opts.MCBatch; k, v = c.Next() {
			h, err := decodeHeader(v)
			if err != nil {
				return fmt.Errorf("counterfactual %q: %w", k, err)
			}
			bd, err := decodeBody(bodies.Get(k), false)
			if err != nil {
				return fmt.Errorf("counterfactual %q: %w", k, err)
			}
			batch = append(batch, auditItem{id: string(k), h: h, xcf: bd.xcf})
		}
		return nil
	})
	return batch, err
}

// auditWrite applies one batch's Monte-Carlo results in one transaction.
func (l *Ledger) auditWrite(want cur, batch []auditItem, pred *bnn.Predictive, samples int, rep *AuditReport) ([]StatusChange, error) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	now := l.opts.Now().UTC()
	pol := l.opts.Policy
	var changes []StatusChange
	reanchored := 0
	err := l.db.Update(func(tx *bolt.Tx) error {
		changes, reanchored = nil, 0
		if readCur(tx) != want {
			return fmt.Errorf("%w: posterior version %d is no longer current", ErrStale, want.version)
		}
		hdrs, bodies := tx.Bucket(bHeaders), tx.Bucket(bBodies)
		cnt := readCounts(tx)
		for i, it := range batch {
			key := []byte(it.id)
			raw := hdrs.Get(key)
			if raw == nil {
				continue // deleted since read
			}
			h, err := decodeHeader(raw)
			if err != nil {
				return fmt.Errorf("counterfactual %q: %w", it.id, err)
			}
			p2, v2, am := pred.P(i, h.target), pred.V(i, h.target), pred.Argmax(i)
			from := h.status
			var kl float64
			var b certify.Bounds
			if from != certify.Uncertified {
				a, err := l.anchorKL(tx, h.anchor)
				if err != nil {
					return fmt.Errorf("counterfactual %q: %w", it.id, err)
				}
				kl, b = a, pol.Bounds(h.certificate(), a)
			}
			to, moved := from, false
			switch {
			case certify.InSet(p2, v2, h.delta, h.epsilon) && am == h.target:
				if from != certify.Uncertified {
					if err := l.ref(tx, want, h.anchor, -1, 0, now); err != nil {
						return err
					}
				}
				if err := l.ref(tx, want, want.version, 1, 0, now); err != nil {
					return err
				}
				h.anchor, h.p1, h.var1, h.samples = want.version, p2, v2, samples
				to, moved = certify.Certified, true
				reanchored++
			case from != certify.Uncertified:
				to = certify.Observed(p2, am, h.target)
			}
			if to == from && !moved {
				continue
			}
			h.updated = now.UnixNano()
			if to != from {
				h.status = to
				ch := StatusChange{ID: it.id, At: now, From: from, To: to, PosteriorVersion: want.version, KL: kl,
					Bound: b.ProbLower, VarBound: b.VarUpper, P2: &p2}
				bd, err := decodeBody(bodies.Get(key), true)
				if err != nil {
					return fmt.Errorf("counterfactual %q: %w", it.id, err)
				}
				bd.history = appendHistory(bd.history, ch)
				if err := bodies.Put(key, bd.encode()); err != nil {
					return err
				}
				cnt.add(from, -1)
				cnt.add(to, 1)
				changes = append(changes, ch)
			}
			if err := hdrs.Put(key, h.encode()); err != nil {
				return err
			}
		}
		if err := cnt.put(tx); err != nil {
			return err
		}
		if err := l.gcAnchors(tx, want.version); err != nil {
			return err
		}
		return bumpGen(tx)
	})
	if err != nil {
		return nil, err
	}
	rep.Evaluated += len(batch)
	rep.Reanchored += reanchored
	return changes, nil
}

// anchorKL is the stored KL(q_now || q_anchor) of a live anchor.
func (l *Ledger) anchorKL(tx *bolt.Tx, version uint64) (float64, error) {
	raw := tx.Bucket(bAnchors).Get(u64bytes(version))
	if raw == nil {
		return 0, fmt.Errorf("%w: anchor %d is not stored", ErrCorrupt, version)
	}
	a, err := decodeAnchor(raw)
	return a.kl, err
}
