package daemon

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/ledger/store"
)

// Retrying a checkpoint that could not be written: the first retry after about
// checkpointRetryMin, doubling up to checkpointRetryMax (backoff.Backoff, with jitter).
const (
	checkpointRetryMin = time.Second
	checkpointRetryMax = 30 * time.Second
)

// heldWrite names a kind of write durably retries, and what waits while it fails, for the log
// lines and /readyz. Each kind has its own failure episode (Daemon.writeFail[kind]): on a full
// disk one kind can fail while the other succeeds.
type heldWrite struct {
	kind    int    // its index in Daemon.writeFail
	what    string // the write
	held    string // what waits while it fails
	resumed string // what goes on once it succeeds
}

// checkpointWrite is an increment's checkpoint; shareWrite is a replica's write of its CE share
// (requests applied, a partition released, requests lost or reset).
var (
	checkpointWrite = heldWrite{kind: 0, what: "checkpoint", held: "the increment is held, consuming paused", resumed: "consuming resumed"}
	shareWrite      = heldWrite{kind: 1, what: "CE share write", held: "what it writes for a CE partition waits", resumed: "the CE share goes on"}
	heldWrites      = [...]heldWrite{checkpointWrite, shareWrite}
)

// writesFailing reports whether a write of any kind is failing (an episode is running).
func (d *Daemon) writesFailing() bool {
	for i := range d.writeFail {
		if _, err := d.writeFail[i].State(); err != nil {
			return true
		}
	}
	return false
}

// durably runs write (one ledger write of the increment in hand, or of a replica's CE share: w
// says which) until it succeeds, ctx ends, or it fails with an error other than ledger.ErrWrite
// (returned: the daemon stops). While it fails with ErrWrite the daemon is degraded: what the
// write carries is held (an increment's offsets are not checkpointed or committed, nothing more
// is consumed), /readyz fails naming the ledger and the error, cfguard_checkpoint_failures_total
// counts every failed attempt, one ERROR line is logged for the episode, and the same write is
// retried after 1 s, 2 s, 4 s ... up to 30 s. Because a failed write leaves the ledger as it was,
// the retry applies it exactly once. The first success ends the episode with one INFO line.
func (d *Daemon) durably(ctx context.Context, w heldWrite, write func() error) error {
	bo := backoff.Backoff{Min: checkpointRetryMin, Max: checkpointRetryMax}
	for {
		err := write()
		if err == nil {
			if took, n := d.writeFail[w.kind].Clear(time.Now()); n > 0 {
				if !d.writesFailing() {
					d.metrics.CheckpointRecovered()
				}
				d.log.Info(w.what+" written again; "+w.resumed, "ledger", d.ledger.Path(),
					"failed_for", took.Round(time.Millisecond), "failed_attempts", n)
			}
			return nil
		}
		if !errors.Is(err, ledger.ErrWrite) {
			return err
		}
		// The episode (what /readyz reads), then the metrics: one who sees the failure counted
		// sees the daemon not ready.
		wait := bo.Next()
		first := d.writeFail[w.kind].Fail(err, time.Now())
		d.metrics.CheckpointFailed()
		if first {
			d.log.Error(w.what+" could not be written; "+w.held+", retrying with backoff until it succeeds",
				"ledger", d.ledger.Path(), "err", err, "first_retry_in", wait.Round(time.Millisecond), "max_retry_interval", checkpointRetryMax)
		}
		if err := backoff.Sleep(ctx, wait); err != nil {
			return err
		}
	}
}

// ledgerHealth is nil unless a commit to the ledger failed within the last ledgerFailureHold
// (ledger.WriteFailures), whichever write it was: a registration, a deletion, a batch of
// verdicts, or a checkpoint (which checkpointHealth reports first while it is held), for /readyz
// and cfguard_ledger_write_failing. A commit that succeeds does not end it: on a full disk a
// small commit can succeed while larger ones fail, so the report lasts as long as commits keep
// failing and ends ledgerFailureHold after the last.
func (d *Daemon) ledgerHealth(now time.Time) error {
	f := d.ledger.WriteFailures()
	if f.Err == nil || now.Sub(f.At) >= cmp.Or(d.hooks.LedgerFailureHold, ledgerFailureHold) {
		return nil
	}
	return fmt.Errorf("a commit to the ledger %s failed %s ago, at %s (the writes that fail are answered 503 or retried): %v",
		d.ledger.Path(), now.Sub(f.At).Round(time.Second), f.At.UTC().Format(time.RFC3339), f.Err)
}

// ledgerFailureHold is how long /readyz reports a failed commit to the ledger: the window in
// which CfguardCheckpointFailing looks for the next failure. It is the ledger's store.FailureQuiet:
// a failure the ledger logs at WARN (an episode's first) is one the report did not hold before.
const ledgerFailureHold = store.FailureQuiet

// checkpointHealth is nil unless writes durably retries are failing (for /readyz): it names each
// kind that is, checkpoints first.
func (d *Daemon) checkpointHealth() error {
	var failing []string
	for _, w := range heldWrites {
		if since, err := d.writeFail[w.kind].State(); err != nil {
			failing = append(failing, fmt.Sprintf("%s to %s failing since %s (%s, retrying): %v",
				w.what, d.ledger.Path(), since.UTC().Format(time.RFC3339), w.held, err))
		}
	}
	if len(failing) == 0 {
		return nil
	}
	return errors.New(strings.Join(failing, "; "))
}
