package ceshare

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/stream"
)

const testStateTopic = "cfguard.ce.state"

// writeRaw writes records to the CE state topic as a writer outside cfguard would, each to its
// key's partition.
func writeRaw(t *testing.T, conn stream.ConnConfig, msgs ...kafka.Message) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	w := &kafka.Writer{Addr: kafka.TCP(conn.Brokers...), Topic: testStateTopic, Transport: kafkatest.Transport(t), RequiredAcks: kafka.RequireAll,
		Balancer:     kafka.BalancerFunc(func(m kafka.Message, _ ...int) int { return Partition(string(m.Key), testPartitions) }),
		BatchTimeout: time.Millisecond}
	defer w.Close()
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
}

// A member that acquires a partition afresh hands each registration the state its previous
// owners left on the CE state topic: of one CE's records, the last one, as compaction keeps it.
// A tombstone, or a record that does not authenticate or decode, leaves the CE without a state;
// such records are counted. Once the partition caught up, registrations come without states.
func TestMemberHandsRegistrationsTheirStates(t *testing.T) {
	_, conn := startBroker(t)
	cfg := memberConfig(conn, "r1")
	cfg.StateTopic = testStateTopic
	first := startReplica(t, cfg)
	pr := testProducer(t, conn)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const n = 11
	for i := range n {
		r := Request{Kind: KindRegister, ID: fmt.Sprintf("a-%d", i), Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)}
		if _, _, err := pr.Send(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.Cond(t, 60*time.Second, "the first member applying the registrations", func() bool { return first.l.registered() == n })

	sw, err := NewStateWriter(ctx, conn, testStateTopic, testPartitions, testKeys())
	if err != nil {
		t.Fatal(err)
	}
	defer sw.Close()
	st := func(id string, gen int32, ce string) State {
		return State{ID: id, Replica: "r1", Generation: gen, CE: json.RawMessage(ce)}
	}
	if err := sw.Write(ctx, []State{
		st("a-0", 5, `{"s":"a-0 g5"}`),
		// A state of an older generation after a newer one, of the owner the claim in force
		// names, is the last record: compaction would keep it, and so does the reader.
		st("a-1", 5, `{"s":"a-1 g5"}`), st("a-1", 3, `{"s":"a-1 g3, written last"}`),
		st("a-2", 5, `{"s":"a-2 g5"}`), st("a-2", 7, `{"s":"a-2 g7"}`),
		st("a-3", 5, `{"s":"a-3 first"}`), st("a-3", 5, `{"s":"a-3 second"}`),
		st("a-8", 5, `{"s":"a-8, then deleted"}`),
		st("a-9", 5, `{"s":"a-9, then forged over"}`),
		st("a-10", 5, `{"s":"a-10, deleted"}`),
		st("b-0", 5, `{"s":"b-0, registered after the catch-up"}`),
	}); err != nil {
		t.Fatal(err)
	}
	other, err := clusterkey.Parse([]byte("t1:"+strings.Repeat("a5", 32)), "another cluster's")
	if err != nil {
		t.Fatal(err)
	}
	encode := func(s State) []byte {
		t.Helper()
		_, v, err := EncodeState(s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	forged, forged5, forged9 := encode(st("a-4", 9, `{"s":"forged"}`)), encode(st("a-5", 9, `{"s":"forged"}`)), encode(st("a-9", 9, `{"s":"forged"}`))
	malformed := []byte(`{"id":"a-6","replica":"r1","generation":9,"ce":"not an object"}`)
	writeRaw(t, conn,
		kafka.Message{Key: []byte("a-4"), Value: forged, Headers: []kafka.Header{{Key: clusterkey.Header, Value: other.Sign(StateDomain, forged)}}},
		kafka.Message{Key: []byte("a-5"), Value: forged5, Headers: []kafka.Header{{Key: clusterkey.Header, Value: Sign(testKeys(), forged5)}}},
		kafka.Message{Key: []byte("a-6"), Value: malformed, Headers: []kafka.Header{{Key: clusterkey.Header, Value: testKeys().Sign(StateDomain, malformed)}}},
		kafka.Message{Key: []byte("a-7")}, // a tombstone without an authenticator
		kafka.Message{Key: []byte("a-9"), Value: forged9, Headers: []kafka.Header{{Key: clusterkey.Header, Value: other.Sign(StateDomain, forged9)}}},
	)
	// a-8: a tombstone of the cluster; a-10: deleted and its state written again.
	if err := sw.WriteEncoded(ctx, []Encoded{{Key: []byte("a-8")}, {Key: []byte("a-10")}}); err != nil {
		t.Fatal(err)
	}
	if err := sw.Write(ctx, []State{st("a-5", 5, `{"s":"a-5 g5"}`), st("a-10", 5, `{"s":"a-10 again"}`)}); err != nil {
		t.Fatal(err)
	}

	// The first member stops; a second takes every partition from offset 0.
	first.stop(t)
	second := startReplica(t, cfg)
	waitfor.Cond(t, 60*time.Second, "the second member owning every partition, caught up", func() bool { return ownership(second) != nil })
	if _, _, err := pr.Send(ctx, Request{Kind: KindRegister, ID: "b-0", Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)}); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 30*time.Second, "the second member applying b-0", func() bool { return second.l.registered() == n+1 })
	want := map[string]string{"a-0": `{"s":"a-0 g5"}`, "a-1": `{"s":"a-1 g3, written last"}`, "a-2": `{"s":"a-2 g7"}`,
		"a-3": `{"s":"a-3 second"}`, "a-5": `{"s":"a-5 g5"}`, "a-10": `{"s":"a-10 again"}`}
	second.l.mu.Lock()
	defer second.l.mu.Unlock()
	for _, id := range append(ids("a-", n), "b-0") {
		got := second.l.states[id]
		switch w, ok := want[id]; {
		case !ok && got != nil:
			t.Errorf("%s came with state %s, want none", id, got.CE)
		case ok && got == nil:
			t.Errorf("%s came without a state, want %s", id, w)
		case ok && string(got.CE) != w:
			t.Errorf("%s came with state %s (generation %d), want %s", id, got.CE, got.Generation, w)
		}
	}
	if s := second.m.Stats().States; s.Read != 13 || s.Tombstones != 2 || s.Unauthenticated != 4 || s.Malformed != 1 {
		t.Errorf("states read %+v; want 13 read, 2 tombstones, 4 unauthenticated, 1 malformed", s)
	}
	if s := first.m.Stats().States; s.Read != 0 {
		t.Errorf("the first member, which acquired an empty state topic, read %+v", s)
	}
}

// ids is prefix0 .. prefix(n-1).
func ids(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%d", prefix, i)
	}
	return out
}

