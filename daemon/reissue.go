package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/explain"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
)

// reissueQueue bounds the CEs waiting to be reissued; beyond it they are dropped, logged and
// published as failures (the operator can still reissue them with POST /v1/explain).
const reissueQueue = 4096

// reissuer gives the system that told an applicant the explanation a replacement when the old
// one stops holding (explain.reissue): when a CE reaches the configured status (invalidated, or
// at_risk and so also invalidated), it generates a new robust CE for the same x under the current
// posterior with PSCE, in the background and within explain.concurrency, stores it under the id
// "<old id>.r<posterior version>", and publishes counterfactual_reissued (id -> new_id) or
// counterfactual_reissue_failed (with the error) through the ledger's outbox. The old CE is kept:
// deleting it is the caller's decision.
type reissuer struct {
	d     *Daemon
	worst certify.Status // the least severe status that triggers a reissue
	queue chan string
	log   *slog.Logger
}

func newReissuer(d *Daemon, status string, log *slog.Logger) *reissuer {
	r := &reissuer{d: d, log: log, queue: make(chan string, reissueQueue)}
	switch status {
	case "invalidated":
		r.worst = certify.Invalidated
	case "at_risk":
		r.worst = certify.AtRisk
	}
	return r
}

// triggers reports whether a CE entering status s is reissued.
func (r *reissuer) triggers(s certify.Status) bool {
	return r.worst != 0 && (s == certify.Invalidated || s == r.worst)
}

// notify queues the CEs the changes move into a triggering status, without waiting for the
// queue. The CEs that do not fit get their counterfactual_reissue_failed events in one outbox
// transaction per call (a drift that invalidates 10^5 CEs writes one, not 10^5 fsyncs while the
// confirmer that called waits) and one WARN line.
func (r *reissuer) notify(changes []ledger.StatusChange) {
	if r == nil || r.worst == 0 {
		return
	}
	var dropped []Event
	for _, ch := range changes {
		if !r.triggers(ch.To) || r.triggers(ch.From) {
			continue
		}
		select {
		case r.queue <- ch.ID:
		default:
			dropped = append(dropped, Event{Type: "counterfactual_reissue_failed", ID: ch.ID, PosteriorVersion: ch.PosteriorVersion,
				Error: fmt.Sprintf("%d counterfactuals already wait to be reissued", reissueQueue)})
		}
	}
	if len(dropped) > 0 {
		r.log.Warn("reissue queue full: counterfactuals not reissued (each gets a counterfactual_reissue_failed Event)",
			"count", len(dropped), "first_id", dropped[0].ID, "queue", reissueQueue)
		r.publish(dropped...)
	}
}

// run reissues queued CEs until ctx ends.
func (r *reissuer) run(ctx context.Context) error {
	if r.worst == 0 {
		<-ctx.Done()
		return nil
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case id := <-r.queue:
			r.reissue(ctx, id)
		}
	}
}

// reissue generates and stores the replacement of CE id, if it still needs one.
func (r *reissuer) reissue(ctx context.Context, id string) {
	old, err := r.d.ledger.Get(id)
	if err != nil || !r.triggers(old.Status) {
		return // deleted, or it recovered before its turn
	}
	release, err := r.waitSlot(ctx)
	if err != nil {
		return
	}
	defer release()
	var (
		m  *bnn.Model
		ce *ledger.CE
	)
	start := time.Now()
	// A replacement generated under one posterior and measured under the next (ingestion went
	// on meanwhile) may fall outside the set: generate again under the newer one, a few times.
	for attempt := 1; ; attempt++ {
		m = r.d.current()
		ce, err = r.generate(ctx, m, old, id)
		if err == nil || !errors.Is(err, errOutsideSet) || r.d.current().Version == m.Version || attempt == reissueAttempts {
			break
		}
	}
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		r.log.Warn("counterfactual not reissued", "id", id, "posterior_version", m.Version, "err", err)
		r.publish(Event{Type: "counterfactual_reissue_failed", ID: id, PosteriorVersion: m.Version, Error: err.Error()})
		return
	}
	r.log.Info("counterfactual reissued", "id", id, "new_id", ce.ID, "status", ce.Status, "p1", ce.P1,
		"posterior_version", ce.AnchorVersion, "took", time.Since(start).Round(time.Millisecond))
	p1 := ce.P1
	r.publish(Event{Type: "counterfactual_reissued", ID: id, NewID: ce.ID, From: old.Status.String(), To: ce.Status.String(),
		PosteriorVersion: ce.AnchorVersion, P2: &p1})
}

// reissueAttempts bounds the generations of one replacement while the posterior moves.
const reissueAttempts = 3

// generate runs PSCE for old's x under m and registers the result under ident.Reissue(id, version).
func (r *reissuer) generate(ctx context.Context, m *bnn.Model, old *ledger.CE, id string) (*ledger.CE, error) {
	newID := ident.Reissue(id, m.Version)
	gctx, cancel := context.WithTimeout(ctx, r.d.cfg.Explain.Timeout)
	defer cancel()
	res, err := r.d.exp.generate(gctx, m, old.X, old.Target, explain.MethodPSCE)
	if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
		return nil, fmt.Errorf("no counterfactual within explain.timeout %v: %w", r.d.cfg.Explain.Timeout, err)
	}
	if err != nil {
		return nil, err
	}
	return r.d.register(ctx, registration{id: newID, x: old.X, xcf: res.XCF, target: target{set: true, index: res.Target}})
}

// waitSlot takes a generation slot, waiting while API requests hold them all.
func (r *reissuer) waitSlot(ctx context.Context) (func(), error) {
	for {
		release, err := r.d.exp.acquire()
		if !errors.Is(err, errBusy) {
			return release, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// publish writes es to the ledger's outbox in one transaction (published from there, at least
// once).
func (r *reissuer) publish(es ...Event) {
	if err := r.d.ledger.Checkpoint(&ledger.Checkpoint{Events: outboxEntries(es)}); err != nil {
		r.log.Error("writing reissue events to the outbox", "count", len(es), "id", es[0].ID, "type", es[0].Type, "err", err)
		return
	}
	r.d.outbox.notify()
}
