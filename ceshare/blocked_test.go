package ceshare

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// newerDecode is Decode of a build whose requests may carry a field this build does not know
// ("condition"): the build a replica is upgraded to.
func newerDecode(key, value []byte) (Request, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(value, &fields); err == nil {
		delete(fields, "condition")
		if v, err := json.Marshal(fields); err == nil {
			value = v
		}
	}
	return Decode(key, value)
}

// A request the cluster signed in a format this build cannot read blocks its partition: nothing
// at or after it is applied, the store keeps its offset, the partition is not ready, a restart
// of the same build stops there again, and a build that reads it applies it and every request
// after it, each once. Nothing is skipped.
func TestUnreadableRequestBlocksItsPartition(t *testing.T) {
	b, conn := startBroker(t)
	l := newLedger()
	r := startReplicaOn(t, memberConfig(conn, "r1"), l)
	pr := testProducer(t, conn)
	want := produced{}
	produce(t, pr, "a", 60, want)
	var owner map[int]string
	waitfor.Cond(t, 30*time.Second, "the member owning every partition and applying every request", func() bool {
		owner = ownership(r)
		return owner != nil && caughtUp(b, []*replica{r}, owner)
	})

	const id = "newer-1"
	p := Partition(id, testPartitions)
	at := time.Now().UTC().Format(time.RFC3339Nano)
	offset := b.HighWatermarks(testTopic)[p]
	writeSigned(t, conn, p, kafka.Message{Key: []byte(id),
		Value: []byte(`{"kind":"register","id":"` + id + `","replica":"r9","at":"` + at + `","ce":{"i":1},"condition":"x"}`)})
	want[p] = append(want[p], KindRegister+"/"+id)
	produce(t, pr, "b", 60, want) // some land in p, after the unreadable request
	var after []string
	for _, k := range want[p] {
		if strings.Contains(k, "/b-") {
			after = append(after, k)
		}
	}
	if len(after) == 0 {
		t.Fatal("no request of the second batch in the blocked partition")
	}

	blockedAt := func(r *replica) {
		t.Helper()
		waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d blocked at offset %d", p, offset), func() bool {
			bl := r.m.Blocked()
			return len(bl) == 1 && bl[0].Partition == p && bl[0].Offset == offset
		})
		// Every other partition applies on.
		waitfor.Cond(t, 30*time.Second, "the other partitions caught up", func() bool {
			hwm := b.HighWatermarks(testTopic)
			for q := range testPartitions {
				if q != p && (l.stored(q) != hwm[q] || !r.m.Ready(q)) {
					return false
				}
			}
			return true
		})
		bl := r.m.Blocked()[0]
		if bl.Reason != ReasonJSON || bl.Writer != "r9" {
			t.Errorf("blocked by %+v, want reason %q and writer r9", bl, ReasonJSON)
		}
		if r.m.Ready(p) {
			t.Errorf("partition %d ready while blocked", p)
		}
		if got := l.stored(p); got != offset {
			t.Errorf("partition %d: stored offset %d, want the unreadable request's %d", p, got, offset)
		}
		if got := l.applied(p); slices.ContainsFunc(got, func(k string) bool { return strings.Contains(k, "/b-") || k == KindRegister+"/"+id }) {
			t.Errorf("partition %d applied requests at or after the one it cannot read: %v", p, got)
		}
		if s := r.m.Stats(); s.Skipped[ReasonJSON] != 0 {
			t.Errorf("the unreadable request counted as skipped: %v", s.Skipped)
		}
	}
	blockedAt(r)

	// The same build, restarted on its store, stops at the same request.
	r.stop(t)
	r = startReplicaOn(t, memberConfig(conn, "r1"), l)
	blockedAt(r)

	// Upgraded, it applies the request and everything after it, once.
	r.stop(t)
	cfg := memberConfig(conn, "r1")
	cfg.decode = newerDecode
	r = startReplicaOn(t, cfg, l)
	waitfor.Cond(t, 30*time.Second, "the upgraded member applying every request", func() bool {
		owner = ownership(r)
		return owner != nil && caughtUp(b, []*replica{r}, owner)
	})
	checkShares(t, b, []*replica{r}, owner, want)
	if bl := r.m.Blocked(); len(bl) != 0 {
		t.Errorf("still blocked after the upgrade: %+v", bl)
	}
}

