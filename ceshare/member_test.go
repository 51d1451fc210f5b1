package ceshare

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
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
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/stream"
)

const (
	testTopic      = "cfguard.ce"
	testGroup      = "cfguard.ce"
	testPartitions = 12
	// The session timeout and heartbeat interval the takeover times are measured at.
	testSession   = 3 * time.Second
	testHeartbeat = 300 * time.Millisecond
)

func testLog(t testing.TB) *slog.Logger {
	return tooltest.Logger(t)
}

// startBroker starts an embedded broker, closed when the test ends, and lowers its minimum
// group session timeout (kfake's default, 6s, is Kafka's) so that members may use testSession.
func startBroker(t testing.TB) (*broker.Broker, stream.ConnConfig) {
	t.Helper()
	return startBrokerWith(t, broker.Config{})
}

// startBrokerWith is startBroker with cfg.
func startBrokerWith(t testing.TB, cfg broker.Config) (*broker.Broker, stream.ConnConfig) {
	t.Helper()
	b, err := broker.Start(context.Background(), cfg, testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	conn := stream.ConnConfig{Brokers: b.Addrs(), DialTimeout: 5 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tr, err := conn.Transport(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(b.Addrs()...), Transport: tr}
	res, err := cl.IncrementalAlterConfigs(ctx, &kafka.IncrementalAlterConfigsRequest{Resources: []kafka.IncrementalAlterConfigsRequestResource{{
		ResourceType: kafka.ResourceTypeBroker, ResourceName: "0",
		Configs: []kafka.IncrementalAlterConfigsRequestConfig{{Name: "group.min.session.timeout.ms", Value: "1000", ConfigOperation: kafka.ConfigOperationSet}},
	}}})
	if err == nil {
		for _, r := range res.Resources {
			err = errors.Join(err, r.Error)
		}
	}
	if err != nil {
		t.Fatalf("lowering the broker's group.min.session.timeout.ms: %v", err)
	}
	return b, conn
}

// ledger is a test's Hooks: what one replica's ledger would keep of its share.
type ledger struct {
	mu        sync.Mutex
	next      map[int]int64                     // stored offset per partition
	reqs      map[int]map[string]int            // requests applied per partition: kind/id -> times
	acquired  []acquisition                     // every Acquire, in order
	released  []int                             // every Release, in order
	bad       []string                          // what broke a rule (a request applied twice, an offset going back)
	lastCE    map[string]json.RawMessage        // the CE of each id's last registration
	states    map[string]*State                 // the state each id's last registration came with
	owned     map[int]bool                      // acquired and not released
	apply     func(p int, reqs []Request) error // called by Apply, when set
	release   func(ctx context.Context, p int)  // called by Release before it records p, when set
	acquire   func(p int)                       // called by Acquire first, when set
	lost      map[int]int64                     // requests counted lost per partition (Lost)
	restored  map[string]*State                 // the state of each registration rebuilt from one (Request.Restored)
	restoreAt map[int]int64                     // the stored offset when a partition's first restored registrations came
	witness   map[int]Witness                   // the Witness stored per partition (Apply), as the ledger keeps it
	resets    []int                             // every Reset, in order
	reqOff    map[int]map[string]int64          // the offset each kind/id of reqs was last applied at
}

type acquisition struct {
	p    int
	from int64
}

func newLedger() *ledger {
	return &ledger{next: map[int]int64{}, reqs: map[int]map[string]int{}, lastCE: map[string]json.RawMessage{}, owned: map[int]bool{},
		states: map[string]*State{}, witness: map[int]Witness{}}
}

func (l *ledger) Acquire(_ context.Context, p int) (int64, *Witness, error) {
	if l.acquire != nil {
		l.acquire(p)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.acquired = append(l.acquired, acquisition{p, l.next[p]})
	l.owned[p] = true
	if w, ok := l.witness[p]; ok {
		return l.next[p], &w, nil
	}
	return l.next[p], nil, nil
}

func (l *ledger) Reset(_ context.Context, p int, end, from int64) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.next[p] = 0
	delete(l.witness, p)
	for k, off := range l.reqOff[p] { // may be of the new log: applied once more, in order
		if off >= from {
			delete(l.reqs[p], k)
		}
	}
	l.resets = append(l.resets, p)
	return nil
}

func (l *ledger) Apply(_ context.Context, p int, reqs []Request, next int64, w *Witness) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.apply != nil {
		if err := l.apply(p, reqs); err != nil {
			return err
		}
	}
	if !l.owned[p] {
		l.bad = append(l.bad, fmt.Sprintf("Apply of partition %d, not acquired", p))
	}
	if len(reqs) > 0 && reqs[0].Restored {
		l.restore(p, reqs, next)
		return nil
	}
	if next <= l.next[p] {
		l.bad = append(l.bad, fmt.Sprintf("partition %d: next %d after %d", p, next, l.next[p]))
	}
	if l.reqs[p] == nil {
		l.reqs[p] = map[string]int{}
	}
	for _, r := range reqs {
		k := r.Kind + "/" + r.ID
		if r.Offset < l.next[p] || r.Offset >= next {
			l.bad = append(l.bad, fmt.Sprintf("partition %d: %s at offset %d, stored with offsets %d to %d", p, k, r.Offset, l.next[p], next))
		}
		if r.Kind != KindRegister && r.State != nil {
			l.bad = append(l.bad, fmt.Sprintf("partition %d: %s came with a state", p, k))
		}
		if l.reqOff == nil {
			l.reqOff = map[int]map[string]int64{}
		}
		if l.reqOff[p] == nil {
			l.reqOff[p] = map[string]int64{}
		}
		l.reqOff[p][k] = r.Offset
		if l.reqs[p][k]++; l.reqs[p][k] > 1 {
			l.bad = append(l.bad, fmt.Sprintf("partition %d: %s applied twice", p, k))
		}
		if Partition(r.ID, testPartitions) != p {
			l.bad = append(l.bad, fmt.Sprintf("%s read from partition %d, belongs to %d", r.ID, p, Partition(r.ID, testPartitions)))
		}
		if r.Kind == KindRegister {
			l.lastCE[r.ID], l.states[r.ID] = r.CE, r.State
		}
	}
	l.next[p] = next
	switch {
	case w != nil && w.Offset >= next:
		l.bad = append(l.bad, fmt.Sprintf("partition %d: witness at offset %d stored with offset %d", p, w.Offset, next))
	case w != nil:
		l.witness[p] = *w
	}
	return nil
}

// restore keeps registrations rebuilt from states (all of reqs must be), which leave the
// stored offset where it is.
func (l *ledger) restore(p int, reqs []Request, next int64) {
	if next != l.next[p] {
		l.bad = append(l.bad, fmt.Sprintf("partition %d: restored registrations with offset %d, stored offset %d", p, next, l.next[p]))
	}
	if l.restored == nil {
		l.restored, l.restoreAt = map[string]*State{}, map[int]int64{}
	}
	if _, ok := l.restoreAt[p]; !ok {
		l.restoreAt[p] = l.next[p]
	}
	for _, r := range reqs {
		switch {
		case !r.Restored || r.Kind != KindRegister || r.State == nil || r.State.ID != r.ID:
			l.bad = append(l.bad, fmt.Sprintf("partition %d: %+v among restored registrations", p, r))
		case Partition(r.ID, testPartitions) != p:
			l.bad = append(l.bad, fmt.Sprintf("%s restored in partition %d, belongs to %d", r.ID, p, Partition(r.ID, testPartitions)))
		default:
			l.restored[r.ID] = r.State
		}
	}
}

func (l *ledger) Lost(_ context.Context, p int, from, to int64) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.owned[p] {
		l.bad = append(l.bad, fmt.Sprintf("Lost of partition %d, not acquired", p))
	}
	if from != l.next[p] || to < from {
		l.bad = append(l.bad, fmt.Sprintf("partition %d: lost from %d to %d, stored offset %d", p, from, to, l.next[p]))
	}
	if l.lost == nil {
		l.lost = map[int]int64{}
	}
	l.lost[p] += to - from
	l.next[p] = to
	return nil
}

