package ceshare

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

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
// owners left on the CE state topic: of one CE's records, the newest generation's, the later of
// one generation; records that do not authenticate or decode are left out and counted. Once the
// partition caught up, registrations come without states.
func TestMemberHandsRegistrationsTheirStates(t *testing.T) {
	_, conn := startBroker(t)
	cfg := memberConfig(conn, "r1")
	cfg.StateTopic = testStateTopic
	first := startReplica(t, cfg)
	pr, err := NewProducer(context.Background(), conn, testTopic, testKeys(), testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := range 8 {
		r := Request{Kind: KindRegister, ID: fmt.Sprintf("a-%d", i), Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)}
		if _, _, err := pr.Send(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	waitfor.Cond(t, 60*time.Second, "the first member applying the registrations", func() bool { return len(first.l.lastCE) == 8 })

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
		st("a-1", 5, `{"s":"a-1 g5"}`), st("a-1", 3, `{"s":"a-1 g3, a paused owner's late write"}`),
		st("a-2", 5, `{"s":"a-2 g5"}`), st("a-2", 7, `{"s":"a-2 g7"}`),
		st("a-3", 5, `{"s":"a-3 first"}`), st("a-3", 5, `{"s":"a-3 second"}`),
		st("b-0", 5, `{"s":"b-0, registered after the catch-up"}`),
	}); err != nil {
		t.Fatal(err)
	}
	other, err := clusterkey.Parse([]byte("t1:"+strings.Repeat("a5", 32)), "another cluster's")
	if err != nil {
		t.Fatal(err)
	}
	_, forged, _ := EncodeState(st("a-4", 9, `{"s":"forged"}`))
	_, forged5, _ := EncodeState(st("a-5", 9, `{"s":"forged"}`))
	malformed := []byte(`{"id":"a-6","replica":"r1","generation":9,"ce":"not an object"}`)
	writeRaw(t, conn,
		kafka.Message{Key: []byte("a-4"), Value: forged, Headers: []kafka.Header{{Key: clusterkey.Header, Value: other.Sign(StateDomain, forged)}}},
		kafka.Message{Key: []byte("a-5"), Value: forged5, Headers: []kafka.Header{{Key: clusterkey.Header, Value: Sign(testKeys(), forged5)}}},
		kafka.Message{Key: []byte("a-6"), Value: malformed, Headers: []kafka.Header{{Key: clusterkey.Header, Value: testKeys().Sign(StateDomain, malformed)}}},
		kafka.Message{Key: []byte("a-7")}, // a tombstone
	)
	if err := sw.Write(ctx, []State{st("a-5", 5, `{"s":"a-5 g5"}`)}); err != nil {
		t.Fatal(err)
	}

	// The first member stops; a second takes every partition from offset 0.
	first.stop(t)
	second := startReplica(t, cfg)
	waitfor.Cond(t, 60*time.Second, "the second member owning every partition, caught up", func() bool { return ownership(second) != nil })
	if _, _, err := pr.Send(ctx, Request{Kind: KindRegister, ID: "b-0", Replica: "r1", At: time.Now(), CE: json.RawMessage(`{"reg":1}`)}); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 30*time.Second, "the second member applying b-0", func() bool {
		second.l.mu.Lock()
		defer second.l.mu.Unlock()
		_, ok := second.l.lastCE["b-0"]
		return ok
	})
	want := map[string]string{"a-0": `{"s":"a-0 g5"}`, "a-1": `{"s":"a-1 g5"}`, "a-2": `{"s":"a-2 g7"}`, "a-3": `{"s":"a-3 second"}`,
		"a-5": `{"s":"a-5 g5"}`}
	second.l.mu.Lock()
	defer second.l.mu.Unlock()
	for _, id := range []string{"a-0", "a-1", "a-2", "a-3", "a-4", "a-5", "a-6", "a-7", "b-0"} {
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
	if s := second.m.Stats().States; s.Read != 9 || s.Unauthenticated != 2 || s.Malformed != 1 {
		t.Errorf("states read %+v; want 9 read, 2 unauthenticated, 1 malformed", s)
	}
	if s := first.m.Stats().States; s.Read != 0 {
		t.Errorf("the first member, which acquired an empty state topic, read %+v", s)
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
	pr, err := NewProducer(ctx, conn, testTopic, testKeys(), testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
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
