package ceshare

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/stream"
)

// The CE state topic (StateTopic: the CE topic's name + ".state") is a compacted topic with the
// CE topic's partitions, keyed by CE id: the owner of a CE writes the CE's state there when it
// stores its registration and each time it changes (a status change, a renewal, a verdict), and
// a tombstone when the CE is deleted. A replica that acquires a partition afresh reads the
// partition to its end and claims it (claim.go) before it reads the partition's requests; those
// registrations it replays get the state their previous owner left (Request.State), and a
// partition whose first requests the CE topic's retention deleted gets its CEs back from their
// states (Request.Restored). The CE topic keeps the registrations.
//
// Of the records of one CE, a reader keeps the last one the owner of the time wrote, as
// compaction would keep the last one: the newest state, or none when it is a tombstone or a
// record that does not authenticate or decode. An owner paused past its session, or one whose
// outbox is published after a restart, may write a state after its successor claimed the
// partition; the claim in force does not own it, so a reader keeps the CE's state from before
// it, and takes the late one only when compaction removed every other (a state is a claim the
// new owner checks and judges again, never taken on trust).

// StateTopic is the CE state topic of CE topic ceTopic (replication.ce_topic): its name with
// ".state" appended. Deriving it keeps the replicas of a cluster on one state topic.
func StateTopic(ceTopic string) string { return ceTopic + ".state" }

// StateDomain separates the CE state topic's authenticators from those of the CE topic and the
// posterior log (clusterkey): a state's authenticator never verifies as a request's.
const StateDomain = "cfguard ce state v1"

// TombstoneDomain is the domain of a tombstone's authenticator, which covers its key (the CE
// id): a tombstone has no value to sign, and one that does not authenticate deletes nothing.
const TombstoneDomain = "cfguard ce state tombstone v1"

// MaxStateBytes bounds the value of a state record (EncodeState refuses a larger one with
// ErrStateTooLarge). Kafka refuses a produce request over the topic's max.message.bytes (1 MiB
// by default); a writer sends at most stateBatchBytes in one.
const MaxStateBytes = 256 << 10

// stateBatchBytes bounds the records of one produce request of a StateWriter (their keys,
// values and authenticators, and recordOverhead each).
const (
	stateBatchBytes = 512 << 10
	recordOverhead  = 64
)

// ErrStateTooLarge is EncodeState's error for a state whose value is over MaxStateBytes.
var ErrStateTooLarge = errors.New("ceshare: CE state over the size a state record may have")

// State is one record of the CE state topic: its key is the CE id, its value the JSON of State.
type State struct {
	// ID is the CE's id (ident.Check); the record's key.
	ID string `json:"id"`
	// Replica is the id of the replica that owned the CE and wrote the state.
	Replica string `json:"replica"`
	// Generation is the latest CE group generation the writer took part in when it wrote the
	// state (0 before it joined one). It tells an operator reading the topic which generation a
	// state came from; a reader orders states by offset, not by it (generations start again
	// from 1 when the group is removed).
	Generation int32 `json:"generation"`
	// CE is the CE as its owner's ledger holds it (JSON); opaque here.
	CE json.RawMessage `json:"ce"`
	// Late marks, in a reader's result, a state written by a replica no claim owned when no
	// owner's state of the CE was left (set by the reader, not encoded): compaction may have
	// removed a tombstone before it, so it is not taken to restore a CE (Request.Restored).
	Late bool `json:"-"`
}

// EncodeState checks s and returns the record's key and value.
func EncodeState(s State) (key, value []byte, err error) {
	if err := s.check(); err != nil {
		return nil, nil, err
	}
	if value, err = json.Marshal(s); err != nil {
		return nil, nil, &DecodeError{Reason: ReasonCE, Detail: err.Error()}
	}
	if len(value) > MaxStateBytes {
		return nil, nil, fmt.Errorf("%w: %d bytes, at most %d", ErrStateTooLarge, len(value), MaxStateBytes)
	}
	return []byte(s.ID), value, nil
}

// DecodeState parses one record of the CE state topic; a value that is not a valid State, or a
// key that is not its ID, is refused with a *DecodeError.
func DecodeState(key, value []byte) (State, error) {
	var s State
	if err := decodeStrict(value, &s); err != nil {
		return State{}, err
	}
	if err := s.check(); err != nil {
		return State{}, err
	}
	if string(key) != s.ID {
		return State{}, &DecodeError{Reason: ReasonKey, Detail: fmt.Sprintf("key %q is not the id %q", clip(key), s.ID)}
	}
	return s, nil
}

