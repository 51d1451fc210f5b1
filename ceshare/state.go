package ceshare

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/stream"
)

// The CE state topic (StateTopic: the CE topic's name + ".state") is a compacted topic with the
// CE topic's partitions, keyed by CE id: the owner of a CE writes the CE's state there each time
// it changes (a status change, a renewal, a verdict) and when it stores a registration with a
// state its previous owner left, and a tombstone when the CE is deleted. A later owner of the
// partition reads the partition from its start to its end when it acquires it with
// registrations still to replay, so that those registrations get the state their previous
// owner left (Request.State). The CE topic keeps the registrations.
//
// Of the records of one CE, a reader keeps the last one, as compaction does: the newest state,
// or none when it is a tombstone or a record that does not authenticate or decode. The reader's
// view is then the same before and after the cleaner ran. An owner paused past its session may
// write a state after its successor read the topic; the successor's next write of that CE
// supersedes it, and a later reader checks it as any other (a state is a claim the new owner
// checks and judges again, never taken on trust).

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
	dec := json.NewDecoder(bytes.NewReader(value))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&s); err != nil {
		return State{}, &DecodeError{Reason: ReasonJSON, Detail: err.Error()}
	}
	if dec.More() {
		return State{}, &DecodeError{Reason: ReasonJSON, Detail: "data after the JSON object"}
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
	err := w.produce(ctx, p, recs)
	bo := backoff.Backoff{Min: 20 * time.Millisecond, Max: time.Second}
	for topicGone(err) {
		if _, cerr := createStateTopic(ctx, w.cl, w.topic, w.partitions); cerr != nil {
			return errors.Join(err, cerr)
		}
		if bo.Wait(ctx) != nil {
			return err
		}
		err = w.produce(ctx, p, recs)
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

// produce writes states to partition p in one request (the records are made anew each time:
// a record's key and value are read as it is sent).
func (w *StateWriter) produce(ctx context.Context, p int, states []signed) error {
	now := time.Now()
	records := make([]kafka.Record, len(states))
	for i, s := range states {
		records[i] = kafka.Record{Time: now, Key: kafka.NewBytes(s.key), Headers: []kafka.Header{{Key: clusterkey.Header, Value: s.auth}}}
		if s.value != nil { // else a tombstone: a null value
			records[i].Value = kafka.NewBytes(s.value)
		}
	}
	res, err := w.cl.Produce(ctx, &kafka.ProduceRequest{Topic: w.topic, Partition: p, RequiredAcks: kafka.RequireAll,
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

// StateStats counts what a member read from the CE state topic.
type StateStats struct {
	Read            int64 // authenticated, well-formed states read
	Tombstones      int64 // authenticated tombstones read
	Unauthenticated int64 // records whose authenticator does not verify: left out
	Malformed       int64 // authenticated records that are not a State: left out
}

// readStates reads partition p of the CE state topic from its start to its end as of the call
// and returns the state of each CE whose last record is a state. Records that do not
// authenticate or decode are counted and logged.
func (m *Member) readStates(ctx context.Context, cl *kafka.Client, p int) (map[string]State, error) {
	topic := m.cfg.StateTopic
	next, end, err := partitionOffsets(ctx, cl, topic, p)
	if err != nil {
		return nil, err
	}
	states := map[string]State{}
	for next < end {
		fr, err := cl.Fetch(ctx, &kafka.FetchRequest{Topic: topic, Partition: p, Offset: next,
			MinBytes: 1, MaxBytes: int64(m.cfg.FetchMaxBytes), MaxWait: m.cfg.FetchWait})
		if err == nil && fr.Error != nil {
			err = fr.Error
		}
		if err != nil {
			return nil, fmt.Errorf("ceshare: reading partition %d of %q at offset %d: %w", p, topic, next, err)
		}
		from := next
		next, err = eachRecord(fr.Records, from, func(r record) { m.foldState(states, p, r) })
		if err != nil {
			return nil, fmt.Errorf("ceshare: reading partition %d of %q at offset %d: %w", p, topic, from, err)
		}
		if next == from {
			break // nothing past next up to end: records deleted meanwhile
		}
	}
	return states, nil
}

// foldState folds record r of partition p into states: a state replaces the CE's state; a
// tombstone, or a record that does not authenticate or decode, removes it (compaction keeps
// such a record in place of the states before it, so a reader does the same). Records that do
// not authenticate or decode are counted and logged.
func (m *Member) foldState(states map[string]State, p int, r record) {
	delete(states, string(r.key))
	tomb := len(r.value) == 0
	var err error
	if tomb {
		err = m.cfg.Keys.Verify(TombstoneDomain, r.key, r.auth)
	} else {
		err = m.cfg.Keys.Verify(StateDomain, r.value, r.auth)
	}
	if err != nil {
		m.mu.Lock()
		m.states.Unauthenticated++
		m.mu.Unlock()
		if m.cfg.OnUnauthenticated != nil {
			m.cfg.OnUnauthenticated(m.cfg.StateTopic, p, r.offset)
		}
		m.log.Warn("unauthenticated CE state ignored: a writer without the cluster key (replication.key_file) wrote to the CE state topic; check its ACLs",
			"state_topic", m.cfg.StateTopic, "partition", p, "offset", r.offset, "tombstone", tomb, "err", err)
		return
	}
	if tomb {
		m.mu.Lock()
		m.states.Tombstones++
		m.mu.Unlock()
		return
	}
	s, err := DecodeState(r.key, r.value)
	var de *DecodeError
	if errors.As(err, &de) {
		m.mu.Lock()
		m.states.Malformed++
		m.mu.Unlock()
		if m.cfg.OnMalformedState != nil {
			m.cfg.OnMalformedState(p, r.offset)
		}
		m.log.Warn("malformed CE state skipped", "state_topic", m.cfg.StateTopic, "partition", p, "offset", r.offset,
			"reason", de.Reason, "detail", de.Detail)
		return
	}
	m.mu.Lock()
	m.states.Read++
	m.mu.Unlock()
	states[s.ID] = s
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
