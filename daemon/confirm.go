package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
)

// confirmBatch is how many CEs one confirmation batch measures (one pool evaluation, one short
// write transaction). At ~1 ms per CE (S = 1000 on one core) a batch takes ~0.13 s, a few
// posterior versions when ingestion promotes one every ~25 ms: its verdicts are written while
// the posterior they were measured under is still close enough for most of them to carry
// (BenchmarkConfirmUnderDrift: with 1024 every batch's verdicts came too late to carry).
const confirmBatch = 128

// confirmPoolSlack is how far (the mean slack of KL(q_newest || q_pool), certify.Policy.Slack)
// the newest posterior may move from the pool's before the next batch draws a pool for it: a
// verdict carries only with a margin above the slack, so past it most verdicts measured with
// the old pool would be superseded when written. A pool costs ~30 ms at S = 1000, a quarter of
// a batch; below this slack the old pool is kept.
const confirmPoolSlack = 0.05

// confirmPoll is how often the confirmer looks for unconfirmed CEs without being woken (a
// verdict batch that failed, for instance on a full disk, is retried then).
const confirmPoll = 30 * time.Second

// confirmer gives every CE whose bound fails a Monte-Carlo verdict under the current posterior
// (a CE due at a known version, such as the one a certificate lapsed at, under that version
// when it is near: measureDue), in the background. Re-certification at a commit only applies the bounds (Theorem 1 and 2):
// a certificate whose bound fails stays certified, renewal pending; the confirmer then samples such CEs with
// ledger.Confirm, in batches of confirmBatch, outside the daemon's lock and outside the ledger's
// writer lock (each batch is written in one short transaction, its status changes going to the
// outbox in it):
//
//	p2 = E_q_now[p(target | x', w)]   (S = certify.samples networks drawn once per posterior version)
//	at_risk (confirmed) if p2 >= 1/2 and target is the argmax, invalidated otherwise
//
// so the work of one increment's commit is bounded whatever the number of CEs a drift fails.
// The S networks are one bnn.Pool per posterior version with seed = the version XOR poolSeed,
// so that a restart and a replay measure with the same networks; it is
// evaluated on one core per lane (backgroundPredictor; confirmers: audit.workers lanes, each
// measuring its own CEs, ledger.ConfirmLane), leaving a core to ingestion. A verdict
// measured under one posterior stays in force under later ones while certify.Carries holds at
// their KL from it, so a new posterior sends back to the confirmer only the CEs whose verdict it
// no longer carries (the ledger finds them per verdict version, not per CE). What became of each
// measurement (kept, superseded, discarded: ledger.Measurements) is counted in
// cfguard_counterfactuals_measured_total.
type confirmer struct {
	l           *ledger.Ledger
	current     func() *bnn.Model
	pools       *pools // the version's shared draws (certify.samples in certify.precision)
	metrics     *alerts.Metrics
	changed     func([]ledger.StatusChange) // after a batch changed statuses: wake the outbox, reissue
	log         *slog.Logger
	wake        chan struct{}
	pool        *bnn.Pool
	model       *bnn.Model // the posterior pool was drawn from
	stale       bool       // pool's pass is done while a newer posterior is current
	batch       int        // CEs per batch: confirmBatch
	poolSlack   float64    // a new pool before a batch past this slack: confirmPoolSlack
	failedAt    time.Time  // when the batches began to fail (zero while they work); logged once per episode
	lane        int        // the lane of lanes this confirmer measures (ledger.ConfirmLane)
	lanes       int
	poll        time.Duration // how often run looks without being woken: confirmPoll
	measured    atomic.Int64  // measurements written (ConfirmReport.Confirmed), for tests and logs
	dueMeasured atomic.Int64  // of those, the ones made under a due version (measureDue)
	batches     atomic.Int64  // round's batches (ConfirmLaneLeaving calls), for benchmarks
	dueReads    atomic.Int64  // measureDue's reads of the waiting CEs (DueLane calls), for benchmarks
	dueReadTime atomic.Int64  // the nanoseconds those reads took
	// beforeRound, when set (hooks.ConfirmRound, by tests), is called before each round.
	beforeRound func(ctx context.Context)
	// past, when set, gives the posterior of a past version (nil when it is not kept): a CE
	// due for a measurement at a version it gives is measured under that version (measureDue),
	// not under the newest.
	past func(v uint64) *bnn.Model
	// gate, when set, is waited for before each batch: a replica's share settled
	// (Daemon.awaitShareSettled), so that no batch judges the stale copy of a CE another replica
	// took over while this one was stopped or paused. An error (ctx ended) ends the round.
	gate func(ctx context.Context) error
	// points, when set (a replica: the posterior log's head), gives the log's confirmation
	// points: once the log marks one, CEs are measured at points only, never under the newest
	// posterior (pointRound), and past must be set too.
	points func() ledger.Points
	// inexact counts pointRound's measurements that may differ from another owner's: made at the
	// latest point instead of the one a CE was due at, which the posteriors it holds did not
	// tell (ledger.Due.Inexact), or certified again at once past a point at which the CE waited
	// (ledger.ConfirmReport.Inexact).
	inexact       atomic.Int64
	inexactLogged time.Time // when pointRound last logged inexact measurements (once a minute at most)
	// through is, as of pointRound's last read that found every CE of the lane due (and the
	// measurements that followed it), the latest version through which each of them was judged
	// at every point it was due at: the latest point when none was due, else the earliest point
	// (or version certified again at) a CE was judged at, or one before a point whose CEs were
	// not all measured. behind says it logged that the head forgot points past it (once per
	// episode).
	through       uint64
	workedThrough bool // through is set
	behind        bool
	// lastReadAt and lastRead are when pointRound's last read of the due CEs ended and how long
	// it took; later wakes the confirmer when a read it put off is due (wakeAfter).
	lastReadAt time.Time
	lastRead   time.Duration
	later      *time.Timer
}

