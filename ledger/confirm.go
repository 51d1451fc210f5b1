package ledger

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
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
	// Discarded: the current posterior was not the predictor's version when reading or when
	// writing; nothing was written.
	Discarded bool `json:"discarded"`
	// More: CEs beyond this batch still lack a verdict at this version.
	More     bool          `json:"more"`
	Duration time.Duration `json:"duration_ns"`
}

// confirmItem is one CE picked for a Monte-Carlo verdict.
type confirmItem struct {
	id  []byte
	h   header
	xcf []float64
}

var errDiscard = errors.New("posterior changed while sampling")

// Confirm gives a Monte-Carlo verdict to up to max CEs whose bound fails and whose last verdict
// is missing or older than p's posterior version, which must be the current one:
//
//	p2 = E_q_now[f(w)] (p's draws),  at_risk if p2 >= 1/2 and argmax_c p(c | x') = target,
//	invalidated otherwise
//
// It reads the CEs (a read transaction), samples them without holding the writer lock, and
// writes the verdicts in one short transaction, only if the current posterior is still p's
// version (else the batch is discarded and reported, nothing written). A CE whose bound holds
// again by then is left to the bound. The CEs come from the front of idx_fail, so a call costs
// O(max), not a scan of every CE. Call it until More is false.
func (l *Ledger) Confirm(ctx context.Context, p Predictor, max int) (ConfirmReport, []StatusChange, error) {
	start := time.Now()
	v := p.Version()
	rep := ConfirmReport{PosteriorVersion: v}
	if max <= 0 {
		return rep, nil, fmt.Errorf("ledger: confirm: %w", invalidf("max = %d, want >= 1", max))
	}
	var items []confirmItem
	err := l.view(func(tx *bolt.Tx) error {
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		if !c.ok {
			return ErrNoPosterior
		}
		if c.version != v {
			rep.Discarded = true
			return nil
		}
		items, rep.More, err = pickUnconfirmed(tx, v, max)
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
		return rep, nil, nil
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	var changes []StatusChange
	err = l.update(func(tx *bolt.Tx) error {
		rep.Confirmed, rep.Skipped, changes = 0, 0, nil
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		if c.version != v {
			return errDiscard
		}
		w, err := l.newWriteTx(tx, l.opts.Now().UTC())
		if err != nil {
			return err
		}
		for i := range items {
			done, err := w.confirm(&items[i], v, pred, i)
			if err != nil {
				return err
			}
			if done {
				rep.Confirmed++
			} else {
				rep.Skipped++
			}
		}
		changes = w.changes
		if len(changes) == 0 {
			return w.finishNoGen()
		}
		return w.finish()
	})
	if errors.Is(err, errDiscard) {
		rep.Discarded, rep.Confirmed, rep.Skipped, err = true, 0, 0, nil
	}
	rep.Changed, rep.Duration = len(changes), time.Since(start)
	if err != nil {
		return rep, nil, fmt.Errorf("ledger: confirm: %w", err)
	}
	return rep, changes, nil
}

// pickUnconfirmed reads up to max CEs from the front of idx_fail whose verdict is older than
// version v; more reports whether another follows.
func pickUnconfirmed(tx *bolt.Tx, v uint64, max int) (items []confirmItem, more bool, err error) {
	c := tx.Bucket(bIdxFail).Cursor()
	bodies := tx.Bucket(bBodies)
	for k, val := c.First(); k != nil; k, val = c.Next() {
		if _, ok := unseal(k, val); !ok || len(k) < 8 {
			return nil, false, corruptf("idx_fail entry %x is damaged", k)
		}
		if binary.BigEndian.Uint64(k) >= v+1 {
			return items, false, nil
		}
		if len(items) == max {
			return items, true, nil
		}
		id := append([]byte(nil), k[8:]...)
		h, ok, err := readHeader(tx, id)
		if err == nil && (!ok || !h.failing()) {
			err = corruptf("idx_fail lists counterfactual %q, which is not failing", id)
		}
		if err != nil {
			return nil, false, err
		}
		raw, err := getSealed(bodies, id, "body")
		if err == nil && raw == nil {
			err = corruptf("body is missing")
		}
		if err != nil {
			return nil, false, inRecord(err, "counterfactual %q", id)
		}
		bd, err := decodeBody(raw, false)
		if err != nil {
			return nil, false, inRecord(err, "counterfactual %q", id)
		}
		items = append(items, confirmItem{id: id, h: h, xcf: bd.xcf})
	}
	return items, false, nil
}

// sameCertificate reports whether a and b are the same certificate of the same CE.
func sameCertificate(a, b *header) bool {
	return a.target == b.target && a.anchor == b.anchor && a.p1 == b.p1 && a.var1 == b.var1 &&
		a.samples == b.samples && a.delta == b.delta && a.epsilon == b.epsilon
}

// confirm writes the verdict of prediction i for it, unless the CE changed since it was read in
// a way that makes the verdict moot. It reports whether it wrote.
func (w *writeTx) confirm(it *confirmItem, v uint64, pred *bnn.Predictive, i int) (bool, error) {
	h, ok, err := readHeader(w.tx, it.id)
	if err != nil || !ok || !h.failing() || !sameCertificate(&h, &it.h) || h.confirmed && h.cv >= v {
		return false, err
	}
	p2 := pred.P(i, h.target)
	nh := h
	nh.status, nh.confirmed, nh.cv, nh.updated = certify.Observed(p2, pred.Argmax(i), h.target), true, v, w.now.UnixNano()
	if err := w.putHeader(it.id, &h, &nh); err != nil {
		return false, err
	}
	if nh.status == h.status {
		return true, nil
	}
	a, ok, err := readAnchor(w.tx, h.anchor)
	if err == nil && !ok {
		err = corruptf("counterfactual %q refers to anchor %d, which is not stored", it.id, h.anchor)
	}
	if err != nil {
		return false, err
	}
	b := w.l.opts.Policy.Bounds(h.certificate(), a.kl)
	return true, w.recordChange(it.id, StatusChange{From: h.status, To: nh.status, PosteriorVersion: v, KL: a.kl,
		Bound: b.ProbLower, VarBound: b.VarUpper, P2: &p2})
}

// wrapErr prefixes "ledger: <op>: " to a non-nil error.
func wrapErr(op string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("ledger: %s: %w", op, err)
}
