package daemon

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/cfguard/cfguard/bnn"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
)

// Registration errors (the API maps them to status codes).
var (
	errBadRequest        = errors.New("bad request")
	errNotCounterfactual = errors.New("not a counterfactual") // x_cf is not classified as the target, or x already is
	errOutsideSet        = errors.New("outside the <delta, epsilon>-set")
	errStopping          = errors.New("the daemon is stopping; nothing was stored, retry once it runs again")
)

// registration is a CE to store: x, its counterfactual x_cf and the target class.
type registration struct {
	id     string
	x, xcf []float64
	target target
	req    ledger.RequestRef // its request id and fingerprint when sent with an Idempotency-Key
	// inBulk marks a line of POST /v1/counterfactuals:bulk: the request logs one line for all
	// its lines (handleBulkRegister), so none is logged for it alone.
	inBulk bool
}

// is reports whether r registers ce: the same x, x_cf and target (resolved among classes).
func (r registration) is(ce *ledger.CE, classes []string) bool {
	t, err := r.target.resolve(classes)
	return err == nil && t == ce.Target && slices.Equal(ce.X, r.x) && slices.Equal(ce.XCF, r.xcf)
}

// registered is the outcome of one registration: the CE as stored, or why it was not; req and
// offset are the request a replica sent it as.
type registered struct {
	ce     *ledger.CE
	err    error
	req    ledger.RequestRef
	offset int64 // where a replica's request landed in its CE-topic partition
	// exists: on a replica, a registration refused as new whose id holds the same CE
	// (storedInCluster).
	exists bool
}

// maxRegisterBatch bounds the registrations measured and stored together: measuring one takes
// two inputs through the version's pool, and a batch measured again under d.mu (the posterior
// changed while it was measured) holds the lock (and keeps an increment waiting) for about
// maxRegisterBatch x 2 inputs x certify.samples networks (about 0.2 s at the defaults).
const maxRegisterBatch = 256

// register measures a CE under the current posterior (certify.samples draws), checks that it is
// a counterfactual, and stores it anchored to that posterior: certified when in its
// <delta, epsilon>-set, else refused or stored as uncertified (certify.uncertified). Concurrent
// registrations share one measurement and one durable write (see registrar).
//
// On a replica the registration is a request on the CE topic, and its answer is the outcome its
// owner stored for it (cluster.Share.AwaitOutcome): what the owner decided at the request's offset. A keyed
// registration (Idempotency-Key) whose request was applied before answers from that outcome
// (answerOutcome) and stores nothing again: a single daemon does not measure it again, a
// replica sends it again and its owner skips it.
func (d *Daemon) register(ctx context.Context, r registration) (*ledger.CE, error) {
	if rep, ok := d.replay(r); ok {
		return rep.ce, rep.err
	}
	out, err := d.registrar.submit(ctx, []registration{r})
	if err != nil {
		return nil, err
	}
	if out[0].err != nil {
		if rep, ok := d.duplicate(r, out[0].err); ok {
			return rep.ce, rep.err
		}
		if d.refusedAsNew(r, out[0].err) {
			lctx, cancel := context.WithTimeout(ctx, lookupBudget)
			defer cancel()
			ce, _, err := d.storedInCluster(lctx, r, out[0].err)
			return ce, err
		}
		return nil, out[0].err
	}
	if d.rep != nil {
		want, ref := out[0].ce, out[0].req
		ro, err := d.share.AwaitOutcome(ctx, want.ID, ref, out[0].offset)
		if err != nil {
			return want, err
		}
		return answerOutcome(ro.Outcome, ro.Counterfactual, want.X, want.XCF, ref.Fingerprint)
	}
	if d.hooks.Registered != nil {
		d.hooks.Registered(out[0].ce.ID)
	}
	return storedNow(d.ledger, out[0].ce, r.req.Fingerprint != "")
}

// lookupBudget bounds the questions a replica asks the owners of the ids of the registrations it
// refused as new (storedInCluster): for one registration, or all the lines of a bulk request.
const lookupBudget = 5 * time.Second

