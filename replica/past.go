package replica

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/postlog"
)

// recentPosteriors is how many of the last posteriors past finds without reading the log.
const recentPosteriors = 256

// remember keeps m among the recent posteriors.
func (r *Replica) remember(m *bnn.Model) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recent[m.Version] = m
	if m.Version >= recentPosteriors {
		delete(r.recent, m.Version-recentPosteriors)
	}
}

// Recall finds, by playing the posterior log, the posteriors of the recentPosteriors versions
// before the current one that are not in memory, keeps them among the recent posteriors as if it
// had applied them, and returns them: after Join resumed from the ledger's head (a restart), the
// replica holds only the posteriors it applied since. It does nothing after a Join that followed
// the log from its genesis, which applies, and keeps, every version. Versions the log does not
// have (before a new epoch's genesis) are not in the answer; a version that became too old to
// keep while the log was played is returned but not kept. The play costs what a bootstrap's does:
// every entry from the log's first record.
func (r *Replica) Recall(ctx context.Context) (map[uint64]*bnn.Model, error) {
	r.mu.Lock()
	resumed := r.resumed
	r.mu.Unlock()
	if !resumed {
		return nil, nil
	}
	var cur uint64
	if m := r.host.Current(); m != nil {
		cur = m.Version
	}
	r.mu.Lock()
	var want []uint64
	for v := cur - min(cur, recentPosteriors-1); v < cur; v++ {
		if _, ok := r.recent[v]; !ok {
			want = append(want, v)
		}
	}
	r.mu.Unlock()
	if len(want) == 0 {
		return nil, nil
	}
	got, err := r.Past(ctx, want)
	if err != nil {
		return nil, err
	}
	now := r.host.Current().Version
	r.mu.Lock()
	defer r.mu.Unlock()
	for v, m := range got {
		if _, ok := r.recent[v]; !ok && v+recentPosteriors > now {
			r.recent[v] = m
		}
	}
	return got, nil
}

// Recent returns the posteriors of versions from `from` on that are kept in memory (the last
// recentPosteriors applied), without reading the log: what an anchor's KL history taken over
// with a partition is computed from (ledger.ApplyShare).
func (r *Replica) Recent(from uint64) map[uint64]*bnn.Model {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[uint64]*bnn.Model{}
	for v, m := range r.recent {
		if v >= from {
			out[v] = m
		}
	}
	return out
}

// Past returns the posteriors of the given versions, each at most the current one: the recent
// ones from memory, the others by playing the posterior log. The play starts from the latest
// place it knows at or before the lowest version asked for: where the last play stopped, or one
// of the places the last plays found a version at (pastKeep of them), or else the log's first
// record. A rebuild asks for the anchors of a partition's registrations in about the order they
// were measured, with the few versions restored verdicts were measured under (a confirmer
// measures a batch of CEs under one), so it reads the log about once, not once per batch.
// Versions the log does not have are not in the answer.
func (r *Replica) Past(ctx context.Context, versions []uint64) (map[uint64]*bnn.Model, error) {
	out := map[uint64]*bnn.Model{}
	want := map[uint64]bool{}
	r.mu.Lock()
	for _, v := range versions {
		if m, ok := r.recent[v]; ok {
			out[v] = m
		} else {
			want[v] = true
		}
	}
	until := r.chain.Head().Offset
	r.mu.Unlock()
	if len(want) == 0 {
		return out, nil
	}
	r.pastMu.Lock()
	defer r.pastMu.Unlock()
	for v := range want {
		if c, ok := r.pastKept.get(v); ok {
			out[v] = c.m
			delete(want, v)
		}
	}
	if len(want) == 0 {
		return out, nil
	}
	at := r.pastKept.from(r.pastAt, slices.Min(slices.Collect(maps.Keys(want))), until)
	if at == nil {
		at = &pastCursor{chain: postlog.NewChain(r.keys)}
	}
	r.pastAt = nil // set again only when this play ends without an error
	found := func() {
		if m := at.m; m != nil && want[m.Version] {
			out[m.Version] = m
			delete(want, m.Version)
			r.pastKept.put(*at)
		}
	}
	found() // the place itself may hold one
	if len(want) > 0 && at.next <= until {
		rd, err := r.plog.Read(at.next)
		if err != nil {
			return nil, err
		}
		defer rd.Close()
		for len(want) > 0 && at.next <= until {
			rec, err := rd.Next(ctx)
			if err != nil {
				return nil, fmt.Errorf("reading the posterior log for past posteriors: %w", err)
			}
			if err := r.replay(ctx, at, rec); err != nil {
				return nil, err
			}
			found()
		}
	}
	r.pastAt = at
	return out, nil
}

