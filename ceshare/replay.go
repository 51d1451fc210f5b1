package ceshare

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/stream"
)

// readPartition acquires p (given to the member in generation gen) and hands its requests to
// Apply, batch by batch, until ctx (the generation) ends. An error no retry fixes stops the
// member through fail.
func (m *Member) readPartition(ctx context.Context, cl *kafka.Client, p int, gen int32, fail context.CancelCauseFunc) {
	m.mu.Lock()
	releasing := m.releasing[p]
	m.mu.Unlock()
	if releasing != nil { // given back while its release still runs: acquired once it ended
		m.log.Info("CE partition given back while its release runs: acquired once the release ends", "partition", p)
		select {
		case <-releasing:
		case <-ctx.Done():
			return
		}
	}
	from, witness, err := m.hooks.Acquire(ctx, p)
	if err != nil {
		if ctx.Err() == nil {
			fail(fmt.Errorf("ceshare: acquiring partition %d of %q: %w", p, m.cfg.Topic, err))
		}
		return
	}
	if from < 0 {
		fail(fmt.Errorf("ceshare: acquiring partition %d of %q: Acquire returned offset %d", p, m.cfg.Topic, from))
		return
	}
	m.mu.Lock()
	ps := m.parts[p]
	fresh := ps == nil || ps.next != from || !ps.acquired
	if fresh {
		ps = &partState{next: from, since: time.Now(), acquired: m.cfg.StateTopic == ""}
		m.parts[p] = ps
		m.log.Info("CE partition acquired", "partition", p, "from", from)
	}
	m.mu.Unlock()
	// A partition acquired afresh is claimed. The registrations still to replay get their
	// states: all of them when the partition is acquired from its start, the rest of them when
	// a rebuild was cut short (a crash).
	if fresh && m.cfg.StateTopic != "" {
		replay := m.toReplay(ctx, cl, p, from)
		states, before, stale := m.acquireStates(ctx, cl, p, gen, replay, from > 0, false)
		if ctx.Err() != nil {
			return
		}
		if stale != nil {
			// The store holds p from before another replica claimed it (a restart, or a pause
			// past the session, given p back): its CEs of p lack what that owner learnt of them
			// (renewals, verdicts, history), which that owner's states hold. p is released and
			// rebuilt from offset 0 with them, as a partition acquired afresh is, and claimed
			// only then; a state this replica wrote from its copy (its confirmer judged it until
			// the release, and its outbox may publish that after the claim) is a late write.
			m.log.Warn("this replica's ledger holds the CE partition from before another replica owned it: released and rebuilt "+
				"from offset 0 with the states that owner left", "partition", p, "from", from, "owner_since", stale.Replica, "term", stale.Term)
			if err := m.hooks.Release(ctx, p); err != nil {
				if ctx.Err() == nil {
					fail(fmt.Errorf("ceshare: releasing partition %d of %q held from before another owner: %w", p, m.cfg.Topic, err))
				}
				return
			}
			if from, witness, err = m.hooks.Acquire(ctx, p); err != nil {
				if ctx.Err() == nil {
					fail(fmt.Errorf("ceshare: acquiring partition %d of %q: %w", p, m.cfg.Topic, err))
				}
				return
			}
			m.mu.Lock()
			ps.next = from
			m.mu.Unlock()
			replay = true
			if states, before, _ = m.acquireStates(ctx, cl, p, gen, true, false, true); ctx.Err() != nil {
				return
			}
		}
		m.mu.Lock()
		ps.ownedBefore, ps.acquired = before, true
		m.mu.Unlock()
		if replay {
			m.mu.Lock()
			if !ps.ready {
				ps.states = states
			}
			m.mu.Unlock()
			m.log.Info("CE states of the partition read", "partition", p, "states", len(states))
		}
	}
	bo := backoff.Backoff{Min: m.cfg.RetryMin, Max: m.cfg.RetryMax}
	blockedBo := bo // between reads of a record this build cannot read
	var failing fetchFailures
	// retry counts a failed read of p and waits out the backoff: false when ctx ended meanwhile.
	retry := func(err error) bool {
		failing.failed(m.log, time.Now(), p, err)
		return bo.Wait(ctx) == nil
	}
	next := from
	if witness != nil && witness.Offset >= from {
		witness = nil // not a record before the offset: nothing to check
	}
	// While p is owned, the last record read as of a check (seen) is the witness of the next
	// one: once an owner reads on into a new log, its last record is of that log, but the one
	// it had read at the check before is of the old one. It starts as the store's Witness (an
	// idle partition's is checked again at each check), or as the first record read when there
	// is none; and it is the Witness Apply stores, so that the store's Witness, checked at the
	// next acquisition (a new generation, a restart after a crash), is never a record read since
	// the last check. Both are forgotten where next goes back (a reset): they are records of a
	// log read no more.
	seen, last := witness, witness
	checked := time.Now()
	for ctx.Err() == nil {
		if witness == nil && time.Since(checked) >= m.cfg.WitnessEvery {
			witness, seen, checked = seen, last, time.Now()
			if witness != nil && witness.Offset >= next {
				witness = nil
			}
		}
		if witness != nil { // first: is the partition still the log the store read?
			m.mu.Lock()
			m.checks++
			m.mu.Unlock()
			other, end, err := m.sameLog(ctx, cl, p, *witness)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				if !stream.Retryable(err) && !errors.Is(err, errRecords) {
					fail(fmt.Errorf("ceshare: reading partition %d of %q: %w", p, m.cfg.Topic, err))
					return
				}
				if !retry(err) {
					return
				}
				continue
			}
			bo.Reset()
			failing.worked(m.log, time.Now(), p)
			if other {
				m.log.Error("CE partition holds another record than the one this replica read at its offset: the topic was deleted and "+
					"created again and has grown past what this replica read; its requests are gone, the partition is read again from "+
					"offset 0 and this replica's CEs of it are sent again", "partition", p, "offset", witness.Offset, "read_to", next, "end", end)
				if next, err = m.reset(ctx, p, next, end, witness.Offset+1); err != nil {
					if ctx.Err() == nil {
						fail(err)
					}
					return
				}
				seen, last = nil, nil
			}
			witness = nil
		}
		if m.cfg.beforeFetch != nil {
			m.cfg.beforeFetch(p, next)
		}
		res, err := cl.Fetch(ctx, &kafka.FetchRequest{Topic: m.cfg.Topic, Partition: p, Offset: next,
			MinBytes: 1, MaxBytes: int64(m.cfg.FetchMaxBytes), MaxWait: m.cfg.FetchWait})
		if err == nil && res.Error != nil {
			err = res.Error
		}
		if errors.Is(err, kafka.OffsetOutOfRange) {
			was := next
			if next, err = m.outOfRange(ctx, cl, p, next); err != nil {
				if ctx.Err() == nil {
					fail(err)
				}
				return
			}
			if next < was {
				seen, last = nil, nil
			}
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if !stream.Retryable(err) {
				fail(fmt.Errorf("ceshare: reading partition %d of %q: %w", p, m.cfg.Topic, err))
				return
			}
			m.log.Debug("fetching CE requests failed; retrying", "partition", p, "err", err)
			if !retry(err) {
				return
			}
			continue
		}
		bo.Reset()
		batch, after, lastRead, blocked, err := m.decode(p, res.Records, next)
		if err != nil {
			m.log.Debug("reading fetched CE requests failed; retrying", "partition", p, "err", err)
			if !retry(err) {
				return
			}
			continue
		}
		failing.worked(m.log, time.Now(), p)
		if lastRead != nil {
			last = lastRead
			if seen == nil {
				seen = lastRead
			}
		}
		m.mu.Lock()
		for i := range batch {
			if s, ok := ps.states[batch[i].req.ID]; ok && batch[i].req.Kind == KindRegister {
				batch[i].req.State = &s
			}
		}
		m.mu.Unlock()
		if next, err = m.apply(ctx, p, batch, next, after, seen); err != nil {
			if ctx.Err() == nil {
				fail(fmt.Errorf("ceshare: applying requests of partition %d of %q: %w", p, m.cfg.Topic, err))
			}
			return
		}
		m.mu.Lock()
		ps.end = res.HighWatermark
		if ps.blocked != nil && next > ps.blocked.Offset { // passed: read, or deleted by the topic's retention
			m.log.Info("CE partition no longer blocked", "partition", p, "offset", ps.blocked.Offset, "next", next,
				"blocked_for", time.Since(ps.blocked.Since).Round(time.Millisecond))
			ps.blocked = nil
		}
		if next >= ps.end && !ps.ready {
			ps.ready, ps.states = true, nil
			m.log.Info("CE partition caught up", "partition", p, "next", next, "took", time.Since(ps.since).Round(time.Millisecond))
		}
		m.mu.Unlock()
		if blocked == nil {
			blockedBo.Reset()
			continue
		}
		if next == blocked.Offset {
			// This build reads nothing past it; read it again after a while all the same, as
			// retention may delete it (then the partition's gap is counted lost, as any).
			m.block(p, ps, blocked)
			if blockedBo.Wait(ctx) != nil {
				return
			}
		}
	}
}

