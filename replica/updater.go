package replica

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// rejoinPause is how long an updater that stepped down (its entry lost, or its term failed)
// keeps its generation before it ends it and rejoins the group.
const rejoinPause = time.Second

// maxRejoinPause bounds rejoinWait: the pause is served holding the generation, so no other
// replica can take the role meanwhile. failedTermSpan is how long a term must have run for its
// failure not to follow the ones before it.
const (
	maxRejoinPause = 30 * time.Second
	failedTermSpan = 10 * time.Minute
)

// rejoinWait is the pause of an updater that steps down after failed consecutive failed terms:
// rejoinPause doubled for each after the first, at most maxRejoinPause. An error no retry fixes
// (credentials refused, a dead-letter topic that refuses a dead letter) fails every term, and
// every replica's: without the doubling the role went round at the speed of rebalances, each
// term logging the error and writing the dead letters before it again.
func rejoinWait(failed int) time.Duration {
	if failed <= 1 {
		return rejoinPause
	}
	return min(rejoinPause<<min(failed-1, 20), maxRejoinPause)
}

// failedTerms is the count of consecutive failed terms after a term that ran for ran and ended
// with termErr, prev being the count before it: 0 after a term that ended without an error (it
// lost, or gave the role up), 1 after a failure that came more than failedTermSpan into its term
// (it does not follow the ones before), prev + 1 otherwise.
func failedTerms(prev int, termErr error, ran time.Duration) int {
	switch {
	case termErr == nil:
		return 0
	case ran > failedTermSpan:
		return 1
	default:
		return prev + 1
	}
}

// errLost: another writer's entry was accepted in this replica's place; it is no longer the
// updater of its term.
var errLost = errors.New("posterior log: this replica's entry lost to another writer's")

// errStopped: the follower is stopped at an entry it cannot apply; nothing is appended on a head
// that is no longer the log's.
var errStopped = errors.New("posterior log: stopped at an entry this replica cannot apply; nothing appended")

// appendAndJudge appends e and reads the log back until an entry is accepted at e's place: it
// reports whether that entry is e. An append that failed is retried after the read-back shows
// it was not stored (a retry that was in fact stored is a duplicate, which the chain ignores).
// Once the follower has stopped at an entry it cannot apply, e is not appended (errStopped):
// every replica would ignore it as no successor of that entry, and the new epoch that moves the
// log on starts from the head's coverage anyway. An entry appended while the follower had not
// yet read the stopping one is ignored so, counted as not_successor.
func (r *Replica) appendAndJudge(ctx context.Context, e *postlog.Entry) (bool, error) {
	v, err := e.Encode()
	if err != nil {
		return false, err
	}
	want := hashHex(v)
	bo := backoff.Backoff{Min: 100 * time.Millisecond, Max: 5 * time.Second}
	for {
		if r.isStopped() {
			return false, errStopped
		}
		aerr := r.plog.Append(ctx, "e/"+strconv.FormatUint(e.Seq, 10), v)
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		if err := r.catchUp(ctx); err != nil {
			return false, err
		}
		r.mu.Lock()
		got, judged := r.accepted[e.Seq]
		headSeq := r.chain.Head().Seq
		r.mu.Unlock()
		switch {
		case judged:
			return got == want, nil
		case headSeq >= e.Seq:
			return false, nil // accepted entries at e's place are past the window: not e
		case aerr == nil:
			return false, fmt.Errorf("posterior log: entry %d was stored but not accepted (a bug: the updater wrote an entry the acceptance rule refuses)", e.Seq)
		}
		r.lg.Warn("posterior log: append failed, retrying", "entry", e.Seq, "err", aerr)
		if err := bo.Wait(ctx); err != nil {
			return false, err
		}
	}
}

// joinWarnEvery is how many consecutive failed joins of the updater group log one WARN (the
// first of them, then one in joinWarnEvery; the others at DEBUG): a join is retried every second,
// and an error no retry fixes (a session timeout the broker refuses) would log a WARN a second.
const joinWarnEvery = 30