// pastCursor is a place in a play of the posterior log: the chain and posterior after the
// record before next. A cursor's chain is never changed once the cursor moves on (replay
// offers each record to a fork), so copies of a cursor share it.
type pastCursor struct {
	chain *postlog.Chain
	m     *bnn.Model // nil before the genesis
	next  int64
}

// pastKeep is how many of the places Past found a version at it keeps.
const pastKeep = 64

// keptCursors are the places Past found versions at, by version, the least recently used first
// out.
type keptCursors struct {
	order []uint64 // least recently used first
	by    map[uint64]pastCursor
}

// get returns the place version v was found at, if it is kept.
func (k *keptCursors) get(v uint64) (pastCursor, bool) {
	c, ok := k.by[v]
	if ok {
		k.touch(v)
	}
	return c, ok
}

func (k *keptCursors) touch(v uint64) {
	k.order = append(slices.DeleteFunc(k.order, func(o uint64) bool { return o == v }), v)
}

// put keeps c, a place where a version was found.
func (k *keptCursors) put(c pastCursor) {
	if k.by == nil {
		k.by = map[uint64]pastCursor{}
	}
	v := c.m.Version
	if _, ok := k.by[v]; !ok && len(k.order) == pastKeep {
		delete(k.by, k.order[0])
		k.order = k.order[1:]
	}
	k.by[v] = c
	k.touch(v)
}

// from returns a copy of the latest place at or before version lo among last (where the last
// play stopped) and the kept ones, nil when there is none; places past until+1 (a log that
// ends before them) are not used. Places and their posteriors outlive a reset of the log: a
// replica follows a recreated log only from a new epoch that moves past its own head, so they
// are of the history the new log goes on with; a play resumed on the new log from a place of the
// old one accepts only records that extend that place (its chain judges them), so it finds
// nothing of another history.
func (k *keptCursors) from(last *pastCursor, lo uint64, until int64) *pastCursor {
	var best *pastCursor
	consider := func(c pastCursor) {
		if c.m != nil && c.m.Version <= lo && c.next <= until+1 && (best == nil || c.next > best.next) {
			cp := c
			best = &cp
		}
	}
	if last != nil {
		consider(*last)
	}
	for _, c := range k.by {
		consider(c)
	}
	if best != nil {
		if _, ok := k.by[best.m.Version]; ok {
			k.touch(best.m.Version)
		}
	}
	return best
}

// replay moves c past rec as the follower would: an accepted entry moves the chain and the
// posterior, any other record only the offset. On an error c is left where it was.
func (r *Replica) replay(ctx context.Context, c *pastCursor, rec postlog.Record) error {
	fork := c.chain.Fork()
	e, reason, err := fork.Offer(rec)
	switch {
	case errors.Is(err, postlog.ErrUnknownFormat):
		c.chain = fork // stopped there until a new epoch moves past it, as the follower
	case err != nil:
		return err
	}
	if reason == postlog.Accepted {
		if err := r.checkCoverage(ctx, e, false); errors.Is(err, postlog.ErrPastEnd) {
			reason = postlog.PastEnd // refused, as the follower refuses it
		} else if err != nil {
			return err
		}
	}
	switch {
	case reason != postlog.Accepted:
	case e.Kind == postlog.Genesis && e.Epoch > 0 && c.m != nil:
		c.chain = fork // a new epoch keeps the head's posterior: nothing to apply
	default:
		m := c.m
		if e.Kind == postlog.Genesis {
			m, err = e.Body.Model(e.PosteriorSHA256)
		} else {
			m, err = e.ApplyHashing(m, &r.pastHash) // Past holds pastMu
		}
		if err != nil {
			return fmt.Errorf("replaying the posterior log, entry %d: %w", e.Seq, err)
		}
		c.chain, c.m = fork, m
	}
	c.next = rec.Offset + 1
	return nil
}