// confirmers are the confirmer's lanes: audit.workers of them (default every core but one), each
// measuring its own CEs (ledger.Lane) on one core, sharing the version's pool, so that
// confirmation scales with the cores audits get while ingestion keeps one.
type confirmers []*confirmer

// newConfirmers makes n lanes of confirmers (n >= 1).
func newConfirmers(n int, l *ledger.Ledger, current func() *bnn.Model, pools *pools, m *alerts.Metrics, changed func([]ledger.StatusChange), log *slog.Logger) confirmers {
	cs := make(confirmers, max(1, n))
	for i := range cs {
		lg := log
		if len(cs) > 1 {
			lg = log.With("lane", i)
		}
		cs[i] = newConfirmer(l, current, pools, m, changed, lg)
		cs[i].lane, cs[i].lanes = i, len(cs)
	}
	return cs
}

// notify wakes every lane (after a commit); it never blocks.
func (cs confirmers) notify() {
	for _, c := range cs {
		c.notify()
	}
}

// run runs every lane until ctx ends.
func (cs confirmers) run(ctx context.Context) error {
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.run(ctx)
		}()
	}
	wg.Wait()
	return nil
}

func newConfirmer(l *ledger.Ledger, current func() *bnn.Model, pools *pools, m *alerts.Metrics, changed func([]ledger.StatusChange), log *slog.Logger) *confirmer {
	return &confirmer{l: l, current: current, pools: pools, metrics: m, changed: changed, log: log,
		wake: make(chan struct{}, 1), batch: confirmBatch, poolSlack: confirmPoolSlack, poll: confirmPoll, lanes: 1}
}

// moved reports whether m has moved from the pool's posterior by more than confirmPoolSlack
// (an error computing the KL counts as moved: a new pool is always safe).
func (c *confirmer) moved(m *bnn.Model) bool {
	kl, _, err := certify.KL(m, c.model)
	return err != nil || c.l.Policy().Slack(kl).Mean > c.poolSlack
}