// block records that p is blocked at b (Blocked), and says so at ERROR when it was not at
// that offset before.
func (m *Member) block(p int, ps *partState, b *Blocked) {
	m.mu.Lock()
	found := ps.blocked == nil || ps.blocked.Offset != b.Offset
	m.mu.Unlock()
	if !found {
		return
	}
	// Published after it is logged: who sees the block finds its line.
	defer func() {
		m.mu.Lock()
		b.Since = time.Now()
		ps.blocked = b
		m.mu.Unlock()
	}()
	m.log.Error("CE partition blocked at a request this build cannot read: nothing at or after it is applied, and its "+
		"registrations answer 202, until a cfguard that reads it owns the partition (upgrade this replica to the build "+
		"of the replica that wrote it) or replication.skip_ce_requests names it", "partition", p, "offset", b.Offset, "id", b.ID, "writer", b.Writer, "reason", b.Reason, "detail", b.Detail)
}

// fetchWarnAfter is how long the fetches of a partition fail in a row before the member says so
// at WARN, once per episode: shorter episodes, such as a partition's leader moving, stay at
// DEBUG. A partition being rebuilt stays so until a fetch works again
// (cfguard_counterfactuals_partitions_rebuilding, alert CfguardCounterfactualsNotCaughtUp).
const fetchWarnAfter = 10 * time.Second

