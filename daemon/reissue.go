package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/explain"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
)

// reissueQueue bounds the CEs waiting in memory to be reissued; beyond it they are dropped, logged
// and published as failures (the operator can still reissue them with POST /v1/explain).
const reissueQueue = 4096

// reissuer gives the system that told an applicant the explanation a replacement when the old
// one stops holding (explain.reissue): when a CE reaches the configured status (invalidated, or
// at_risk and so also invalidated), it generates a new robust CE for the same x under the current
// posterior with PSCE, in the background and within explain.concurrency, stores it under the id
// "<old id>.r<v>", v the posterior version of the status change that made it wait (not the
// version generated under: every owner of the CE names the replacement of one wait alike, so a
// previous owner that stores one while this one generates takes the name first, and this one
// announces that one rather than store a second), and publishes counterfactual_reissued (id -> new_id) or
// counterfactual_reissue_failed (with the error) through the ledger's outbox. The old CE is kept:
// deleting it is the caller's decision.
//
// The ledger records that a CE waits for its reissue in the transaction of the status change
// (ledger.Options.Reissue) and forgets it in the transaction of the outcome's event
// (ledger.Checkpoint.Reissued), so a CE queued when the daemon stops is queued again at the next
// start (resume), and one whose replacement was stored but not announced is announced, not
// generated again (stored). A CE whose change reached the ledger without reaching notify (a CE
// a replica took over and judged at another status than its previous owner left) is found by
// the sweep every sweepEvery, as at a start.
type reissuer struct {
	d          *Daemon
	rule       reissueRule
	queue      chan string
	log        *slog.Logger
	sweepEvery time.Duration // how often run looks for waiting CEs not queued: reissueSweep
	// gate, when set, is waited for before each resume, sweep and reissue: a replica's share
	// settled (Daemon.awaitShareSettled), so that no stale copy of a CE another replica took
	// over while this one was stopped or paused is reissued or failed. An error: ctx ended.
	gate func(ctx context.Context) error
	// wake asks run, with explain.reissue off, to publish the outcomes of the CEs waiting
	// (resume): adopt's CEs, restored from a previous owner's states.
	wake chan struct{}
	// page lists up to 16 stored CEs after the id after, as GET /v1/counterfactuals pages them
	// (on a replica, the cluster's): where stored looks for a replacement. Daemon.list.
	page func(ctx context.Context, after, authorization string) ([]*ledger.CE, error)

	mu     sync.Mutex
	queued map[string]bool // the ids in queue
}

// reissueSweep is how often the reissuer looks in the ledger for CEs waiting and not queued.
const reissueSweep = 30 * time.Second

// reissueRule is explain.reissue: the least severe status that triggers a reissue, 0 when off.
type reissueRule certify.Status

func parseReissueRule(status string) reissueRule {
	switch status {
	case "invalidated":
		return reissueRule(certify.Invalidated)
	case "at_risk":
		return reissueRule(certify.AtRisk)
	}
	return 0
}

// triggers reports whether a CE in status s waits for a reissue.
func (w reissueRule) triggers(s certify.Status) bool {
	return w != 0 && (s == certify.Invalidated || s == certify.Status(w))
}

// enters reports whether ch moves a CE into a status that triggers a reissue (a change between
// two such statuses does not: the CE waits since the first).
func (w reissueRule) enters(ch ledger.StatusChange) bool {
	return w.triggers(ch.To) && !w.triggers(ch.From)
}

// ledgerOption is the rule as ledger.Options.Reissue (nil when off).
func (w reissueRule) ledgerOption() func(ledger.StatusChange) bool {
	if w == 0 {
		return nil
	}
	return w.enters
}

func newReissuer(d *Daemon, status string, log *slog.Logger) *reissuer {
	page := func(ctx context.Context, after, authorization string) ([]*ledger.CE, error) {
		ces, _, err := d.list(ctx, 0, 16, after, authorization, false, nil)
		return ces, err
	}
	return &reissuer{d: d, log: log, rule: parseReissueRule(status), queue: make(chan string, reissueQueue),
		sweepEvery: reissueSweep, queued: map[string]bool{}, wake: make(chan struct{}, 1), page: page}
}