// RunUpdaterGroup is a member of <kafka.group_id>.updater for as long as ctx lasts. In each
// generation that assigns it the log's partition, it is the updater (lead) until the generation
// ends; otherwise it only heartbeats. Leaving the group (ctx's end, SIGTERM) hands the role over
// at once.
func (r *Replica) RunUpdaterGroup(ctx context.Context) error {
	dialer, err := r.conn.Dialer()
	if err != nil {
		return err
	}
	rc := r.cfg.Replication
	cg, err := kafka.NewConsumerGroup(kafka.ConsumerGroupConfig{ID: r.group, Brokers: r.conn.Brokers, Dialer: dialer,
		Topics: []string{rc.PosteriorTopic}, SessionTimeout: rc.SessionTimeout, HeartbeatInterval: rc.HeartbeatInterval,
		GroupBalancers:   []kafka.GroupBalancer{r.bal, kafka.RangeGroupBalancer{}, kafka.RoundRobinGroupBalancer{}},
		RebalanceTimeout: rc.SessionTimeout, JoinGroupBackoff: time.Second, Timeout: 10 * time.Second,
		ErrorLogger: kafka.LoggerFunc(func(msg string, args ...any) {
			r.lg.Debug("updater group: " + fmt.Sprintf(msg, args...))
		})})
	if err != nil {
		return fmt.Errorf("updater group %s: %w", r.group, err)
	}
	defer cg.Close()
	failures := 0 // consecutive failed joins: one WARN for the first and every joinWarnEvery-th
	for {
		gen, err := cg.Next(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			lg := r.lg.Debug
			if failures%joinWarnEvery == 0 {
				lg = r.lg.Warn
			}
			failures++
			lg("updater group: joining", "group", r.group, "failures", failures,
				"err", stream.GroupJoinError(err, "replication.session_timeout", rc.SessionTimeout))
			continue
		}
		if failures > 0 {
			r.lg.Info("updater group: joined", "group", r.group, "after_failures", failures)
			failures = 0
		}
		assigned := false
		for _, p := range gen.Assignments[rc.PosteriorTopic] {
			assigned = assigned || p.ID == 0
		}
		r.bal.led(gen.ID, assigned)
		r.lg.Info("updater group: new generation", "generation", gen.ID, "updater", assigned)
		r.m.Generations.Inc()
		if assigned {
			id := gen.ID
			gen.Start(func(gctx context.Context) { r.lead(gctx, id) })
		}
		if r.bal.assignedWithoutTopic() {
			// The posterior topic had no partition when this member assigned the generation:
			// nobody holds the role, and the group would not rebalance when the topic is
			// created again. End the generation once the topic answers.
			r.lg.Warn("updater group: the posterior topic has no partition; nobody is the updater until it exists again",
				"topic", rc.PosteriorTopic, "generation", gen.ID)
			gen.Start(r.awaitPosteriorTopic)
		}
	}
}

// awaitPosteriorTopic returns once the posterior topic answers its end offset, or when ctx ends.
func (r *Replica) awaitPosteriorTopic(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if _, err := r.plog.End(ctx); err == nil {
			r.lg.Info("updater group: the posterior topic exists again; rejoining to give the updater role", "topic", r.plog.Topic())
			return
		}
	}
}

// lead is the updater's work in one generation: claim the next term unless the head is already
// this writer's, then ingest until the generation ends or an entry loses. Returning ends the
// generation (kafka-go's Generation.Start), so a replica that lost rejoins and the group's next
// generation decides again. While the follower is stopped at an entry it cannot apply, the
// updater keeps its generation and waits for a new epoch (or a restart on a build that reads
// the entry): returning would end the generation at once, and the group would go through
// generations as fast as it can rebalance for as long as the log stays stopped. For the same
// reason, a replica that steps down keeps its generation for rejoinPause before it returns.
func (r *Replica) lead(ctx context.Context, generation int32) {
	r.updater.Store(true)
	r.m.Updater.Set(1)
	defer func() {
		r.updater.Store(false)
		r.m.Updater.Set(0)
	}()
	for {
		if err := r.awaitFollowing(ctx); err != nil {
			return
		}
		start := time.Now()
		if h := r.Head(); h.Term > 0 && h.Writer != r.writer {
			r.mu.Lock()
			r.failedTerms = 0 // another writer held the role since: its failures are not ours
			r.mu.Unlock()
		}
		keep, termErr := r.leadTerm(ctx, generation)
		if !keep {
			// Rejoin, but not at once: a failure that persists would otherwise end generations
			// as fast as the group can rebalance. It is no longer the updater meanwhile; unless
			// the generation ended, it gave the role up, and says so to the group's balancer,
			// which gives the role to another member if there is one.
			r.updater.Store(false)
			r.m.Updater.Set(0)
			if ctx.Err() == nil {
				r.bal.steppedDown()
			}
			r.mu.Lock()
			r.failedTerms = failedTerms(r.failedTerms, termErr, time.Since(start))
			failed := r.failedTerms
			r.mu.Unlock()
			pause := rejoinWait(failed) // rejoinPause unless terms keep failing (failed > 1 only after errors)
			if failed > 1 {
				r.lg.Warn("updater: terms keep failing; rejoining the group after a longer pause", "failed_terms", failed,
					"pause", pause, "err", termErr)
			}
			select {
			case <-ctx.Done():
			case <-time.After(pause):
			}
			return
		}
		if r.isStopped() {
			r.lg.Warn("updater: the posterior log stopped; keeping the updater role until a new epoch moves past the entry (see /readyz)")
		}
	}
}