// refusedAsNew reports whether a replica refused registration r, which names its id, as a new
// CE (not a counterfactual, or outside the set, under its posterior): its ledger holds only its
// share, so whether the id holds that CE is the owner's to say (storedInCluster).
func (d *Daemon) refusedAsNew(r registration, err error) bool {
	return d.rep != nil && r.id != "" && (errors.Is(err, errNotCounterfactual) || errors.Is(err, errOutsideSet))
}

// storedInCluster answers, on a replica, registration r refused as new (refusal) from what the
// owner of its id holds now: its ledger holds only its share, and a single daemon looks the id up
// before judging it (see storeRegistrations). Nothing is sent to the CE topic, so the answer is
// read at one moment, not at a place in the partition's order: a request still on its way to
// the owner is not seen.
//
// A keyed request is answered from the outcome the owner holds for its key (a retry, after a
// drift, of a request that stored its CE), and otherwise refused: a key records what a request
// decided, and this one decides nothing, so its retries are judged again (docs/API.md). An
// unkeyed one whose id holds the same CE (stored under an earlier posterior and sent again) is
// answered as stored (same); one whose id holds another CE is 409. Else, or when the owner cannot
// say now (unreachable, rebuilding, past ctx), the answer is the refusal: true of this request,
// which stores nothing.
func (d *Daemon) storedInCluster(ctx context.Context, r registration, refusal error) (ce *ledger.CE, same bool, err error) {
	if r.req.RID != "" {
		ro, ok, err := d.share.OutcomeNow(ctx, r.id, r.req.RID)
		if err != nil || !ok {
			return nil, false, refusal
		}
		if ro.Outcome.Fingerprint == r.req.Fingerprint { // not a key reused for another request (answered 422)
			d.requests.Replayed(ro.Outcome.Result)
		}
		ce, err := answerOutcome(ro.Outcome, ro.Counterfactual, r.x, r.xcf, r.req.Fingerprint)
		return ce, false, err
	}
	cur, _, err := d.share.Find(ctx, r.id, "")
	if err != nil {
		return nil, false, refusal
	}
	if r.is(cur, d.current().Classes) {
		return cur, true, nil
	}
	return nil, false, fmt.Errorf("%w: %q holds another counterfactual", ledger.ErrExists, r.id)
}

// storedInClusterAll is storedInCluster for the registrations of a bulk batch refused as new
// (out[i] is rs[i]'s answer, replaced in place), at most maxAsking at once, within *left, the
// time the request has left for such questions, which it takes the time they took from: those
// not answered within it keep their refusal. Measuring and storing a request's batches spend
// none of it, so a large import's later batches are looked up as its first are.
func (d *Daemon) storedInClusterAll(ctx context.Context, left *time.Duration, rs []registration, out []registered) {
	var ask []int
	for i := range out {
		if d.refusedAsNew(rs[i], out[i].err) {
			ask = append(ask, i)
		}
	}
	if len(ask) == 0 || *left <= 0 {
		return
	}
	start := time.Now()
	defer func() { *left -= time.Since(start) }()
	ctx, cancel := context.WithTimeout(ctx, *left)
	defer cancel()
	sem := make(chan struct{}, maxAsking)
	var wg sync.WaitGroup
	for _, i := range ask {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case sem <- struct{}{}:
				defer func() { <-sem }()
			case <-ctx.Done():
				return
			}
			ce, same, err := d.storedInCluster(ctx, rs[i], out[i].err)
			out[i].ce, out[i].exists, out[i].err = ce, same, err
		}()
	}
	wg.Wait()
}

// maxAsking bounds the owners' lookups of one bulk batch asked at once.
const maxAsking = 16

// taken reports whether the ledger holds a CE under id.
func (d *Daemon) taken(id string) bool {
	_, err := d.ledger.Get(id)
	return err == nil
}

