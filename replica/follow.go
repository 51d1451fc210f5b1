package replica

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// Head is the follower's head.
func (r *Replica) Head() *postlog.Head {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := *r.chain.Head()
	return &h
}

// Follow plays the log from the follower's position until ctx ends. An entry it cannot apply
// (an unknown format, a posterior that does not hash to its entry) stops following: the replica
// keeps serving the last version it verified, and /readyz says why. It goes on reading: a new
// epoch that moves past that entry (cfguard new-epoch) resumes it. A log it cannot read (the
// broker down, a leader moving) is read again with backoff, from where the follower is, while
// the replica serves its posterior (a WARN line per episode); only an error no retry fixes
// (credentials, ACLs) ends Follow.
func (r *Replica) Follow(ctx context.Context) error {
	// The watch of the log's end stops with follow: the log is closed after follow returns.
	wctx, stopWatch := context.WithCancel(ctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		r.watchEnd(wctx)
	}()
	defer func() {
		stopWatch()
		<-watched
	}()
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for {
		r.mu.Lock()
		from := r.read
		r.mu.Unlock()
		err := r.followFrom(ctx, from)
		r.mu.Lock()
		unreadable := r.unreadable
		r.mu.Unlock()
		if unreadable.IsZero() {
			bo.Reset()
		}
		switch {
		case errors.Is(err, errRewind):
		case err == nil || ctx.Err() != nil:
			return nil
		case !stream.Retryable(err):
			return err
		default:
			if unreadable.IsZero() {
				r.mu.Lock()
				r.unreadable = time.Now()
				r.mu.Unlock()
				r.lg.Warn("posterior log: reading it failed; reading it again with backoff, serving the last posterior applied", "topic", r.plog.Topic(),
					"from", from, "err", err)
			}
			if bo.Wait(ctx) != nil {
				return nil
			}
			continue
		}
		// The log was reset under the follower (halt): what it holds now is read from its
		// start, where only a new epoch that moves past the head is accepted.
		r.mu.Lock()
		r.read = 0
		r.logEnds = nil // what the log holds now was not appended when the ends seen say
		r.mu.Unlock()
		r.lg.Info("posterior log reset: reading it again from its start, for a new epoch that moves past the head", "topic", r.plog.Topic())
	}
}

// later is the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// pendingStep is a step the updater appended as entry seq, kept until an entry is accepted there.
type pendingStep struct {
	seq  uint64
	step Step
}

// storeError is a failure of this replica to store an entry it accepted (its ledger): not the
// entry's fault, and not one a new epoch moves past.
type storeError struct{ err error }

func (e *storeError) Error() string { return "storing the entry: " + e.err.Error() }

func (e *storeError) Unwrap() error { return e.err }

// storeErr is err as a storeError, unless the ledger refused the entry for what it holds (an
// invalid field): that is the entry's, and every restart meets it again.
func storeErr(err error) error {
	if errors.Is(err, ledger.ErrInvalid) {
		return err
	}
	return &storeError{err}
}

// errRewind ends followFrom when the follower must read the log again from its start (halt).
var errRewind = errors.New("posterior log: read again from the start")