// stateTopics creates the CE topic and the CE state topic, as a member does, and returns a
// state writer and a client of the broker, closed when the test ends.
func stateTopics(ctx context.Context, t testing.TB, conn stream.ConnConfig) (*StateWriter, *kafka.Client) {
	t.Helper()
	sw, err := NewStateWriter(ctx, conn, testStateTopic, testPartitions, testKeys())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sw.Close() })
	cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: kafkatest.Transport(t)}
	if _, err := ensureTopic(ctx, cl, testTopic, testPartitions); err != nil {
		t.Fatal(err)
	}
	if _, err := ensureStateTopic(ctx, cl, testStateTopic, testPartitions); err != nil {
		t.Fatal(err)
	}
	return sw, cl
}

// A new owner of partitions whose first requests were deleted before it read them (the CE topic
// given a retention) restores the CEs of the states a previous owner left on the CE state topic:
// it hands each state to Apply as a registration rebuilt from it, while the partition's offset
// is still where the gap begins, then stores the gap (uncounted: an earlier owner claimed the
// partitions) and applies the requests after it as they come. A CE whose owner wrote no state,
// or whose state a tombstone ended, is not restored. A store that read past offset 0 before the
// gap (it may have applied deletions the state topic does not show yet) restores nothing and
// counts its gap lost.
func TestStatesRestoreCEsWhoseRequestsWereDeleted(t *testing.T) {
	b, conn := startBrokerWith(t, broker.Config{RetentionCheckInterval: time.Hour})
	cfg := memberConfig(conn, "r1")
	cfg.StateTopic = testStateTopic
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	sw, _ := stateTopics(ctx, t, conn)
	pr := testProducer(t, conn)
	first := startReplica(t, cfg)
	const n = 12
	for _, id := range ids("r-", n) {
		if _, _, err := pr.Send(ctx, Request{Kind: KindRegister, ID: id, Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)}); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.Cond(t, 60*time.Second, "the first member applying the registrations", func() bool { return first.l.registered() == n })
	// The first member's states: r-0..r-8, r-8's ended by a tombstone; none for r-9..r-11.
	gen := first.m.LastGeneration()
	var states []State
	for _, id := range ids("r-", 9) {
		states = append(states, State{ID: id, Replica: "r1", Generation: gen, CE: json.RawMessage(`{"s":"` + id + `"}`)})
	}
	if err := sw.Write(ctx, states); err != nil {
		t.Fatal(err)
	}
	if err := sw.WriteEncoded(ctx, []Encoded{{Key: []byte("r-8")}}); err != nil {
		t.Fatal(err)
	}
	first.stop(t)

	// Retention deletes every request; then r-1 is deleted, r-2 registered again, n-0 registered.
	kafkatest.SetTopicConfig(t, conn.Brokers, testTopic, "retention.ms", "1")
	time.Sleep(10 * time.Millisecond) // every request older than 1 ms
	b.ApplyRetention()
	kafkatest.SetTopicConfig(t, conn.Brokers, testTopic, "retention.ms", "-1")
	starts, ends := b.LogStartOffsets(testTopic), b.HighWatermarks(testTopic)
	if !slices.Equal(starts, ends) {
		t.Fatalf("after retention, %s starts at %v and ends at %v; want every request deleted", testTopic, starts, ends)
	}
	for _, r := range []Request{
		{Kind: KindDelete, ID: "r-1", Replica: "r1", At: time.Now()},
		{Kind: KindRegister, ID: "r-2", Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)},
		{Kind: KindRegister, ID: "n-0", Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)},
	} {
		if _, _, err := pr.Send(ctx, r); err != nil {
			t.Fatal(err)
		}
	}

	cfg.ReplicaID = "r2"
	second := startReplica(t, cfg)
	waitfor.Cond(t, 60*time.Second, "the second member owning every partition, caught up", func() bool {
		return ownership(second) != nil && caughtUp(b, []*replica{second}, ownership(second))
	})
	l := second.l
	l.mu.Lock()
	for i, id := range ids("r-", n) {
		s := l.restored[id]
		switch {
		case i < 8 && (s == nil || string(s.CE) != `{"s":"`+id+`"}`):
			t.Errorf("%s restored from %v, want its state", id, s)
		case i >= 8 && s != nil:
			t.Errorf("%s restored from state %s, want it left out (a tombstone, or no state)", id, s.CE)
		}
	}
	if len(l.restored) != 8 {
		t.Errorf("%d CEs restored, want r-0..r-7", len(l.restored))
	}
	for p, at := range l.restoreAt {
		if at != 0 {
			t.Errorf("partition %d: restored with its offset at %d, want 0 (before the gap is stored)", p, at)
		}
	}
	for _, k := range []string{"delete/r-1", "register/r-2", "register/n-0"} {
		id := k[strings.Index(k, "/")+1:]
		if l.reqs[Partition(id, testPartitions)][k] != 1 {
			t.Errorf("%s after the gap applied %d times, want once", k, l.reqs[Partition(id, testPartitions)][k])
		}
	}
	if s := l.states["r-2"]; s == nil || string(s.CE) != `{"s":"r-2"}` {
		t.Errorf("r-2, registered again after the gap, came with state %v, want its own", s)
	}
	if len(l.lost) != 0 {
		t.Errorf("requests counted lost %v, want none: an earlier owner claimed every partition", l.lost)
	}
	if len(l.bad) > 0 {
		t.Errorf("rules broken: %v", l.bad)
	}
	if s := second.m.Stats(); s.Restored != 8 || s.Gaps != 0 {
		t.Errorf("Stats(): %d restored, %d gaps counted; want 8 and 0", s.Restored, s.Gaps)
	}
	l.mu.Unlock()
	second.stop(t)

	// A store that read each partition's first request before the retention (a replica that
	// held them, restarted) may have applied deletions the state topic does not show yet: its
	// gap is counted lost, and nothing is restored.
	held := newLedger()
	gaps := int64(0)
	for p, start := range starts {
		if start > 0 {
			held.next[p] = 1
			gaps += start - 1
		}
	}
	cfg.ReplicaID = "r3"
	third := startReplicaOn(t, cfg, held)
	waitfor.Cond(t, 60*time.Second, "the third member owning every partition, caught up", func() bool {
		return ownership(third) != nil && caughtUp(b, []*replica{third}, ownership(third))
	})
	if s := third.m.Stats(); s.Restored != 0 || s.Gaps != gaps {
		t.Errorf("a store past offset 0: Stats() %d restored, %d gaps counted; want 0 and %d", s.Restored, s.Gaps, gaps)
	}
}