// storedNow is the answer to a registration that stored want: the CE as stored now, read back
// for its status. A request handled after the store (a DELETE, a registration of the id once
// free) may have removed or replaced it before the read: the answer is then errDeletedSince
// (409), as a replica's is (answerOutcome), not the 201 of a CE that is not there.
func storedNow(l *ledger.Ledger, want *ledger.CE, keyed bool) (*ledger.CE, error) {
	cur, err := l.Get(want.ID)
	if err != nil && !errors.Is(err, ledger.ErrNotFound) {
		return nil, err
	}
	if cur != nil && slices.Equal(cur.X, want.X) && slices.Equal(cur.XCF, want.XCF) {
		return cur, nil
	}
	again := "a later request deleted or replaced it; to register it again, send it again"
	if keyed {
		again = "a later request deleted or replaced it; to register it again, send it with a new Idempotency-Key"
	}
	return nil, fmt.Errorf("%w: counterfactual %q was stored by this request and is not stored now; %s", errDeletedSince, want.ID, again)
}

// registerMany is register for up to maxRegisterBatch CEs sent together (a bulk import): each
// has its own outcome, in order. The CEs returned are as Put filled them in. A single daemon
// answers a keyed registration applied before from its outcome; a replica sends every
// registration (its owner applies a request once) and answers it accepted, and looks up the
// ids of those it refused as new (storedInCluster) within *lookups, the time left for that to
// every batch of a request (storedInClusterAll).
func (d *Daemon) registerMany(ctx context.Context, rs []registration, lookups *time.Duration) ([]registered, error) {
	out := make([]registered, len(rs))
	var (
		send []registration
		at   []int // index in rs of each registration in send
	)
	for i, r := range rs {
		if rep, ok := d.replay(r); ok {
			out[i] = rep
			continue
		}
		send, at = append(send, r), append(at, i)
	}
	if len(send) == 0 {
		return out, nil
	}
	got, err := d.registrar.submit(ctx, send)
	if err != nil {
		return nil, err
	}
	for k, o := range got {
		if rep, ok := d.duplicate(send[k], o.err); ok {
			got[k] = rep
		}
	}
	if d.rep != nil {
		d.storedInClusterAll(ctx, lookups, send, got)
	}
	for k, o := range got {
		out[at[k]] = o
	}
	return out, nil
}

// registrar is the group commit of registrations, as databases commit transactions: it takes
// every registration waiting (up to about maxRegisterBatch), measures them in one call on the
// version's pool and stores them in one ledger transaction (one fsync), then answers each with
// its own outcome. A registration that finds nothing else waiting is measured and stored at
// once: there is no timer, so a lone client waits for nothing; under load, the registrations
// that arrive while batches are measured and written form the next.
//
// Measuring is most of a registration's cost (two inputs through certify.samples networks, about
// 1.2 ms of a core at the defaults, against ~0.3 ms for the HTTP exchange and the write), and
// it needs no lock: batches are measured on up to lanes cores at once, without d.mu, on the
// posterior current then, as the predict batcher runs its batches (a batch beyond the first
// starts only with minLaneInputs/2 registrations, each batch paying one pass over the pool),
// while one writer stores the measured batches in turn, under d.mu and waiting for each fsync.
// store measures a batch again under d.mu only if the posterior changed meanwhile, so every CE
// is still anchored to the posterior it was measured under, current when it is stored. Each
// CE's p1 and Var1 are what it would get measured alone (the version's shared draws; each
// input's estimate depends on its own row only).
type registrar struct {
	jobs    chan *registerJob
	stopped chan struct{} // closed when run returns: every job it took was answered before
	lanes   int
	measure func(ctx context.Context, rs []registration) *regMeasure
	store   func(ctx context.Context, rs []registration, me *regMeasure) []registered
}

// registerQueue is how many jobs may wait for the registrar (more wait to be queued).
const registerQueue = 1024

// registerJob is registrations submitted together and answered together.
type registerJob struct {
	ctx  context.Context
	regs []registration
	out  []registered
	done chan struct{}
}

// newRegistrar measures on up to lanes cores at once (at least 1) and stores with store.
func newRegistrar(lanes int, measure func(ctx context.Context, rs []registration) *regMeasure,
	store func(ctx context.Context, rs []registration, me *regMeasure) []registered) *registrar {
	return &registrar{jobs: make(chan *registerJob, registerQueue), stopped: make(chan struct{}), lanes: max(1, lanes),
		measure: measure, store: store}
}