// followFrom plays the log from offset from until ctx ends (nil), a record cannot be read, or
// halt asks for a rewind (errRewind).
func (r *Replica) followFrom(ctx context.Context, from int64) error {
	rd, err := r.plog.Read(from)
	if err != nil {
		return err
	}
	defer rd.Close()
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var rewound atomic.Bool
	go func() {
		select {
		case <-r.rewind:
			rewound.Store(true)
			cancel()
		case <-rctx.Done():
		}
	}()
	for {
		r.mu.Lock()
		if r.starved.IsZero() {
			r.starved = time.Now() // kept across failed reads and reopened readers
		}
		r.mu.Unlock()
		rec, err := rd.Next(rctx)
		if err != nil {
			if rewound.Load() && ctx.Err() == nil {
				return errRewind
			}
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("posterior log %s: %w", r.plog.Topic(), err)
		}
		r.mu.Lock()
		since := r.unreadable
		r.unreadable, r.starved = time.Time{}, time.Time{}
		r.mu.Unlock()
		if !since.IsZero() {
			r.lg.Info("posterior log readable again", "topic", r.plog.Topic(), "unreadable_for", time.Since(since).Round(time.Second))
		}
		if err := r.offer(ctx, rec); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			r.mu.Lock()
			if r.chain.Stuck() == nil {
				r.chain.Block(rec)
			}
			recovery := "once every replica runs a build that reads it, or after cfguard new-epoch moves the log past it, the replicas resume: "
			runbook := "CfguardPosteriorLogStopped"
			var se *storeError
			var settings *SettingsError
			switch {
			case errors.As(err, &settings):
				recovery = "" // the error says how to recover
				runbook = "CfguardReplicaSettingsDiffer"
			case errors.As(err, &se):
				recovery = "the entry is valid: this replica could not store it; once what the error names is fixed, restart this replica " +
					"and it applies the entry again: "
			case errors.Is(err, postlog.ErrDiverged):
				recovery = "if the other replicas follow on, this one alone refused the entry: stop it, move its state_dir aside and start it, " +
					"and it rebuilds its ledger from the log and the CE topic; if every replica stopped here, a holder of the cluster key " +
					"wrote these entries: cfguard new-epoch moves the log past them: "
			}
			r.stopped = fmt.Errorf("%w (offset %d of %s; %ssee docs/RUNBOOK.md, %s)", err, rec.Offset, r.plog.Topic(), recovery, runbook)
			r.read = rec.Offset + 1
			// The line and the gauge before the lock is released, as in halt.
			r.lg.Error("stopped following the posterior log; serving the last verified posterior", "offset", rec.Offset, "err", err)
			r.m.Stopped.Set(1)
			close(r.changed)
			r.changed = make(chan struct{})
			r.mu.Unlock()
		}
	}
}

// applyEntry applies the increment e to prev (postlog.Entry.ApplyHashing) with the follower's
// hasher, which hashes the layers the log's entries leave unchanged once.
func (r *Replica) applyEntry(e *postlog.Entry, prev *bnn.Model) (*bnn.Model, error) {
	r.hashMu.Lock()
	defer r.hashMu.Unlock()
	return e.ApplyHashing(prev, &r.hash)
}