// fetchFailures is one partition's episode of failed reads, for its log lines: of its requests
// (fetches, or fetched records that do not decode; the zero value), or of its CE states
// (stateFailures).
type fetchFailures struct {
	since   time.Time // the episode's first failure; zero while reads work
	warned  bool
	failing string // the WARN line's message; "" for fetches of requests
	again   string // the INFO line's
}

// stateFailures is the episode of a partition's reads and claim of the CE state topic.
func stateFailures() fetchFailures {
	return fetchFailures{failing: "reading or claiming the CE states of a partition keeps failing; retrying (the partition is not caught up until it works)",
		again: "CE states of the partition read and claimed again"}
}

// failed records a failure at now, and logs at WARN when the episode reaches fetchWarnAfter.
func (f *fetchFailures) failed(log *slog.Logger, now time.Time, p int, err error) {
	if f.since.IsZero() {
		f.since = now
	}
	if failing := now.Sub(f.since); !f.warned && failing >= fetchWarnAfter {
		f.warned = true
		log.Warn(cmp.Or(f.failing, "fetching CE requests of a partition keeps failing; retrying (a partition not caught up stays so until a fetch works)"),
			"partition", p, "failing_for", failing.Round(time.Millisecond), "err", err)
	}
}

// worked ends the episode at now, saying so when it was logged at WARN.
func (f *fetchFailures) worked(log *slog.Logger, now time.Time, p int) {
	if f.warned {
		log.Info(cmp.Or(f.again, "fetching CE requests of the partition works again"), "partition", p, "failed_for", now.Sub(f.since).Round(time.Millisecond))
	}
	f.since, f.warned = time.Time{}, false
}

