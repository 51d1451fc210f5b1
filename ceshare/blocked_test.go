package ceshare

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/stream"
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
	waitCaughtUp(t, b, r, "the member owning every partition and applying every request")

	const id = "newer-1"
	p := Partition(id, testPartitions)
	// In one write, so that one fetch reads them: a request this build reads, the one it does
	// not, and one it reads after it.
	before, after := idIn(p, "before"), idIn(p, "after")
	offset := b.HighWatermarks(testTopic)[p] + 1
	writeSigned(t, conn, p, readableRequest(t, before), newerRequest(id), readableRequest(t, after))
	want[p] = append(want[p], KindRegister+"/"+before, KindRegister+"/"+id, KindRegister+"/"+after)
	produce(t, pr, "b", 60, want) // some land in p, after the unreadable request
	if !slices.ContainsFunc(want[p], func(k string) bool { return strings.Contains(k, "/b-") }) {
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
		got := l.applied(p)
		if slices.ContainsFunc(got, func(k string) bool {
			return strings.Contains(k, "/b-") || k == KindRegister+"/"+id || k == KindRegister+"/"+after
		}) {
			t.Errorf("partition %d applied requests at or after the one it cannot read: %v", p, got)
		}
		if !slices.Contains(got, KindRegister+"/"+before) {
			t.Errorf("partition %d did not apply the request before the one it cannot read: %v", p, got)
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
	owner := waitCaughtUp(t, b, r, "the upgraded member applying every request")
	checkShares(t, b, []*replica{r}, owner, want)
	if bl := r.m.Blocked(); len(bl) != 0 {
		t.Errorf("still blocked after the upgrade: %+v", bl)
	}
}

// idIn returns an id of partition p, prefix-<k> for the smallest such k.
func idIn(p int, prefix string) string {
	for k := 0; ; k++ {
		if id := fmt.Sprintf("%s-%d", prefix, k); Partition(id, testPartitions) == p {
			return id
		}
	}
}

// readableRequest is a registration of id in this build's format, as a record to sign.
func readableRequest(t *testing.T, id string) kafka.Message {
	t.Helper()
	key, value, err := Encode(Request{Kind: KindRegister, ID: id, Replica: "r1", At: time.Now().UTC(), CE: json.RawMessage(`{"i":0}`)})
	if err != nil {
		t.Fatal(err)
	}
	return kafka.Message{Key: key, Value: value}
}

// newerRequest is a registration of id with a field this build does not know, as a newer build
// would write it, as a record to sign.
func newerRequest(id string) kafka.Message {
	at := time.Now().UTC().Format(time.RFC3339Nano)
	return kafka.Message{Key: []byte(id), Value: []byte(`{"kind":"register","id":"` + id + `","replica":"r9","at":"` + at + `","ce":{"i":1},"condition":"x"}`)}
}

// A value the cluster signed blocks only the partition it was written to by a replica: the
// same bytes copied under another key, or to another partition than its id's, are skipped, and
// so is a value that names no id (it could have been copied anywhere), so that a writer without
// the key cannot block a partition with a copy.
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
		{"no id to read", p, id, `not json`, ReasonJSON, false},
		{"an id that is not a string", p, id, `{"id":7,"kind":"register"}`, ReasonJSON, false},
		{"an empty id", p, "", `{"id":"","kind":"register"}`, ReasonID, false},
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
	createTopic(t, conn, halfHourRetention)
	const id = "newer-1"
	p := Partition(id, testPartitions)
	old := newerRequest(id)
	old.Time = time.Now().Add(-time.Hour)
	writeSigned(t, conn, p, old)
	want := produced{}
	produce(t, testProducer(t, conn), "b", 60, want)
	r := startReplica(t, memberConfig(conn, "r1"))
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d blocked at offset 0", p), func() bool {
		bl := r.m.Blocked()
		return len(bl) == 1 && bl[0].Partition == p && bl[0].Offset == 0
	})
	b.ApplyRetention()
	owner := waitCaughtUp(t, b, r, "the member applying every request left")
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

// A request no build reads, named in MemberConfig.Skip (replication.skip_ce_requests), is left
// out, counted and lost, and the partition applies the requests after it.
func TestSkippedUnreadableRequest(t *testing.T) {
	b, conn := startBroker(t)
	const id = "newer-1"
	p := Partition(id, testPartitions)
	createTopic(t, conn)
	want := produced{}
	produce(t, testProducer(t, conn), "a", 30, want)
	offset := b.HighWatermarks(testTopic)[p]
	writeSigned(t, conn, p, newerRequest(id))
	produce(t, testProducer(t, conn), "b", 60, want)
	cfg := memberConfig(conn, "r1")
	// The second rule names readable requests: they are applied.
	cfg.Skip = []Skip{{Partition: p, Offset: offset, ID: id}, {Partition: (p + 1) % testPartitions, Offset: 0, Through: 1000}}
	r := startReplica(t, cfg)
	owner := waitCaughtUp(t, b, r, "the member applying every request but the skipped one")
	checkShares(t, b, []*replica{r}, owner, want)
	if bl := r.m.Blocked(); len(bl) != 0 {
		t.Errorf("blocked at a request named to skip: %+v", bl)
	}
	if s := r.m.Stats(); s.Skipped[ReasonJSON] != 1 {
		t.Errorf("skipped %v, want the 1 unreadable request under %s", s.Skipped, ReasonJSON)
	}
}

