package daemon

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
	"github.com/cfguard/cfguard/update"
)

// ingest consumes increments until ctx ends. For each: update, judge, checkpoint (with its
// events, in the ledger's outbox), then tell the consumer the increment is durable (it commits
// the offsets to the group in the background, for Kafka tooling). The checkpoint's offsets are
// where a restart reads again. A checkpoint that cannot be written (ledger.ErrWrite) holds the
// increment and is retried until it succeeds (durably): nothing more is consumed meanwhile. Any
// other failure to checkpoint stops the daemon and the restart redoes the increment; a failed
// update is recorded and skipped. A consumer that stopped for good (stream.ErrStopped) stops
// ingest only: the daemon keeps serving and /readyz reports why.
func (d *Daemon) ingest(ctx context.Context) error {
	schema, err := d.schema()
	if err != nil {
		return err
	}
	resume, marks, err := d.ledger.ResumePoint()
	if err != nil {
		return err
	}
	resets, err := d.topicResets()
	if err != nil {
		return err
	}
	pendingResets := map[int]bool{}
	for _, r := range resets { // their records wait from the new log's start
		d.ends.setReset(r.Partition, true)
	}
	if len(resets) > 0 {
		if !d.acceptTopicReset {
			// A reset found earlier and not confirmed: ingest stays stopped.
			e := resets[0]
			e.Hint = d.topicResetHint()
			d.ingestStopped = fmt.Errorf("ingest stopped: %w", &e)
			d.metrics.SetTopicReset(true)
			close(d.ready)
			d.log.Error("ingest stays stopped: a topic reset found earlier is not confirmed", "file", d.topicResetPath(), "err", &e)
			<-ctx.Done()
			return nil
		}
		for _, r := range resets {
			pendingResets[r.Partition] = true
		}
	}
	c, err := stream.NewConsumer(ctx, stream.ConsumerConfig{Conn: d.conn, Topic: d.cfg.Kafka.Topic, GroupID: d.cfg.Kafka.GroupID,
		DeadLetterTopic: d.cfg.Kafka.DeadLetterTopic, MaxRecords: d.cfg.Kafka.MaxRecords, MaxRecordsBacklog: d.cfg.Kafka.MaxRecordsBacklog,
		MaxWait: d.cfg.Kafka.MaxWait, Resume: resume, ResumeMarks: resumeMarks(marks), AcceptTopicReset: d.acceptTopicReset, TopicResetHint: d.topicResetHint(),
		ResetPartitions: slices.Sorted(maps.Keys(pendingResets))},
		schema, d.log.With("component", "consumer"))
	if err != nil {
		return err
	}
	defer c.Close()
	d.consumer = c
	close(d.ready)
	d.log.Info("consuming", "topic", d.cfg.Kafka.Topic, "group", d.cfg.Kafka.GroupID, "resume", resume, "confirmed_topic_resets", len(resets))
	if st, err := d.ledger.State(); err == nil {
		d.log.Info("ready", "posterior_version", st.PosteriorVersion, "counterfactuals", countsByName(st.Counts),
			"renewal_backlog", st.Pending, "applied", st.Applied, "api", d.httpAddr.String())
	}
	for {
		inc, err := c.Next(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, stream.ErrStopped) {
				// A configuration-class error or a reset topic: the consumer logged it once
				// and its Health reports it, so /readyz answers 503 with the reason. The API
				// keeps serving what the ledger holds; a restart after the fix (or with
				// --accept-topic-reset) resumes ingest.
				var reset *stream.TopicResetError
				if errors.As(err, &reset) {
					d.metrics.SetTopicReset(true)
					d.ends.setReset(reset.Partition, true)
					if err := d.recordTopicReset(reset); err != nil { // readiness still reports the reset
						d.log.Error("the topic reset could not be recorded; a restart may not find it again", "file", d.topicResetPath(), "err", err)
					}
				}
				<-ctx.Done()
				return nil
			}
			return err
		}
		if err := d.apply(ctx, inc); err != nil {
			if ctx.Err() != nil {
				return nil // abandoned mid-way: nothing was checkpointed or committed
			}
			return err
		}
		// Counted once durable, like everything apply reports.
		d.metrics.AddRecords(alerts.RecordDeadLettered, inc.DeadLettered)
		c.MarkDurable(inc)
		if len(pendingResets) > 0 {
			for p := range pendingResets {
				if inc.Reset(p) {
					delete(pendingResets, p)
					d.ends.setReset(p, false)
				}
			}
			if len(pendingResets) == 0 {
				if err := d.clearTopicResets(); err != nil {
					return fmt.Errorf("the confirmed topic resets are checkpointed, but %s could not be removed (remove it by hand): %w", d.topicResetPath(), err)
				}
				d.log.Warn("confirmed topic resets checkpointed: the ledger's offsets now follow the new log", "partitions", len(resets))
			}
		}
	}
}