// isStopped reports whether the follower is stopped at an entry it cannot apply.
func (r *Replica) isStopped() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stopped != nil
}

// awaitFollowing waits while the follower is stopped at an entry it cannot apply; it returns
// ctx's error when ctx ends first.
func (r *Replica) awaitFollowing(ctx context.Context) error {
	for {
		r.mu.Lock()
		stopped, ch := r.stopped, r.changed
		r.mu.Unlock()
		if stopped == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		}
	}
}

// leadTerm claims a term and ingests in it (lead). It reports whether the updater keeps its
// role (the follower stopped, or a new epoch moved the log on while ingest was stopped on a
// reset input topic), and the error that ended the term, if one did.
func (r *Replica) leadTerm(ctx context.Context, generation int32) (keep bool, failed error) {
	for attempt := 0; ; attempt++ {
		if err := r.catchUp(ctx); err != nil {
			stopped := ctx.Err() == nil && r.isStopped()
			if ctx.Err() == nil && !stopped {
				r.lg.Warn("updater: the posterior log cannot be read to its end; giving the role up", "err", err)
			}
			return stopped, nil
		}
		head := r.Head()
		if head.Writer == r.writer {
			break
		}
		claim := r.claimOn(head, generation)
		won, err := r.appendAndJudge(ctx, claim)
		if err != nil {
			if ctx.Err() == nil && r.isStopped() {
				return true, nil
			}
			if ctx.Err() != nil {
				return false, nil
			}
			r.lg.Error("updater: claim failed", "err", err)
			return false, err
		}
		if won {
			r.lg.Info("updater: term claimed", "term", claim.Term, "entry", claim.Seq, "generation", generation, "covers", claim.Covers)
			break
		}
		r.m.AppendsLost.Inc()
		// An entry of the old term that arrived before the claim is no rival: claim again on it.
		// A claim of another writer is: rejoin, and let the group's next generation decide.
		if h := r.Head(); h.Writer != head.Writer || attempt >= 5 {
			r.lg.Warn("updater: another replica claimed first; rejoining the group", "term", h.Term, "claimant", h.Writer)
			return false, nil
		}
	}
	err := r.ingestTerm(ctx)
	var reset *stream.TopicResetError
	switch {
	case errors.As(err, &reset) && ctx.Err() == nil:
		// The input topic no longer holds what the log covers: reading on would skip the new
		// log's first records. The updater keeps its role, reading nothing, until its
		// generation ends; /readyz and cfguard_consumer_topic_mismatch say why.
		r.mu.Lock()
		r.inputReset = err
		r.mu.Unlock()
		r.host.TopicReset(reset)
		r.lg.Error("updater: kafka.topic was reset; ingest stopped, keeping the updater role (see docs/RUNBOOK.md, CfguardTopicReset)",
			"err", err)
		// Until the log moves (an operator's new epoch), or the generation ends.
		seq := r.Head().Seq
		for ctx.Err() == nil && r.Head().Seq == seq {
			r.WaitChange(ctx)
		}
		r.mu.Lock()
		r.inputReset = nil
		r.mu.Unlock()
		// Cleared whether the log moved or the role ended: an updater that is not this replica
		// reads the topic now, and finds the reset itself.
		r.host.TopicReset(nil)
		return ctx.Err() == nil, nil
	case err != nil && ctx.Err() == nil && r.isStopped():
		return true, nil // the follower logged why; the records read and not appended are read again from the head's coverage
	case errors.Is(err, errLost):
		r.lg.Warn("updater: the log's head is not this replica's last entry (another writer's entry took its place, or the log changed under it); stepping down and rejoining the group",
			"head", r.Head().Seq, "term", r.Head().Term)
		r.m.AppendsLost.Inc()
	case err != nil && ctx.Err() == nil:
		r.lg.Error("updater stopped", "err", err)
		return false, err
	}
	return false, nil
}