// A rebuild cut short (a crash stored offset 3 of the partition's 6 registrations) gives the
// registrations left their states too; a partition acquired at its end is claimed, and has no
// registration to give a state.
func TestStatesForARebuildCutShort(t *testing.T) {
	_, conn := startBroker(t)
	cfg := memberConfig(conn, "r1")
	cfg.StateTopic = testStateTopic
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pr := testProducer(t, conn)
	sw, _ := stateTopics(ctx, t, conn)
	var zero []string // ids of partition 0, registered at offsets 0..5
	for i := 0; len(zero) < 6; i++ {
		id := fmt.Sprintf("z-%d", i)
		if Partition(id, testPartitions) != 0 {
			continue
		}
		zero = append(zero, id)
		if _, _, err := pr.Send(ctx, Request{Kind: KindRegister, ID: id, Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)}); err != nil {
			t.Fatal(err)
		}
		if err := sw.Write(ctx, []State{{ID: id, Replica: "r0", Generation: 1, CE: json.RawMessage(`{"s":"` + id + `"}`)}}); err != nil {
			t.Fatal(err)
		}
	}
	l := newLedger()
	l.next[0] = 3
	r := startReplicaOn(t, cfg, l)
	waitfor.Cond(t, 60*time.Second, "the member owning every partition, caught up", func() bool { return ownership(r) != nil })
	l.mu.Lock()
	for i, id := range zero {
		_, applied := l.lastCE[id]
		s := l.states[id]
		switch {
		case i < 3 && applied:
			t.Errorf("%s, before the stored offset, applied again", id)
		case i >= 3 && (s == nil || string(s.CE) != `{"s":"`+id+`"}`):
			t.Errorf("%s, replayed after a rebuild cut short, came with state %v", id, s)
		}
	}
	l.mu.Unlock()
	r.stop(t)

	l = newLedger()
	l.next[0] = 6
	r = startReplicaOn(t, cfg, l)
	waitfor.Cond(t, 60*time.Second, "the member owning every partition again, caught up", func() bool { return ownership(r) != nil })
	// Partition 0, acquired at its end, reads the claims alone: none of its states.
	if s := r.m.Stats().States; s.Claimed != testPartitions || s.Read != 0 {
		t.Errorf("a member acquiring every partition afresh claimed %d and read %d states (%+v), want %d claimed, none read",
			s.Claimed, s.Read, s, testPartitions)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.lastCE) != 0 || len(l.states) != 0 {
		t.Errorf("a member acquiring partition 0 at its end applied %d registrations, %d with states; want none", len(l.lastCE), len(l.states))
	}
}