// A blocked partition whose topic is deleted and created again is no longer blocked: the
// request that blocked it went with the old log.
func TestBlockedPartitionOfATopicCreatedAgain(t *testing.T) {
	b, conn := startBroker(t)
	const id = "newer-1"
	p := Partition(id, testPartitions)
	createTopic(t, conn)
	produce(t, testProducer(t, conn), "a", 60, produced{})
	r := startReplica(t, memberConfig(conn, "r1"))
	offset := b.HighWatermarks(testTopic)[p]
	writeSigned(t, conn, p, newerRequest(id))
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d blocked at offset %d", p, offset), func() bool {
		bl := r.m.Blocked()
		return len(bl) == 1 && bl[0].Offset == offset
	})
	deleteTopic(t, conn, testTopic)
	createTopic(t, conn)
	writeSigned(t, conn, p, readableRequest(t, idIn(p, "again")))
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read again from the new log", p), func() bool {
		return r.l.stored(p) == 1 && r.m.Ready(p)
	})
	if bl := r.m.Blocked(); len(bl) != 0 {
		t.Errorf("still blocked at a request of the deleted log: %+v", bl)
	}
}

// createTopic creates the test topic as a member does, with configs.
func createTopic(t *testing.T, conn stream.ConnConfig, configs ...kafka.ConfigEntry) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: kafkatest.Transport(t)}
	if _, err := create(ctx, cl, testTopic, testPartitions, configs); err != nil {
		t.Fatal(err)
	}
}

// halfHourRetention is a retention an operator may give the CE topic (cfguard creates it with none).
var halfHourRetention = kafka.ConfigEntry{ConfigName: "retention.ms", ConfigValue: "1800000"}

// A rule of MemberConfig.Skip names a blocked record by its partition, its offset or a range of
// them, and its id when the rule gives one.
func TestSkipRulesNameRecords(t *testing.T) {
	b := &Blocked{Partition: 3, Offset: 10, ID: "ce-1"}
	for _, c := range []struct {
		name  string
		rule  Skip
		names bool
	}{
		{"its offset", Skip{Partition: 3, Offset: 10}, true},
		{"its offset and id", Skip{Partition: 3, Offset: 10, ID: "ce-1"}, true},
		{"another id", Skip{Partition: 3, Offset: 10, ID: "ce-2"}, false},
		{"another partition", Skip{Partition: 4, Offset: 10}, false},
		{"another offset", Skip{Partition: 3, Offset: 11}, false},
		{"a range over it", Skip{Partition: 3, Offset: 5, Through: 10}, true},
		{"a range before it", Skip{Partition: 3, Offset: 5, Through: 9}, false},
		{"a range after it", Skip{Partition: 3, Offset: 11, Through: 90}, false},
		{"a through below the offset", Skip{Partition: 3, Offset: 10, Through: 2}, true},
	} {
		if got := c.rule.names(b); got != c.names {
			t.Errorf("%s: %+v names %+v: %v, want %v", c.name, c.rule, b, got, c.names)
		}
	}
}

// waitCaughtUp waits until r owns every partition, ready, and has stored each one's end, and
// returns who owns which.
func waitCaughtUp(t *testing.T, b *broker.Broker, r *replica, what string) map[int]string {
	t.Helper()
	var owner map[int]string
	waitfor.Cond(t, 30*time.Second, what, func() bool {
		owner = ownership(r)
		return owner != nil && caughtUp(b, []*replica{r}, owner)
	})
	return owner
}