// offer queues id unless it is queued already: added says it was queued now, ok that it is
// queued (false when the queue is full).
func (r *reissuer) offer(id string) (added, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.queued[id] {
		return false, true
	}
	select {
	case r.queue <- id:
		r.queued[id] = true
		return true, true
	default:
		return false, false
	}
}

// taken forgets that id, just received from the queue, is queued.
func (r *reissuer) taken(id string) {
	r.mu.Lock()
	delete(r.queued, id)
	r.mu.Unlock()
}

// triggers reports whether a CE entering status s is reissued.
func (r *reissuer) triggers(s certify.Status) bool { return r.rule.triggers(s) }

// notify queues the CEs the changes move into a triggering status, without waiting for the
// queue. The CEs that do not fit get their counterfactual_reissue_failed events in one outbox
// transaction per call (a drift that invalidates 10^5 CEs writes one, not 10^5 fsyncs while the
// confirmer that called waits) and one WARN line.
func (r *reissuer) notify(changes []ledger.StatusChange) {
	if r == nil || r.rule == 0 {
		return
	}
	var dropped []ledger.PendingReissue
	for _, ch := range changes {
		if !r.rule.enters(ch) {
			continue
		}
		if _, ok := r.offer(ch.ID); !ok {
			dropped = append(dropped, ledger.PendingReissue{ID: ch.ID, Version: ch.PosteriorVersion})
		}
	}
	if len(dropped) > 0 {
		r.log.Warn("reissue queue full: counterfactuals not reissued (each gets a counterfactual_reissue_failed Event)",
			"count", len(dropped), "first_id", dropped[0].ID, "queue", reissueQueue)
		r.fail(dropped, queueFull)
	}
}

// adopt takes the CEs a previous owner of their partition left waiting for a reissue (restored
// with their states, ledger.CE.ReissuePendingSince), which the ledger holds as waiting from then
// on: they are queued as far as the queue has room, the rest left for a sweep. With
// explain.reissue off, none will be reissued here: run publishes the outcome of each as at a
// start (resume), a failure, or counterfactual_reissued for one whose previous owner stored its
// replacement, from the ledger (a CE deleted since gets none) and in turn with resume's (none
// gets two). adopt does not wait for that: it is called as the share applies requests, and
// resume may ask the cluster.
func (r *reissuer) adopt(ps []ledger.PendingReissue) {
	if r == nil || len(ps) == 0 {
		return
	}
	if r.rule == 0 { // resume logs what it publishes
		select {
		case r.wake <- struct{}{}:
		default: // run has a wake pending, which reads the ledger after these
		}
		return
	}
	queued := 0
	for _, p := range ps {
		if _, ok := r.offer(p.ID); !ok {
			break
		}
		queued++
	}
	r.log.Info("counterfactuals a previous owner left waiting for a reissue queued", "queued", queued,
		"left_for_a_sweep", len(ps)-queued, "first_id", ps[0].ID)
}

// reissueOff is the error of a CE waiting for a reissue in a daemon that does not reissue.
const reissueOff = "explain.reissue is off"

// queueFull is the error of a CE that found the queue full.
var queueFull = fmt.Sprintf("%d counterfactuals already wait to be reissued", reissueQueue)

// fail publishes a counterfactual_reissue_failed event saying why for each of ps, settling them,
// in one outbox transaction.
func (r *reissuer) fail(ps []ledger.PendingReissue, why string) {
	es := make([]Event, len(ps))
	for i, p := range ps {
		es[i] = Event{Type: "counterfactual_reissue_failed", ID: p.ID, PosteriorVersion: p.Version, Error: why}
	}
	r.publish(ps, es...)
}

// waitingPage is how many waiting CEs resume and sweep read from the ledger at once.
const waitingPage = 1024