// A writer cuts the states of one partition into produce requests the broker takes (its
// max.message.bytes, 1 MiB by default): 3 MiB of states in one call are written, in order, and
// read back.
func TestStateWriterSplitsLargeWrites(t *testing.T) {
	_, conn := startBroker(t)
	cfg := memberConfig(conn, "r1")
	cfg.StateTopic = testStateTopic
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	sw, cl := stateTopics(ctx, t, conn)
	// 48 states of 64 KiB, two per CE, all of one partition.
	pad := strings.Repeat("x", 64<<10)
	var (
		states []State
		last   = map[string]string{}
	)
	for i := 0; len(states) < 48; i++ {
		id := fmt.Sprintf("big-%d", i)
		if Partition(id, testPartitions) != 0 {
			continue
		}
		for k := range 2 {
			ce := fmt.Sprintf(`{"k":%d,"pad":%q}`, k, pad)
			states, last[id] = append(states, State{ID: id, Replica: "r1", Generation: 1, CE: json.RawMessage(ce)}), ce
		}
	}
	if err := sw.Write(ctx, states); err != nil {
		t.Fatalf("writing %d states of 64 KiB to one partition: %v", len(states), err)
	}
	m, err := NewMember(ctx, cfg, newLedger(), testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	f := newStateFold()
	if _, err := m.readStates(ctx, cl, 0, f, 0); err != nil {
		t.Fatal(err)
	}
	got := f.result()
	if len(got) != len(last) {
		t.Fatalf("read %d states, want %d", len(got), len(last))
	}
	for id, ce := range last {
		if string(got[id].CE) != ce {
			t.Errorf("%s: read a state of %d bytes that is not the last one written", id, len(got[id].CE))
		}
	}
	if _, _, err := EncodeState(State{ID: "huge", Replica: "r1", CE: json.RawMessage(fmt.Sprintf(`{"pad":%q}`, strings.Repeat("x", MaxStateBytes)))}); !errors.Is(err, ErrStateTooLarge) {
		t.Errorf("a state over MaxStateBytes encoded: %v", err)
	}
}

// A state's encoding is checked both ways, as a request's is.
func TestStateEncoding(t *testing.T) {
	good := State{ID: "ce-1", Replica: "r1", Generation: 3, CE: json.RawMessage(`{"status":"certified"}`)}
	k, v, err := EncodeState(good)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := DecodeState(k, v); err != nil || got.ID != good.ID || got.Generation != 3 || string(got.CE) != string(good.CE) {
		t.Fatalf("round trip = %+v, %v", got, err)
	}
	for _, tc := range []struct {
		name, key, value, reason string
	}{
		{"not JSON", "ce-1", `{`, ReasonJSON},
		{"an unknown field", "ce-1", `{"id":"ce-1","replica":"r1","generation":1,"ce":{},"x":1}`, ReasonJSON},
		{"two objects", "ce-1", `{"id":"ce-1","replica":"r1","generation":1,"ce":{}} {}`, ReasonJSON},
		{"no replica", "ce-1", `{"id":"ce-1","generation":1,"ce":{}}`, ReasonReplica},
		{"a bad id", "", `{"id":"","replica":"r1","generation":1,"ce":{}}`, ReasonID},
		{"another key", "ce-2", `{"id":"ce-1","replica":"r1","generation":1,"ce":{}}`, ReasonKey},
		{"no CE", "ce-1", `{"id":"ce-1","replica":"r1","generation":1}`, ReasonCE},
	} {
		_, err := DecodeState([]byte(tc.key), []byte(tc.value))
		if de, ok := err.(*DecodeError); !ok || de.Reason != tc.reason {
			t.Errorf("%s: %v; want reason %s", tc.name, err, tc.reason)
		}
	}
}

// deleteTopic deletes topic from the broker, as an operator's mistake would.
func deleteTopic(t *testing.T, conn stream.ConnConfig, topic string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: kafkatest.Transport(t)}
	res, err := cl.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{topic}})
	if err == nil {
		err = res.Errors[topic]
	}
	if err != nil {
		t.Fatalf("deleting %s: %v", topic, err)
	}
}