func (s *State) check() error {
	if err := ident.Check(s.ID); err != nil {
		return &DecodeError{Reason: ReasonID, Detail: err.Error()}
	}
	if s.Replica == "" {
		return &DecodeError{Reason: ReasonReplica, Detail: "no replica named"}
	}
	if len(s.CE) == 0 || s.CE[0] != '{' || !json.Valid(s.CE) {
		return &DecodeError{Reason: ReasonCE, Detail: "a state needs the CE as a JSON object"}
	}
	return nil
}

// StateWriter appends states to the CE state topic, each to its CE's partition, and waits
// until all in-sync replicas acknowledged them. It is safe for concurrent use.
type StateWriter struct {
	topic      string
	partitions int
	cl         *kafka.Client
	tr         *kafka.Transport
	keys       *clusterkey.Keyring
	stop       context.CancelFunc
}

// NewStateWriter returns a StateWriter for topic, which has partitions partitions (the CE
// topic's), signing each state with keys' signing key. It does not connect yet.
func NewStateWriter(ctx context.Context, conn stream.ConnConfig, topic string, partitions int, keys *clusterkey.Keyring) (*StateWriter, error) {
	switch {
	case topic == "":
		return nil, errors.New("ceshare: state writer: no CE state topic")
	case keys == nil:
		return nil, errors.New("ceshare: state writer: no cluster key (replication.key_file)")
	case partitions < 1:
		return nil, fmt.Errorf("ceshare: state writer: %d partitions", partitions)
	}
	ctx, stop := context.WithCancel(ctx)
	tr, err := conn.Transport(ctx)
	if err != nil {
		stop()
		return nil, err
	}
	return &StateWriter{topic: topic, partitions: partitions, tr: tr, stop: stop, keys: keys,
		cl: &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: tr}}, nil
}

// Write appends states, in order within each CE's partition, with acks=all. An error means
// some may have been written; writing them again is harmless (a reader keeps the newest).
func (w *StateWriter) Write(ctx context.Context, states []State) error {
	recs := make([]Encoded, len(states))
	for i, s := range states {
		key, value, err := EncodeState(s)
		if err != nil {
			return fmt.Errorf("ceshare: state of %q: %w", s.ID, err)
		}
		recs[i] = Encoded{Key: key, Value: value}
	}
	return w.WriteEncoded(ctx, recs)
}

// Encoded is a state as EncodeState returned it: the record's key and value. An empty value
// is a tombstone: the CE of the key was deleted.
type Encoded struct{ Key, Value []byte }

// WriteEncoded is Write for states already encoded by EncodeState (a replica's outbox holds
// them so), which it does not decode again, and for tombstones. Each partition's records go in
// produce requests of at most stateBatchBytes (one record alone when it is larger), in order.
func (w *StateWriter) WriteEncoded(ctx context.Context, recs []Encoded) error {
	byPart := map[int][]signed{}
	var order []int
	for _, r := range recs {
		p := Partition(string(r.Key), w.partitions)
		if _, ok := byPart[p]; !ok {
			order = append(order, p)
		}
		s := signed{key: r.Key, value: r.Value}
		if len(r.Value) == 0 {
			s.value, s.auth = nil, w.keys.Sign(TombstoneDomain, r.Key)
		} else {
			s.auth = w.keys.Sign(StateDomain, r.Value)
		}
		byPart[p] = append(byPart[p], s)
	}
	for _, p := range order {
		for _, batch := range batches(byPart[p]) {
			if err := w.write(ctx, p, batch); err != nil {
				return fmt.Errorf("ceshare: writing %d states to partition %d of %q: %w", len(batch), p, w.topic, err)
			}
		}
	}
	return nil
}

// batches cuts recs into runs of at most stateBatchBytes, in order; a record larger than that
// is a run of its own.
func batches(recs []signed) [][]signed {
	var (
		out   [][]signed
		start int
		size  int
	)
	for i, r := range recs {
		n := len(r.key) + len(r.value) + len(r.auth) + recordOverhead
		if i > start && size+n > stateBatchBytes {
			out = append(out, recs[start:i])
			start, size = i, 0
		}
		size += n
	}
	if start < len(recs) {
		out = append(out, recs[start:])
	}
	return out
}