// eachWaiting calls fn with the CEs the ledger holds as waiting for a reissue, a page at a time
// in id order, until fn returns false, ctx ends or no CE is left; an error is the ledger's.
func (r *reissuer) eachWaiting(ctx context.Context, fn func([]ledger.PendingReissue) bool) error {
	for after := ""; ctx.Err() == nil; {
		page, err := r.d.ledger.PendingReissues(after, waitingPage)
		if err != nil {
			return fmt.Errorf("after %q: %w", after, err)
		}
		if len(page) == 0 || !fn(page) {
			return nil
		}
		after = page[len(page)-1].ID
	}
	return nil
}

// resume queues the CEs the ledger holds as waiting for a reissue, those a stopped daemon left in
// its queue, as far as the queue has room; the others get their failure events, as notify's do,
// a page per outbox transaction. With explain.reissue off, every one gets its failure event: none
// will be reissued. A CE not queued whose replacement an earlier run stored gets that
// replacement's counterfactual_reissued event instead (announceStored). It reads a page at a time,
// whatever the number waiting.
func (r *reissuer) resume(ctx context.Context) {
	why := queueFull
	if r.rule == 0 {
		why = reissueOff
	}
	queued, failed, announced := 0, 0, 0
	err := r.eachWaiting(ctx, func(page []ledger.PendingReissue) bool {
		var dropped []ledger.PendingReissue
		for _, p := range page {
			if r.rule == 0 {
				dropped = append(dropped, p)
			} else if _, ok := r.offer(p.ID); ok {
				queued++
			} else {
				dropped = append(dropped, p)
			}
		}
		if len(dropped) > 0 {
			rest := r.announceStored(ctx, dropped)
			announced += len(dropped) - len(rest)
			failed += len(rest)
			r.fail(rest, why)
		}
		return true
	})
	if err != nil {
		r.log.Error("reading the counterfactuals waiting for a reissue; those not read stay waiting for a sweep or the next start", "err", err)
	}
	switch {
	case r.rule != 0:
		r.log.Info("counterfactuals waiting for a reissue queued again at start", "queued", queued, "failed", failed,
			"announced", announced, "queue", reissueQueue)
	case failed+announced > 0:
		r.log.Warn("counterfactuals waiting for a reissue, with explain.reissue off: each gets a counterfactual_reissue_failed Event, or counterfactual_reissued when its replacement is stored",
			"count", failed, "announced", announced)
	}
}

// announceStored announces the replacements of the CEs of ps that an earlier run stored without
// announcing them, and returns the others. A CE resume does not queue would otherwise get a
// failure event while its replacement is stored, and that replacement would never be announced.
func (r *reissuer) announceStored(ctx context.Context, ps []ledger.PendingReissue) []ledger.PendingReissue {
	var rest []ledger.PendingReissue
	for _, p := range ps {
		old, err := r.d.ledger.Get(p.ID)
		if errors.Is(err, ledger.ErrNotFound) {
			rest = append(rest, p)
			continue
		}
		if err != nil {
			r.log.Error("reading a counterfactual waiting for a reissue; it stays waiting for a sweep or the next start", "id", p.ID, "err", err)
			continue
		}
		ce, err := r.stored(ctx, old, p)
		if err != nil {
			continue // stored logged it; the CE stays waiting
		}
		if ce == nil {
			rest = append(rest, p)
			continue
		}
		r.log.Info("counterfactual reissued by an earlier run, its event not written: announcing it", "id", p.ID, "new_id", ce.ID)
		r.announce(old, ce, p)
	}
	return rest
}

// run reissues queued CEs until ctx ends, sweeping the ledger every sweepEvery.
func (r *reissuer) run(ctx context.Context) error {
	if r.await(ctx) != nil {
		return nil
	}
	r.resume(ctx)
	for r.rule == 0 {
		select {
		case <-ctx.Done():
			return nil
		case <-r.wake:
			if r.await(ctx) != nil {
				return nil
			}
			r.resume(ctx)
		}
	}
	t := time.NewTicker(r.sweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if r.await(ctx) != nil {
				return nil
			}
			r.sweep(ctx)
		case id := <-r.queue:
			r.taken(id)
			if r.await(ctx) != nil {
				return nil
			}
			r.reissue(ctx, id)
		}
	}
}