// offer judges one record and applies it when accepted.
func (r *Replica) offer(ctx context.Context, rec postlog.Record) error {
	r.mu.Lock()
	c := r.chain.Fork()
	halts := r.halts
	r.mu.Unlock()
	e, reason, err := c.Offer(rec)
	if err != nil {
		return err
	}
	if reason == postlog.Unauthenticated {
		r.unauthenticated(rec)
		r.advance(rec.Offset+1, nil, 0)
		return nil
	}
	if reason != postlog.Accepted {
		r.ignored(rec, e, reason)
		if e != nil {
			r.lg.Info("posterior log record ignored", "offset", rec.Offset, "reason", reason, "seq", e.Seq, "term", e.Term, "entry_writer", e.Writer)
			if err := c.Diverged(rec, e); err != nil {
				return err // the follower stops, blocking its chain at rec
			}
		}
		r.advance(rec.Offset+1, nil, 0)
		return nil
	}
	if err := r.checkCoverage(ctx, e, true); errors.Is(err, postlog.ErrPastEnd) {
		r.lg.Warn("posterior log entry refused: it covers input records that do not exist", "topic", r.plog.Topic(), "partition", 0,
			"offset", rec.Offset, "seq", e.Seq, "term", e.Term, "entry_writer", e.Writer, "input_topic", r.cfg.Kafka.Topic, "err", err)
		r.m.Ignored.WithLabelValues(string(postlog.PastEnd)).Inc() // after the line: whoever sees the count finds it
		r.mu.Lock()
		if !r.caughtUp {
			// Read while catching up: the replicas that followed the log judged it earlier, on
			// the input as it was then, and may have applied it. One refused live was judged by
			// every follower on the same input, and the updater's next entry takes its place.
			r.refusedNext = fmt.Errorf("entry %d at offset %d, which extends this replica's head and was read while catching up, was refused: %w", e.Seq, rec.Offset, err)
		}
		r.mu.Unlock()
		r.advance(rec.Offset+1, nil, 0)
		return nil
	} else if err != nil {
		return err
	}
	head := c.Head()
	hb, err := postlog.MarshalHead(head)
	if err != nil {
		return err
	}
	switch e.Kind {
	case postlog.Genesis: // a new epoch: the posterior and coverage stay the head's (judgeEpoch)
		if err := r.checkSettings(e, rec.Offset); err != nil {
			if se := (*SettingsError)(nil); errors.As(err, &se) {
				r.mu.Lock() // now, not at the offer's start: a halt meanwhile is a reset too
				reset := r.halts > r.epochHalts
				r.mu.Unlock()
				se.following = stoppedAtEpoch(r.recorded.Load(), reset)
			}
			return err
		}
		if err := r.host.Checkpoint(ctx, &ledger.Checkpoint{LogHead: hb}); err != nil {
			return storeErr(err)
		}
		r.mu.Lock()
		resumed := r.stopped != nil
		r.stopped = nil
		r.epochHalts = halts
		r.mu.Unlock()
		r.m.Stopped.Set(0)
		r.lg.Warn("posterior log: new epoch", "epoch", e.Epoch, "entry", e.Seq, "offset", rec.Offset, "moved_past", e.Past.Offset,
			"entry_writer", e.Writer, "resumed", resumed, "covers", e.Covers)
	case postlog.Claim:
		// The claimant publishes the events the entries before its claim owe: their writer
		// may have died between its append and its own apply. They may be published twice.
		var owed []ledger.OutboxEntry
		if e.Writer == r.writer {
			for _, u := range head.Unpublished {
				for _, ev := range u.Events {
					owed = append(owed, ledger.OutboxEntry{Key: ev.Key, Value: ev.Value})
				}
			}
		}
		if err := r.host.Checkpoint(ctx, &ledger.Checkpoint{LogHead: hb, Events: owed}); err != nil {
			return storeErr(err)
		}
		r.lg.Info("posterior log: new term", "term", e.Term, "claimant", e.Writer, "entry", e.Seq, "generation", e.Generation, "build", e.Build)
		if len(owed) > 0 {
			r.lg.Info("updater: published again the events of entries whose writer may not have", "events", len(owed),
				"entries", len(head.Unpublished), "from_entry", head.Unpublished[0].Seq)
			r.m.Republished.Add(float64(len(owed)))
		}
	case postlog.Increment:
		prev := r.host.Current()
		next, err := r.applyEntry(e, prev)
		if err != nil {
			return err
		}
		// The step this updater computed for this very entry (by hash: an entry of its that
		// lands late, after it appended another at the same place, is told apart).
		var own Step
		r.mu.Lock()
		if p, ok := r.pending[head.Hash]; ok && e.Writer == r.writer {
			own = p.step
		}
		r.mu.Unlock()
		if err := r.host.Commit(ctx, e, prev, next, own, &ledger.Checkpoint{Offsets: e.Covers, LogHead: hb, At: r.replayedAt(rec)}); err != nil {
			return storeErr(err)
		}
		r.remember(next)
	}
	r.advance(rec.Offset+1, c, halts)
	return nil
}

// logEnd is one end of the posterior log (its next offset: the high watermark, past every record
// committed) as watchEnd found it: first, when the first answer that gave it came back, and last,
// when the last question that got it was asked. An entry at offset o was committed after the last
// question that got an end at or below o, and before the first answer that gave an end past o.
type logEnd struct {
	end         int64
	first, last time.Time
}

