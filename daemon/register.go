package daemon

import (
	"context"
	"errors"
	"fmt"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
)

// Registration errors (the API maps them to status codes).
var (
	errBadRequest        = errors.New("bad request")
	errNotCounterfactual = errors.New("not a counterfactual") // x_cf is not classified as the target, or x already is
	errOutsideSet        = errors.New("outside the <delta, epsilon>-set")
)

// registration is a CE to store: x, its counterfactual x_cf and the target class.
type registration struct {
	id     string
	x, xcf []float64
	target target
}

// register measures a CE under the current posterior (certify.samples draws), checks that it is a
// counterfactual, and stores it anchored to that posterior: certified when in its
// <delta, epsilon>-set, else refused or stored as uncertified (certify.uncertified).
func (d *Daemon) register(ctx context.Context, r registration) (*ledger.CE, error) {
	if r.id != "" { // checked before measuring (the ledger checks it again when storing)
		if err := ident.Check(r.id); err != nil {
			return nil, fmt.Errorf("%w: %v", errBadRequest, err)
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	m := d.current()
	if !r.target.set {
		return nil, fmt.Errorf("%w: target is required (class index or name)", errBadRequest)
	}
	t, err := r.target.resolve(m.Classes)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errBadRequest, err)
	}
	if err := checkVector("x", r.x, m.Inputs()); err != nil {
		return nil, fmt.Errorf("%w: %v", errBadRequest, err)
	}
	if err := checkVector("x_cf", r.xcf, m.Inputs()); err != nil {
		return nil, fmt.Errorf("%w: %v", errBadRequest, err)
	}
	S := d.cfg.Certify.Samples
	pool, err := d.pools.get(m)
	if err != nil {
		return nil, err
	}
	p, err := pool.Predict(ctx, [][]float64{r.xcf, r.x})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errBadRequest, err)
	}
	if orig := p.Argmax(1); orig == t {
		return nil, fmt.Errorf("%w: x is already classified as %q", errNotCounterfactual, m.Classes[t])
	}
	if p.Argmax(0) != t {
		return nil, fmt.Errorf("%w: x_cf is classified as %q (p = %.4f for %q)", errNotCounterfactual, m.Classes[p.Argmax(0)], p.P(0, t), m.Classes[t])
	}
	ce := &ledger.CE{ID: r.id, X: r.x, XCF: r.xcf, Target: t, AnchorVersion: m.Version, P1: p.P(0, t), Var1: p.V(0, t),
		Samples: S, Delta: d.cfg.Certify.Delta, Epsilon: d.cfg.Certify.Epsilon}
	if !ce.Certificate().InSet() && d.cfg.Certify.Uncertified == certify.Refuse {
		return nil, fmt.Errorf("%w: p1 = %.4f (need >= %.4f), var1 = %.5f (need <= %.5f); set certify.uncertified: store to keep such CEs",
			errOutsideSet, ce.P1, 1-ce.Delta, ce.Var1, ce.Epsilon)
	}
	if err := d.ledger.Put(ctx, ce); err != nil {
		return nil, err
	}
	d.log.Info("counterfactual registered", "id", ce.ID, "status", ce.Status, "p1", ce.P1, "var1", ce.Var1, "posterior_version", m.Version)
	return d.ledger.Get(ce.ID)
}

// forget deletes a CE (its anchor is released when no CE refers to it any more).
func (d *Daemon) forget(id string) error {
	d.mu.Lock()
	err := d.ledger.Delete(id)
	d.mu.Unlock()
	if err != nil {
		return err
	}
	d.log.Info("counterfactual deleted", "id", id)
	return nil
}
