package daemon

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/replica"
	"github.com/cfguard/cfguard/stream"
	"github.com/cfguard/cfguard/ui"
)

// replicaHost is the daemon as package replica sees it (replica.Host): the posterior it serves,
// the update it computes, the commits it writes. A replica reaches nothing else of the Daemon.
type replicaHost struct{ d *Daemon }

var _ replica.Host = replicaHost{}

func (h replicaHost) Current() *bnn.Model     { return h.d.current() }
func (h replicaHost) SetCurrent(m *bnn.Model) { h.d.setCurrent(m) }
func (h replicaHost) InitialModel(ctx context.Context) (*bnn.Model, error) {
	return h.d.initialModel(ctx)
}
func (h replicaHost) DeadLettered(n int) { h.d.metrics.AddRecords(alerts.RecordDeadLettered, n) }

func (h replicaHost) Checkpoint(ctx context.Context, cp *ledger.Checkpoint) error {
	return h.d.checkpoint(ctx, cp)
}

// TopicReset sets cfguard_consumer_topic_mismatch (CfguardTopicReset) while e is not nil, and
// marks e's partition reset, so that cfguard_consumer_lag_records counts its new log whole.
func (h replicaHost) TopicReset(e *stream.TopicResetError) {
	h.d.metrics.SetTopicReset(e != nil)
	if e != nil {
		h.d.ends.setReset(e.Partition, true) // its new log waits whole (cfguard_consumer_lag_records)
		return
	}
	h.d.ends.clearResets()
}

// Consumer is the updater's consumer of kafka.topic, from the log head's coverage and marks.
func (h replicaHost) Consumer(ctx context.Context, resume map[int]int64, marks map[int]stream.RecordMark) (*stream.Consumer, error) {
	d := h.d
	schema, err := d.schema()
	if err != nil {
		return nil, err
	}
	return stream.NewConsumer(ctx, stream.ConsumerConfig{Conn: d.conn, Topic: d.cfg.Kafka.Topic, GroupID: d.cfg.Kafka.GroupID,
		DeadLetterTopic: d.cfg.Kafka.DeadLetterTopic, MaxRecords: d.cfg.Kafka.MaxRecords, MaxRecordsBacklog: d.cfg.Kafka.MaxRecordsBacklog,
		MaxWait: d.cfg.Kafka.MaxWait, Resume: resume, ResumeMarks: marks, TopicResetHint: replicaTopicResetHint}, schema, d.log.With("component", "consumer"))
}

// replicaTopicResetHint ends the updater's TopicResetError: replicas stop ingesting rather than
// skip records, and a reset cannot be confirmed on them.
const replicaTopicResetHint = "Records below the log's coverage in the new topic would be skipped, so the updater stopped ingesting " +
	"kafka.topic (every replica keeps serving its posterior); replicas cannot confirm a topic reset: see docs/RUNBOOK.md, CfguardTopicReset"

// Compute is Daemon.compute: the updater appends the step it returns to the posterior log.
func (h replicaHost) Compute(ctx context.Context, prev *bnn.Model, inc *stream.Increment) (replica.Step, error) {
	s, err := h.d.compute(ctx, prev, inc)
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Commit writes an accepted increment entry as the step it records (stepOf), with the events
// of this replica's own step, and the input records its consumer found lost, when the entry is
// its own.
func (h replicaHost) Commit(ctx context.Context, e *postlog.Entry, prev, next *bnn.Model, own replica.Step, cp *ledger.Checkpoint) error {
	if next != nil {
		if err := h.d.awaitShareSettled(ctx, "the follower's next posterior"); err != nil {
			return err
		}
	}
	s := stepOf(e, prev, next)
	if o, ok := own.(*step); ok {
		s.events = o.eventsOf(e.Seq)
		if n := o.counters[counterConsumerLost]; n > 0 {
			s.counters[counterConsumerLost] = n
		}
	}
	if h.d.hooks.FollowCommit != nil && next != nil {
		h.d.hooks.FollowCommit(ctx, next.Version)
	}
	return h.d.commitStep(ctx, s, cp, time.Now())
}

// recallServed keeps again, among the posteriors the daemon holds (served), those of the
// versions before its start, which a replica that resumed from its ledger finds in the posterior
// log (replica.Replica.Recall), so that across a restart the confirmer measures a CE under the
// version it became due at, as it did before. The confirmers wait for it (awaitRecalled), for
// recallWait at most from the start. When it fails, or is not done by then, the confirmers go on
// with the posteriors they hold, and measure a CE that became due at one they do not under the
// newest. It returns once ctx ends.
func (d *Daemon) recallServed(ctx context.Context) error {
	start := time.Now()
	if d.hooks.Recall != nil {
		d.hooks.Recall(ctx)
	}
	got, err := d.rep.Recall(ctx)
	switch {
	case err != nil && ctx.Err() == nil:
		d.log.Warn("could not recall the posteriors served before the start from the posterior log: a CE that became due "+
			"at one of them is measured under the newest posterior", "err", err)
	case len(got) > 0:
		versions := slices.Sorted(maps.Keys(got))
		for _, v := range slices.Backward(versions) { // newest first: each shares the unchanged layers of the one after it
			d.served.recall(got[v])
		}
		d.log.Info("recalled the posteriors served before the start from the posterior log", "versions", len(versions),
			"from", versions[0], "to", versions[len(versions)-1], "took", time.Since(start).Round(time.Millisecond))
	}
	close(d.recalled)
	<-ctx.Done()
	return nil
}

// wakeOnPoints wakes the confirmers whenever the posterior log marks a new confirmation point:
// an increment of no records marks the version the replica already serves, and commits nothing
// that would wake them. It returns once ctx ends.
func (d *Daemon) wakeOnPoints(ctx context.Context) error {
	head, changed := d.rep.HeadAndChange()
	last, _ := head.LatestPoint(math.MaxUint64)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
		head, changed = d.rep.HeadAndChange()
		if p, ok := head.LatestPoint(math.MaxUint64); ok && p != last {
			last = p
			d.confirm.notify()
		}
	}
}