// write produces recs to partition p. A topic that was deleted is created again (its states
// are lost; those written from now on are kept) and written once the client's metadata knows
// it (within its TTL, 6 s).
func (w *StateWriter) write(ctx context.Context, p int, recs []signed) error {
	err := produceSigned(ctx, w.cl, w.topic, p, recs)
	bo := backoff.Backoff{Min: 20 * time.Millisecond, Max: time.Second}
	for topicGone(err) {
		if _, cerr := createStateTopic(ctx, w.cl, w.topic, w.partitions); cerr != nil {
			return errors.Join(err, cerr)
		}
		if bo.Wait(ctx) != nil {
			return err
		}
		err = produceSigned(ctx, w.cl, w.topic, p, recs)
	}
	return err
}

// topicGone says whether err is a topic the broker, or the client's cached metadata, does not
// have.
func topicGone(err error) bool {
	return errors.Is(err, kafka.UnknownTopicOrPartition) || errors.Is(err, protocol.ErrNoTopic)
}

// signed is a record's key, value and authenticator.
type signed struct{ key, value, auth []byte }

// produceSigned writes signed records to partition p of topic in one request, with acks=all (the
// records are made anew each time: a record's key and value are read as it is sent).
func produceSigned(ctx context.Context, cl *kafka.Client, topic string, p int, recs []signed) error {
	now := time.Now()
	records := make([]kafka.Record, len(recs))
	for i, s := range recs {
		records[i] = kafka.Record{Time: now, Key: kafka.NewBytes(s.key), Headers: []kafka.Header{{Key: clusterkey.Header, Value: s.auth}}}
		if s.value != nil { // else a tombstone: a null value
			records[i].Value = kafka.NewBytes(s.value)
		}
	}
	res, err := cl.Produce(ctx, &kafka.ProduceRequest{Topic: topic, Partition: p, RequiredAcks: kafka.RequireAll,
		Records: kafka.NewRecordReader(records...)})
	if err == nil {
		err = res.Error
	}
	return err
}

// Close closes the writer's connections.
func (w *StateWriter) Close() error {
	w.stop()
	w.tr.CloseIdleConnections()
	return nil
}

// StateStats counts what a member read from, and claimed on, the CE state topic.
type StateStats struct {
	Read            int64 // authenticated, well-formed states read
	Tombstones      int64 // authenticated tombstones read
	Unauthenticated int64 // records whose authenticator does not verify: left out
	Malformed       int64 // authenticated records that are not a State or a Claim: left out
	Claims          int64 // authenticated, well-formed claims read
	Fenced          int64 // states read that the claim in force does not own (late writes of a previous owner)
	Claimed         int64 // claims this member wrote
}

// stateFold is a reader's view of one partition of the CE state topic, folded record by
// record in offset order (claim.go says which states are an owner's).
type stateFold struct {
	states map[string]State // each CE's last state written by the partition's owner of the time
	late   map[string]State // a CE's last state after that one, written by a replica no claim owned
	ended  map[string]bool  // CEs a tombstone deleted since their owner's last state: no late write brings them back
	owner  *Claim           // the claim in force; nil before the first
	term   int64            // the greatest term read
	// claimsOnly folds the claims alone: states are neither authenticated nor decoded, and
	// result is empty (a partition acquired with no registration to replay needs only its terms).
	claimsOnly bool
	// self, when set, is this replica's id, whose states are late writes wherever they are
	// (fenceSelf: its copy of the partition is stale).
	self string
}

func newStateFold() *stateFold {
	return &stateFold{states: map[string]State{}, late: map[string]State{}, ended: map[string]bool{}}
}

// result is the state of each CE: its owner's, or the late write when compaction left no other
// and no tombstone of its owner ended the CE.
func (f *stateFold) result() map[string]State {
	out := maps.Clone(f.states)
	for id, s := range f.late {
		if _, ok := out[id]; !ok && !f.ended[id] {
			s.Late = true
			out[id] = s
		}
	}
	return out
}

// readStates folds the records of partition p of the CE state topic from offset from (or the
// partition's first, when later) to its end as of the call into f, and returns the offset it
// read to. Records that do not authenticate or decode are counted and logged.
func (m *Member) readStates(ctx context.Context, cl *kafka.Client, p int, f *stateFold, from int64) (int64, error) {
	topic := m.cfg.StateTopic
	first, end, err := partitionOffsets(ctx, cl, topic, p)
	if err != nil {
		return from, err
	}
	next := max(from, first)
	for next < end {
		fr, err := cl.Fetch(ctx, &kafka.FetchRequest{Topic: topic, Partition: p, Offset: next,
			MinBytes: 1, MaxBytes: int64(m.cfg.FetchMaxBytes), MaxWait: m.cfg.FetchWait})
		if err == nil && fr.Error != nil {
			err = fr.Error
		}
		if err != nil {
			return next, fmt.Errorf("ceshare: reading partition %d of %q at offset %d: %w", p, topic, next, err)
		}
		at := next
		next, err = eachRecord(fr.Records, at, func(r record) { m.foldState(f, p, r) })
		if err != nil {
			return at, fmt.Errorf("ceshare: reading partition %d of %q at offset %d: %w", p, topic, at, err)
		}
		if next == at {
			break // nothing past next up to end: records deleted meanwhile
		}
	}
	return max(next, end), nil
}