// submit hands rs to the registrar and waits for their outcomes. It returns ctx's error if ctx
// ends first (the registrations may still be stored) and errStopping if the daemon stops
// before taking them.
func (g *registrar) submit(ctx context.Context, rs []registration) ([]registered, error) {
	j := &registerJob{ctx: ctx, regs: rs, done: make(chan struct{})}
	select {
	case g.jobs <- j:
	case <-g.stopped:
		return nil, errStopping
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case <-j.done:
		return j.out, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-g.stopped:
		select {
		case <-j.done: // taken and answered before run returned
			return j.out, nil
		default: // queued, never taken
			return nil, errStopping
		}
	}
}

// run takes jobs until ctx ends and starts the measurement of their batches, which go to one
// writer (commit). It measures and stores with ctx, not with a request's context: a client that
// goes away does not cancel the others' registrations. When ctx ends it answers the jobs it took
// and did not start with errStopping, and returns once the batches started are answered.
func (g *registrar) run(ctx context.Context) error {
	defer close(g.stopped)
	measured := make(chan *regBatch)
	written := make(chan struct{})
	go func() {
		defer close(written)
		for b := range measured {
			g.commit(ctx, b)
		}
	}()
	var (
		queue   []*registerJob
		queued  int // registrations in queue
		running int
		ended   = make(chan struct{}, g.lanes)
	)
	for {
		for len(queue) > 0 && running < g.lanes && (running == 0 || 2*queued >= minLaneInputs) {
			k, n := 0, 0
			for k < len(queue) && n < maxRegisterBatch {
				k, n = k+1, n+len(queue[k].regs)
			}
			batch := queue[:k:k]
			queue, queued, running = queue[k:], queued-n, running+1
			go func() {
				if b := g.prepare(ctx, batch); b != nil {
					measured <- b // the writer takes every batch until measured is closed
				}
				ended <- struct{}{}
			}()
		}
		select {
		case j := <-g.jobs:
			queue, queued = append(queue, j), queued+len(j.regs)
		waiting: // and every job waiting with it
			for queued < maxRegisterBatch {
				select {
				case j := <-g.jobs:
					queue, queued = append(queue, j), queued+len(j.regs)
				default:
					break waiting
				}
			}
		case <-ended:
			running--
		case <-ctx.Done():
			for _, j := range queue {
				j.out = make([]registered, len(j.regs))
				for i := range j.out {
					j.out[i].err = errStopping
				}
				close(j.done)
			}
			for ; running > 0; running-- {
				<-ended
			}
			close(measured)
			<-written
			return nil
		}
	}
}

// regBatch is the registrations of the live jobs of a batch, measured.
type regBatch struct {
	live []*registerJob
	regs []registration
	me   *regMeasure
}

// prepare answers the batch's jobs whose client went away meanwhile, without storing them, and
// measures the registrations of the others (nil when none is left).
func (g *registrar) prepare(ctx context.Context, batch []*registerJob) *regBatch {
	b := &regBatch{}
	for _, j := range batch {
		if err := j.ctx.Err(); err != nil {
			j.out = make([]registered, len(j.regs))
			for i := range j.out {
				j.out[i].err = err
			}
			close(j.done)
			continue
		}
		b.regs, b.live = append(b.regs, j.regs...), append(b.live, j)
	}
	if len(b.regs) == 0 {
		return nil
	}
	b.me = g.measure(ctx, b.regs)
	return b
}

// commit stores a measured batch and answers each of its jobs.
func (g *registrar) commit(ctx context.Context, b *regBatch) {
	out := g.store(ctx, b.regs, b.me)
	for _, j := range b.live {
		j.out, out = out[:len(j.regs):len(j.regs)], out[len(j.regs):]
		close(j.done)
	}
}

// regMeasure is registrations measured under one posterior: the refusals found before
// measuring, and the rows of the others (x_cf then x of each) through the version's pool.
type regMeasure struct {
	m        *bnn.Model
	out      []registered // a refusal per registration, or nothing yet
	targets  []int        // the target class of each registration measured
	measured []int        // indexes of the registrations measured, in the order of their rows
	p        *bnn.Predictive
	err      error // of the measurement, for every registration measured
}