// schema is the records' schema for the current posterior (Schema).
func (d *Daemon) schema() (*stream.Schema, error) {
	return Schema(d.current(), d.cfg.Kafka.MaxRecordBytes)
}

// Schema is the schema of the records a daemon serving m reads: m's features (x0, x1, ...
// when unnamed) and classes, records of at most maxBytes, and features within
// stream.MaxScaledFeature standard deviations of m's scaler (a model's scaler is its first
// posterior's: updates change the last layer only). cfguard verify-log decodes with it too.
func Schema(m *bnn.Model, maxBytes int) (*stream.Schema, error) {
	features := m.Features
	if len(features) == 0 {
		for j := 0; j < m.Inputs(); j++ {
			features = append(features, fmt.Sprintf("x%d", j))
		}
	}
	s, err := stream.NewSchema(features, m.Classes, maxBytes)
	if err != nil {
		return nil, err
	}
	return s.WithScale(m.Scaler.Mean, m.Scaler.Std)
}

// resumeMarks converts the ledger's marks for the consumer, which checks at start that the topic
// still holds the records they identify.
func resumeMarks(marks map[int]ledger.OffsetMark) map[int]stream.RecordMark {
	out := make(map[int]stream.RecordMark, len(marks))
	for p, m := range marks {
		out[p] = stream.RecordMark{Offset: m.Offset, Timestamp: m.Timestamp, Sum: m.Sum}
	}
	return out
}

// checkpointMarks puts in cp the marks of inc's partitions (a record read before each offset,
// checked at the next start), and forgets those of partitions reset to a new log.
func checkpointMarks(cp *ledger.Checkpoint, inc *stream.Increment) {
	for p := range inc.NextOffsets {
		if m, ok := inc.Mark(p); ok {
			if cp.Marks == nil {
				cp.Marks = map[int]ledger.OffsetMark{}
			}
			cp.Marks[p] = ledger.OffsetMark{Offset: m.Offset, Timestamp: m.Timestamp, Sum: m.Sum}
		} else if inc.Reset(p) {
			cp.ForgetMarks = append(cp.ForgetMarks, p)
		}
	}
}

// topicResetHint ends the consumer's TopicResetError: the command that confirms the reset.
func (d *Daemon) topicResetHint() string {
	return fmt.Sprintf("Records below the ledger's offset in the new log would be skipped, so ingest of kafka.topic %s stopped; "+
		"to confirm the reset and read the partition from its log start (the ledger's offsets are reset there and the records applied), "+
		"restart the daemon once with: cfguard run --config %s --accept-topic-reset", d.cfg.Kafka.Topic, d.configPath)
}

// step is what an increment does to the posterior, decided before anything is written: the
// update, its KL and the policy's outcome, with the counters and events that go with them.
type step struct {
	prev *bnn.Model
	// next is the new posterior, nil when the posterior is kept (rejected, failed, or no records).
	next    *bnn.Model
	kl      float64
	outcome certify.Outcome // "" for an increment without records
	seed    uint64
	// update is the KL history's entry (nil without records); counters and events go into the
	// checkpoint; records and metric are counted once it is durable.
	update   *ledger.UpdateRecord
	counters map[string]int64
	events   []Event
	records  int
	metric   alerts.RecordResult
	// quality is the increment's prequential record (nil without records or when scoring
	// failed), made current once the checkpoint is durable.
	quality *qualityRecord
}

// compute runs inc through the update and the on-breach policy from prev. It writes nothing: a
// single daemon checkpoints the step (apply), a replica's updater appends it to the posterior
// log. Only a checkpoint-class failure returns an error; a failed update is a step (outcome
// failed) that keeps the posterior.
func (d *Daemon) compute(ctx context.Context, prev *bnn.Model, inc *stream.Increment) (*step, error) {
	X, y := inc.XY()
	s, err := d.computeUpdate(ctx, prev, inc, X, y)
	if err != nil || s.update == nil {
		return s, err
	}
	// Events are stamped when decided, so that a log entry's copy (replicas) and the outbox's agree.
	now := time.Now().UTC()
	for i := range s.events {
		s.events[i].At = now
	}
	// Test, then train: the records are scored under prev, the posterior before them, whatever
	// the update's outcome; the record goes into the same checkpoint as the update.
	q, data, err := d.quality.score(prev, X, y, d.cfg.Update.Draws, s.seed^0x9e4d5c07, time.Now())
	if err != nil {
		d.log.Error("prequential scoring failed; the increment is applied unscored", "posterior_version", prev.Version, "err", err)
		return s, nil
	}
	s.quality, s.update.Quality = q, data
	return s, nil
}