// foldState folds record r of partition p into f. A claim may put another claim in force
// (foldClaim); a state the claim in force owns replaces the CE's state, one it does not own is
// kept aside (stateFold.late) and leaves the state before it; a tombstone, or a record of a CE
// that does not authenticate or decode, removes the CE's state (compaction keeps such a record in
// place of the states before it, so a reader does the same); a tombstone also ends the CE until
// its owner writes it again, so that a late write after it does not bring a deleted CE back.
// Records that do not authenticate or decode are counted and logged.
func (m *Member) foldState(f *stateFold, p int, r record) {
	if isClaim(r.key) {
		m.foldClaim(f, p, r)
		return
	}
	if f.claimsOnly {
		return
	}
	id := string(r.key)
	tomb := len(r.value) == 0
	var err error
	if tomb {
		err = m.cfg.Keys.Verify(TombstoneDomain, r.key, r.auth)
	} else {
		err = m.cfg.Keys.Verify(StateDomain, r.value, r.auth)
	}
	if err != nil {
		delete(f.states, id)
		delete(f.late, id)
		m.unauthenticated(p, r, err)
		return
	}
	if tomb {
		delete(f.states, id)
		delete(f.late, id)
		f.ended[id] = true
		m.count(func(s *StateStats) { s.Tombstones++ })
		return
	}
	s, err := DecodeState(r.key, r.value)
	if err != nil {
		delete(f.states, id)
		delete(f.late, id)
		m.malformed(p, r, err)
		return
	}
	if (f.owner == nil || f.owner.owns(s)) && (f.self == "" || s.Replica != f.self) {
		m.count(func(s *StateStats) { s.Read++ })
		f.states[id] = s
		delete(f.late, id)
		delete(f.ended, id)
		return
	}
	m.count(func(s *StateStats) { s.Fenced++ })
	if m.cfg.OnFencedState != nil {
		m.cfg.OnFencedState(p, r.offset)
	}
	m.log.Debug("CE state written after another replica claimed the partition: the CE keeps its state from before it",
		"partition", p, "offset", r.offset, "id", id, "writer", s.Replica, "generation", s.Generation,
		"owner", f.owner.Replica, "owner_generation", f.owner.Generation, "term", f.owner.Term)
	f.late[id] = s
}

// foldClaim folds claim record r of partition p into f: it is in force when it is after the one
// in force (Claim.after). A claim that does not authenticate or decode is counted, logged and
// left out.
func (m *Member) foldClaim(f *stateFold, p int, r record) {
	if err := m.cfg.Keys.Verify(ClaimDomain, r.value, r.auth); err != nil {
		m.unauthenticated(p, r, err)
		return
	}
	c, err := DecodeClaim(p, r.key, r.value)
	if err != nil {
		m.malformed(p, r, err)
		return
	}
	m.count(func(s *StateStats) { s.Claims++ })
	f.term = max(f.term, c.Term)
	if f.owner == nil || c.after(*f.owner) {
		f.owner = &c
	}
}

// unauthenticated counts and logs record r of partition p, whose authenticator err refused.
func (m *Member) unauthenticated(p int, r record, err error) {
	m.count(func(s *StateStats) { s.Unauthenticated++ })
	if m.cfg.OnUnauthenticated != nil {
		m.cfg.OnUnauthenticated(m.cfg.StateTopic, p, r.offset)
	}
	m.log.Warn("unauthenticated CE state ignored: it is not signed under a key of this replica's replication.key_file: a writer without the cluster key (check the CE state topic's ACLs), or a key file that is not the cluster's",
		"state_topic", m.cfg.StateTopic, "partition", p, "offset", r.offset, "tombstone", len(r.value) == 0, "claim", isClaim(r.key), "err", err)
}

