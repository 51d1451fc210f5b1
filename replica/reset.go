package replica

import (
	"context"
	"fmt"
	"time"
)

// resetAfter is how long the posterior log must end before what a follower has read before the
// follower stops as on a reset topic. A partition's new leader may report a lower end for a
// moment (its high watermark catches up with its followers'); a recreated topic stays short.
const resetAfter = 10 * time.Second

// watchEnd keeps the lag gauge and the caught-up flag (readiness) current, and stops following
// when the log ends before what the follower has read for resetAfter (halt).
func (r *Replica) watchEnd(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	var shortSince time.Time
	headChecked := time.Now()
	for {
		asked := time.Now()
		end, err := r.plog.End(ctx)
		answered := time.Now()
		switch {
		case err == nil:
			r.mu.Lock()
			read, failingSince := r.read, r.endUnknown
			r.endUnknown, r.endErr = time.Time{}, nil
			r.mu.Unlock()
			if !failingSince.IsZero() {
				r.lg.Info("posterior log reachable again", "after", time.Since(failingSince).Round(time.Second))
			}
			switch {
			case end >= read:
				shortSince = time.Time{}
			case shortSince.IsZero():
				shortSince = time.Now()
				r.lg.Warn("posterior log ends before what this replica has read", "topic", r.plog.Topic(), "end", end, "read", read)
			case time.Since(shortSince) >= resetAfter:
				r.halt(fmt.Sprintf("has ended at offset %d, before offset %d this replica has read, for %s",
					end, read, time.Since(shortSince).Round(time.Second)))
			}
			if end >= read && time.Since(headChecked) >= resetAfter {
				headChecked = time.Now()
				if found, gone := r.headGone(ctx); gone {
					r.halt(found)
				}
			}
			r.m.Lag.Set(float64(r.sawEnd(end, asked, answered)))
		case ctx.Err() == nil:
			r.mu.Lock()
			first := r.endUnknown.IsZero()
			if first {
				r.endUnknown = time.Now()
			}
			r.endErr = err
			r.mu.Unlock()
			if first {
				r.lg.Warn("posterior log unreachable: serving the last applied posterior", "topic", r.plog.Topic(), "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// headGone reports whether the log no longer holds the entry this replica applied last, at its
// offset with its bytes, and what it holds there instead: a topic recreated and grown past that
// offset before the log was seen short (watchEnd checks every resetAfter). A record that cannot
// be read now is not judged: the next check asks again.
func (r *Replica) headGone(ctx context.Context) (found string, gone bool) {
	r.mu.Lock()
	head := r.chain.Head()
	reset := r.stoppedByReset()
	r.mu.Unlock()
	if reset || head == nil {
		return "", false
	}
	rd, err := r.plog.Read(head.Offset)
	if err != nil {
		return "", false
	}
	defer rd.Close()
	cctx, cancel := context.WithTimeout(ctx, resetAfter)
	defer cancel()
	rec, err := rd.Next(cctx)
	switch {
	case err != nil:
		return "", false
	case rec.Offset != head.Offset:
		return fmt.Sprintf("no longer holds entry %d this replica applied last at offset %d: its first record from there is at offset %d",
			head.Seq, head.Offset, rec.Offset), true
	case hashHex(rec.Value) != head.Hash:
		return fmt.Sprintf("no longer holds entry %d this replica applied last at offset %d: the record there hashes to %s, not %s",
			head.Seq, head.Offset, hashHex(rec.Value), head.Hash), true
	}
	return "", false
}

// halt stops following a log that is no longer the one the follower read (what says so: the
// topic has ended before what it has read, or no longer holds its head): the topic was recreated
// (or lost records), and what it holds now is another history. The chain accepts nothing more but
// a new epoch on its head; /readyz and cfguard_posterior_log_stopped say so. A replica stopped
// at an entry (one it cannot read or verify) halts too: that entry is in a history the topic no
// longer holds, and only the reset's recovery applies. One stopped by a halt since its last
// epoch is left as it is.
func (r *Replica) halt(what string) {
	r.mu.Lock()
	if r.stoppedByReset() {
		r.mu.Unlock()
		return
	}
	r.chain.Halt()
	r.halts++
	h := r.chain.Head()
	r.stopped = fmt.Errorf("posterior log reset: replication.posterior_topic %s %s: the topic was deleted and recreated, or lost "+
		"records. This replica keeps serving entry %d (posterior version %d) and applies nothing more until a new epoch moves past that "+
		"entry: cfguard new-epoch --head-from <this replica's URL> (docs/RUNBOOK.md, CfguardPosteriorLogStopped)",
		r.plog.Topic(), what, h.Seq, h.Version)
	// The line and the gauge before the lock is released: whoever sees the stop (/readyz, the
	// gauge) finds the line.
	r.lg.Error("stopped following the posterior log; serving the last verified posterior", "err", r.stopped)
	r.m.Stopped.Set(1)
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
	select {
	case r.rewind <- struct{}{}:
	default:
	}
}

// stoppedByReset reports whether the replica is stopped by a halt since its last epoch (r.mu
// held): a reset it has reported already.
func (r *Replica) stoppedByReset() bool { return r.stopped != nil && r.halts > r.epochHalts }