// measureRegistrations measures rs under the current posterior, without d.mu (see registrar).
func (d *Daemon) measureRegistrations(ctx context.Context, rs []registration) *regMeasure {
	return d.measureUnder(ctx, rs, d.current())
}

// measureUnder checks rs and measures those that pass with one call on m's pool (split over the
// cores when it is large: predictSplit).
func (d *Daemon) measureUnder(ctx context.Context, rs []registration, m *bnn.Model) *regMeasure {
	me := &regMeasure{m: m, out: make([]registered, len(rs)), targets: make([]int, len(rs))}
	var rows [][]float64
	for i, r := range rs {
		if r.id != "" { // checked before measuring (the ledger checks it again when storing)
			if err := ident.Check(r.id); err != nil {
				me.out[i].err = fmt.Errorf("%w: %v", errBadRequest, err)
				continue
			}
		}
		if me.out[i].err = checkRegistration(r, m); me.out[i].err != nil {
			continue
		}
		t, err := r.target.resolve(m.Classes)
		if err != nil {
			me.out[i].err = fmt.Errorf("%w: %v", errBadRequest, err)
			continue
		}
		me.targets[i], me.measured, rows = t, append(me.measured, i), append(rows, r.xcf, r.x)
	}
	if len(me.measured) == 0 {
		return me
	}
	pool, err := d.pools.get(m)
	if err != nil {
		me.err = err
		return me
	}
	if me.p, err = predictSplit(ctx, pool, rows); err != nil {
		if ctx.Err() != nil {
			me.err = errStopping
		} else {
			me.err = fmt.Errorf("%w: %v", errBadRequest, err)
		}
	}
	return me
}