// A CE state topic deleted under the replicas is created again, compacted with the CE topic's
// partitions, by the next write of a state or the next acquisition, and neither blocks: the
// states it held are lost, the ones written after it are kept.
func TestStateTopicDeletedIsCreatedAgain(t *testing.T) {
	_, conn := startBroker(t)
	cfg := memberConfig(conn, "r1")
	cfg.StateTopic = testStateTopic
	first := startReplica(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pr := testProducer(t, conn)
	for _, id := range []string{"a-0", "a-1"} {
		if _, _, err := pr.Send(ctx, Request{Kind: KindRegister, ID: id, Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)}); err != nil {
			t.Fatal(err)
		}
	}
	sw, err := NewStateWriter(ctx, conn, testStateTopic, testPartitions, testKeys())
	if err != nil {
		t.Fatal(err)
	}
	defer sw.Close()
	if err := sw.Write(ctx, []State{{ID: "a-0", Replica: "r1", Generation: 1, CE: json.RawMessage(`{"s":"before"}`)}}); err != nil {
		t.Fatal(err)
	}
	deleteTopic(t, conn, testStateTopic)
	if err := sw.Write(ctx, []State{{ID: "a-1", Replica: "r1", Generation: 1, CE: json.RawMessage(`{"s":"after"}`)}}); err != nil {
		t.Fatalf("writing a state once the topic is gone: %v", err)
	}
	cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: kafkatest.Transport(t)}
	if n, err := topicPartitions(ctx, cl, testStateTopic); err != nil || n != testPartitions {
		t.Fatalf("the state topic created again has %d partitions (%v), want %d", n, err, testPartitions)
	}
	if p := cleanupPolicy(t, cl, testStateTopic); p != "compact" {
		t.Fatalf("the state topic created again has cleanup.policy %q, want compact", p)
	}
	first.stop(t)
	second := startReplica(t, cfg)
	waitfor.Cond(t, 60*time.Second, "the second member owning every partition, caught up", func() bool { return ownership(second) != nil })
	second.l.mu.Lock()
	if s := second.l.states["a-0"]; s != nil {
		t.Errorf("a-0 came with %s, written before the topic was deleted", s.CE)
	}
	if s := second.l.states["a-1"]; s == nil || string(s.CE) != `{"s":"after"}` {
		t.Errorf("a-1 came with %+v, want the state written after the topic was created again", s)
	}
	second.l.mu.Unlock()

	// Gone when a member acquires partitions: it creates it again and rebuilds them without states.
	second.stop(t)
	deleteTopic(t, conn, testStateTopic)
	third := startReplica(t, cfg)
	waitfor.Cond(t, 60*time.Second, "the third member owning every partition, caught up", func() bool { return ownership(third) != nil })
	third.l.mu.Lock()
	defer third.l.mu.Unlock()
	if len(third.l.lastCE) != 2 || third.l.states["a-1"] != nil {
		t.Errorf("the third member applied %d registrations, a-1 with state %v; want both, without states", len(third.l.lastCE), third.l.states["a-1"])
	}
	if n, err := topicPartitions(ctx, cl, testStateTopic); err != nil || n != testPartitions {
		t.Fatalf("the state topic created again by a member has %d partitions (%v), want %d", n, err, testPartitions)
	}
	if s := third.m.Stats().States; s.Claimed != testPartitions {
		t.Errorf("the third member claimed %d partitions of the state topic it created again (%+v), want %d", s.Claimed, s, testPartitions)
	}
}