// A partition stays blocked at the record it cannot read while the member reads that record
// again, after a while each time: it is said at ERROR once, the block keeps the time it was
// found, the partition is neither ready nor read past it, and a Witness stored with it is of a
// record before it.
func TestBlockedPartitionIsReadAgainAndSaidOnce(t *testing.T) {
	_, conn := startBroker(t)
	createTopic(t, conn)
	const id = "newer-1"
	p := Partition(id, testPartitions)
	writeSigned(t, conn, p, readableRequest(t, idIn(p, "before")), newerRequest(id))
	var reads atomic.Int64 // of p from offset 1, the unreadable request's
	cfg := memberConfig(conn, "r1")
	cfg.beforeFetch = func(q int, next int64) {
		if q == p && next == 1 {
			reads.Add(1)
		}
	}
	var out tooltest.Output
	l := newLedger()
	r := startReplicaWith(t, cfg, l, l, tooltest.Logger(t, &out))
	// Found at the first read from offset 1; the block is published before the next.
	waitfor.Cond(t, 30*time.Second, "a second read of the unreadable request", func() bool { return reads.Load() >= 2 })
	bl := r.m.Blocked()
	if len(bl) != 1 || bl[0].Partition != p || bl[0].Offset != 1 {
		t.Fatalf("blocked at %+v, want partition %d at offset 1", bl, p)
	}
	found := bl[0].Since
	waitfor.Cond(t, 30*time.Second, "four more reads of the unreadable request", func() bool { return reads.Load() >= 6 })
	if again := r.m.Blocked(); len(again) != 1 || !again[0].Since.Equal(found) || r.m.Ready(p) {
		t.Errorf("after reading it again: blocked at %+v (found at %v), ready %v; want the block found first, not ready", again, found, r.m.Ready(p))
	}
	if got := logLines(out.String(), "CE partition blocked at a request this build cannot read"); len(got) != 1 {
		t.Errorf("the block said %d times at ERROR, want once", len(got))
	}
	if next, _ := r.m.Next(p); next != 1 || l.stored(p) != 1 {
		t.Errorf("partition %d: member's offset %d, stored %d; want the unreadable request's 1", p, next, l.stored(p))
	}
	if bad := l.problems(); len(bad) > 0 {
		t.Errorf("rules broken: %v", bad)
	}
}

// The member hands its callbacks what it leaves out or stops at: OnUnauthenticated, with the CE
// topic, partition and offset, each record that does not authenticate and each copy, once;
// OnSkip each record a Skip rule names, once; and a request Readable refuses blocks its partition
// (Blocked, ReasonCE, with Readable's error, the record's id and writer).
func TestMemberCallbacksNameTheRecordsLeftOut(t *testing.T) {
	b, conn := startBroker(t)
	createTopic(t, conn)
	offsets := func(before []int64) []string { // topic/partition/offset of the records written since before
		var out []string
		for p, end := range b.HighWatermarks(testTopic) {
			for o := before[p]; o < end; o++ {
				out = append(out, fmt.Sprintf("%s/%d/%d", testTopic, p, o))
			}
		}
		return out
	}
	before := b.HighWatermarks(testTopic)
	writeForged(t, conn)
	writeCopies(t, conn)
	wantUnauth := offsets(before)
	const skipID, refusedID = "newer-1", "refused-1"
	ps, pr := Partition(skipID, testPartitions), Partition(refusedID, testPartitions)
	skipAt := b.HighWatermarks(testTopic)[ps]
	writeSigned(t, conn, ps, newerRequest(skipID))
	refusedAt := b.HighWatermarks(testTopic)[pr]
	writeSigned(t, conn, pr, readableRequest(t, refusedID))

	var mu sync.Mutex
	var unauth, skipped []string
	cfg := memberConfig(conn, "r1")
	cfg.OnUnauthenticated = func(topic string, p int, off int64) {
		mu.Lock()
		defer mu.Unlock()
		unauth = append(unauth, fmt.Sprintf("%s/%d/%d", topic, p, off))
	}
	cfg.Skip = []Skip{{Partition: ps, Offset: skipAt}}
	cfg.OnSkip = func(p int, off int64) {
		mu.Lock()
		defer mu.Unlock()
		skipped = append(skipped, fmt.Sprintf("%d/%d", p, off))
	}
	cfg.Readable = func(r Request) error {
		if r.ID == refusedID {
			return errors.New("a CE of a newer schema")
		}
		return nil
	}
	r := startReplica(t, cfg)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d blocked or read to its end, every other one read to its end", pr), func() bool {
		hwm := b.HighWatermarks(testTopic)
		for p := range testPartitions {
			if next, ok := r.m.Next(p); !ok || (next != hwm[p] && (p != pr || len(r.m.Blocked()) == 0)) {
				return false
			}
		}
		return true
	})
	want := Blocked{Partition: pr, Offset: refusedAt, ID: refusedID, Reason: ReasonCE, Detail: "a CE of a newer schema", Writer: "r1"}
	bl := r.m.Blocked()
	var since time.Time
	if len(bl) == 1 {
		since, bl[0].Since = bl[0].Since, time.Time{}
	}
	if len(bl) != 1 || since.IsZero() || bl[0] != want {
		t.Errorf("blocked at %+v (since %v), want %+v", bl, since, want)
	}
	mu.Lock()
	defer mu.Unlock()
	slices.Sort(unauth)
	slices.Sort(wantUnauth)
	if !slices.Equal(unauth, wantUnauth) {
		t.Errorf("OnUnauthenticated called for %v, want %v", unauth, wantUnauth)
	}
	if w := []string{fmt.Sprintf("%d/%d", ps, skipAt)}; !slices.Equal(skipped, w) {
		t.Errorf("OnSkip called for %v, want %v", skipped, w)
	}
}