// ingestTerm forms increments from kafka.topic starting at the head's coverage and appends one
// entry per increment, each read back before the next.
func (r *Replica) ingestTerm(ctx context.Context) error {
	head := r.Head()
	marks := make(map[int]stream.RecordMark, len(head.Marks))
	for p, m := range head.Marks {
		marks[p] = stream.RecordMark{Offset: m.Offset, Timestamp: m.Timestamp, Sum: m.Sum}
	}
	c, err := r.host.Consumer(ctx, head.Covers, marks)
	if err != nil {
		return err
	}
	defer c.Close()
	r.mu.Lock()
	r.consumer = c
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.consumer = nil
		r.mu.Unlock()
	}()
	r.lg.Info("updater: consuming", "topic", r.cfg.Kafka.Topic, "from", head.Covers, "term", head.Term)
	// at is the entry whose coverage the consumer's position is: the head it started from, then
	// each entry of this term it won. A head that is another entry (one of this updater's own,
	// appended before its generation ended and accepted late) covers what the consumer reads
	// next: an increment on it would apply those records twice.
	at := head.Hash
	for {
		inc, err := r.nextIncrement(ctx, c, at)
		if errors.Is(err, errQuiet) {
			// No record for kafka.max_wait after a version of this updater's that is not a
			// confirmation point: mark it one, so that the CEs due since the last point are
			// measured now, not when records come again.
			if at, err = r.appendPoint(ctx, at); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return err
		}
		st := c.Stats()
		caughtUp := st.CaughtUp
		if r.incCaughtUp != nil {
			caughtUp = r.incCaughtUp(st)
		}
		head := r.Head()
		prev := r.host.Current()
		if prev.Version != head.Version || head.Writer != r.writer || head.Hash != at {
			return errLost
		}
		// The order of an increment's records is part of its boundary, not of the fetch.
		slices.SortFunc(inc.Records, func(a, b stream.Record) int {
			return cmp.Or(cmp.Compare(a.Partition, b.Partition), cmp.Compare(a.Offset, b.Offset))
		})
		s, err := r.host.Compute(ctx, prev, inc)
		if err != nil {
			return err
		}
		e, err := r.entryOf(head, s, inc, caughtUp)
		if err != nil {
			return err
		}
		v, err := e.Encode()
		if err != nil {
			return err
		}
		h := hashHex(v)
		r.mu.Lock()
		r.pending[h] = pendingStep{seq: e.Seq, step: s} // kept when the append fails: the entry may still land, late
		r.mu.Unlock()
		won, err := r.appendAndJudge(ctx, e)
		if errors.Is(err, errStopped) {
			// Not appended (or appended by an attempt that failed before the stop): no replica
			// accepts it, as the head it extends is the one the follower stopped after.
			r.mu.Lock()
			delete(r.pending, h)
			r.mu.Unlock()
		}
		if err != nil {
			return err
		}
		if !won {
			r.mu.Lock()
			delete(r.pending, h)
			r.mu.Unlock()
			return errLost
		}
		at = h
		r.host.DeadLettered(inc.DeadLettered)
		c.MarkDurable(inc)
	}
}

// entryOf is the log entry of step s on head; caughtUp says the consumer held no record past
// inc when it handed inc out.
func (r *Replica) entryOf(head *postlog.Head, s Step, inc *stream.Increment, caughtUp bool) (*postlog.Entry, error) {
	sum := s.Summary(head.Seq + 1)
	covers := maps.Clone(head.Covers)
	if covers == nil {
		covers = map[int]int64{}
	}
	maps.Copy(covers, inc.NextOffsets)
	var marks map[int]postlog.Mark
	for p := range inc.NextOffsets {
		if m, ok := inc.Mark(p); ok {
			if marks == nil {
				marks = map[int]postlog.Mark{}
			}
			marks[p] = postlog.Mark{Offset: m.Offset, Timestamp: m.Timestamp, Sum: m.Sum}
		}
	}
	e := &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: head.Seq + 1, Parent: head.Hash, Term: head.Term,
		Writer: r.writer, Version: head.Version, ParentVersion: head.Version, InputTopic: r.cfg.Kafka.Topic, Covers: covers,
		Outcome: string(sum.Outcome), KL: sum.KL, Seed: sum.Seed, PosteriorSHA256: head.PosteriorSHA256,
		Counts:  &postlog.Counts{DeadLettered: int64(inc.DeadLettered), Lost: inc.Lost(), Failed: sum.Counters["failed"], Held: sum.Counters["held"]},
		Quality: sum.Quality, Events: sum.Events, Marks: marks,
		// The updater applied (and so published) the head before it computed this step.
		EventsThrough: head.Seq}
	head.Lineage(e)
	if sum.Outcome == "" {
		e.Outcome = postlog.Skipped
	}
	if sum.Next != nil {
		sha, err := postlog.PosteriorHash(sum.Next)
		if err != nil {
			return nil, err
		}
		e.Version, e.LastLayer, e.PosteriorSHA256, e.Records = sum.Next.Version, postlog.LastLayerOf(sum.Next), sha, sum.Next.Records
		e.Counts.Applied = int64(sum.Records)
	}
	e.Point = marksPoint(head, e, caughtUp || len(inc.Records) < r.cfg.Kafka.MaxRecords)
	return e, nil
}