// notify wakes the confirmer (after a commit); it never blocks.
func (c *confirmer) notify() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// run confirms until ctx ends. Failures are logged and retried at the next wake-up or poll;
// they never stop the daemon. The CEs that wait keep their status: a lapsed certificate stays
// certified with renewal pending (cfguard_counterfactuals_renewal_pending, CfguardRenewalBehind),
// an at_risk or invalidated CE keeps its verdict, unconfirmed.
func (c *confirmer) run(ctx context.Context) error {
	t := time.NewTicker(c.poll)
	defer t.Stop()
	defer func() {
		if c.later != nil {
			c.later.Stop()
		}
	}()
	for {
		if c.beforeRound != nil {
			c.beforeRound(ctx)
		}
		err := c.round(ctx)
		if ctx.Err() != nil {
			return nil
		}
		switch {
		case err != nil && c.failedAt.IsZero():
			c.failedAt = time.Now()
			c.log.Error("confirming counterfactuals failed: the CEs that wait for a measurement keep their status "+
				"(a lapsed certificate stays certified with renewal_pending) and are retried", "err", err)
		case err == nil && !c.failedAt.IsZero():
			c.log.Info("confirming counterfactuals works again", "failed_for", time.Since(c.failedAt).Round(time.Millisecond))
			c.failedAt = time.Time{}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-c.wake:
		case <-t.C:
		}
	}
}

// round measures batches until no CE waits for a measurement under the current posterior. A
// pool is drawn for the newest posterior and used until its pass is done, even when ingestion
// promotes newer posteriors meanwhile (the ledger keeps those measurements as of it), unless the
// newest posterior has moved so far from the pool's that the verdicts of the next batch would
// not carry to it (the mean slack of their KL over confirmPoolSlack): then a pool is drawn for
// the newest one before the batch. Versions that come faster than batches are coalesced instead
// of each costing a pool that is thrown away before it is used, and a batch's verdicts are
// measured under a posterior close enough to be kept (ledger.Measurements). With past, the CEs
// measured under their due version (measureDue) are measured first, and again before a batch
// once a batch left some out and a newer posterior is current, so that a CE that becomes due
// during a long pass does not wait for the whole pass, and the round does not end with one its
// batches left out. A read of the waiting CEs costs one walk of them, so measureDue runs again
// within a pass no sooner than confirmDueReadEvery times its last reads took: under fast
// ingestion its reads cost a tenth of the pass at most, not one walk per batch.
func (c *confirmer) round(ctx context.Context) error {
	if c.points != nil {
		if _, marked := c.points().LatestPoint(math.MaxUint64); marked {
			return c.pointRound(ctx)
		}
		// The log marks no point: its updater is of a build that does not mark them (a rolling
		// upgrade). Measured under the newest posterior, as on a single node, rather than not
		// at all until the log marks one.
	}
	var (
		dueFor  *bnn.Model // the newest posterior when measureDue last ran
		dueNext time.Time  // measureDue runs again within the pass no sooner than this
		left    bool       // a batch left CEs out since (leave)
		ending  bool       // the pass is done, with CEs left out that measureDue has not seen
	)
	for ctx.Err() == nil {
		if c.gate != nil && c.gate(ctx) != nil {
			return nil
		}
		m := c.current()
		if c.past != nil && (dueFor == nil || left && dueFor.Version != m.Version && (ending || !time.Now().Before(dueNext))) {
			read, err := c.measureDue(ctx)
			if err != nil {
				return err
			}
			// m is not read again: a version promoted meanwhile is newer than dueFor, so that
			// measureDue runs for it once a batch leaves CEs out.
			dueFor, left, ending = m, false, false
			dueNext = time.Now().Add(confirmDueReadEvery * read)
		}
		if c.pool == nil || c.pool.Version() != m.Version && (c.stale || c.moved(m)) {
			// With no CE waiting, nothing is drawn: the pool (S networks, 4.3 M normals at
			// S = 1000 on the paper's network) would cost more than the commit that woke us.
			// Nor when every verdict carries to the newest posterior (certify.Carries).
			waiting, err := c.l.Waiting()
			if err != nil {
				return err
			}
			if !waiting {
				return nil // a commit that fails a bound wakes us again
			}
			p, err := c.pools.get(m)
			if err != nil {
				return fmt.Errorf("drawing %d networks from posterior version %d: %w", c.pools.samples, m.Version, err)
			}
			c.pool, c.model = p, m
		}
		c.stale = false
		leave := c.leave(c.pool.Version(), m)
		if leave != nil {
			at := leave
			leave = func(u uint64) bool {
				l := at(u)
				left = left || l
				return l
			}
		}
		rep, changes, err := c.l.ConfirmLaneLeaving(ctx, backgroundPredictor{c.pool, c.model}, c.batch, c.lane, c.lanes, c.past, leave)
		c.batches.Add(1)
		if err != nil {
			return err
		}
		c.wrote(rep, changes, "")
		if rep.Discarded {
			if c.current().Version == c.pool.Version() {
				return nil // the ledger is ahead of the daemon's posterior for a moment; woken after the swap
			}
			c.stale = true
			continue
		}
		if !rep.More {
			if c.current().Version != c.pool.Version() {
				c.stale = true // this pool's pass is done: measure again under the newest posterior
				continue
			}
			if left && dueFor.Version != c.pool.Version() {
				ending = true // what the pass left out became due at a version measureDue has not seen
				continue
			}
			return nil
		}
	}
	return nil
}