// toReplay says whether partition p of the CE topic holds records at or after from (true when
// its end cannot be read: reading the states costs a read, missing them costs the states).
func (m *Member) toReplay(ctx context.Context, cl *kafka.Client, p int, from int64) bool {
	if from == 0 {
		return true
	}
	_, end, err := partitionOffsets(ctx, cl, m.cfg.Topic, p)
	return err != nil || end > from
}

// acquireStates claims partition p of the CE state topic for generation gen and, with restore,
// reads its states, and says whether an earlier owner claimed p (claimStates). With held (the
// store holds p from an earlier acquisition), it claims nothing when another replica's claim is
// in force, and returns that claim as stale instead; with fenceSelf, this replica's states are
// late writes (claimStates). A broker's
// transient errors are retried for as long as they last, as fetches of the CE topic are: the
// partition stays not caught up meanwhile (cfguard_counterfactuals_partitions_rebuilding,
// CfguardCounterfactualsNotCaughtUp), with a WARN line once the episode reaches fetchWarnAfter.
// Rebuilding without the states would lose the previous owner's renewals, verdicts and history,
// and leave p unclaimed, so that the next owner would take this replica's states for late
// writes. A state topic that is gone is created again. Any other error (ACLs, records that do
// not decode) is logged at ERROR and the partition is rebuilt from its registrations alone.
func (m *Member) acquireStates(ctx context.Context, cl *kafka.Client, p int, gen int32, restore, held, fenceSelf bool) (states map[string]State, before bool, stale *Claim) {
	bo := backoff.Backoff{Min: m.cfg.RetryMin, Max: m.cfg.RetryMax}
	failing := stateFailures()
	for {
		states, before, err := m.claimStates(ctx, cl, p, gen, restore, held, fenceSelf)
		if err == nil {
			failing.worked(m.log, time.Now(), p)
			return states, before, nil
		}
		if ctx.Err() != nil {
			return nil, false, nil
		}
		if s := (*staleStore)(nil); errors.As(err, &s) {
			failing.worked(m.log, time.Now(), p)
			return nil, false, &s.claim
		}
		transient := stream.Transient(err)
		if topicGone(err) {
			created, cerr := createStateTopic(ctx, cl, m.cfg.StateTopic, m.cfg.Partitions)
			if created {
				m.log.Warn("CE state topic was gone and is created again: the states it held are lost", "state_topic", m.cfg.StateTopic)
			}
			transient = cerr == nil || stream.Transient(cerr) // read it again (as created now), or create it again
			err = errors.Join(err, cerr)
		}
		if !transient {
			m.log.Error("CE state topic cannot be read or the partition claimed there: its CEs are rebuilt from their registrations, "+
				"without the renewals, verdicts and history of their previous owner, and the partition's next owner may take the "+
				"states this replica writes for them for a previous owner's late writes", "partition", p, "state_topic", m.cfg.StateTopic, "err", err)
			return nil, false, nil
		}
		failing.failed(m.log, time.Now(), p, err)
		m.log.Debug("reading or claiming CE states failed; retrying", "partition", p, "err", err)
		if bo.Wait(ctx) != nil {
			return nil, false, nil
		}
	}
}

// offsetRequest is a decoded request and its offset.
type offsetRequest struct {
	req    Request
	offset int64
}