// maxLogEnds bounds Replica.logEnds: one a second for a follower more than about three hours
// behind a log that grows every second; past it the oldest go, and their entries are dated by
// their own time, no later than the oldest end kept.
const maxLogEnds = 10_000

// sawEnd records that the posterior log ended at offset end when watchEnd asked at asked and had
// the answer at answered, for replayedAt, and returns the lag: the records not read yet. A log
// that ends before an end seen earlier was cut (an unclean leader election, a topic recreated)
// or its new leader's end is catching up: the ends seen past it may not be of the records it
// holds now, and are forgotten; the lower end itself is not recorded either, since after a
// leader change the records past it may be old.
func (r *Replica) sawEnd(end int64, asked, answered time.Time) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch n := len(r.logEnds); {
	case n > 0 && end == r.logEnds[n-1].end:
		r.logEnds[n-1].last = asked
	case n == 0 || end > r.logEnds[n-1].end:
		r.logEnds = append(r.logEnds, logEnd{end: end, first: answered, last: asked})
	default:
		keep := 0
		for keep < n && r.logEnds[keep].end <= end {
			keep++
		}
		r.logEnds = r.logEnds[:keep]
	}
	// Only the entries from read on are dated again: of the ends at or below it, the last is kept.
	drop := 0
	for drop+1 < len(r.logEnds) && r.logEnds[drop+1].end <= r.read {
		drop++
	}
	drop = max(drop, len(r.logEnds)-maxLogEnds)
	r.logEnds = append(r.logEnds[:0], r.logEnds[drop:]...)
	lag := max(end-r.read, 0)
	switch {
	case lag == 0:
		r.caughtUp = true
		r.behind = time.Time{}
	case r.behind.IsZero():
		r.behind = time.Now()
	}
	r.lag = lag
	return lag
}

// replayedAt is when the update of rec was made, for the KL history, so that an alert on a
// breach or a failure is dated by the update, not by when a replica applied it: the record's
// Kafka time, which its writer's clock set, kept within what the ends of the log seen say of
// when it was committed (logEnd) and no later than now. While the follower keeps up, that span is
// about watchEnd's second, so a writer's clock that is off does not date the updates every
// replica alerts on; a follower that fell behind, or that replays the log of a bootstrap or a
// restored backup, dates them by their records, not as new updates.
func (r *Replica) replayedAt(rec postlog.Record) time.Time {
	if rec.Time.IsZero() {
		return time.Time{}
	}
	lo, hi := time.Time{}, time.Now()
	r.mu.Lock()
	for _, e := range r.logEnds {
		if e.end > rec.Offset {
			hi = minTime(hi, e.first)
			break
		}
		lo = e.last
	}
	r.mu.Unlock()
	return minTime(later(rec.Time, lo), hi)
}