// confirmDueReadEvery bounds how often round runs measureDue again within a pass: no sooner
// than this many times as long as its last reads of the waiting CEs took.
const confirmDueReadEvery = 10

// confirmDuePick is how many CEs measureDue finds in one read of the ledger's waiting CEs
// (ledger.DueLane), which it then measures in batches of c.batch per due version.
const confirmDuePick = 16 * confirmBatch

// atDue says which due versions u (ledger.DueLane: the version a certificate lapsed at, or a
// verdict stopped carrying at) measureDue measures under, while now is the newest posterior:
// those whose posterior q_u past keeps and from which now has not moved past confirmPoolSlack
// (the mean slack of KL(q_now || q_u), the rule by which round keeps an older pool). Further,
// most verdicts measured under q_u would not carry to now and would be measured again at once
// (ledger.Measurements: superseded); such a CE is measured under the newest posterior instead, as
// one whose due version is not known. nil without past.
func (c *confirmer) atDue(now *bnn.Model) func(due uint64) bool {
	if c.past == nil {
		return nil
	}
	near := map[uint64]bool{}
	return func(u uint64) bool {
		ok, seen := near[u]
		if !seen {
			ok = c.near(u, now)
			near[u] = ok
		}
		return ok
	}
}

// near reports whether past keeps the posterior q_u and now has not moved past confirmPoolSlack
// from it (atDue).
func (c *confirmer) near(u uint64, now *bnn.Model) bool {
	q := c.past(u)
	if q == nil {
		return false
	}
	kl, _, err := certify.KL(now, q)
	return err == nil && c.l.Policy().Slack(kl).Mean <= c.poolSlack
}

// leave says which CEs a batch measured under the pool's posterior (version v) leaves to
// measureDue: those it measures (atDue, with the newest posterior now), and those due after v (a
// batch under v measures a bound that still held at v, or a verdict that still carried). nil
// without past.
func (c *confirmer) leave(v uint64, now *bnn.Model) func(due uint64) bool {
	at := c.atDue(now)
	if at == nil {
		return nil
	}
	return func(u uint64) bool { return u > v || at(u) }
}