// record is one data record of a fetch response: its offset, key, value and authenticator
// (the clusterkey.Header header, nil without one).
type record struct {
	offset     int64
	time       time.Time // the record's timestamp
	key, value []byte
	auth       []byte
}

// eachRecord calls fn with each data record of rr at or after from (a batch may start before
// the offset asked for) and returns the offset after the last record, control records included.
func eachRecord(rr kafka.RecordReader, from int64, fn func(r record)) (next int64, err error) {
	next = from
	err = stream.EachRecord(rr, func(r *kafka.Record, control bool) error {
		if r.Offset < from {
			return nil
		}
		next = max(next, r.Offset+1)
		if control {
			return nil
		}
		rec := record{offset: r.Offset, time: r.Time}
		var err error
		if rec.key, err = stream.ReadBytes(r.Key); err != nil {
			return err
		}
		if rec.value, err = stream.ReadBytes(r.Value); err != nil {
			return err
		}
		for _, h := range r.Headers {
			if h.Key == clusterkey.Header {
				rec.auth = h.Value
			}
		}
		fn(rec)
		return nil
	})
	return next, err
}

// decode reads the records of a fetch response at or after from. It returns the well-formed
// requests, the offset after the last record and the Witness of the last record before it;
// records that do not authenticate and copies are counted and logged. At a record that blocks p
// (Blocked) it stops: it returns the requests before it, its offset as the offset after them,
// and what blocks p.
func (m *Member) decode(p int, rr kafka.RecordReader, from int64) ([]offsetRequest, int64, *Witness, *Blocked, error) {
	var out []offsetRequest
	var blocked *Blocked
	var last *record // the last record read, not stopped at: its Witness is hashed once, at the end
	next, err := eachRecord(rr, from, func(r record) {
		if blocked != nil {
			return
		}
		defer func() {
			if blocked == nil {
				last = &r
			}
		}()
		if err := Authenticate(m.cfg.Keys, r.value, r.auth); err != nil {
			// The line before the counts, so that whoever sees a count (an alert, a test) finds it.
			m.log.Warn("unauthenticated CE request ignored: it is not signed under a key of this replica's replication.key_file: a writer without the cluster key (check the CE topic's ACLs), or a key file that is not the cluster's",
				"partition", p, "offset", r.offset, "err", err)
			m.mu.Lock()
			m.skipped[ReasonUnauthenticated]++
			m.mu.Unlock()
			if m.cfg.OnUnauthenticated != nil {
				m.cfg.OnUnauthenticated(m.cfg.Topic, p, r.offset)
			}
			return
		}
		req, err := m.cfg.decode(r.key, r.value)
		if err == nil && Partition(req.ID, m.cfg.Partitions) != p {
			err = &DecodeError{Reason: ReasonPartition, Detail: fmt.Sprintf("id %q belongs to partition %d", req.ID, Partition(req.ID, m.cfg.Partitions))}
		}
		if err == nil && m.cfg.Readable != nil {
			if rerr := m.cfg.Readable(req); rerr != nil {
				blocked = m.blockOrSkip(&Blocked{Partition: p, Offset: r.offset, ID: clip([]byte(req.ID)), Reason: ReasonCE, Detail: rerr.Error(), Writer: clip([]byte(req.Replica))})
				return
			}
		}
		var de *DecodeError
		if errors.As(err, &de) {
			if b := m.blocks(p, r, de); b != nil {
				blocked = m.blockOrSkip(b)
				return
			}
			m.log.Warn("copy of a CE request skipped: a signed request under another record's key or in another partition than its id's, "+
				"or naming no id; only a writer that copies records makes one: check the CE topic's ACLs", "partition", p, "offset", r.offset,
				"reason", de.Reason, "detail", de.Detail)
			m.mu.Lock()
			m.skipped[de.Reason]++
			m.mu.Unlock()
			if m.cfg.OnUnauthenticated != nil { // its authenticator is not for where it was written
				m.cfg.OnUnauthenticated(m.cfg.Topic, p, r.offset)
			}
			return
		}
		req.Offset = r.offset
		out = append(out, offsetRequest{req: req, offset: r.offset})
	})
	if blocked != nil {
		next = blocked.Offset
	}
	var w *Witness
	if last != nil {
		x := witnessOf(*last)
		w = &x
	}
	return out, next, w, blocked, err
}