// minTime is the earlier of a and b.
func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// checkCoverage returns an error wrapping postlog.ErrPastEnd when the increment e covers
// offsets of kafka.topic past its partitions' ends. The ends are asked of the broker only when e
// covers more than they did the last time (they only grow); a failure to ask is retried until
// ctx ends, since an entry is never accepted unchecked. For the follower (follower true), when
// the asking began and its last error are kept for /readyz (Health) until it is answered.
func (r *Replica) checkCoverage(ctx context.Context, e *postlog.Entry, follower bool) error {
	if e.Kind != postlog.Increment {
		return nil
	}
	r.mu.Lock()
	ends := r.ends
	r.mu.Unlock()
	if postlog.CheckCoverage(e.Covers, ends) == nil {
		return nil
	}
	if follower {
		r.mu.Lock()
		r.coverageUnknown, r.coverageEntry, r.coverageErr = time.Now(), e.Seq, nil
		r.mu.Unlock()
		defer func() {
			r.mu.Lock()
			r.coverageUnknown, r.coverageErr = time.Time{}, nil
			r.mu.Unlock()
		}()
	}
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	var failing time.Time // since the first failed attempt: logged once, at WARN, and its end at INFO
	for {
		fresh, err := r.plog.InputEnds(ctx, r.cfg.Kafka.Topic)
		if err == nil {
			r.mu.Lock()
			r.ends = fresh
			r.mu.Unlock()
			if !failing.IsZero() {
				r.lg.Info("posterior log: the input topic's end offsets read again; checking the entry's coverage", "entry", e.Seq,
					"failed_for", time.Since(failing).Round(time.Millisecond))
			}
			return postlog.CheckCoverage(e.Covers, fresh)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if failing.IsZero() {
			failing = time.Now()
			r.lg.Warn("posterior log: cannot read the input topic's end offsets to check an entry's coverage; retrying with backoff, "+
				"serving the last posterior applied", "entry", e.Seq, "err", err)
		}
		if follower {
			r.mu.Lock()
			r.coverageErr = err
			r.mu.Unlock()
		}
		if err := bo.Wait(ctx); err != nil {
			return err
		}
	}
}

// unauthenticated logs and counts a record of the posterior log that does not authenticate.
// It is ignored: never decoded, applied, or counted as covering anything. The line is written
// before the count, so that whoever sees the count (an alert, a test) finds the line.
func (r *Replica) unauthenticated(rec postlog.Record) {
	r.lg.Warn("unauthenticated posterior log record ignored: it is not signed under a key of this replica's replication.key_file: a writer without the cluster key (check the topic's ACLs), or a key file that is not the cluster's",
		"topic", r.plog.Topic(), "partition", 0, "offset", rec.Offset, "err", postlog.Authenticate(r.keys, rec))
	r.m.Ignored.WithLabelValues(string(postlog.Unauthenticated)).Inc()
	r.m.Unauthenticated.WithLabelValues(r.plog.Topic()).Inc()
}

// ignored counts an authenticated record the chain did not accept (e its entry as Offer decoded
// it, nil for a record that is not one), and logs at WARN one that is not an entry at all
// (malformed), an entry of a newer format, another log's entry (other_log) or one that names the
// head but does not follow from it (invalid): a holder of the cluster key wrote it, by a bug, with
// a stolen key, or for another log (CfguardPosteriorLogRefused). The other reasons (a replayed or
// late entry) are the log's ordinary traffic; the caller logs them.
// As in unauthenticated, the line is written before the count.
func (r *Replica) ignored(rec postlog.Record, e *postlog.Entry, reason postlog.Reason) {
	defer r.m.Ignored.WithLabelValues(string(reason)).Inc()
	switch reason {
	case postlog.Malformed:
		if _, err := postlog.Decode(rec.Value); err != nil {
			r.lg.Warn("posterior log record ignored: it authenticates under the cluster key but is not an entry", "topic", r.plog.Topic(),
				"partition", 0, "offset", rec.Offset, "err", err)
		}
	case postlog.UnknownFormat:
		r.lg.Warn("posterior log entry of a format this build does not read ignored: the replica stopped at an earlier one", "topic", r.plog.Topic(),
			"partition", 0, "offset", rec.Offset)
	case postlog.OtherLog:
		attrs := []any{"topic", r.plog.Topic(), "partition", 0, "offset", rec.Offset}
		if e != nil {
			attrs = append(attrs, "seq", e.Seq, "entry_writer", e.Writer, "genesis", e.Genesis, "epoch", e.Epoch)
		}
		r.lg.Warn("posterior log entry refused: it authenticates under the cluster key but belongs to another log "+
			"(it names another genesis than this log's, of an epoch no later than this log's): the cluster's key signs another log too", attrs...)
	case postlog.Invalid:
		attrs := []any{"topic", r.plog.Topic(), "partition", 0, "offset", rec.Offset}
		if e != nil {
			attrs = append(attrs, "seq", e.Seq, "term", e.Term, "entry_writer", e.Writer, "version", e.Version, "parent_version", e.ParentVersion)
		}
		r.lg.Warn("posterior log entry refused: it authenticates under the cluster key and names the head, but does not follow from it "+
			"(its version, its coverage, or the genesis it names)", attrs...)
	}
}

// advance moves the follower past a record; c is set when the record was accepted, forked from
// the chain when halts (r.halts) halt calls had been made.
func (r *Replica) advance(next int64, c *postlog.Chain, halts int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c != nil {
		if r.halts != halts {
			// Halted while the entry was applied (the log ended before what was read): the
			// fork stops too, after the entry it applied.
			c.Halt()
		}
		r.chain = c
		r.refusedNext = nil
		h := c.Head()
		r.accepted[h.Seq] = h.Hash
		for k, p := range r.pending { // no other entry can be accepted at this place or before
			if p.seq <= h.Seq {
				delete(r.pending, k)
			}
		}
		if h.Seq > acceptedWindow {
			delete(r.accepted, h.Seq-acceptedWindow)
		}
		r.m.Entry.Set(float64(h.Seq))
		r.m.Term.Set(float64(h.Term))
	}
	r.read = next
	close(r.changed)
	r.changed = make(chan struct{})
}

// HeadAndChange returns the chain's head and a channel closed at the follower's next record,
// read together, so that a caller that waits on it misses no change after the head it saw.
func (r *Replica) HeadAndChange() (*postlog.Head, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := *r.chain.Head()
	return &h, r.changed
}

// WaitChange waits for the follower's next record, or ctx's end.
func (r *Replica) WaitChange(ctx context.Context) error {
	r.mu.Lock()
	ch := r.changed
	r.mu.Unlock()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-ch:
		return nil
	}
}