// malformed counts and logs authenticated record r of partition p, which does not decode (err).
func (m *Member) malformed(p int, r record, err error) {
	m.count(func(s *StateStats) { s.Malformed++ })
	if m.cfg.OnMalformedState != nil {
		m.cfg.OnMalformedState(p, r.offset)
	}
	reason, detail := ReasonJSON, err.Error()
	if de := (*DecodeError)(nil); errors.As(err, &de) {
		reason, detail = de.Reason, de.Detail
	}
	m.log.Warn("malformed CE state skipped", "state_topic", m.cfg.StateTopic, "partition", p, "offset", r.offset,
		"claim", isClaim(r.key), "reason", reason, "detail", detail)
}

// count updates the member's state counters.
func (m *Member) count(fn func(*StateStats)) {
	m.mu.Lock()
	fn(&m.states)
	m.mu.Unlock()
}

// claimStates reads partition p of the CE state topic to its end, claims the partition for
// generation gen with a term one past the greatest it read, then reads on to the end again
// (the claim, and any state written meanwhile). With restore, it returns each CE's state;
// without, it folds the claims alone and returns none (BenchmarkClaimAtAcquisition: most of a
// restore's time goes to authenticating and decoding the states). before says whether the
// partition held a claim before this one (an earlier owner). With held (the store holds p from
// an earlier acquisition), a claim in force of another replica is returned as a *staleStore
// error before any claim is written: that replica owned p since, and the store's CEs of p lack
// what it learnt of them. With fenceSelf (the store's copy of p, stale, was released), every
// state this replica wrote of p is a late write: one that its outbox publishes after this claim,
// under the generation of the claim, was judged from that copy.
func (m *Member) claimStates(ctx context.Context, cl *kafka.Client, p int, gen int32, restore, held, fenceSelf bool) (states map[string]State, before bool, err error) {
	f := newStateFold()
	f.claimsOnly = !restore
	if fenceSelf {
		f.self = m.cfg.ReplicaID
	}
	next, err := m.readStates(ctx, cl, p, f, 0)
	if err != nil {
		return nil, false, err
	}
	if held && f.owner != nil && f.owner.Replica != m.cfg.ReplicaID {
		return nil, false, &staleStore{claim: *f.owner}
	}
	before = f.term > 0
	c := Claim{Partition: p, Term: f.term + 1, Replica: m.cfg.ReplicaID, Generation: gen}
	key, value, err := EncodeClaim(c)
	if err != nil {
		return nil, false, err
	}
	rec := signed{key: key, value: value, auth: m.cfg.Keys.Sign(ClaimDomain, value)}
	if err := produceSigned(ctx, cl, m.cfg.StateTopic, p, []signed{rec}); err != nil {
		return nil, false, fmt.Errorf("ceshare: claiming partition %d of %q: %w", p, m.cfg.StateTopic, err)
	}
	m.count(func(s *StateStats) { s.Claimed++ })
	if m.cfg.afterClaim != nil {
		m.cfg.afterClaim(p)
	}
	if _, err := m.readStates(ctx, cl, p, f, next); err != nil {
		return nil, false, err
	}
	if f.owner == nil || *f.owner != c {
		m.log.Warn("another replica claimed the CE partition after this one did: the partition is about to move",
			"partition", p, "term", c.Term, "generation", gen, "in_force", f.owner)
	} else {
		m.log.Debug("CE partition claimed", "partition", p, "term", c.Term, "generation", gen)
	}
	return f.result(), before, nil
}

// staleStore is claimStates' answer for a partition the store holds from an earlier acquisition
// and that another replica claimed since (claim, the claim in force).
type staleStore struct{ claim Claim }

func (e *staleStore) Error() string {
	return fmt.Sprintf("ceshare: partition %d was claimed by replica %s (term %d) since this store read it", e.claim.Partition, e.claim.Replica, e.claim.Term)
}

// ensureStateTopic creates the CE state topic, compacted, with partitions partitions, unless it
// exists; an existing topic must have partitions partitions.
func ensureStateTopic(ctx context.Context, cl *kafka.Client, topic string, partitions int) (created bool, err error) {
	return ensure(ctx, cl, topic, partitions, stateTopicConfigs)
}

// createStateTopic creates the CE state topic again once the broker said it has none (created
// is false when it exists: another replica made it, or the client's metadata was stale).
func createStateTopic(ctx context.Context, cl *kafka.Client, topic string, partitions int) (created bool, err error) {
	return create(ctx, cl, topic, partitions, stateTopicConfigs)
}

// stateTopicConfigs are the CE state topic's settings.
var stateTopicConfigs = []kafka.ConfigEntry{{ConfigName: "cleanup.policy", ConfigValue: "compact"}}