// storeRegistrations stores those of rs that are counterfactuals (in their set, or with
// certify.uncertified: store) in one ledger transaction; each gets its own outcome. me is rs
// measured (measureRegistrations); it holds d.mu from reading the current posterior to the
// write, and measures rs again under it when me is nil or of another posterior, so that every
// CE is anchored to the posterior it was measured under, current when it is stored (see apply).
// Each CE stored gets a log line, except the lines of a bulk request (registration.inBulk).
func (d *Daemon) storeRegistrations(ctx context.Context, rs []registration, me *regMeasure) []registered {
	d.mu.Lock()
	defer d.mu.Unlock()
	m := d.current()
	if me == nil || me.m.Version != m.Version {
		me = d.measureUnder(ctx, rs, m)
	}
	out := me.out
	if me.err != nil {
		for _, i := range me.measured {
			out[i].err = me.err
		}
		return out
	}
	if len(me.measured) == 0 {
		return out
	}
	p, targets, measured := me.p, me.targets, me.measured
	var (
		ces    []*ledger.CE
		stored []int // index in rs of each CE in ces
	)
	for k, i := range measured {
		t, cf, orig := targets[i], 2*k, 2*k+1
		ce := &ledger.CE{ID: rs[i].id, X: rs[i].x, XCF: rs[i].xcf, Target: t, AnchorVersion: m.Version, P1: p.P(cf, t), Var1: p.V(cf, t),
			Samples: d.cfg.Certify.Samples, Delta: d.cfg.Certify.Delta, Epsilon: d.cfg.Certify.Epsilon}
		if d.rep == nil && rs[i].id != "" && d.taken(rs[i].id) {
			// The id is taken, and stays so until the write (a single daemon's deletions hold
			// d.mu). The write answers it as for any taken id (exists, 409, a key's earlier
			// outcome) whatever this measurement says: a CE stored under an earlier posterior and
			// sent again is not refused as if it were new.
			ces, stored = append(ces, ce), append(stored, i)
			continue
		}
		if p.Argmax(orig) == t {
			out[i].err = fmt.Errorf("%w: x is already classified as %q", errNotCounterfactual, m.Classes[t])
			continue
		}
		if c := p.Argmax(cf); c != t {
			out[i].err = fmt.Errorf("%w: x_cf is classified as %q (p = %.4f for %q)", errNotCounterfactual, m.Classes[c], p.P(cf, t), m.Classes[t])
			continue
		}
		if !ce.Certificate().Admits(d.cfg.Certify.VerdictAlpha) && d.cfg.Certify.Uncertified == certify.Refuse {
			lo, _ := certify.Evidence{P: ce.P1, Var: ce.Var1, Samples: ce.Samples}.Interval(d.cfg.Certify.VerdictAlpha)
			out[i].err = fmt.Errorf("%w: p1 = %.4f, its lower %.0f%% confidence bound %.4f (need >= %.4f, the rule that renews certificates), "+
				"var1 = %.5f (need <= %.5f); set certify.uncertified: store to keep such CEs",
				errOutsideSet, ce.P1, 100*(1-d.cfg.Certify.VerdictAlpha), lo, 1-ce.Delta, ce.Var1, ce.Epsilon)
			continue
		}
		ces, stored = append(ces, ce), append(stored, i)
	}
	var (
		errs    []error
		offsets []int64
		err     error
	)
	refs := make([]ledger.RequestRef, len(ces))
	keyed := false
	for k, i := range stored {
		refs[k], keyed = rs[i].req, keyed || rs[i].req.RID != ""
	}
	switch {
	case d.rep != nil:
		// A replica sends the CEs to their owners, without d.mu: the owner anchors them.
		d.mu.Unlock()
		errs, offsets = d.share.Send(ctx, ces, refs)
		d.mu.Lock()
	case keyed:
		errs, err = d.ledger.PutRequests(ctx, ces, refs)
	default:
		errs, err = d.ledger.PutEach(ctx, ces)
	}
	if n := len(ces) - nonNil(errs); err == nil && n > 0 {
		d.metrics.ObserveRegistrationBatch(n)
	}
	if err != nil {
		for _, i := range stored {
			out[i].err = err
		}
		return out
	}
	for k, i := range stored {
		if out[i].err = errs[k]; out[i].err != nil {
			continue
		}
		out[i].ce, out[i].req = ces[k], refs[k]
		if offsets != nil {
			out[i].offset = offsets[k]
		}
		switch {
		case rs[i].inBulk:
		case d.rep != nil: // its owner decides its status, or refuses it, when it applies the request
			d.log.Info("counterfactual registration sent to its partition's owner", "id", ces[k].ID, "offset", out[i].offset,
				"p1", ces[k].P1, "var1", ces[k].Var1, "posterior_version", m.Version)
		default:
			d.log.Info("counterfactual registered", "id", ces[k].ID, "status", ces[k].Status, "p1", ces[k].P1, "var1", ces[k].Var1, "posterior_version", m.Version)
		}
	}
	return out
}

// splitRows is the fewest inputs worth a core of their own in predictSplit: each part pays a pass
// over the pool from memory (about 1.35 ms of a core at 1000 float64 networks, the cost of ~2.3
// inputs), under 4% of 64 inputs. Batches of concurrent registrations are smaller and use the
// cores through the registrar's lanes instead; a bulk import's batches are larger.
const splitRows = 64

