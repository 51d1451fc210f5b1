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
// it changes (a status change, a renewal, a verdict), and a later owner of the partition reads
// the partition from its start to its end when it acquires it afresh (from offset 0 of the CE
// topic), so that the registrations it replays get the state their previous owner left
// (Request.State). Compaction keeps the newest record of each CE; the CE topic keeps the
// registrations.
//
// Of the records of one CE, a reader keeps the one written in the latest generation of the CE
// group, the later one of a generation: an owner paused past its session writes under the
// generation that gave it the partition, and the new owner's records, written under a later
// one, win over its late writes while the topic holds both.

// StateTopic is the CE state topic of CE topic ceTopic (replication.ce_topic): its name with
// ".state" appended. Deriving it keeps the replicas of a cluster on one state topic.
func StateTopic(ceTopic string) string { return ceTopic + ".state" }

// StateDomain separates the CE state topic's authenticators from those of the CE topic and the
// posterior log (clusterkey): a state's authenticator never verifies as a request's.
const StateDomain = "cfguard ce state v1"

// State is one record of the CE state topic: its key is the CE id, its value the JSON of State.
type State struct {
	// ID is the CE's id (ident.Check); the record's key.
	ID string `json:"id"`
	// Replica is the id of the replica that owned the CE and wrote the state.
	Replica string `json:"replica"`
	// Generation is the CE group generation in which that replica owned the CE's partition.
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

// Encoded is a state as EncodeState returned it: the record's key and value.
type Encoded struct{ Key, Value []byte }

// WriteEncoded is Write for states already encoded by EncodeState (a replica's outbox holds
// them so), which it does not decode again.
func (w *StateWriter) WriteEncoded(ctx context.Context, recs []Encoded) error {
	byPart := map[int][]signed{}
	var order []int
	for _, r := range recs {
		p := Partition(string(r.Key), w.partitions)
		if _, ok := byPart[p]; !ok {
			order = append(order, p)
		}
		byPart[p] = append(byPart[p], signed{r.Key, r.Value, w.keys.Sign(StateDomain, r.Value)})
	}
	for _, p := range order {
		err := w.produce(ctx, p, byPart[p])
		// The topic was deleted: create it again (its states are lost; those written from now on
		// are kept) and write once the client's metadata knows it (within its TTL, 6 s).
		bo := backoff.Backoff{Min: 20 * time.Millisecond, Max: time.Second}
		for topicGone(err) {
			if _, cerr := createStateTopic(ctx, w.cl, w.topic, w.partitions); cerr != nil {
				err = errors.Join(err, cerr)
				break
			}
			if bo.Wait(ctx) != nil {
				break
			}
			err = w.produce(ctx, p, byPart[p])
		}
		if err != nil {
			return fmt.Errorf("ceshare: writing %d states to partition %d of %q: %w", len(byPart[p]), p, w.topic, err)
		}
	}
	return nil
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
		records[i] = kafka.Record{Time: now, Key: kafka.NewBytes(s.key), Value: kafka.NewBytes(s.value),
			Headers: []kafka.Header{{Key: clusterkey.Header, Value: s.auth}}}
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
	Unauthenticated int64 // records whose authenticator does not verify: left out
	Malformed       int64 // authenticated records that are not a State: left out
}

// readStates reads partition p of the CE state topic from its start to its end as of the call
// and returns the state of each CE it holds (the newest generation's, the later of one
// generation). Records that do not authenticate or decode are left out, counted and logged.
func (m *Member) readStates(ctx context.Context, cl *kafka.Client, p int) (map[string]State, error) {
	topic := m.cfg.StateTopic
	res, err := cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
		topic: {kafka.FirstOffsetOf(p), kafka.LastOffsetOf(p)}}})
	if err != nil {
		return nil, fmt.Errorf("ceshare: listing offsets of partition %d of %q: %w", p, topic, err)
	}
	var next, end int64
	found := false
	for _, po := range res.Topics[topic] {
		if po.Partition != p {
			continue
		}
		if po.Error != nil {
			return nil, fmt.Errorf("ceshare: listing offsets of partition %d of %q: %w", p, topic, po.Error)
		}
		next, end, found = po.FirstOffset, po.LastOffset, true
	}
	if !found {
		return nil, fmt.Errorf("ceshare: listing offsets of partition %d of %q: no answer for it", p, topic)
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

// foldState keeps record r of partition p in states when it authenticates, decodes, and is
// of a generation no older than the state it replaces.
func (m *Member) foldState(states map[string]State, p int, r record) {
	if len(r.value) == 0 {
		return // a tombstone
	}
	if err := m.cfg.Keys.Verify(StateDomain, r.value, r.auth); err != nil {
		m.mu.Lock()
		m.states.Unauthenticated++
		m.mu.Unlock()
		if m.cfg.OnUnauthenticated != nil {
			m.cfg.OnUnauthenticated(m.cfg.StateTopic, p, r.offset)
		}
		m.log.Warn("unauthenticated CE state ignored: a writer without the cluster key (replication.key_file) wrote to the CE state topic; check its ACLs",
			"state_topic", m.cfg.StateTopic, "partition", p, "offset", r.offset, "err", err)
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
	if have, ok := states[s.ID]; !ok || s.Generation >= have.Generation {
		states[s.ID] = s
	}
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