// measureDue measures the CEs of its lane whose due version u is known and near enough to the
// newest posterior (atDue) under q_u with u's pool (ledger.ConfirmDue): a certificate under the
// first version its bound failed at, a verdict under the first version it stopped carrying at.
// The measurement of a CE that still waits when it is made is then a function of the log (the
// version, its posterior, the pool's seed), the same at whichever replica and whenever within
// that reach it is made, along whole chains (a verdict measured at its due version that stops
// carrying later is due again then). Versions are measured in ascending order, one pool each; a
// version's batches stop once the newest posterior has moved past the slack from it while
// earlier ones were measured (round then measures the rest under the newest). read is how long
// its reads of the waiting CEs took.
func (c *confirmer) measureDue(ctx context.Context) (read time.Duration, err error) {
	for ctx.Err() == nil {
		start := time.Now()
		byVersion, _, err := c.l.DueLane(confirmDuePick, c.lane, c.lanes, c.past, c.atDue(c.current()))
		took := time.Since(start)
		read += took
		c.dueReads.Add(1)
		c.dueReadTime.Add(int64(took))
		if err != nil {
			return read, err
		}
		wrote := false
		for _, u := range slices.Sorted(maps.Keys(byVersion)) {
			m := c.past(u)
			if m == nil || !c.near(u, c.current()) {
				continue // no longer kept, or moved past: measured under the newest posterior (round)
			}
			pool, err := c.pools.get(m)
			if err != nil {
				return read, fmt.Errorf("drawing %d networks from posterior version %d: %w", c.pools.samples, u, err)
			}
			for ids := range slices.Chunk(byVersion[u], c.batch) {
				if c.gate != nil && c.gate(ctx) != nil {
					return read, nil
				}
				if !c.near(u, c.current()) {
					break
				}
				rep, changes, err := c.l.ConfirmDue(ctx, backgroundPredictor{pool, m}, ids, c.past)
				if err != nil {
					return read, err
				}
				c.wrote(rep, changes, "the version they became due at")
				c.dueMeasured.Add(int64(rep.Confirmed))
				wrote = wrote || rep.Confirmed > 0
			}
		}
		if !wrote {
			return read, nil // the next read would find what this one found
		}
		// Again: the CEs past this read's confirmDuePick, and those its batches made due at a
		// later version (a verdict that stops carrying by then, a renewal that lapses again).
	}
	return read, nil
}

// wrote counts and logs what one batch wrote, and hands its status changes on.
func (c *confirmer) wrote(rep ledger.ConfirmReport, changes []ledger.StatusChange, how string) {
	c.measured.Add(int64(rep.Confirmed))
	c.metrics.AddRenewed(rep.Renewed)
	c.metrics.AddMeasurements(rep.Measurements.Kept, rep.Measurements.Superseded, rep.Measurements.Discarded)
	if len(changes) > 0 {
		c.changed(changes)
	}
	if rep.Renewed > 0 || len(changes) > 0 {
		args := []any{"posterior_version", rep.PosteriorVersion, "renewed", rep.Renewed,
			"status_changes", summarizeChanges(changes), "measured", rep.Confirmed, "took", rep.Duration.Round(time.Millisecond)}
		if how != "" {
			args = append(args, "measured_at", how)
		}
		c.log.Info("counterfactuals measured", args...)
	}
}