func (l *ledger) Release(ctx context.Context, p int) error {
	if l.release != nil {
		l.release(ctx, p)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if d, ok := ctx.Deadline(); ok {
		// A store's release takes as long as its share's deletion: a deadline would leave
		// CEs another member owns in it.
		l.bad = append(l.bad, fmt.Sprintf("partition %d released with a deadline %v away", p, time.Until(d).Round(time.Second)))
	}
	l.released = append(l.released, p)
	delete(l.owned, p)
	return nil
}

// registered returns how many ids got a registration applied.
func (l *ledger) registered() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.lastCE)
}

// applied returns the kind/id of every request applied to partition p.
func (l *ledger) applied(p int) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Sorted(maps.Keys(l.reqs[p]))
}

func (l *ledger) stored(p int) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.next[p]
}

func (l *ledger) problems() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.bad)
}

func (l *ledger) releases() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.released)
}

// waitReleased waits until the partitions l released after its first `from` releases are want
// (sorted) and none is still being released by m: releases run in the background
// (Member.startRelease), after the partitions have left Owned.
func waitReleased(t *testing.T, m *Member, l *ledger, from int, want []int, what string) {
	t.Helper()
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("%s releasing %v and no other partition", what, want), func() bool {
		return slices.Equal(slices.Sorted(slices.Values(l.releases()[from:])), want) && len(m.Releasing()) == 0
	})
}

func (l *ledger) acquisitions() []acquisition {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.acquired)
}

// replica is a running Member with its ledger.
type replica struct {
	id     string
	m      *Member
	l      *ledger
	cancel context.CancelFunc
	done   chan error
}

// stop ends the member's Run (it leaves the group) and waits for it.
func (r *replica) stop(t *testing.T) {
	t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		if err != nil {
			t.Errorf("replica %s: Run: %v", r.id, err)
		}
		r.done <- nil // for the cleanup's second stop
	case <-time.After(30 * time.Second):
		t.Fatalf("replica %s: Run did not return within 30s of its context's end", r.id)
	}
}

// testProducer is a producer of the test topic, signing with testKeys, closed when the test ends.
func testProducer(t *testing.T, conn stream.ConnConfig) *Producer {
	t.Helper()
	pr, err := NewProducer(context.Background(), conn, testTopic, testKeys(), testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pr.Close() })
	return pr
}

func memberConfig(conn stream.ConnConfig, id string) MemberConfig {
	return MemberConfig{Conn: conn, Topic: testTopic, Group: testGroup, Partitions: testPartitions,
		ReplicaID: id, AdvertiseURL: "http://" + id + ".test:8080", Keys: testKeys(),
		SessionTimeout: testSession, HeartbeatInterval: testHeartbeat,
		FetchWait: 100 * time.Millisecond, RetryMin: 10 * time.Millisecond, RetryMax: 200 * time.Millisecond,
		JoinBackoff: 100 * time.Millisecond}
}

// statefulConfig is memberConfig with the CE state topic, for the tests of owners that keep
// their CEs' states.
func statefulConfig(conn stream.ConnConfig, id string) MemberConfig {
	c := memberConfig(conn, id)
	c.StateTopic = testStateTopic
	return c
}

func startReplica(t *testing.T, cfg MemberConfig) *replica {
	t.Helper()
	return startReplicaOn(t, cfg, newLedger())
}

// startReplicaOn starts a member on ledger l (a replica restarted on its state directory).
func startReplicaOn(t *testing.T, cfg MemberConfig, l *ledger) *replica {
	t.Helper()
	return startReplicaWith(t, cfg, l, l, testLog(t))
}

