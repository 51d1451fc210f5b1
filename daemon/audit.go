package daemon

import (
	"context"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/cfguard/cfguard/ledger"
)

// auditSchedule runs full audits on audit.schedule until ctx ends.
func (d *Daemon) auditSchedule(ctx context.Context) error {
	if d.cfg.Audit.Schedule == "" {
		<-ctx.Done()
		return nil
	}
	c := cron.New(cron.WithParser(cron.NewParser(cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)))
	if _, err := c.AddFunc(d.cfg.Audit.Schedule, func() {
		if _, err := d.audit(ctx); err != nil && ctx.Err() == nil {
			d.log.Error("scheduled audit failed", "err", err)
		}
	}); err != nil {
		return err
	}
	c.Start()
	<-ctx.Done()
	<-c.Stop().Done() // waits for a running audit to notice the cancelled context and return
	return nil
}

// audit re-evaluates every stored CE by Monte-Carlo under the current posterior and re-anchors
// the ones that are in the <delta, epsilon>-set there.
func (d *Daemon) audit(ctx context.Context) (ledger.AuditReport, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	m := d.current()
	start := time.Now()
	d.log.Info("audit started", "posterior_version", m.Version)
	rep, changes, err := d.ledger.Audit(ctx, ledger.NewModelPredictor(m, d.cfg.Certify.Samples, m.Version^0xa0d17), ledger.AuditOptions{})
	if err != nil {
		return rep, err
	}
	d.own.audits.Inc()
	d.refreshGauges()
	d.log.Info("audit done", "evaluated", rep.Evaluated, "reanchored", rep.Reanchored, "changed", rep.Changed, "took", time.Since(start).Round(time.Millisecond))
	d.publish(ctx, append(changeEvents(changes), event{Type: "audit_completed", PosteriorVersion: m.Version, Counts: countsByName(rep.Counts)}))
	return rep, nil
}