// claimOn is this replica's claim of the next term on head. It marks the head's version a
// confirmation point when it is not one: the last updater may have stopped after a version it
// did not mark (records were still to come), and with the input quiet no increment marks one.
func (r *Replica) claimOn(head *postlog.Head, generation int32) *postlog.Entry {
	claim := &postlog.Entry{Format: postlog.Format, Kind: postlog.Claim, Seq: head.Seq + 1, Parent: head.Hash, Term: head.Term + 1,
		Writer: r.writer, Version: head.Version, ParentVersion: head.Version, Covers: head.Covers, InputTopic: r.cfg.Kafka.Topic,
		PosteriorSHA256: head.PosteriorSHA256, Build: buildString(), Generation: int(generation), Point: !head.IsPoint(head.Version)}
	head.Lineage(claim)
	return claim
}

// errQuiet: no record came for kafka.max_wait while the head, this updater's entry, left a
// version that is not a confirmation point (nextIncrement).
var errQuiet = errors.New("no record for kafka.max_wait after a version that is not a confirmation point")

// nextIncrement is c.Next; while the head is this updater's entry at and leaves a version that
// is not a confirmation point (its increment closed while the consumer seemed behind: a
// transaction marker, or a batch compacted empty, fetched only after it), it waits kafka.max_wait
// at most and returns errQuiet then. What Next had taken stays pending for the next call.
func (r *Replica) nextIncrement(ctx context.Context, c *stream.Consumer, at string) (*stream.Increment, error) {
	head := r.Head()
	if head.Hash != at || head.IsPoint(head.Version) {
		return c.Next(ctx)
	}
	wctx, cancel := context.WithTimeout(ctx, r.cfg.Kafka.MaxWait)
	defer cancel()
	inc, err := c.Next(wctx)
	if err != nil && ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
		return nil, errQuiet
	}
	return inc, err
}

// appendPoint appends, on the head (this updater's entry at), an increment of no records that
// marks the head's version a confirmation point, and returns its hash: errLost when the head is
// no longer at, or another entry took its place.
func (r *Replica) appendPoint(ctx context.Context, at string) (string, error) {
	head := r.Head()
	if head.Hash != at || head.Writer != r.writer {
		return "", errLost
	}
	e := &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: head.Seq + 1, Parent: head.Hash, Term: head.Term,
		Writer: r.writer, Version: head.Version, ParentVersion: head.Version, InputTopic: r.cfg.Kafka.Topic,
		Covers: maps.Clone(head.Covers), Outcome: postlog.Skipped, PosteriorSHA256: head.PosteriorSHA256, Counts: &postlog.Counts{},
		EventsThrough: head.Seq, Point: true}
	head.Lineage(e)
	v, err := e.Encode()
	if err != nil {
		return "", err
	}
	won, err := r.appendAndJudge(ctx, e)
	if err != nil {
		return "", err
	}
	if !won {
		return "", errLost
	}
	r.lg.Info("updater: marked the head's version a confirmation point, the input quiet", "posterior_version", e.Version, "entry", e.Seq)
	return hashHex(v), nil
}

// confirmStride is how many versions apart the updater marks confirmation points
// (postlog.Entry.Point) while it works through a backlog: a CE that became due waits at most this
// many versions for its measurement, and a chain of measurements through a drift costs one pool
// of draws per point, not one per version.
const confirmStride = 8

// marksPoint reports whether the entry e, to append on head, marks the version it leaves as a
// confirmation point: never one that is a point already; always when e leaves the version as it
// was (nothing applied, or the update held), or when the consumer is caught up (e closes short
// of kafka.max_records, or no record past it was fetched or known to the consumer: versions then
// come at the pace of the input, and the last version before the input goes quiet is a point);
// and otherwise once confirmStride versions passed since the last point.
func marksPoint(head *postlog.Head, e *postlog.Entry, caughtUp bool) bool {
	if head.IsPoint(e.Version) {
		return false
	}
	if e.Version == head.Version || caughtUp {
		return true
	}
	last, ok := head.LatestPoint(head.Version)
	if !ok {
		last = head.PointsAfter
	}
	return e.Version-last >= confirmStride
}
