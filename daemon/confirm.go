package daemon

import (
	"context"
	"fmt"
	"log/slog"
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

// confirmer gives every CE whose bound fails a Monte-Carlo verdict under the current posterior,
// in the background. Re-certification at a commit only applies the bounds (Theorem 1 and 2) and
// marks a CE whose bound fails at_risk at once; the confirmer then samples such CEs with
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
	l         *ledger.Ledger
	current   func() *bnn.Model
	pools     *pools // the version's shared draws (certify.samples in certify.precision)
	metrics   *alerts.Metrics
	changed   func([]ledger.StatusChange) // after a batch changed statuses: wake the outbox, reissue
	log       *slog.Logger
	wake      chan struct{}
	pool      *bnn.Pool
	model     *bnn.Model // the posterior pool was drawn from
	stale     bool       // pool's pass is done while a newer posterior is current
	batch     int        // CEs per batch: confirmBatch
	poolSlack float64    // a new pool before a batch past this slack: confirmPoolSlack
	failedAt  time.Time  // when the batches began to fail (zero while they work); logged once per episode
	lane      int        // the lane of lanes this confirmer measures (ledger.ConfirmLane)
	lanes     int
	poll      time.Duration // how often run looks without being woken: confirmPoll
	measured  atomic.Int64  // measurements written (ConfirmReport.Confirmed), for tests and logs
	// beforeRound, when set (hooks.ConfirmRound, by tests), is called before each round.
	beforeRound func(ctx context.Context)
	// gate, when set, is waited for before each batch: a replica's share settled
	// (Daemon.awaitShareSettled), so that no batch judges the stale copy of a CE another replica
	// took over while this one was stopped or paused. An error (ctx ended) ends the round.
	gate func(ctx context.Context) error
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
// they never stop the daemon (the CEs stay at_risk, which is the safe side).
func (c *confirmer) run(ctx context.Context) error {
	t := time.NewTicker(c.poll)
	defer t.Stop()
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
			c.log.Error("confirming counterfactuals whose bound fails; they stay at_risk (unconfirmed) and are retried", "err", err)
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
// measured under a posterior close enough to be kept (ledger.Measurements).
func (c *confirmer) round(ctx context.Context) error {
	for ctx.Err() == nil {
		if c.gate != nil && c.gate(ctx) != nil {
			return nil
		}
		m := c.current()
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
		rep, changes, err := c.l.ConfirmLane(ctx, backgroundPredictor{c.pool, c.model}, c.batch, c.lane, c.lanes)
		if err != nil {
			return err
		}
		c.measured.Add(int64(rep.Confirmed))
		c.metrics.AddRenewed(rep.Renewed)
		c.metrics.AddMeasurements(rep.Measurements.Kept, rep.Measurements.Superseded, rep.Measurements.Discarded)
		if len(changes) > 0 {
			c.changed(changes)
		}
		if rep.Renewed > 0 || len(changes) > 0 {
			c.log.Info("counterfactuals measured", "posterior_version", rep.PosteriorVersion, "renewed", rep.Renewed,
				"status_changes", summarizeChanges(changes), "measured", rep.Confirmed, "took", rep.Duration.Round(time.Millisecond))
		}
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
			return nil
		}
	}
	return nil
}
