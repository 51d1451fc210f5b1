package daemon

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/ledger"
)

// Retrying a checkpoint that could not be written: the first retry after about
// checkpointRetryMin, doubling up to checkpointRetryMax (backoff.Backoff, with jitter).
const (
	checkpointRetryMin = time.Second
	checkpointRetryMax = 30 * time.Second
)

// writeFailure is the degraded mode: the increment in hand cannot be checkpointed because the
// ledger cannot be written (ledger.ErrWrite: no space, file size limit, failed fsync). The ledger
// is then exactly as before the failed write, so the posterior and the offsets are too.
type writeFailure struct {
	mu       sync.Mutex
	err      error
	since    time.Time
	attempts int
}

// fail records a failed attempt; it reports whether it is the first of an episode.
func (w *writeFailure) fail(err error, now time.Time) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	first := w.err == nil
	if first {
		w.since = now
	}
	w.err = err
	w.attempts++
	return first
}

// clear ends an episode; it returns how long it lasted and how many attempts failed (0 if none).
func (w *writeFailure) clear(now time.Time) (time.Duration, int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.err == nil {
		return 0, 0
	}
	took, n := now.Sub(w.since), w.attempts
	w.err, w.attempts = nil, 0
	return took, n
}

// state returns the last error of the running episode (nil when checkpoints succeed).
func (w *writeFailure) state() (time.Time, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.since, w.err
}

// durably runs write (one ledger write of the increment in hand) until it succeeds, ctx ends, or
// it fails with an error other than ledger.ErrWrite (returned: the daemon stops). While it fails
// with ErrWrite the daemon is degraded: the increment is held (its offsets are not checkpointed
// or committed, nothing more is consumed), /readyz fails naming the ledger and the error,
// cfguard_checkpoint_failures_total counts every failed attempt, one ERROR line is logged for the
// episode, and the same write is retried after 1 s, 2 s, 4 s ... up to 30 s. Because a failed
// write leaves the ledger as it was, the retry applies the increment exactly once. The first
// success ends the episode with one INFO line.
func (d *Daemon) durably(ctx context.Context, write func() error) error {
	bo := backoff.Backoff{Min: checkpointRetryMin, Max: checkpointRetryMax}
	for {
		err := write()
		if err == nil {
			if took, n := d.writeFail.clear(time.Now()); n > 0 {
				d.metrics.CheckpointRecovered()
				d.log.Info("checkpoint written again; consuming resumed", "ledger", d.ledger.Path(),
					"failed_for", took.Round(time.Millisecond), "failed_attempts", n)
			}
			return nil
		}
		if !errors.Is(err, ledger.ErrWrite) {
			return err
		}
		d.metrics.CheckpointFailed()
		wait := bo.Next()
		if d.writeFail.fail(err, time.Now()) {
			d.log.Error("checkpoint could not be written; the increment is held, consuming paused, retrying with backoff until it succeeds",
				"ledger", d.ledger.Path(), "err", err, "first_retry_in", wait.Round(time.Millisecond), "max_retry_interval", checkpointRetryMax)
		}
		if err := backoff.Sleep(ctx, wait); err != nil {
			return err
		}
	}
}

// ledgerHealth is nil unless the ledger's last commit failed (ledger.WriteFailure) outside the
// checkpoints, which checkpointHealth reports: a registration, a deletion, a verdict batch or a
// probe (for /readyz).
func (d *Daemon) ledgerHealth() error {
	since, err := d.ledger.WriteFailure()
	if err == nil {
		return nil
	}
	return fmt.Errorf("the ledger %s cannot be written since %s (registrations and deletions answer 503, verdicts wait; a probe write retries): %v",
		d.ledger.Path(), since.UTC().Format(time.RFC3339), err)
}

// probeLedger ends an episode of failed commits that no writer would end: a registration that
// failed on a full disk leaves ledger.WriteFailure set, and with no record arriving and no
// client retrying nothing else commits, so /readyz and cfguard_ledger_write_failing would report
// it for ever after the disk has room again. Every probePoll it looks; while commits fail, it
// commits ledger.Probe after checkpointRetryMin, doubling up to checkpointRetryMax, until one
// succeeds. While checkpoints fail it does not probe: durably retries the checkpoint itself, and
// a small probe that succeeds beside a checkpoint that cannot would only make the episode flap.
func (d *Daemon) probeLedger(ctx context.Context) error {
	bo := backoff.Backoff{Min: checkpointRetryMin, Max: checkpointRetryMax}
	wait := probePoll
	for {
		if err := backoff.Sleep(ctx, wait); err != nil {
			return nil
		}
		_, cperr := d.writeFail.state()
		if _, err := d.ledger.WriteFailure(); err == nil || cperr != nil {
			bo.Reset()
			wait = probePoll
			continue
		}
		if err := d.ledger.Probe(); err == nil {
			bo.Reset()
			wait = probePoll
			continue
		} else if !errors.Is(err, ledger.ErrWrite) {
			d.log.Warn("probing the ledger after a failed write", "ledger", d.ledger.Path(), "err", err)
		}
		wait = bo.Next()
	}
}

// probePoll is how often probeLedger looks for an episode of failed commits.
const probePoll = time.Second

// checkpointHealth is nil unless checkpoints are failing (for /readyz).
func (d *Daemon) checkpointHealth() error {
	since, err := d.writeFail.state()
	if err == nil {
		return nil
	}
	return fmt.Errorf("checkpoint to %s failing since %s (consuming paused, retrying): %v", d.ledger.Path(), since.UTC().Format(time.RFC3339), err)
}
