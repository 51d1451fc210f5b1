package daemon

import (
	"cmp"
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/ledger"
)

// auditStatus is GET /v1/audit: the running audit, if any, and the last one that finished.
type auditStatus struct {
	Running      bool                `json:"running"`
	Trigger      string              `json:"trigger,omitempty"` // "schedule" or "api"
	StartedAt    *time.Time          `json:"started_at,omitempty"`
	Last         *ledger.AuditReport `json:"last,omitempty"`
	LastError    string              `json:"last_error,omitempty"`
	LastFinished *time.Time          `json:"last_finished,omitempty"`
	// Replicas is, on replicas (GET /v1/audit not forwarded), the status of each replica that
	// owns CE partitions, this one's included.
	Replicas map[string]auditStatus `json:"replicas,omitempty"`
}

// auditBusyError: an audit is already running; only one runs at a time.
type auditBusyError struct {
	trigger   string
	started   time.Time
	remaining time.Duration // a guess for Retry-After: as long as the last audit took
}

// Is makes a busy audit at this replica count as a busy peer in a cluster's audit
// (cluster.Share.Audit).
func (e *auditBusyError) Is(target error) bool { return target == cluster.ErrPeerBusy }

func (e *auditBusyError) Error() string {
	return fmt.Sprintf("an audit (%s) has been running since %s; one audit runs at a time", e.trigger, e.started.Format(time.RFC3339))
}

// auditor lets one audit run at a time and remembers the last result.
type auditor struct {
	mu       sync.Mutex
	st       auditStatus
	lastTook time.Duration
}

// begin marks an audit as running, or says which one already is.
func (a *auditor) begin(trigger string, now time.Time) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.st.Running {
		return &auditBusyError{trigger: a.st.Trigger, started: *a.st.StartedAt, remaining: max(time.Second, a.lastTook-now.Sub(*a.st.StartedAt))}
	}
	a.st.Running, a.st.Trigger, a.st.StartedAt = true, trigger, &now
	return nil
}

func (a *auditor) end(rep ledger.AuditReport, err error, now time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.lastTook = now.Sub(*a.st.StartedAt)
	a.st.Running, a.st.Trigger, a.st.StartedAt = false, "", nil
	a.st.LastFinished, a.st.LastError = &now, ""
	if err != nil {
		a.st.LastError = publicMessage(err.Error()) // answered by GET /v1/audit; the log has the paths
		return
	}
	a.st.Last = &rep
}

func (a *auditor) status() auditStatus {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.st
}

func (d *Daemon) auditStatus() auditStatus { return d.audits.status() }

// auditSchedule runs full audits on audit.schedule until ctx ends. A scheduled audit that finds
// another one running is skipped (and logged).
func (d *Daemon) auditSchedule(ctx context.Context) error {
	if d.cfg.Audit.Schedule == "" {
		<-ctx.Done()
		return nil
	}
	c := cron.New(cron.WithParser(cron.NewParser(cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)))
	if _, err := c.AddFunc(d.cfg.Audit.Schedule, func() {
		if _, err := d.runAudit(ctx, "schedule"); err != nil && ctx.Err() == nil {
			d.log.Error("scheduled audit not run or failed", "err", err)
		}
	}); err != nil {
		return err
	}
	c.Start()
	<-ctx.Done()
	<-c.Stop().Done() // waits for a running audit to notice the cancelled context and return
	return nil
}

// audit is POST /v1/audit.
func (d *Daemon) audit(ctx context.Context, authorization string, forwarded bool) (cluster.AuditAnswer, error) {
	if d.rep != nil && !forwarded {
		return d.share.Audit(ctx, authorization, func(ctx context.Context) (ledger.AuditReport, error) { return d.runAudit(ctx, "api") })
	}
	rep, err := d.runAudit(ctx, "api")
	return cluster.AuditAnswer{AuditReport: rep}, err
}

// auditState is GET /v1/audit: this daemon's audits, and on replicas every replica's
// (under Replicas, this one's included) unless another replica forwarded the request.
func (d *Daemon) auditState(ctx context.Context, authorization string, forwarded bool) (auditStatus, error) {
	own := d.auditStatus()
	if d.rep == nil || forwarded {
		return own, nil
	}
	all, err := cluster.AskAll(ctx, d.share, "/v1/audit", authorization, d.auditStatus)
	if err != nil {
		return auditStatus{}, err
	}
	own.Replicas = all
	return own, nil
}