// startReplicaWith starts a member on ledger l, through hooks (l, or hooks wrapping it), logging
// to log.
func startReplicaWith(t *testing.T, cfg MemberConfig, l *ledger, hooks Hooks, log *slog.Logger) *replica {
	t.Helper()
	m, err := NewMember(context.Background(), cfg, hooks, log)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &replica{id: cfg.ReplicaID, m: m, l: l, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- m.Run(ctx) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// ownership returns, when the replicas hold every partition exactly once and each of them is
// ready, who holds which; otherwise nil.
func ownership(reps ...*replica) map[int]string {
	owner := map[int]string{}
	for _, r := range reps {
		for _, p := range r.m.Owned() {
			if _, dup := owner[p]; dup || !r.m.Ready(p) {
				return nil
			}
			owner[p] = r.id
		}
	}
	if len(owner) != testPartitions {
		return nil
	}
	return owner
}

func byID(reps []*replica, id string) *replica {
	for _, r := range reps {
		if r.id == id {
			return r
		}
	}
	return nil
}

// produced is what a test sent: the kind/id of each request, by partition.
type produced map[int][]string

func produce(t *testing.T, pr *Producer, prefix string, n int, out produced) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := range n {
		r := Request{Kind: KindRegister, ID: fmt.Sprintf("%s-%d", prefix, i), Replica: "r1", At: time.Now(),
			CE: json.RawMessage(fmt.Sprintf(`{"i":%d}`, i))}
		if i%5 == 4 { // a deletion of an earlier registration
			r = Request{Kind: KindDelete, ID: fmt.Sprintf("%s-%d", prefix, i-1), Replica: "r2", At: time.Now()}
		}
		p, off, err := pr.Send(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		if want := Partition(r.ID, testPartitions); p != want {
			t.Fatalf("%s sent to partition %d, want %d", r.ID, p, want)
		}
		if off < 0 {
			t.Fatalf("%s: offset %d", r.ID, off)
		}
		out[p] = append(out[p], r.Kind+"/"+r.ID)
	}
}

// checkShares fails unless the owner of each partition applied exactly the requests produced
// to it, and no ledger broke a rule.
func checkShares(t *testing.T, b *broker.Broker, reps []*replica, owner map[int]string, want produced) {
	t.Helper()
	hwm := b.HighWatermarks(testTopic)
	for p := range testPartitions {
		r := byID(reps, owner[p])
		if got, w := r.l.applied(p), slices.Sorted(slices.Values(want[p])); !slices.Equal(got, w) {
			t.Errorf("partition %d, owner %s: applied %d requests, %d produced (missing or extra: %v)", p, r.id, len(got), len(w), symDiff(got, w))
		}
		if got := r.l.stored(p); got != hwm[p] {
			t.Errorf("partition %d, owner %s: stored offset %d, partition end %d", p, r.id, got, hwm[p])
		}
	}
	for _, r := range reps {
		if bad := r.l.problems(); len(bad) > 0 {
			t.Errorf("replica %s: %d problems, the first: %v", r.id, len(bad), bad[:min(len(bad), 5)])
		}
	}
}

func symDiff(a, b []string) []string {
	var out []string
	for _, x := range a {
		if !slices.Contains(b, x) {
			out = append(out, "+"+x)
		}
	}
	for _, x := range b {
		if !slices.Contains(a, x) {
			out = append(out, "-"+x)
		}
	}
	if len(out) > 10 {
		out = append(out[:10], "...")
	}
	return out
}

// caughtUp reports whether each partition's owner has stored the partition's end.
func caughtUp(b *broker.Broker, reps []*replica, owner map[int]string) bool {
	hwm := b.HighWatermarks(testTopic)
	for p := range testPartitions {
		if byID(reps, owner[p]).l.stored(p) != hwm[p] {
			return false
		}
	}
	return true
}

// Three members share the partitions; every request is applied once by its partition's
// owner; a member that leaves hands its partitions to the others, who rebuild them from the
// offsets their ledgers stored; the others keep theirs; the Directory follows.
func TestMembersSharePartitionsAndMoveThemOnLeave(t *testing.T) {
	b, conn := startBroker(t)
	// Before any member joins, no partition has an owner: Owners names them.
	empty := testDirectory(t, conn)
	if o, err := empty.Owners(context.Background()); !errors.Is(err, ErrNoOwner) || !strings.Contains(err.Error(), "partitions [0 1 2") {
		t.Fatalf("Owners of a group without members: %v, %v; want ErrNoOwner naming the partitions", o, err)
	}
	empty.Close()
	var reps []*replica
	for _, id := range []string{"r1", "r2", "r3"} {
		reps = append(reps, startReplica(t, memberConfig(conn, id)))
	}
	var owner map[int]string
	waitfor.Cond(t, 60*time.Second, "three members owning every partition once", func() bool {
		owner = ownership(reps...)
		return owner != nil && len(reps[0].m.Owned()) > 0 && len(reps[1].m.Owned()) > 0 && len(reps[2].m.Owned()) > 0
	})
	for _, r := range reps {
		if n := len(r.m.Owned()); n != testPartitions/3 {
			t.Errorf("replica %s owns %d partitions, want %d: %v", r.id, n, testPartitions/3, owner)
		}
	}

	pr := testProducer(t, conn)
	want := produced{}
	produce(t, pr, "a", 600, want)
	if Partition("x-7", testPartitions) == 0 {
		t.Fatal("x-7 is in partition 0: the misplaced request needs an id of another partition")
	}
	writeCopies(t, conn)
	forged := writeForged(t, conn)
	produce(t, pr, "b", 60, want)
	waitfor.Cond(t, 30*time.Second, "the owners applying every request", func() bool { return caughtUp(b, reps, owner) })
	if again := ownership(reps...); !maps.Equal(again, owner) {
		t.Fatalf("partitions moved while the members stayed: %v, then %v", owner, again)
	}
	checkShares(t, b, reps, owner, want)
	var applied int64
	skipped := map[string]int64{}
	for _, r := range reps {
		s := r.m.Stats()
		applied += s.Applied
		for k, v := range s.Skipped {
			skipped[k] += v
		}
	}
	if applied != 660 {
		t.Errorf("the members applied %d requests, 660 were produced", applied)
	}
	wantSkipped := map[string]int64{ReasonKey: 1, ReasonPartition: 1, ReasonUnauthenticated: int64(forged)}
	for _, r := range Reasons() {
		if skipped[r] != wantSkipped[r] {
			t.Errorf("records skipped %v, want %v", skipped, wantSkipped)
			break
		}
	}
	for _, r := range reps {
		if b := r.m.Blocked(); len(b) > 0 {
			t.Errorf("replica %s blocked at %v by a copy or a forgery", r.id, b)
		}
	}

	dir := testDirectory(t, conn)
	checkDirectory(t, dir, owner)

	// r2 leaves.
	gone := reps[1]
	before := map[string][]int{"r1": reps[0].m.Owned(), "r3": reps[2].m.Owned()}
	acquiredBefore := map[string]int{"r1": len(reps[0].l.acquisitions()), "r3": len(reps[2].l.acquisitions())}
	goneOwned, goneReleased := gone.m.Owned(), len(gone.l.releases())
	start := time.Now()
	gone.stop(t)
	stay := []*replica{reps[0], reps[2]}
	waitfor.Cond(t, 60*time.Second, "r1 and r3 owning every partition", func() bool { owner = ownership(stay...); return owner != nil })
	t.Logf("takeover after a member's Close (session timeout %v, heartbeat %v): %v", testSession, testHeartbeat, time.Since(start))
	if rel := gone.l.releases()[goneReleased:]; len(rel) != 0 || len(goneOwned) == 0 {
		t.Errorf("r2 released %v when it stopped, holding %v; want nothing released (its store keeps them for a restart)", rel, goneOwned)
	}
	if got := gone.m.Owned(); len(got) != 0 {
		t.Errorf("r2 still names %v as its own once stopped", got)
	}
	for _, r := range stay {
		for _, p := range before[r.id] {
			if owner[p] != r.id {
				t.Errorf("partition %d moved from %s to %s when r2 left", p, r.id, owner[p])
			}
		}
		// Every acquisition since the move started from what the ledger stored: 0 for r2's
		// former partitions (never applied here), the stored offset for the kept ones.
		for _, a := range r.l.acquisitions()[acquiredBefore[r.id]:] {
			if slices.Contains(before[r.id], a.p) {
				continue
			}
			if a.from != 0 {
				t.Errorf("%s acquired r2's partition %d from %d, its ledger had nothing", r.id, a.p, a.from)
			}
		}
	}
	produce(t, pr, "c", 120, want)
	waitfor.Cond(t, 30*time.Second, "the new owners applying every request", func() bool { return caughtUp(b, stay, owner) })
	checkShares(t, b, stay, owner, want)
	waitfor.Cond(t, 10*time.Second, "the directory naming the new owners", func() bool { return directoryAgrees(dir, owner) })
	checkDirectory(t, dir, owner)

	// r2 comes back on its ledger: a partition it gets back is read from the offset its
	// ledger stored (reading it from 0 again would apply its requests twice), a new one from 0.
	back := startReplicaOn(t, memberConfig(conn, "r2"), gone.l)
	reps = []*replica{reps[0], back, reps[2]}
	waitfor.Cond(t, 60*time.Second, "r2 back, and every partition owned once", func() bool {
		owner = ownership(reps...)
		return owner != nil && len(back.m.Owned()) == testPartitions/3
	})
	produce(t, pr, "d", 60, want)
	waitfor.Cond(t, 30*time.Second, "the owners applying every request", func() bool { return caughtUp(b, reps, owner) })
	checkShares(t, b, reps, owner, want)
	resumed := 0
	for _, a := range back.l.acquisitions() {
		if a.from > 0 {
			resumed++
		}
	}
	t.Logf("r2 back: %d of its %d partitions resumed from its ledger's offsets", resumed, testPartitions/3)
}

// writeCopies writes to partition 0 two records that the cluster signed for other records:
// a deletion under another key, and a registration of an id of another partition.
func writeCopies(t *testing.T, conn stream.ConnConfig) {
	t.Helper()
	at := time.Now().UTC().Format(time.RFC3339Nano)
	writeSigned(t, conn, 0,
		kafka.Message{Key: []byte("other"), Value: []byte(`{"kind":"delete","id":"x-3","replica":"r","at":"` + at + `"}`)},
		kafka.Message{Key: []byte("x-7"), Value: []byte(`{"kind":"register","id":"x-7","replica":"r","at":"` + at + `","ce":{"i":7}}`)})
}

// writeSigned writes msgs to partition p of the test topic, each signed under testKeys.
func writeSigned(t *testing.T, conn stream.ConnConfig, p int, msgs ...kafka.Message) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	tr, err := conn.Transport(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.CloseIdleConnections()
	for i := range msgs {
		msgs[i].Headers = []kafka.Header{{Key: clusterkey.Header, Value: Sign(testKeys(), msgs[i].Value)}}
	}
	w := &kafka.Writer{Addr: kafka.TCP(conn.Brokers...), Topic: testTopic, Transport: tr, RequiredAcks: kafka.RequireAll,
		Balancer: kafka.BalancerFunc(func(kafka.Message, ...int) int { return p }), BatchTimeout: time.Millisecond}
	defer w.Close()
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
}

// testDirectory is a Directory of the test group's owners, closed with the test.
func testDirectory(t *testing.T, conn stream.ConnConfig) *Directory {
	t.Helper()
	dir, err := NewDirectory(context.Background(), conn, testGroup, testTopic, testPartitions, testKeys(), testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dir.Close() })
	return dir
}

// testKeys is the cluster key of these tests.
func testKeys() *clusterkey.Keyring {
	k, err := clusterkey.Parse([]byte("t1:"+strings.Repeat("5a", 32)), "test")
	if err != nil {
		panic(err)
	}
	return k
}

// writeForged writes well-formed requests that do not authenticate, each to its id's
// partition: a deletion of a registered CE without an authenticator, a registration signed
// under another key with the cluster's key id, and one that carries the authenticator of
// another request. It returns how many it wrote.
func writeForged(t *testing.T, conn stream.ConnConfig) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	tr, err := conn.Transport(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.CloseIdleConnections()
	other, err := clusterkey.Parse([]byte("t1:"+strings.Repeat("a5", 32)), "another cluster's")
	if err != nil {
		t.Fatal(err)
	}
	enc := func(r Request) []byte {
		_, v, err := Encode(r)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	at := time.Now().UTC()
	del := enc(Request{Kind: KindDelete, ID: "a-0", Replica: "evil", At: at})
	reg := enc(Request{Kind: KindRegister, ID: "evil-1", Replica: "evil", At: at, CE: json.RawMessage(`{"i":1}`)})
	reg2 := enc(Request{Kind: KindRegister, ID: "evil-2", Replica: "evil", At: at, CE: json.RawMessage(`{"i":2}`)})
	msgs := []kafka.Message{
		{Key: []byte("a-0"), Value: del},
		{Key: []byte("evil-1"), Value: reg, Headers: []kafka.Header{{Key: clusterkey.Header, Value: Sign(other, reg)}}},
		{Key: []byte("evil-2"), Value: reg2, Headers: []kafka.Header{{Key: clusterkey.Header, Value: Sign(testKeys(), reg)}}},
	}
	w := &kafka.Writer{Addr: kafka.TCP(conn.Brokers...), Topic: testTopic, Transport: tr, RequiredAcks: kafka.RequireAll,
		Balancer:     kafka.BalancerFunc(func(m kafka.Message, _ ...int) int { return Partition(string(m.Key), testPartitions) }),
		BatchTimeout: time.Millisecond}
	defer w.Close()
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	return len(msgs)
}

func directoryAgrees(dir *Directory, owner map[int]string) bool {
	for i := range 200 {
		id := fmt.Sprintf("dir-%d", i)
		o, err := dir.Owner(context.Background(), id)
		if err != nil || o.Replica != owner[Partition(id, testPartitions)] {
			return false
		}
	}
	return true
}

func checkDirectory(t *testing.T, dir *Directory, owner map[int]string) {
	t.Helper()
	for i := range 200 {
		id := fmt.Sprintf("dir-%d", i)
		o, err := dir.Owner(context.Background(), id)
		if err != nil {
			t.Fatalf("Owner(%q): %v", id, err)
		}
		want := owner[Partition(id, testPartitions)]
		if o.Replica != want || o.URL != "http://"+want+".test:8080" || o.MemberID == "" {
			t.Fatalf("Owner(%q) = %+v, want replica %s at http://%s.test:8080", id, o, want, want)
		}
	}
	all, err := dir.Owners(context.Background())
	if err != nil || len(all) != testPartitions {
		t.Fatalf("Owners: %d partitions, %v; want all %d", len(all), err, testPartitions)
	}
	for p, o := range all {
		if o.Replica != owner[p] || o.URL != "http://"+owner[p]+".test:8080" {
			t.Fatalf("Owners: partition %d owned by %+v, want %s", p, o, owner[p])
		}
	}
}

// cutter cuts a member off the broker, as a network partition or a paused process would:
// its connections are closed and new ones refused, so it can neither heartbeat nor leave.
type cutter struct {
	mu    sync.Mutex
	cut   bool
	conns []net.Conn
}

func (c *cutter) dial(ctx context.Context, network, address string) (net.Conn, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cut {
		return nil, &net.OpError{Op: "dial", Net: network, Err: errors.New("cut off by the test")}
	}
	conn, err := (&net.Dialer{}).DialContext(ctx, network, address)
	if err == nil {
		c.conns = append(c.conns, conn)
	}
	return conn, err
}

func (c *cutter) cutOff() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cut = true
	for _, conn := range c.conns {
		conn.Close()
	}
}

// A member cut off from the broker (it cannot heartbeat, nor leave) loses its partitions to
// the others once the group's session timeout passes, and releases them itself.
func TestMemberCutOffLosesPartitions(t *testing.T) {
	b, conn := startBroker(t)
	cut := &cutter{}
	cfg := memberConfig(conn, "r2")
	cfg.dial = cut.dial
	reps := []*replica{startReplica(t, memberConfig(conn, "r1")), startReplica(t, cfg), startReplica(t, memberConfig(conn, "r3"))}
	var owner map[int]string
	waitfor.Cond(t, 60*time.Second, "three members owning every partition once", func() bool {
		owner = ownership(reps...)
		return owner != nil && len(reps[0].m.Owned()) > 0 && len(reps[1].m.Owned()) > 0 && len(reps[2].m.Owned()) > 0
	})
	pr := testProducer(t, conn)
	want := produced{}
	produce(t, pr, "a", 300, want)
	waitfor.Cond(t, 30*time.Second, "the owners applying every request", func() bool { return caughtUp(b, reps, owner) })

	before := map[string][]int{"r1": reps[0].m.Owned(), "r3": reps[2].m.Owned()}
	cutOwned, cutReleased := reps[1].m.Owned(), len(reps[1].l.releases())
	start := time.Now()
	cut.cutOff()
	stay := []*replica{reps[0], reps[2]}
	waitfor.Cond(t, 60*time.Second, "r1 and r3 owning every partition", func() bool { owner = ownership(stay...); return owner != nil })
	t.Logf("takeover after a member was cut off (session timeout %v, heartbeat %v): %v", testSession, testHeartbeat, time.Since(start))
	for _, r := range stay {
		for _, p := range before[r.id] {
			if owner[p] != r.id {
				t.Errorf("partition %d moved from %s to %s when r2 was cut off", p, r.id, owner[p])
			}
		}
	}
	produce(t, pr, "b", 120, want)
	waitfor.Cond(t, 30*time.Second, "the new owners applying every request", func() bool { return caughtUp(b, stay, owner) })
	checkShares(t, b, stay, owner, want)
	waitfor.Cond(t, 30*time.Second, "the cut-off member giving its partitions up", func() bool { return len(reps[1].m.Owned()) == 0 })
	waitReleased(t, reps[1].m, reps[1].l, cutReleased, cutOwned, "the cut-off member")
	if s := reps[1].m.Stats(); s.Lost != 1 {
		t.Errorf("the cut-off member counted %d losses of its partitions, want 1", s.Lost)
	}
}

func TestNewMemberRefusesAnotherPartitionCount(t *testing.T) {
	_, conn := startBroker(t)
	if _, err := NewMember(context.Background(), memberConfig(conn, "r1"), newLedger(), testLog(t)); err != nil {
		t.Fatal(err)
	}
	cfg := memberConfig(conn, "r2")
	cfg.Partitions = 6
	_, err := NewMember(context.Background(), cfg, newLedger(), testLog(t))
	var pm *PartitionsMismatchError
	if !errors.As(err, &pm) || pm.Have != testPartitions || pm.Configured != 6 {
		t.Fatalf("NewMember with 6 partitions on a topic of %d: %v, want a PartitionsMismatchError", testPartitions, err)
	}
	for _, s := range []string{testTopic, "replication.ce_partitions"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not name %q", err, s)
		}
	}
}