// cleanupPolicy is topic's cleanup.policy as the broker describes it.
func cleanupPolicy(t *testing.T, cl *kafka.Client, topic string) string {
	t.Helper()
	res, err := cl.DescribeConfigs(context.Background(), &kafka.DescribeConfigsRequest{Resources: []kafka.DescribeConfigRequestResource{{
		ResourceType: kafka.ResourceTypeTopic, ResourceName: topic, ConfigNames: []string{"cleanup.policy"}}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res.Resources {
		for _, e := range r.ConfigEntries {
			if e.ConfigName == "cleanup.policy" {
				return e.ConfigValue
			}
		}
	}
	return ""
}

// A replica that acquires a partition afresh claims it; a state its previous owner writes after
// that claim (a paused process, or its outbox published after a restart) does not replace the
// state the next owner reads. r1 owns every partition, then r2 does; r1's late writes land
// after r2's claims; r3 then reads r2's state of a-0 (r2 wrote one after r1's late write would
// have superseded it), r1's own state of a-1 from before the claim (r2 wrote none), and r1's late
// write of a-2 (nothing else is left of it).
func TestLateStatesOfAPreviousOwnerAreFenced(t *testing.T) {
	_, conn := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pr := testProducer(t, conn)
	sw, _ := stateTopics(ctx, t, conn)
	for _, id := range []string{"a-0", "a-1", "a-2"} {
		if _, _, err := pr.Send(ctx, Request{Kind: KindRegister, ID: id, Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)}); err != nil {
			t.Fatal(err)
		}
	}
	write := func(r *replica, id, label string) {
		t.Helper()
		if err := sw.Write(ctx, []State{{ID: id, Replica: r.id, Generation: r.m.LastGeneration(), CE: json.RawMessage(`{"s":"` + label + `"}`)}}); err != nil {
			t.Fatal(err)
		}
	}
	r1 := startReplica(t, statefulConfig(conn, "r1"))
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition, caught up", func() bool { return ownership(r1) != nil })
	write(r1, "a-0", "r1's")
	write(r1, "a-1", "r1's")
	r1.stop(t)

	r2 := startReplica(t, statefulConfig(conn, "r2"))
	waitfor.Cond(t, 60*time.Second, "r2 owning every partition, caught up", func() bool { return ownership(r2) != nil })
	write(r1, "a-0", "r1 late")
	write(r1, "a-1", "r1 late")
	write(r1, "a-2", "r1 late")
	write(r2, "a-0", "r2's")
	r2.stop(t)

	r3 := startReplica(t, statefulConfig(conn, "r3"))
	waitfor.Cond(t, 60*time.Second, "r3 owning every partition, caught up", func() bool { return ownership(r3) != nil })
	want := map[string]string{"a-0": `{"s":"r2's"}`, "a-1": `{"s":"r1's"}`, "a-2": `{"s":"r1 late"}`}
	r3.l.mu.Lock()
	for id, w := range want {
		switch s := r3.l.states[id]; {
		case s == nil:
			t.Errorf("r3 gave %s no state, want %s", id, w)
		case string(s.CE) != w:
			t.Errorf("r3 gave %s the state %s of %s (generation %d), want %s", id, s.CE, s.Replica, s.Generation, w)
		}
	}
	r3.l.mu.Unlock()
	if s := r3.m.Stats().States; s.Fenced != 3 || s.Claims != 3*testPartitions || s.Claimed != testPartitions {
		t.Errorf("r3's state counters %+v: want 3 fenced, %d claims read, %d written", s, 3*testPartitions, testPartitions)
	}

	// Each partition holds one claim per owner, in order of term.
	for p := range testPartitions {
		var got []Claim
		for _, msg := range kafkatest.ReadPartition(t, conn.Brokers, testStateTopic, p) {
			if isClaim(msg.Key) {
				c, err := DecodeClaim(p, msg.Key, msg.Value)
				if err != nil {
					t.Fatal(err)
				}
				got = append(got, c)
			}
		}
		if len(got) != 3 {
			t.Fatalf("partition %d holds claims %+v, want one of each replica", p, got)
		}
		for i, c := range got {
			if want := fmt.Sprintf("r%d", i+1); c.Term != int64(i+1) || c.Replica != want {
				t.Errorf("partition %d: claim %d is %+v, want term %d by %s", p, i, c, i+1, want)
			}
		}
	}
}

// restore hands Apply the states of p's CEs, not a late write (State.Late: compaction may have
// removed the tombstone before it) nor a state of another partition's id; each state left out
// is logged at WARN with its id.
func TestRestoreLeavesLateWritesOut(t *testing.T) {
	l := newLedger()
	l.owned[0] = true
	var out bytes.Buffer
	m := &Member{cfg: MemberConfig{Partitions: testPartitions, MaxBatch: 2}, hooks: l, log: slog.New(slog.NewTextHandler(&out, nil))}
	var zero []string // ids of partition 0
	for i := 0; len(zero) < 4; i++ {
		if id := fmt.Sprintf("z-%d", i); Partition(id, testPartitions) == 0 {
			zero = append(zero, id)
		}
	}
	other := ""
	for i := 0; other == ""; i++ {
		if id := fmt.Sprintf("o-%d", i); Partition(id, testPartitions) != 0 {
			other = id
		}
	}
	states := map[string]State{other: {ID: other, Replica: "r1", CE: json.RawMessage(`{}`)}}
	for i, id := range zero {
		states[id] = State{ID: id, Replica: "r1", CE: json.RawMessage(`{}`), Late: i == 3}
	}
	n, err := m.restore(context.Background(), 0, 0, states)
	if err != nil || n != 3 {
		t.Fatalf("restore = %d, %v; want 3 handed (the late write and the other partition's left out)", n, err)
	}
	for i, id := range zero {
		if _, ok := l.restored[id]; ok != (i < 3) {
			t.Errorf("%s (late %v) restored %v", id, i == 3, ok)
		}
	}
	if _, ok := l.restored[other]; ok || len(l.bad) > 0 {
		t.Errorf("%s of another partition restored %v; rules broken: %v", other, ok, l.bad)
	}
	for _, want := range []string{`msg="CE state on another partition than its id's: not restored" partition=0 id=` + other + " ",
		`msg="CE state written by a replica that no longer owned the partition, and no owner's state left: not restored" partition=0 id=` + zero[3] + " "} {
		if lines := logLines(out.String(), want); len(lines) != 1 || !strings.Contains(lines[0], " level=WARN ") {
			t.Errorf("logged %q; want one WARN line with %s", out.String(), want)
		}
	}
}

// A member whose broker fails its reads of the state topic for longer than the group's session
// timeout waits for them, the partition not caught up meanwhile, instead of rebuilding it
// without the previous owner's states (and unclaimed): once the reads work, every CE comes with
// its state.
func TestMemberWaitsForTheStateTopic(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the members' cleanups
	conn := stream.ConnConfig{Brokers: kc.ListenAddrs(), DialTimeout: 5 * time.Second}
	cfg := memberConfig(conn, "r1")
	cfg.StateTopic = testStateTopic
	first := startReplica(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pr := testProducer(t, conn)
	if _, _, err := pr.Send(ctx, Request{Kind: KindRegister, ID: "a-0", Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)}); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 60*time.Second, "the first member applying the registration", func() bool { return first.l.registered() == 1 })
	sw, err := NewStateWriter(ctx, conn, testStateTopic, testPartitions, testKeys())
	if err != nil {
		t.Fatal(err)
	}
	defer sw.Close()
	if err := sw.Write(ctx, []State{{ID: "a-0", Replica: "r1", Generation: first.m.Generation(), CE: json.RawMessage(`{"s":"renewed"}`)}}); err != nil {
		t.Fatal(err)
	}
	first.stop(t)

	// The state topic's offsets cannot be listed until two session timeouts after the first
	// refusal: past the time a member would have waited before rebuilding without the states.
	var refused atomic.Int64
	var firstRefusal atomic.Int64 // unix nanoseconds
	var released atomic.Bool
	kc.ControlKey(int16(kmsg.ListOffsets), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		for _, tp := range req.(*kmsg.ListOffsetsRequest).Topics {
			if tp.Topic == testStateTopic && !released.Load() {
				firstRefusal.CompareAndSwap(0, time.Now().UnixNano())
				refused.Add(1)
				return nil, errors.New("connection closed by the test"), true
			}
		}
		return nil, nil, false
	})
	second := startReplica(t, cfg)
	waitfor.Cond(t, 60*time.Second, "two session timeouts of refused reads of the state topic", func() bool {
		at := firstRefusal.Load()
		return at != 0 && time.Since(time.Unix(0, at)) >= 2*testSession
	})
	released.Store(true)
	waitfor.Cond(t, 60*time.Second, "the second member owning every partition, caught up", func() bool { return ownership(second) != nil })
	if refused.Load() == 0 {
		t.Fatal("no read of the state topic was refused: the test shows nothing")
	}
	second.l.mu.Lock()
	defer second.l.mu.Unlock()
	if s := second.l.states["a-0"]; s == nil || string(s.CE) != `{"s":"renewed"}` {
		t.Errorf("a-0 came with state %+v after %d refused reads, want the first owner's", s, refused.Load())
	}
}