// A value the cluster signed blocks only the partition it was written to by a replica: the
// same bytes copied under another key, or to another partition than its id's, are skipped, so
// that a writer without the key cannot block a partition with a copy.
func TestBlocksTellCopiesFromUnreadableRequests(t *testing.T) {
	m := &Member{cfg: MemberConfig{Partitions: testPartitions}}
	id := "newer-2"
	p := Partition(id, testPartitions)
	other := (p + 1) % testPartitions
	val := []byte(`{"kind":"register","id":"` + id + `","replica":"r9","ce":{},"condition":"x"}`)
	for _, c := range []struct {
		name   string
		p      int
		key    string
		value  string
		reason string
		blocks bool
	}{
		{"written by a newer replica", p, id, string(val), ReasonJSON, true},
		{"copied under another key", p, "other", string(val), ReasonJSON, false},
		{"copied to another partition", other, id, string(val), ReasonJSON, false},
		{"no id to read", p, id, `not json`, ReasonJSON, true},
		{"an id that is not a string", p, id, `{"id":7,"kind":"register"}`, ReasonJSON, true},
		{"an unknown kind", p, id, `{"kind":"renew","id":"` + id + `","replica":"r9"}`, ReasonKind, true},
		{"a key that is not the id", p, "other", `{"kind":"delete","id":"` + id + `"}`, ReasonKey, false},
		{"an id of another partition", other, id, `{"kind":"delete","id":"` + id + `"}`, ReasonPartition, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := m.blocks(c.p, record{offset: 5, key: []byte(c.key), value: []byte(c.value)}, &DecodeError{Reason: c.reason, Detail: "d"})
			if (got != nil) != c.blocks {
				t.Fatalf("blocks = %+v, want blocking %v", got, c.blocks)
			}
			if got != nil && (got.Partition != c.p || got.Offset != 5 || got.Reason != c.reason) {
				t.Errorf("blocks = %+v, want partition %d offset 5 reason %s", got, c.p, c.reason)
			}
		})
	}
}

// A blocked partition whose unreadable request the topic's retention deletes is no longer
// blocked: the member reads the partition again while blocked, counts the deleted request lost
// (Hooks.Lost), as any request deleted unread, and applies the requests after it.
func TestBlockedRequestDeletedByRetention(t *testing.T) {
	b, conn := startBrokerWith(t, broker.Config{RetentionCheckInterval: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tr, err := conn.Transport(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: tr}
	if _, err := create(ctx, cl, testTopic, testPartitions, []kafka.ConfigEntry{{ConfigName: "retention.ms", ConfigValue: "1800000"}}); err != nil {
		t.Fatal(err)
	}
	const id = "newer-1"
	p := Partition(id, testPartitions)
	at := time.Now().UTC().Format(time.RFC3339Nano)
	writeSigned(t, conn, p, kafka.Message{Key: []byte(id), Time: time.Now().Add(-time.Hour),
		Value: []byte(`{"kind":"register","id":"` + id + `","replica":"r9","at":"` + at + `","ce":{"i":1},"condition":"x"}`)})
	want := produced{}
	produce(t, testProducer(t, conn), "b", 60, want)
	r := startReplica(t, memberConfig(conn, "r1"))
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d blocked at offset 0", p), func() bool {
		bl := r.m.Blocked()
		return len(bl) == 1 && bl[0].Partition == p && bl[0].Offset == 0
	})
	b.ApplyRetention()
	var owner map[int]string
	waitfor.Cond(t, 30*time.Second, "the member applying every request left", func() bool {
		owner = ownership(r)
		return owner != nil && caughtUp(b, []*replica{r}, owner)
	})
	checkShares(t, b, []*replica{r}, owner, want)
	if bl := r.m.Blocked(); len(bl) != 0 {
		t.Errorf("still blocked once the request was deleted: %+v", bl)
	}
	r.l.mu.Lock()
	lost := r.l.lost[p]
	r.l.mu.Unlock()
	if lost != 1 {
		t.Errorf("partition %d: %d requests counted lost, want the 1 deleted", p, lost)
	}
}