// counterConsumerLost is the ledger counter of input records this daemon's own consumer found
// deleted by the broker before it read them: the "lost" of the steps it computed. On a replica
// the counter "lost" also adds what the posterior log's other writers recorded, which a replica
// that replays the log applies long after the loss; cfguard_records_lost_total and its alert
// count this one.
const counterConsumerLost = "consumer_lost"

// computeUpdate is compute without the prequential scores; (X, y) are inc's good records.
func (d *Daemon) computeUpdate(ctx context.Context, prev *bnn.Model, inc *stream.Increment, X [][]float64, y []int) (*step, error) {
	s := &step{prev: prev, counters: map[string]int64{}, records: len(inc.Records)}
	if inc.DeadLettered > 0 {
		s.counters["dead_lettered"] = int64(inc.DeadLettered)
	}
	if lost := inc.Lost(); lost > 0 { // deleted by the broker before they were read (logged by the consumer)
		s.counters["lost"] = lost
		s.counters[counterConsumerLost] = lost
	}
	if len(inc.Records) == 0 {
		return s, nil
	}
	s.seed = d.cfg.Update.Seed ^ (prev.Version+1)*0x9e3779b97f4a7c15 // deterministic per version: replays agree
	from, ucfg := d.cfg.Update.Step(prev, len(X), s.seed)
	next, st, err := update.LastLayer(ctx, from, X, y, ucfg)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		// The posterior is untouched. The records are consumed (their offsets checkpointed) so
		// the stream does not wedge on them; the failure is counted, logged and put in the outbox.
		d.log.Error("update failed; posterior kept", "records", len(inc.Records), "err", err)
		s.outcome, s.metric = certify.OutcomeFailed, alerts.RecordFailed
		s.counters["failed"] = int64(len(inc.Records))
		s.update = &ledger.UpdateRecord{Version: prev.Version + 1, KL: 0, Outcome: certify.OutcomeFailed}
		s.events = []Event{{Type: "update_failed", PosteriorVersion: prev.Version, Records: recordIDs(inc), Offsets: offsetRanges(heldRecords(inc)), Error: err.Error()}}
		return s, nil
	}
	if ucfg.Solver == update.SolverConverge && !st.Converged {
		why := "update did not converge within update.max_iterations; its posterior is the best found"
		if st.Iterations < ucfg.MaxIterations {
			why = "update stopped before update.tolerance: the line search made no more progress; its posterior is the best found"
		}
		d.log.Warn(why, "posterior_version", prev.Version+1, "iterations", st.Iterations, "max_iterations", ucfg.MaxIterations, "records", len(X))
	}
	kl := st.KL // KL(q_new || q_prev), computed by the update
	outcome, over := certify.Decide(kl, d.budget, d.cfg.Certify.OnBreach)
	if over {
		// The event describes the candidate posterior prev.Version + 1 (promoted, clipped or
		// rejected as the policy says) and is queued before the status changes it causes.
		stepKL := kl // kl becomes the clipped step's below
		labels := labelCounts(prev.Classes, y)
		s.events = append(s.events, Event{Type: "kl_over_budget", PosteriorVersion: prev.Version + 1, ParentVersion: &prev.Version,
			KL: &stepKL, Budget: d.budget, Policy: string(d.cfg.Certify.OnBreach), Labels: labels})
		d.log.Warn("update KL over budget", "posterior_version", prev.Version+1, "kl", kl, "budget", d.budget, "on_breach", d.cfg.Certify.OnBreach, "records", len(inc.Records), "labels", labels)
		if outcome == certify.OutcomeClipped {
			clipped, t, err := update.ClipToBudget(prev, next, d.budget)
			if err != nil {
				return nil, fmt.Errorf("clip: %w", err)
			}
			next = clipped
			if kl, _, err = certify.KL(next, prev); err != nil {
				return nil, err
			}
			// The event says how far along the path to the converged posterior the step went.
			ev := &s.events[len(s.events)-1]
			ev.ClipFraction, ev.ClippedKL = &t, &kl
			d.log.Warn("update KL over budget: clipped", "clip_fraction", t, "kl", kl, "budget", d.budget)
		}
	}
	s.kl, s.outcome = kl, outcome
	if outcome == certify.OutcomeRejected {
		d.log.Warn("update KL over budget: update rejected, posterior kept", "kl", kl, "budget", d.budget, "records", len(inc.Records))
		s.metric = alerts.RecordHeld
		s.counters["held"] = int64(len(inc.Records))
		s.update = &ledger.UpdateRecord{Version: prev.Version + 1, KL: kl, Outcome: certify.OutcomeRejected}
		heldKL := kl
		s.events = append(s.events, Event{Type: "increment_held", PosteriorVersion: prev.Version, KL: &heldKL, Records: recordIDs(inc), Held: heldRecords(inc)})
		return s, nil
	}
	s.next, s.metric = next, alerts.RecordApplied
	s.update = &ledger.UpdateRecord{Version: next.Version, KL: kl, Outcome: outcome}
	return s, nil
}