// A member that acquires partitions afresh after the CE state topic was deleted under it creates
// the topic again and claims them there: the partitions of a member that left are claimed by
// the one that takes them over.
func TestStateTopicGoneAtAnAcquisitionIsCreatedAgain(t *testing.T) {
	_, conn := startBroker(t)
	r1 := startReplica(t, statefulConfig(conn, "r1"))
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition", func() bool { return ownership(r1) != nil })
	r2 := startReplica(t, statefulConfig(conn, "r2"))
	waitfor.Cond(t, 60*time.Second, "r1 and r2 sharing the partitions", func() bool {
		return ownership(r1, r2) != nil && len(r1.m.Owned()) > 0 && len(r2.m.Owned()) > 0
	})
	moved := r2.m.Owned()
	claimed := r1.m.Stats().States.Claimed
	deleteTopic(t, conn, testStateTopic)
	r2.stop(t)
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition again", func() bool { return ownership(r1) != nil })
	if got := r1.m.Stats().States.Claimed - claimed; got != int64(len(moved)) {
		t.Errorf("r1 claimed %d partitions once r2 left, want the %d it took over", got, len(moved))
	}
	for _, p := range moved {
		if c, ok := claimInForce(t, conn, p); !ok || c.Replica != "r1" {
			t.Errorf("partition %d taken over by r1: the claim in force is %+v (any: %v)", p, c, ok)
		}
	}
}