// pointRound measures the CEs of its lane that are due at a confirmation point of the log
// (ledger.DueAtPoints), point by point in ascending order, each under its point's posterior with
// that version's pool, until none is due at a point it has reached: a replica's round. A CE's
// measurements, and so every status it takes, are then a function of the log, the same at
// whichever owner and whenever it is measured (ledger.Points); a CE due at no point yet keeps
// its status until the log marks one. A CE whose point the posteriors this replica holds (the
// last 256) do not tell is measured at the latest point instead, and counted (inexact).
func (c *confirmer) pointRound(ctx context.Context) error {
	for first := true; ctx.Err() == nil; first = false {
		if c.gate != nil && c.gate(ctx) != nil {
			return nil
		}
		start := time.Now()
		points := c.points()
		c.checkBehind(points)
		latest, hasPoint := points.LatestPoint(math.MaxUint64)
		if first && c.workedThrough && latest == c.through {
			// No point since the last read that left nothing due: commits between points make
			// nothing due before the next one, but a share's registrations or restored states
			// can. Read again no sooner than confirmDueReadEvery times the last read took.
			if wait := confirmDueReadEvery*c.lastRead - time.Since(c.lastReadAt); wait > 0 {
				c.wakeAfter(wait)
				return nil
			}
		}
		due, err := c.l.DueAtPoints(confirmDuePick, c.lane, c.lanes, c.past, points)
		c.lastReadAt, c.lastRead = time.Now(), time.Since(start)
		c.dueReads.Add(1)
		c.dueReadTime.Add(int64(c.lastRead))
		if err != nil {
			return err
		}
		if due.Inexact > 0 && time.Since(c.inexactLogged) >= time.Minute {
			c.inexactLogged = time.Now()
			c.log.Warn("counterfactuals measured at the latest confirmation point: the posteriors this replica holds (the "+
				"last 256) do not tell the point they were due at, so their statuses may differ from another owner's",
				"counterfactuals", due.Inexact, "measured_so_far", c.inexact.Load()+int64(due.Inexact))
		}
		changes, err := c.l.CertifyAgainAtPoints(ctx, due.Again, c.past, points)
		if err != nil {
			return err
		}
		through := latest
		for _, ch := range changes {
			through = min(through, ch.PosteriorVersion)
		}
		if len(changes) > 0 {
			c.changed(changes)
			c.log.Info("counterfactuals certified again: their bound held again before a confirmation point measured them",
				"status_changes", summarizeChanges(changes))
		}
		wrote := len(changes) > 0
		for _, p := range slices.Sorted(maps.Keys(due.Measure)) {
			m := c.past(p)
			if m == nil {
				through = min(through, p-1)
				continue // no longer held: found again, at the latest point, by the next read
			}
			pool, err := c.pools.get(m)
			if err != nil {
				return fmt.Errorf("drawing %d networks from posterior version %d: %w", c.pools.samples, p, err)
			}
			for ids := range slices.Chunk(due.Measure[p], c.batch) {
				if c.gate != nil && c.gate(ctx) != nil {
					return nil
				}
				rep, changes, err := c.l.ConfirmAtPoint(ctx, backgroundPredictor{pool, m}, ids, c.past, points)
				c.batches.Add(1)
				if err != nil {
					return err
				}
				c.wrote(rep, changes, "a confirmation point")
				if rep.Confirmed < len(ids) {
					through = min(through, p-1)
				} else {
					through = min(through, p)
				}
				c.dueMeasured.Add(int64(rep.Confirmed))
				c.inexact.Add(int64(rep.Inexact))
				wrote = wrote || rep.Confirmed > 0
			}
		}
		c.inexact.Add(int64(due.Inexact))
		if !due.More && hasPoint {
			c.through, c.workedThrough = through, true
		}
		if !wrote {
			return nil // the next read would find what this one found
		}
	}
	return nil
}

// checkBehind logs, once per episode, that the log's head no longer knows the points after the
// last one at which this confirmer left nothing due (it keeps the latest 256): the CEs due at the
// points it forgot are judged from the points it keeps, as an owner that kept up judged them
// (ledger.Points), so their statuses may differ from such an owner's.
func (c *confirmer) checkBehind(points ledger.Points) {
	after := points.KnownAfter()
	switch {
	case c.workedThrough && after > c.through && !c.behind:
		c.behind = true
		c.log.Warn("the confirmer fell behind the confirmation points the posterior log's head keeps: CEs due at the "+
			"points it forgot are judged from the ones it keeps, and their statuses may differ from another owner's",
			"worked_through", c.through, "points_known_after", after)
	case c.behind && after <= c.through:
		c.behind = false
	}
}

// wakeAfter wakes the confirmer after d (a read pointRound put off); a wake set before is moved.
func (c *confirmer) wakeAfter(d time.Duration) {
	if c.later == nil {
		c.later = time.AfterFunc(d, c.notify)
		return
	}
	c.later.Reset(d)
}