// runAudit re-evaluates every stored CE by Monte-Carlo under the current posterior and
// re-anchors the ones that are in the <delta, epsilon>-set there. One audit runs at a time.
func (d *Daemon) runAudit(ctx context.Context, trigger string) (ledger.AuditReport, error) {
	// On a replica, not over a share that is still being rebuilt: the audit would miss the CEs
	// still to replay, and say it covered the share. Nor over one that has not settled after a
	// pause of the process past its session: it would re-anchor the copies of CEs another
	// replica took over meanwhile, and publish their status changes and states again.
	if d.share != nil {
		if err := d.share.CaughtUp(ctx, cmp.Or(d.hooks.AuditRebuildWait, cluster.AuditRebuildWait)); err != nil {
			return ledger.AuditReport{}, fmt.Errorf("audit: %w", err)
		}
	}
	if err := d.audits.begin(trigger, time.Now()); err != nil {
		return ledger.AuditReport{}, err
	}
	rep, err := d.auditOnce(ctx)
	d.audits.end(rep, err, time.Now())
	return rep, err
}

// auditOnce runs ledger.Audit without the daemon's lock: the ledger reads, samples and writes
// in batches (ledger.Options.MCBatch), each written in one short transaction with its status
// changes in the outbox, so increments keep being applied meanwhile. The networks are the
// version's shared pool (pools: certify.samples draws in certify.precision), evaluated on
// audit.workers cores (auditPredictor; default every core but one). The audit measures under
// the posterior that was current when it started even when ingestion promotes others before its
// first batch or between batches: the ledger keeps that posterior as the anchor of the CEs it
// renews, judged at their KL from the newest one, and leaves verdicts under the newest posterior
// to the confirmer. audit_completed goes to the outbox in its own checkpoint (posterior and
// offsets untouched).
func (d *Daemon) auditOnce(ctx context.Context) (ledger.AuditReport, error) {
	start := time.Now()
	m := d.current()
	d.log.Info("audit started", "posterior_version", m.Version)
	pool, err := d.pools.get(m)
	if err != nil {
		return ledger.AuditReport{}, fmt.Errorf("audit: drawing networks from posterior version %d: %w", m.Version, err)
	}
	if d.hooks.AuditPoolReady != nil {
		d.hooks.AuditPoolReady(ctx, m.Version)
	}
	last := time.Now()
	rep, changes, err := d.ledger.Audit(ctx, auditPredictor{pool, m, auditWorkers(d.cfg.Audit.Workers)}, ledger.AuditOptions{Progress: func(done, total int) {
		d.outbox.notify()
		if d.hooks.AuditBatchDone != nil {
			d.hooks.AuditBatchDone(done, total)
		}
		if now := time.Now(); now.Sub(last) >= auditProgressEvery {
			last = now
			d.log.Info("audit progress", "evaluated", done, "stored", total, "elapsed", now.Sub(start).Round(time.Second))
		}
	}})
	d.outbox.notify()
	d.reissue.notify(changes)
	if err != nil {
		d.log.Error("audit failed", "posterior_version", m.Version, "evaluated", rep.Evaluated, "err", err)
		return rep, err
	}
	d.metrics.IncAudits()
	d.metrics.AddRenewed(rep.Reanchored)
	d.log.Info("audit done", "evaluated", rep.Evaluated, "reanchored", rep.Reanchored, "changed", rep.Changed, "behind", rep.Behind,
		"took", time.Since(start).Round(time.Millisecond))
	done := &ledger.Checkpoint{Events: outboxEntries([]Event{{Type: "audit_completed", PosteriorVersion: rep.PosteriorVersion, Counts: countsByName(rep.Counts)}})}
	if err := d.ledger.Checkpoint(done); err != nil {
		d.log.Error("writing the audit_completed event to the outbox", "err", err)
	} else {
		d.outbox.notify()
	}
	d.confirm.notify() // re-anchoring can leave CEs failing without a verdict under a newer posterior
	return rep, nil
}

// auditProgressEvery bounds the audit's progress log lines.
const auditProgressEvery = 10 * time.Second