// releasingLedger is a test ledger whose Release does what the daemon's does
// (ledger.ReleaseShare): the partition's offset goes back to 0 and its CEs, states and
// outcomes leave the store.
type releasingLedger struct{ *ledger }

func (l releasingLedger) Release(ctx context.Context, p int) error {
	if err := l.ledger.Release(ctx, p); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.next[p] = 0
	delete(l.reqs, p)
	delete(l.witness, p)
	for id := range l.lastCE {
		if Partition(id, testPartitions) == p {
			delete(l.lastCE, id)
			delete(l.states, id)
		}
	}
	return nil
}

// A replica that comes back on a store still holding partitions that another replica owned
// meanwhile (its states, renewals, verdicts and history are on the CE state topic) does not go
// on from its own copy of them, which lacks what that owner learnt: it rebuilds each from
// offset 0 with the states the other owner wrote. A partition whose claim in force is still
// its own is kept as it is, and read from its stored offset.
func TestHeldPartitionAnotherOwnerClaimedIsRebuilt(t *testing.T) {
	_, conn := startBroker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pr := testProducer(t, conn)
	sw, _ := stateTopics(ctx, t, conn)
	const n = 12
	for _, id := range ids("a-", n) {
		if _, _, err := pr.Send(ctx, Request{Kind: KindRegister, ID: id, Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)}); err != nil {
			t.Fatal(err)
		}
	}
	l1 := releasingLedger{newLedger()}
	r1 := startReplicaWith(t, statefulConfig(conn, "r1"), l1.ledger, l1, testLog(t))
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition, caught up", func() bool { return ownership(r1) != nil })
	if got := l1.registered(); got != n {
		t.Fatalf("r1 applied %d registrations, want %d", got, n)
	}
	r1.stop(t) // r1's store keeps every partition (Held at its next start)

	r2 := startReplica(t, statefulConfig(conn, "r2"))
	waitfor.Cond(t, 60*time.Second, "r2 owning every partition, caught up", func() bool { return ownership(r2) != nil })
	for _, id := range ids("a-", n) {
		if err := sw.Write(ctx, []State{{ID: id, Replica: "r2", Generation: r2.m.LastGeneration(), CE: json.RawMessage(`{"s":"r2's"}`)}}); err != nil {
			t.Fatal(err)
		}
	}
	r2.stop(t)

	held := make([]int, testPartitions)
	for p := range held {
		held[p] = p
	}
	c := statefulConfig(conn, "r1")
	c.Held = held
	// Until its copy of a partition is released, r1's confirmer may still judge those CEs and
	// write their states, under the generation r1 takes part in: none of them is the state
	// restored.
	var back *replica
	var backMu sync.Mutex
	copyStates := func(ctx context.Context, p int, label string) {
		backMu.Lock()
		gen := back.m.Generation()
		backMu.Unlock()
		for _, id := range ids("a-", n) {
			if Partition(id, testPartitions) == p {
				if err := sw.Write(ctx, []State{{ID: id, Replica: "r1", Generation: gen, CE: json.RawMessage(`{"s":"` + label + `"}`)}}); err != nil {
					t.Error(err)
				}
			}
		}
	}
	l1.release = func(ctx context.Context, p int) { copyStates(ctx, p, "r1's copy") }
	// ... and its outbox may publish those states after r1 claimed the partition again.
	c.afterClaim = func(p int) { copyStates(ctx, p, "r1's copy, published after its claim") }
	backMu.Lock()
	r1 = startReplicaWith(t, c, l1.ledger, l1, testLog(t))
	back = r1
	backMu.Unlock()
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition again, caught up", func() bool {
		return ownership(r1) != nil && l1.registered() == n
	})
	l1.mu.Lock()
	for _, id := range ids("a-", n) {
		if s := l1.states[id]; s == nil || string(s.CE) != `{"s":"r2's"}` {
			t.Errorf("r1, back on its store after r2 owned %s's partition, holds %s with state %v; want r2's state", id, id, s)
		}
	}
	if bad := slices.Clone(l1.bad); len(bad) > 0 {
		t.Errorf("r1's store: %v", bad)
	}
	l1.mu.Unlock()

	// r1 stops and comes back again: its own claim is in force, so it keeps its store as it is.
	r1.stop(t)
	l1.release, c.afterClaim = nil, nil
	released := len(l1.releases())
	r1 = startReplicaWith(t, c, l1.ledger, l1, testLog(t))
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition a third time, caught up", func() bool { return ownership(r1) != nil })
	if got := l1.releases()[released:]; len(got) != 0 {
		t.Errorf("r1, back on partitions it owned last, released %v", got)
	}
	if s := r1.m.Stats().States; s.Read != 0 {
		t.Errorf("r1, back on partitions it owned last, read %d states, want none", s.Read)
	}
}