// recallWait is how long after a replica's start its confirmers wait for recallServed at most:
// the play of a long posterior log takes about 22 s per 10^5 entries on two shared cores
// (BenchmarkRecall, docs/BENCHMARKS.md), and one from a broker that does not answer takes until
// it does.
const recallWait = time.Minute

// awaitRecalled waits until recallServed is done, or recallWait (hooks.RecallWait) after the
// daemon's start, or until ctx ends. The first confirmer that stops waiting because the recall
// is not done logs it.
func (d *Daemon) awaitRecalled(ctx context.Context) error {
	select {
	case <-d.recalled:
		return nil
	default:
	}
	wait := time.Until(d.recallBy)
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-d.recalled:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	d.recallLate.Do(func() {
		d.log.Warn("the confirmers go on before the posteriors served before the start are recalled from the posterior log: "+
			"a CE that became due at one of them is measured under the newest until they are", "waited", cmp.Or(d.hooks.RecallWait, recallWait))
	})
	return nil
}

// awaitShareSettled waits until the CE share has settled which of the partitions the ledger
// holds (kept from an earlier run, or owned before a pause of the process past its session)
// this replica keeps (cluster.Share.Settled), or ctx ends; what says what waits, in the INFO
// line logged when it has to. A re-certification, a confirmation or a reissue before then would
// judge the ledger's copies of CEs another replica took over while this one was away, and
// publish their changes again from a stale copy.
func (d *Daemon) awaitShareSettled(ctx context.Context, what string) error {
	if d.share == nil {
		return nil
	}
	select {
	case <-d.share.Settled():
		return nil
	default:
	}
	start := time.Now()
	d.log.Info(what+" waits until a CE group generation has released the partitions this replica holds that it gives to other replicas "+
		"(kept from the last run, or owned before a pause of this process past its session)", "component", "ceshare")
	select {
	case <-d.share.Settled():
		d.log.Info(what+" goes on: the partitions this replica held that other replicas own are released", "component", "ceshare",
			"waited", time.Since(start).Round(time.Millisecond))
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Summary is what the posterior log's entry number seq records of s (replica.Step): with its
// events, each naming the entry and of at most maxLogEventBytes.
func (s *step) Summary(seq uint64) replica.Summary {
	out := replica.Summary{Outcome: s.outcome, KL: s.kl, Seed: s.seed, Counters: s.counters, Next: s.next, Records: s.records}
	if s.update != nil {
		out.Quality = s.update.Quality
	}
	for _, ev := range s.eventsOf(seq) {
		oe := ev.encode(time.Time{}, maxLogEventBytes)
		out.Events = append(out.Events, postlog.Event{Key: oe.Key, Value: oe.Value})
	}
	return out
}

// eventsOf is s's events as the log's entry number seq records them.
func (s *step) eventsOf(seq uint64) []Event {
	out := slices.Clone(s.events)
	for i := range out {
		out[i].LogEntry = seq
	}
	return out
}

// stepOf is the step an accepted increment records, for the ledger: what Daemon.compute decided
// on the updater, without computing it again.
func stepOf(e *postlog.Entry, prev, next *bnn.Model) *step {
	s := &step{prev: prev, kl: e.KL, outcome: certify.Outcome(e.Outcome), seed: e.Seed, counters: map[string]int64{}}
	if c := e.Counts; c != nil {
		for k, v := range map[string]int64{"dead_lettered": c.DeadLettered, "lost": c.Lost, "failed": c.Failed, "held": c.Held} {
			if v > 0 {
				s.counters[k] = v
			}
		}
	}
	counts := cmp.Or(e.Counts, &postlog.Counts{})
	switch e.Outcome {
	case postlog.Promoted, postlog.Clipped:
		s.next, s.records, s.metric = next, int(counts.Applied), alerts.RecordApplied
		s.update = &ledger.UpdateRecord{Version: e.Version, KL: e.KL, Outcome: s.outcome}
	case postlog.Rejected:
		s.records, s.metric = int(counts.Held), alerts.RecordHeld
		s.update = &ledger.UpdateRecord{Version: e.ParentVersion + 1, KL: e.KL, Outcome: s.outcome}
	case postlog.Failed:
		s.records, s.metric = int(counts.Failed), alerts.RecordFailed
		s.update = &ledger.UpdateRecord{Version: e.ParentVersion + 1, KL: 0, Outcome: s.outcome}
	default:
		s.outcome = ""
	}
	if s.update != nil && len(e.Quality) > 0 {
		var q qualityRecord
		if err := json.Unmarshal(e.Quality, &q); err == nil && q.Detector.Validate() == nil {
			s.update.Quality, s.quality = e.Quality, &q
		}
	}
	return s
}

// replication is GET /v1/model's replication block: nil for a single daemon.
func (d *Daemon) replication(ctx context.Context) map[string]any {
	if d.rep == nil {
		return nil
	}
	out := d.rep.Status()
	if d.share != nil {
		out["ce_partitions"] = d.share.Member().Owned()
		out["ce_generation"] = d.share.Member().Generation()
		out["ce_partitions_rebuilding"] = d.share.NotCaughtUp()
		blocked := []map[string]any{}
		for _, b := range d.share.Member().Blocked() {
			blocked = append(blocked, map[string]any{"partition": b.Partition, "offset": b.Offset, "id": b.ID, "writer": b.Writer,
				"reason": b.Reason, "detail": b.Detail, "since": b.Since.UTC()})
		}
		out["ce_partitions_blocked"] = blocked
	}
	return out
}

// refuse is Run for a replica that does not join (its settings differ from the cluster's): it
// joins no group, applies nothing and owns no CE, and serves only /healthz, /readyz (503 with
// the refusal), /metrics (cfguard_replication_settings_differ) and the web UI's refusal page and
// runbook (ui.Refused, where the alert's links lead) until ctx ends, so that the refusal is seen
// where operators look, without a restart loop. Every other route answers 503 with the refusal.
func (d *Daemon) refuse(ctx context.Context, refusal *replica.SettingsError, web *server, hm *alerts.HTTPMetrics, ready chan<- *Daemon) error {
	d.rep.Refuse(refusal)
	api := d.newAPI(hm).routes()
	mux := http.NewServeMux()
	for _, pattern := range []string{"GET /healthz", "GET /readyz", "GET /metrics"} {
		mux.Handle(pattern, api)
	}
	mux.Handle("/ui/", ui.Refused(refusal.Error()))
	mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		writeError(w, http.StatusServiceUnavailable, refusal.Error())
	})
	d.serveAPI(mux)
	if ready != nil {
		ready <- d
	}
	return web.run(ctx)
}