// predictSplit is pool.Predict over rows split into contiguous parts measured on up to
// GOMAXPROCS goroutines: the pool spreads only larger calls over cores (bnn.Pool.Predict), and
// a bulk import sends its batches one after the other. An input's estimate does not depend on
// the other inputs of its call (bnn's engine), so the split changes no result.
func predictSplit(ctx context.Context, pool *bnn.Pool, rows [][]float64) (*bnn.Predictive, error) {
	parts := min(runtime.GOMAXPROCS(0), len(rows)/splitRows)
	if parts <= 1 {
		return pool.Predict(ctx, rows)
	}
	out := make([]*bnn.Predictive, parts)
	errs := make([]error, parts)
	var wg sync.WaitGroup
	for k := range parts {
		lo, hi := k*len(rows)/parts, (k+1)*len(rows)/parts
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[k], errs[k] = pool.PredictWorkers(ctx, rows[lo:hi], 1)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	p := &bnn.Predictive{N: len(rows), C: out[0].C, S: out[0].S, Precision: out[0].Precision}
	for _, q := range out {
		p.Mean, p.Var = append(p.Mean, q.Mean...), append(p.Var, q.Var...)
	}
	return p, nil
}

func nonNil(errs []error) int {
	n := 0
	for _, err := range errs {
		if err != nil {
			n++
		}
	}
	return n
}

// checkRegistration checks what can be checked of a registration without measuring it.
func checkRegistration(r registration, m *bnn.Model) error {
	if !r.target.set {
		return fmt.Errorf("%w: target is required (class index or name)", errBadRequest)
	}
	if err := checkVector("x", r.x, m); err != nil {
		return fmt.Errorf("%w: %v", errBadRequest, err)
	}
	if err := checkVector("x_cf", r.xcf, m); err != nil {
		return fmt.Errorf("%w: %v", errBadRequest, err)
	}
	return nil
}

// forget deletes CE id as the request ref (the request id and fingerprint of its
// Idempotency-Key; none without one) and answers the outcome recorded for it (answerDeletion):
// nil when it deleted a CE (its anchor is released when no CE refers to it any more),
// ledger.ErrNotFound when nothing was stored under id when it was applied, errPrecondition
// when ifMatch (not nil) names none of the registration stored there, which is kept. A keyed deletion
// applied before is not applied again, and answers its first outcome: a retry does not delete a
// CE registered under the id since. A replica sends the deletion to the CE's owner and answers
// once the owner has applied it, in its partition's order (cluster.Share.Forget).
func (d *Daemon) forget(ctx context.Context, id string, ref ledger.RequestRef, ifMatch []string) error {
	if err := ident.Check(id); err != nil {
		return fmt.Errorf("%w: %q: %v", ledger.ErrNotFound, id, err) // no CE is stored under an invalid id
	}
	if d.rep != nil {
		o, err := d.share.Forget(ctx, id, ref, ifMatch)
		if err != nil {
			return err
		}
		return answerDeletion(o.Outcome, ref.Fingerprint)
	}
	d.mu.Lock()
	o, err := d.ledger.DeleteRequest(id, ref, ifMatch)
	d.mu.Unlock()
	if errors.Is(err, ledger.ErrWrite) {
		return fmt.Errorf("the ledger cannot be written now (see /readyz); nothing was deleted, retry later: %w", err)
	}
	if err != nil {
		return err
	}
	switch {
	case o.Duplicate:
		d.requests.Skipped(ceshare.KindDelete, 1)
		if o.Fingerprint == ref.Fingerprint { // not a key reused for another request (answered 422)
			d.requests.Replayed(o.Result)
		}
	case o.Result == ledger.OutcomeDeleted:
		d.log.Info("counterfactual deleted", "id", id)
	}
	return answerDeletion(o, ref.Fingerprint)
}

// list returns a page of the stored CEs: the ledger's, or on a replica the cluster's
// (cluster.Share.List) unless another replica forwarded the request.
func (d *Daemon) list(ctx context.Context, st certify.Status, limit int, after, authorization string, forwarded bool, expect []int) ([]*ledger.CE, string, error) {
	if d.rep != nil && !forwarded {
		return d.share.List(ctx, st, limit, after, authorization)
	}
	if d.rep != nil { // an owner asked for its page: not while it misses some of its CEs
		if err := d.share.HoldsWhole(expect); err != nil {
			return nil, "", err
		}
	}
	ces, more, err := d.ledger.Page(st, limit, after)
	if err != nil {
		return nil, "", err
	}
	next := ""
	if more {
		next = ces[len(ces)-1].ID
	}
	return ces, next, nil
}

// find returns a stored CE: from the ledger, or on a replica from the CE's owner (forwarding
// authorization). replica names the replica that answered ("" for a single daemon).
func (d *Daemon) find(ctx context.Context, id, authorization string, forwarded bool) (*ledger.CE, string, error) {
	switch {
	case d.rep == nil:
		ce, err := d.ledger.Get(id)
		return ce, "", err
	case forwarded:
		ce, err := d.share.Local(id)
		return ce, "", err
	}
	return d.share.Find(ctx, id, authorization)
}