// await waits for gate, when set; its error is ctx's.
func (r *reissuer) await(ctx context.Context) error {
	if r.gate == nil {
		return nil
	}
	return r.gate(ctx)
}

// sweep queues the CEs the ledger holds as waiting for a reissue that are not queued, in id
// order, until the queue is full: those left are found by a later sweep, or the next start. A CE
// whose status change reached the ledger but not notify waits no longer than a sweep.
func (r *reissuer) sweep(ctx context.Context) {
	queued, full := 0, false
	err := r.eachWaiting(ctx, func(page []ledger.PendingReissue) bool {
		for _, p := range page {
			added, ok := r.offer(p.ID)
			if !ok {
				full = true
				return false
			}
			if added {
				queued++
			}
		}
		return true
	})
	if err != nil {
		r.log.Error("reading the counterfactuals waiting for a reissue; retried at the next sweep", "err", err)
	}
	if queued > 0 || full {
		r.log.Info("counterfactuals waiting for a reissue found in the ledger and queued", "queued", queued, "queue_full", full)
	}
}

// reissue generates and stores the replacement of CE id, if it still waits for one: the ledger
// holds it as waiting (a CE queued twice is reissued once), in a status that triggers a reissue,
// and with no replacement stored since the change that made it wait.
func (r *reissuer) reissue(ctx context.Context, id string) {
	p, waits, err := r.d.ledger.PendingReissue(id)
	if err != nil || !waits {
		return
	}
	old, err := r.d.ledger.Get(id)
	if errors.Is(err, ledger.ErrNotFound) || (err == nil && !r.triggers(old.Status)) {
		r.publish([]ledger.PendingReissue{p}) // deleted, or it recovered before its turn
		return
	}
	if err != nil {
		return
	}
	if ce, err := r.stored(ctx, old, p); err != nil || ce != nil {
		if ce != nil {
			r.log.Info("counterfactual reissued by an earlier run, its event not written: announcing it", "id", id, "new_id", ce.ID)
			r.announce(old, ce, p)
		}
		return
	}
	if r.d.hooks.Reissue != nil {
		r.d.hooks.Reissue(ctx, id)
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
	newID := replacementID(old, p, r.d.current().Version)
	// A replacement generated under one posterior and measured under the next (ingestion went
	// on meanwhile) may fall outside the set: generate again under the newer one, a few times.
	for attempt := 1; ; attempt++ {
		m = r.d.current()
		ce, err = r.generate(ctx, m, old, newID)
		if err == nil || !errors.Is(err, errOutsideSet) || r.d.current().Version == m.Version || attempt == reissueAttempts {
			break
		}
	}
	if ctx.Err() != nil {
		return
	}
	if errors.Is(err, ledger.ErrExists) {
		// The name is taken: by the replacement another owner of the CE (the replica it moved
		// from, still generating when it moved) stored after this one looked.
		had, serr := r.stored(ctx, old, p)
		if serr != nil {
			return // the CE stays waiting: the next sweep looks again (stored logged why)
		}
		if had != nil {
			r.log.Info("counterfactual reissued meanwhile by another run (the CE's previous owner): announcing its replacement, not this one",
				"id", id, "new_id", had.ID)
			r.announce(old, had, p)
			return
		}
	}
	if err != nil {
		r.log.Warn("counterfactual not reissued", "id", id, "posterior_version", m.Version, "err", err)
		r.publish([]ledger.PendingReissue{{ID: id, Version: max(p.Version, m.Version)}},
			Event{Type: "counterfactual_reissue_failed", ID: id, PosteriorVersion: m.Version, Error: err.Error()})
		return
	}
	r.log.Info("counterfactual reissued", "id", id, "new_id", ce.ID, "status", ce.Status, "p1", ce.P1,
		"posterior_version", ce.AnchorVersion, "took", time.Since(start).Round(time.Millisecond))
	r.announce(old, ce, p)
}

// replacementID names the replacement of old for its wait p: ident.Reissue(old.ID, v), v the
// posterior version of the change that made it wait, which every owner of the CE holds alike
// (it travels with the CE's state). A wait read as version 0 (its reissue entry was damaged and
// written again so, ledger.PendingReissue) is named after old's last change to a status other
// than certified in its history (which travels too), else after current: a replacement named .r0 would follow no
// change out of certified, and the web UI links a replacement only to a CE whose history left
// certified by the version in its name.
func replacementID(old *ledger.CE, p ledger.PendingReissue, current uint64) string {
	v := p.Version
	if v == 0 {
		v = current
		for _, h := range slices.Backward(old.History) {
			if h.To != certify.Certified && h.From != h.To { // a change, not a renewal
				v = h.PosteriorVersion
				break
			}
		}
	}
	return ident.Reissue(old.ID, v)
}

// announce publishes counterfactual_reissued for old's replacement ce, settling p.
func (r *reissuer) announce(old, ce *ledger.CE, p ledger.PendingReissue) {
	p1 := ce.P1
	r.publish([]ledger.PendingReissue{{ID: old.ID, Version: max(p.Version, ce.AnchorVersion)}},
		Event{Type: "counterfactual_reissued", ID: old.ID, NewID: ce.ID, From: old.Status.String(), To: ce.Status.String(),
			PosteriorVersion: ce.AnchorVersion, P2: &p1})
}

// stored finds the replacement of old stored for p: named ident.Reissue(old.ID, v) for a
// posterior version v at or after p's change, for the same x and target. A daemon that stopped
// between storing a replacement and writing its event leaves one. It pages the list GET
// /v1/counterfactuals serves, which on a replica is the cluster's: the replacement was registered
// at the owner of its own id's partition, which need not be this one; a peer that does not answer
// leaves the CE waiting.
func (r *reissuer) stored(ctx context.Context, old *ledger.CE, p ledger.PendingReissue) (*ledger.CE, error) {
	auth := "" // a replica's peers ask for the API's token, as they do of the UI's lists
	if t := r.d.cfg.HTTP.Token; t != "" {
		auth = "Bearer " + t
	}
	prefix := ident.ReissueStem(old.ID) + ".r"
	for after := prefix; ; {
		ces, err := r.page(ctx, after, auth)
		if err != nil {
			r.log.Error("looking for a stored replacement; the CE stays waiting for a reissue until the next sweep", "id", old.ID, "err", err)
			return nil, err
		}
		for _, ce := range ces {
			v, ok := strings.CutPrefix(ce.ID, prefix)
			if !ok {
				return nil, nil
			}
			n, err := strconv.ParseUint(v, 10, 64)
			if err == nil && n >= p.Version && ce.Target == old.Target && slices.Equal(ce.X, old.X) {
				return ce, nil
			}
		}
		if len(ces) < 16 {
			return nil, nil
		}
		after = ces[len(ces)-1].ID
	}
}

// reissueAttempts bounds the generations of one replacement while the posterior moves.
const reissueAttempts = 3

// generate runs PSCE for old's x under m and registers the result under newID.
func (r *reissuer) generate(ctx context.Context, m *bnn.Model, old *ledger.CE, newID string) (*ledger.CE, error) {
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
// once), settling the reissues of done in it.
func (r *reissuer) publish(done []ledger.PendingReissue, es ...Event) {
	if err := r.d.ledger.Checkpoint(&ledger.Checkpoint{Events: outboxEntries(es), Reissued: done}); err != nil {
		args := []any{"count", len(es), "settled", len(done), "err", err}
		if len(es) > 0 {
			args = append(args, "id", es[0].ID, "type", es[0].Type)
		}
		r.log.Error("writing reissue events to the outbox; the CEs stay waiting for a reissue, for a sweep or the next start", args...)
		return
	}
	if len(es) > 0 {
		r.d.outbox.notify()
	}
}