// waitRead waits until the follower has read every record below end.
func (r *Replica) waitRead(ctx context.Context, end int64) error {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	start := time.Now()
	for {
		r.mu.Lock()
		read, ch, stopped, starved := r.read, r.changed, r.stopped, r.starved
		r.mu.Unlock()
		if stopped != nil {
			return stopped
		}
		if read >= end {
			return nil
		}
		// The follower waits for a record, failing or not (kafka-go retries some failures
		// inside its reader), while records wait: counted from this wait's start when it began
		// before (an idle log).
		if !starved.IsZero() && time.Since(later(starved, start)) >= resetAfter {
			// An updater whose follower cannot read gives the role up (its caller steps down):
			// another replica may read the log.
			return fmt.Errorf("posterior log %s: this replica's follower has not read it for %s (offset %d of %d)", r.plog.Topic(),
				time.Since(later(starved, start)).Round(time.Second), read, end)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		case <-tick.C:
		}
	}
}

// catchUp reads the log to its present end. The updater does not append to a log that ends
// before what the follower has read (a leader that lags for a moment, or a recreated topic):
// catchUp waits until the log reaches that offset again, or fails once the follower has stopped
// on it (watchEnd halts after resetAfter). Waiting, not failing, keeps the updater's generation:
// a generation that ends at once is joined again at once, as fast as the group can rebalance.
func (r *Replica) catchUp(ctx context.Context) error {
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for {
		end, err := r.plog.End(ctx)
		if err == nil {
			r.mu.Lock()
			read, stopped, changed := r.read, r.stopped, r.changed
			r.mu.Unlock()
			if end >= read {
				return r.waitRead(ctx, end)
			}
			if stopped != nil {
				return fmt.Errorf("posterior log %s ends at offset %d, before offset %d this replica has read", r.plog.Topic(), end, read)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-changed: // halted, or the head moved
			case <-time.After(shortLogPoll):
			}
			continue
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		r.lg.Warn("posterior log: end offset", "err", err)
		if err := bo.Wait(ctx); err != nil {
			return err
		}
	}
}

// shortLogPoll is how often an updater waiting on a log that ends before what it has read asks
// for the log's end again.
const shortLogPoll = time.Second