// blocks returns what blocks partition p at the authenticated record r that Decode refused with
// de (Blocked), or nil when r may be a copy: a value signed for another record. The signature
// covers the value, not the key or the partition, so r blocks only when its value names, as a
// string "id" (every format of Request keeps one), the record's key and an id of p; any other
// record is left out, so that a writer without the key cannot block a partition with a copy of
// another record (a replay of a record into its own place is the record: see Blocked).
func (m *Member) blocks(p int, r record, de *DecodeError) *Blocked {
	if de.Reason == ReasonKey || de.Reason == ReasonPartition {
		return nil
	}
	var named struct {
		ID      any `json:"id"`
		Replica any `json:"replica"`
	}
	json.Unmarshal(r.value, &named) // as far as it goes
	if id, ok := named.ID.(string); !ok || id == "" || id != string(r.key) || Partition(id, m.cfg.Partitions) != p {
		return nil
	}
	writer, _ := named.Replica.(string)
	return &Blocked{Partition: p, Offset: r.offset, ID: clip(r.key), Reason: de.Reason, Detail: de.Detail, Writer: clip([]byte(writer))}
}

// Skip is a rule of MemberConfig.Skip: the records of Partition from Offset through Through
// (Offset alone when Through is below it), those of CE id ID only when ID is set.
type Skip struct {
	Partition       int
	Offset, Through int64
	ID              string
}

// names reports whether s names the record that b blocks at.
func (s Skip) names(b *Blocked) bool {
	return s.Partition == b.Partition && s.Offset <= b.Offset && b.Offset <= max(s.Offset, s.Through) && (s.ID == "" || s.ID == b.ID)
}

// blockOrSkip returns b, unless MemberConfig.Skip names its record: then the record is left
// out (counted and logged) and it returns nil.
func (m *Member) blockOrSkip(b *Blocked) *Blocked {
	if !slices.ContainsFunc(m.cfg.Skip, func(s Skip) bool { return s.names(b) }) {
		return b
	}
	m.mu.Lock()
	m.skipped[b.Reason]++
	m.mu.Unlock()
	if m.cfg.OnSkip != nil {
		m.cfg.OnSkip(b.Partition, b.Offset)
	}
	m.log.Warn("CE request this build cannot read skipped, as replication.skip_ce_requests says: the registration or deletion it holds is lost",
		"partition", b.Partition, "offset", b.Offset, "id", b.ID, "writer", b.Writer, "reason", b.Reason, "detail", b.Detail)
	return nil
}

// apply hands batch to Apply in chunks of MaxBatch, checking ctx between them, and returns
// the offset stored with the last chunk applied. after is the offset after the whole batch,
// stored with w (a record before it) by the last chunk.
func (m *Member) apply(ctx context.Context, p int, batch []offsetRequest, next, after int64, w *Witness) (int64, error) {
	if after == next {
		return next, nil
	}
	for {
		n := min(len(batch), m.cfg.MaxBatch)
		chunkNext, cw := after, w
		if n < len(batch) {
			chunkNext, cw = batch[n].offset, nil
		}
		reqs := make([]Request, n)
		for i := range n {
			reqs[i] = batch[i].req
		}
		if err := m.hooks.Apply(ctx, p, reqs, chunkNext, cw); err != nil {
			return next, err
		}
		next = chunkNext
		m.mu.Lock()
		m.applied += int64(n)
		if ps := m.parts[p]; ps != nil {
			ps.next = next
		}
		m.mu.Unlock()
		batch = batch[n:]
		if len(batch) == 0 || ctx.Err() != nil {
			return next, nil
		}
	}
}