// A ledger that cannot store a batch stops the member (the daemon refuses to go on with a
// broken ledger); Run says which partition.
func TestApplyErrorStopsMember(t *testing.T) {
	_, conn := startBroker(t)
	l := newLedger()
	broken := errors.New("ledger: disk full")
	l.apply = func(int, []Request) error { return broken }
	m, err := NewMember(context.Background(), memberConfig(conn, "r1"), l, testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { done <- m.Run(ctx) }()
	pr := testProducer(t, conn)
	p, _, err := pr.Send(ctx, Request{Kind: KindDelete, ID: "ce-1", Replica: "r1", At: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, broken) || !strings.Contains(err.Error(), fmt.Sprintf("partition %d", p)) {
			t.Fatalf("Run: %v, want the ledger's error for partition %d", err, p)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not stop within 30s of a failed Apply")
	}
	if got := m.Owned(); len(got) != 0 {
		t.Errorf("a stopped member still holds %v", got)
	}
	// The store keeps the partition: a failure is no reason to empty it, and a restart that
	// is not given p back releases it then (MemberConfig.Held).
	if rel := l.releases(); len(rel) != 0 {
		t.Errorf("the member that failed released %v; want nothing released", rel)
	}
}

// Run may be called once: a second call, while the first runs, returns an error (whatever its
// context) and leaves the first running.
func TestRunCalledTwiceIsRefused(t *testing.T) {
	_, conn := startBroker(t)
	r := startReplica(t, memberConfig(conn, "r1"))
	waitfor.Cond(t, 30*time.Second, "the member owning every partition", func() bool { return ownership(r) != nil })
	over, cancel := context.WithCancel(context.Background())
	cancel() // a second run would return at once, and with no error
	if err := r.m.Run(over); err == nil || !strings.Contains(err.Error(), "Run called twice") {
		t.Errorf("a second Run: %v, want an error saying Run was called twice", err)
	}
	if ownership(r) == nil {
		t.Errorf("the member owns %v after a second Run, want every partition", r.m.Owned())
	}
}

// A member that starts on a store still holding every partition (a replica SIGKILLed while it
// owned them all, restarted while another took them over) releases, at its first generation,
// the partitions that generation leaves with the other member, and only those, once: a later
// generation releases only what the member lost in it.
func TestMemberReleasesPartitionsHeldFromACrash(t *testing.T) {
	_, conn := startBroker(t)
	r1 := startReplica(t, memberConfig(conn, "r1"))
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition", func() bool { return ownership(r1) != nil })
	cfg := memberConfig(conn, "r2")
	held := make([]int, testPartitions)
	l := newLedger()
	for p := range held {
		held[p] = p
		l.next[p] = 0
	}
	cfg.Held = held
	r2 := startReplicaOn(t, cfg, l)
	var owner map[int]string
	waitfor.Cond(t, 60*time.Second, "r1 and r2 sharing the partitions", func() bool {
		owner = ownership(r1, r2)
		return owner != nil && len(r1.m.Owned()) > 0 && len(r2.m.Owned()) > 0
	})
	var want []int
	for p := range testPartitions {
		if owner[p] == "r1" {
			want = append(want, p)
		}
	}
	waitReleased(t, r2.m, l, 0, want, "r2, which held every partition, beside r1")

	gen := r2.m.LastGeneration()
	kept := r2.m.Owned()
	r3 := startReplica(t, memberConfig(conn, "r3"))
	waitfor.Cond(t, 60*time.Second, "r1, r2 and r3 sharing the partitions", func() bool {
		owner = ownership(r1, r2, r3)
		return owner != nil && r2.m.LastGeneration() > gen && len(r3.m.Owned()) > 0
	})
	var lost []int
	for _, p := range kept {
		if owner[p] != "r2" {
			lost = append(lost, p)
		}
	}
	waitReleased(t, r2.m, l, len(want), lost, "r2, once r3 joined")
}

// Settled is closed at once for a member that holds nothing from an earlier run; a member that
// does stays unsettled while its first generation's releases of the partitions it gives to
// others run (ReleaseWait set past them), and is settled before it acquires any partition: a
// batch of requests may wait for what Settled holds back.
func TestSettledOnceTheHeldPartitionsOthersOwnAreReleased(t *testing.T) {
	_, conn := startBroker(t)
	r1 := startReplica(t, memberConfig(conn, "r1"))
	select {
	case <-r1.m.Settled():
	default:
		t.Error("a member that holds nothing from an earlier run is not settled")
	}
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition", func() bool { return ownership(r1) != nil })

	cfg := memberConfig(conn, "r2")
	cfg.ReleaseWait = time.Minute
	l := newLedger()
	for p := range testPartitions {
		cfg.Held = append(cfg.Held, p)
		l.next[p] = 0
	}
	gate := make(chan struct{})
	l.release = func(ctx context.Context, _ int) {
		select {
		case <-gate:
		case <-ctx.Done():
		}
	}
	var (
		m         atomic.Pointer[Member]
		unsettled atomic.Int32
	)
	l.acquire = func(int) {
		select {
		case <-m.Load().Settled():
		default:
			unsettled.Add(1)
		}
	}
	r2 := startReplicaOn(t, cfg, l)
	m.Store(r2.m)
	waitfor.Cond(t, 60*time.Second, "r2's first generation releasing what r1 keeps", func() bool { return len(r2.m.Releasing()) > 0 })
	select {
	case <-r2.m.Settled():
		t.Fatalf("r2 settled while it releases %v", r2.m.Releasing())
	case <-time.After(500 * time.Millisecond):
	}
	if a := l.acquisitions(); len(a) > 0 {
		t.Errorf("r2 acquired %v while it releases %v", a, r2.m.Releasing())
	}
	close(gate)
	select {
	case <-r2.m.Settled():
	case <-time.After(30 * time.Second):
		t.Fatal("r2 not settled within 30s of its releases' end")
	}
	waitfor.Cond(t, 60*time.Second, "r1 and r2 sharing the partitions", func() bool {
		return ownership(r1, r2) != nil && len(r2.m.Owned()) > 0
	})
	if n := unsettled.Load(); n > 0 {
		t.Errorf("r2 acquired %d partitions before it was settled", n)
	}
}

// TestFetchFailuresWarnOncePerEpisode: failed fetches of a partition are said at WARN once they
// have gone on for fetchWarnAfter, once per episode, and a fetch that works after that says so
// at INFO; an episode shorter than fetchWarnAfter says nothing above DEBUG.
func TestFetchFailuresWarnOncePerEpisode(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	fail, work := "fail", "work"
	for _, tc := range []struct {
		name  string
		steps []string        // fail or work, in order
		at    []time.Duration // since t0, one per step
		want  []string        // the lines logged, "LEVEL partition failing_for|failed_for"
	}{
		{"a short episode", []string{fail, fail, work}, []time.Duration{0, 9 * time.Second, 9500 * time.Millisecond}, nil},
		{"a long episode", []string{fail, fail, fail, fail, work},
			[]time.Duration{0, 5 * time.Second, fetchWarnAfter, 20 * time.Second, 21 * time.Second},
			[]string{"WARN failing_for=10s", "INFO failed_for=21s"}},
		{"two episodes", []string{fail, fail, work, fail, fail, work},
			[]time.Duration{0, 11 * time.Second, 12 * time.Second, 13 * time.Second, 22 * time.Second, 23 * time.Second},
			[]string{"WARN failing_for=11s", "INFO failed_for=12s"}},
		{"two long episodes", []string{fail, fail, work, fail, fail, work},
			[]time.Duration{0, 11 * time.Second, 12 * time.Second, 13 * time.Second, 23 * time.Second, 24 * time.Second},
			[]string{"WARN failing_for=11s", "INFO failed_for=12s", "WARN failing_for=10s", "INFO failed_for=11s"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			log := slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelInfo,
				ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
					if a.Key == slog.TimeKey {
						return slog.Attr{}
					}
					return a
				}}))
			var f fetchFailures
			for i, s := range tc.steps {
				if s == fail {
					f.failed(log, t0.Add(tc.at[i]), 3, errors.New("leader not available"))
				} else {
					f.worked(log, t0.Add(tc.at[i]), 3)
				}
			}
			var got []string
			for line := range strings.Lines(out.String()) {
				level, _, _ := strings.Cut(strings.TrimPrefix(line, "level="), " ")
				if !strings.Contains(line, " partition=3 ") {
					t.Errorf("a line without the partition: %s", line)
				}
				for _, f := range strings.Fields(line) {
					if strings.HasPrefix(f, "failing_for=") || strings.HasPrefix(f, "failed_for=") {
						got = append(got, level+" "+f)
					}
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("logged %q; want %q\n%s", got, tc.want, out.String())
			}
		})
	}
}