// apply runs one increment through the update and the policy (compute) and checkpoints the
// result; metrics change only after the checkpoint they describe is durable. It returns an
// error only when the checkpoint could not be written for a reason other than a failed write
// (ledger.ErrWrite, which durably retries).
func (d *Daemon) apply(ctx context.Context, inc *stream.Increment) error {
	start := time.Now()
	s, err := d.compute(ctx, d.current(), inc)
	if err != nil {
		return err
	}
	cp := &ledger.Checkpoint{Offsets: inc.NextOffsets}
	checkpointMarks(cp, inc)
	for p := range inc.NextOffsets {
		if inc.Reset(p) {
			s.counters[resetCounter(p)]++ // the reset is checkpointed: topicResets tells it by this
		}
	}
	return d.commitStep(ctx, s, cp, start)
}

// commitStep writes step s with cp (which holds the offsets and, for a replica, the log's head)
// and, when s promotes a posterior, makes it current. Every branch ends in exactly one
// checkpoint.
//
// Locking: only one goroutine changes the current posterior (ingest, or a replica's follower),
// so the update is computed from d.current() without a lock. d.mu is held only around the ledger
// write and the swap of the current posterior (commit), so that a registration is anchored to
// the posterior that is current when it is stored; d.published too, so that a snapshot reader
// sees the ledger and the posterior of one version. Nothing done under d.mu talks to Kafka or
// samples: events go to the ledger's outbox in the checkpoint's transaction (the outbox
// publisher sends them), and Monte-Carlo verdicts for CEs whose bound fails are the confirmer's,
// in the background. A registration does sample under d.mu (two inputs through the version's
// pool, and the pool's draws when it is the version's first use), so that the CE is anchored to
// the posterior it was measured under; measuring outside the lock and retrying when the version
// moved on could starve a registration while ingest commits faster than a pool is drawn.
func (d *Daemon) commitStep(ctx context.Context, s *step, cp *ledger.Checkpoint, start time.Time) error {
	cp.Counters, cp.Update = s.counters, s.update
	if u := cp.Update; u != nil {
		u.Breached = ledger.KLEntry{KL: u.KL, Outcome: u.Outcome}.Breached(d.budget)
	}
	cp.Events = append(cp.Events, outboxEntries(s.events)...)
	if s.next == nil {
		if err := d.checkpoint(ctx, cp); err != nil {
			return err
		}
		if s.outcome != "" {
			d.metrics.IncUpdate(s.outcome)
			d.metrics.AddRecords(s.metric, s.records)
		}
		d.quality.commit(s.quality)
		return nil
	}
	next := s.next
	cp.Model, cp.Applied = next, int64(s.records)
	var (
		rep     ledger.Report
		changes []ledger.StatusChange
	)
	err := d.durably(ctx, checkpointWrite, func() error {
		d.mu.Lock()
		defer d.mu.Unlock()
		d.published.Lock() // the ledger's new version and the new posterior are seen together
		defer d.published.Unlock()
		var err error
		if rep, changes, err = d.ledger.Commit(ctx, cp); err != nil {
			return err
		}
		d.setCurrent(next)
		return nil
	})
	if err != nil {
		return err
	}
	d.outbox.notify()
	d.confirm.notify()
	d.export.changed()
	d.quality.commit(s.quality)
	d.metrics.IncUpdate(s.outcome)
	d.metrics.AddRecords(alerts.RecordApplied, s.records)
	d.metrics.ObserveRecertification(rep.Duration)
	d.log.Info("increment applied", "posterior_version", next.Version, "records", s.records, "dead_lettered", s.counters["dead_lettered"],
		"kl", s.kl, "budget", d.budget, "outcome", s.outcome, "max_anchor_kl", rep.MaxAnchorKL, "lapsed", rep.Lapsed,
		"restored", rep.Restored, "renewal_backlog", rep.Pending, "status_changes", summarizeChanges(changes),
		"candidates", rep.Candidates, "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// checkpoint writes a checkpoint that keeps the posterior (durably, under d.mu) and wakes the
// outbox publisher.
func (d *Daemon) checkpoint(ctx context.Context, cp *ledger.Checkpoint) error {
	err := d.durably(ctx, checkpointWrite, func() error {
		d.mu.Lock()
		defer d.mu.Unlock()
		return d.ledger.Checkpoint(cp)
	})
	if err == nil && len(cp.Events) > 0 {
		d.outbox.notify()
	}
	return err
}

// State is the ledger's state as the metrics report it, read in one transaction.
func (d *Daemon) state() (alerts.State, error) {
	st, err := d.ledger.State()
	if err != nil {
		return alerts.State{}, err
	}
	s := alerts.State{PosteriorVersion: st.PosteriorVersion, MaxAnchorKL: st.MaxAnchorKL, Counts: st.Counts, Decided: st.Decided,
		Pending: st.Pending, Unconfirmed: st.Unconfirmed, OutboxPending: st.OutboxLen, MinBound: st.MinBound, HasBound: st.HasBound,
		LastIngest: st.AppliedAt, Lost: map[string]int64{d.cfg.Kafka.Topic: st.Counters[counterConsumerLost]},
		LostAt: map[string]time.Time{d.cfg.Kafka.Topic: st.CountersAt[counterConsumerLost]}}
	if d.cfg.Replication.Enabled {
		s.Lost[d.cfg.Replication.CETopic] = st.Counters[ledger.CounterRequestsLost]
		s.LostAt[d.cfg.Replication.CETopic] = st.CountersAt[ledger.CounterRequestsLost]
	}
	if w, at, reset, ok := d.ends.get(); ok {
		next := maps.Clone(st.Offsets)
		for p := range reset {
			delete(next, p) // a reset partition's offset counts the old log's records
		}
		s.Waiting, s.HasWaiting, s.WaitingAt = stream.Waiting(w, next), true, at
	}
	if u := st.LastUpdate; u != nil {
		s.UpdateKL, s.HasUpdate, s.UpdateClipped = u.KL, true, u.Outcome == certify.OutcomeClipped
	}
	return s, nil
}

// summarizeChanges counts status changes by transition ("certified->at_risk": 3), so that an
// increment that moves 10^5 CEs logs one line.
func summarizeChanges(changes []ledger.StatusChange) map[string]int {
	out := map[string]int{}
	for _, ch := range changes {
		out[ch.From.String()+"->"+ch.To.String()]++
	}
	return out
}

func recordIDs(inc *stream.Increment) []string {
	ids := make([]string, len(inc.Records))
	for i, r := range inc.Records {
		ids[i] = r.ID
	}
	return ids
}

// heldRecords carries a rejected increment's records in its event, so that they can be
// replayed once an operator decides (they are not applied, and their offsets are committed).
// A record produced without an id carries none: the consumer's name for it,
// "<topic>/<partition>/<offset>" (stream.DefaultID), is no record id, and produced again it
// would be dead-lettered as bad_id.
func heldRecords(inc *stream.Increment) []heldRecord {
	out := make([]heldRecord, len(inc.Records))
	for i, r := range inc.Records {
		id := r.ID
		if ident.Check(id) != nil {
			id = ""
		}
		out[i] = heldRecord{ID: id, Features: r.X, Label: r.Label, Partition: r.Partition, Offset: r.Offset}
	}
	return out
}

// labelCounts is how many of the labels y are of each class, by the class's name (a valid model
// names every class), every class included: an increment of one label steps further than one of
// the same size whose labels come in their usual proportions (docs/MATHS.md, "Increments of one
// label"), so an over-budget step names them.
func labelCounts(classes []string, y []int) map[string]int {
	n := make(map[string]int, len(classes))
	for _, c := range classes {
		n[c] = 0
	}
	for _, c := range y {
		n[classes[c]]++
	}
	return n
}