// shareHost is the daemon as package cluster sees it (cluster.Host): the posterior it serves,
// its lock against posterior commits, its retried writes and its measurements.
type shareHost struct{ d *Daemon }

var _ cluster.Host = shareHost{}

func (h shareHost) Current() *bnn.Model { return h.d.current() }
func (h shareHost) Durably(ctx context.Context, fn func() error) error {
	return h.d.durably(ctx, shareWrite, fn)
}

// Exclusive runs fn under d.mu, which serialises posterior commits with registrations.
func (h shareHost) Exclusive(fn func() error) error {
	h.d.mu.Lock()
	defer h.d.mu.Unlock()
	return fn()
}

func (h shareHost) Predict(ctx context.Context, m *bnn.Model, rows [][]float64) (*bnn.Predictive, error) {
	pool, err := h.d.pools.get(m)
	if err != nil {
		return nil, err
	}
	return predictSplit(ctx, pool, rows)
}

// Applied wakes the confirmers (the requests applied may have stored CEs to judge) and hands
// the reissuer the CEs a previous owner left waiting for a reissue.
func (h shareHost) Applied(waiting []ledger.PendingReissue) {
	h.d.confirm.notify()
	h.d.reissue.adopt(waiting)
}

// joinShare makes this replica a member of the CE group (cluster.NewShare, whose connections
// live as long as life), advertising the API it serves, once the brokers answer (awaitBrokers,
// which a stop through ctx ends).
func (d *Daemon) joinShare(ctx, life context.Context) error {
	rc := d.cfg.Replication
	adv, err := cluster.AdvertiseURL(rc.AdvertiseURL, d.httpAddr, d.cfg.ServesTLS())
	if err != nil {
		return err
	}
	return d.awaitBrokers(ctx, "the CE topic", func() (err error) {
		// The share's connections live as long as life, but a stop asked for while NewShare
		// waits for a broker that does not answer ends the wait.
		sctx, cancel := context.WithCancel(life)
		stopWatching := context.AfterFunc(ctx, cancel)
		d.share, err = cluster.NewShare(sctx, cluster.Config{Replication: rc, Group: ceshare.GroupOf(d.cfg.Kafka.GroupID), Token: d.cfg.HTTP.Token,
			Samples: d.cfg.Certify.Samples, AdvertiseURL: adv, Conn: d.conn, Ledger: d.ledger, Replica: d.rep, States: d.states,
			Requests: d.requests, Host: shareHost{d}, Logger: d.log, OnGeneration: d.hooks.CEGeneration, Now: d.hooks.CEClock,
			BeforeAwait: d.hooks.ShareAwait})
		stopWatching()
		if err != nil {
			cancel()
		}
		return err
	})
}