// TestRequestsDeletedUnreadAreCountedLost: requests the topic's retention deleted before a
// member read them are handed to Lost, from the offset the ledger held to the partition's log
// start, once; the member reads on from there and applies every request still in the topic.
func TestRequestsDeletedUnreadAreCountedLost(t *testing.T) {
	b, conn := startBrokerWith(t, broker.Config{RetentionCheckInterval: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tr, err := conn.Transport(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.CloseIdleConnections()
	createTopic(t, conn, halfHourRetention)
	// p+1 records an hour old in partition p, then requests of now: retention deletes the old.
	var old []kafka.Message
	for p := range testPartitions {
		for range p + 1 {
			old = append(old, kafka.Message{Partition: p, Value: []byte(`{}`), Time: time.Now().Add(-time.Hour)})
		}
	}
	w := &kafka.Writer{Addr: kafka.TCP(conn.Brokers...), Topic: testTopic, Transport: tr, RequiredAcks: kafka.RequireAll,
		Balancer: kafka.BalancerFunc(func(m kafka.Message, _ ...int) int { return m.Partition }), BatchTimeout: time.Millisecond}
	defer w.Close()
	if err := w.WriteMessages(ctx, old...); err != nil {
		t.Fatal(err)
	}
	want := produced{}
	produce(t, testProducer(t, conn), "kept", 60, want)
	b.ApplyRetention()
	for p, start := range b.LogStartOffsets(testTopic) {
		if start != int64(p+1) {
			t.Fatalf("partition %d starts at offset %d after retention, want %d", p, start, p+1)
		}
	}

	r := startReplica(t, memberConfig(conn, "r1"))
	var owner map[int]string
	waitfor.Cond(t, 30*time.Second, "the member owning every partition and applying every request", func() bool {
		owner = ownership(r)
		return owner != nil && caughtUp(b, []*replica{r}, owner)
	})
	checkShares(t, b, []*replica{r}, owner, want)
	r.l.mu.Lock()
	lost := maps.Clone(r.l.lost)
	r.l.mu.Unlock()
	total := int64(0)
	for p := range testPartitions {
		if lost[p] != int64(p+1) {
			t.Errorf("partition %d: %d requests counted lost, want %d", p, lost[p], p+1)
		}
		total += lost[p]
	}
	if s := r.m.Stats(); s.Gaps != total {
		t.Errorf("Stats().Gaps = %d, want %d", s.Gaps, total)
	}
}

// A question to the Directory whose context is already over fails without emptying the cache:
// the next caller, within MinRefresh, gets the owner, not the first caller's context error.
func TestDirectoryKeepsItsCacheForACallerThatGaveUp(t *testing.T) {
	_, conn := startBroker(t)
	r := startReplica(t, memberConfig(conn, "r1"))
	waitfor.Cond(t, 30*time.Second, "the member owning every partition", func() bool { return ownership(r) != nil })
	dir := testDirectory(t, conn)
	if _, err := dir.Owner(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	dir.MaxAge = 0 // every question looks the group up
	over, cancel := context.WithCancel(context.Background())
	cancel()
	dir.Owner(over, "a") // fails, or answers from the cache: either way the cache stays
	dir.MaxAge = time.Hour
	if o, err := dir.Owner(context.Background(), "a"); err != nil || o.Replica != "r1" {
		t.Fatalf("Owner after a caller gave up: %+v, %v; want r1 from the cache", o, err)
	}
}

// failPartitions makes kc answer every request of kind key (Fetch, ListOffsets or Produce) with
// code for each partition the request names, after calling seen (when not nil).
func failPartitions(t *testing.T, kc *kfake.Cluster, key kmsg.Key, code kafka.Error, seen func()) {
	failPartitionsWhen(t, kc, key, code, func(kmsg.Request) bool {
		if seen != nil {
			seen()
		}
		return true
	})
}

// failPartitionsWhen is failPartitions for the requests that fail reports true of; kc serves the
// others. With code 0, kc closes the connection instead of answering.
func failPartitionsWhen(t *testing.T, kc *kfake.Cluster, key kmsg.Key, code kafka.Error, fail func(req kmsg.Request) bool) {
	kc.ControlKey(int16(key), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		if !fail(req) {
			return nil, nil, false
		}
		if code == 0 {
			return nil, errors.New("connection closed by the test"), true
		}
		switch r := req.(type) {
		case *kmsg.FetchRequest:
			res := r.ResponseKind().(*kmsg.FetchResponse)
			res.Version = r.Version
			for _, rt := range r.Topics {
				st := kmsg.NewFetchResponseTopic()
				st.Topic, st.TopicID = rt.Topic, rt.TopicID
				for _, rp := range rt.Partitions {
					sp := kmsg.NewFetchResponseTopicPartition()
					sp.Partition, sp.ErrorCode = rp.Partition, int16(code)
					st.Partitions = append(st.Partitions, sp)
				}
				res.Topics = append(res.Topics, st)
			}
			return res, nil, true
		case *kmsg.ListOffsetsRequest:
			res := r.ResponseKind().(*kmsg.ListOffsetsResponse)
			res.Version = r.Version
			for _, rt := range r.Topics {
				st := kmsg.NewListOffsetsResponseTopic()
				st.Topic = rt.Topic
				for _, rp := range rt.Partitions {
					sp := kmsg.NewListOffsetsResponseTopicPartition()
					sp.Partition, sp.ErrorCode = rp.Partition, int16(code)
					st.Partitions = append(st.Partitions, sp)
				}
				res.Topics = append(res.Topics, st)
			}
			return res, nil, true
		case *kmsg.ProduceRequest:
			res := r.ResponseKind().(*kmsg.ProduceResponse)
			res.Version = r.Version
			for _, rt := range r.Topics {
				st := kmsg.NewProduceResponseTopic()
				st.Topic = rt.Topic
				for _, rp := range rt.Partitions {
					sp := kmsg.NewProduceResponseTopicPartition()
					sp.Partition, sp.ErrorCode = rp.Partition, int16(code)
					st.Partitions = append(st.Partitions, sp)
				}
				res.Topics = append(res.Topics, st)
			}
			return res, nil, true
		}
		t.Errorf("failPartitions: a %T, want a Fetch, ListOffsets or Produce request", req)
		return nil, nil, false
	})
}

// A broker that refuses the session timeout asked for (below its group.min.session.timeout.ms,
// 6s on Kafka and kfake by default) leaves the member joining for ever: JoinError, which
// /readyz shows, says which setting to change.
func TestJoinErrorNamesTheSessionTimeoutTheBrokerRefuses(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(testPartitions, testTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	conn := stream.ConnConfig{Brokers: kc.ListenAddrs(), DialTimeout: 5 * time.Second}
	r := startReplica(t, memberConfig(conn, "r1"))
	waitfor.Cond(t, 20*time.Second, "JoinError naming replication.session_timeout and group.min.session.timeout.ms", func() bool {
		err := r.m.JoinError()
		return err != nil && strings.Contains(err.Error(), "replication.session_timeout") && strings.Contains(err.Error(), "group.min.session.timeout.ms")
	})
}