// joinLog joins the posterior log (replica.Replica.Join), waiting for its brokers (awaitBrokers).
func (d *Daemon) joinLog(ctx context.Context) error {
	return d.awaitBrokers(ctx, "the posterior log", func() error { return d.rep.Join(ctx, d.conn) })
}

// awaitBrokers runs join, a step of a replica's start that reads or writes Kafka, until it
// succeeds, waiting out brokers that cannot be reached yet or answer late (replicas started
// before their brokers, a broker at its connection limit, a busy machine): a transient broker
// error (stream.Transient) is retried with backoff, with a WARN line at the first and every
// joinWarnEvery while it lasts; any other error is returned, and ctx's end (a stop asked for
// meanwhile) as errStoppedAtStart. The API answers once the replica has joined; meanwhile every
// route but /healthz answers 503 naming the wait (front).
func (d *Daemon) awaitBrokers(ctx context.Context, what string, join func() error) error {
	bo := backoff.Backoff{Min: stream.DefaultRetryMin, Max: stream.DefaultRetryMax} // the consumer's: ingestion waits alike
	var since, warned time.Time
	d.front.setPhase("joining " + what)
	for failures := 0; ; failures++ {
		err := join()
		switch {
		case err == nil:
			if failures > 0 {
				d.log.Info("joined "+what+" once its brokers answered", "failures", failures, "waited", time.Since(since).Round(time.Millisecond))
			}
			return nil
		case ctx.Err() != nil && (stream.Transient(err) || errors.Is(err, context.Canceled)):
			return fmt.Errorf("%w: joining %s (%v)", errStoppedAtStart, what, context.Cause(ctx))
		case !stream.Transient(err): // a refusal is a refusal, a stop asked for meanwhile or not
			return err
		}
		now := time.Now()
		if since.IsZero() {
			since = now
		}
		d.front.setPhase(fmt.Sprintf("joining %s: its brokers (%s) did not answer at the last attempt (failing since %s: %v); retrying with backoff",
			what, strings.Join(d.conn.Brokers, ", "), since.UTC().Format(time.RFC3339), err))
		if now.Sub(warned) >= joinWarnEvery {
			warned = now
			d.log.Warn("cannot join "+what+" yet: its brokers do not answer; retrying with backoff (the API answers once joined; meanwhile /readyz says what it waits for)",
				"brokers", d.conn.Brokers, "failing_for", now.Sub(since).Round(time.Millisecond), "err", err)
		}
		if bo.Wait(ctx) != nil {
			return fmt.Errorf("%w: joining %s (%v)", errStoppedAtStart, what, context.Cause(ctx))
		}
	}
}

// errStoppedAtStart is a stop asked for while the daemon started: Run stops cleanly.
var errStoppedAtStart = errors.New("stopped while starting")

// joinWarnEvery is how often awaitBrokers says it still waits.
const joinWarnEvery = 5 * time.Minute
