package ceshare

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/stream"
)

// holdGroup holds every group request (heartbeat, join, sync) of one member at the broker, as
// a paused process's would wait: the group goes on without it.
type holdGroup struct {
	kc       *kfake.Cluster
	mu       sync.Mutex
	member   string
	released chan struct{}
}

func (h *holdGroup) control(req kmsg.Request) (kmsg.Response, error, bool) {
	h.kc.KeepControl()
	var id string
	switch r := req.(type) {
	case *kmsg.HeartbeatRequest:
		id = r.MemberID
	case *kmsg.JoinGroupRequest:
		id = r.MemberID
	case *kmsg.SyncGroupRequest:
		id = r.MemberID
	}
	h.mu.Lock()
	held := h.member != "" && id == h.member
	h.mu.Unlock()
	if held {
		h.kc.SleepControl(func() { <-h.released })
	}
	return nil, nil, false
}

func (h *holdGroup) hold(member string) {
	h.mu.Lock()
	h.member = member
	h.mu.Unlock()
}

func (h *holdGroup) release() {
	h.mu.Lock()
	h.member = ""
	h.mu.Unlock()
	close(h.released)
}

// A member that misses a generation (paused past its session: the group gave its partitions
// to another member, which claimed them) and is given them back in a later one claims them
// again: the other member's claim would otherwise stay in force, and every state the member
// writes for them would be taken for a late write.
func TestMemberThatMissedAGenerationClaimsAgain(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the members' cleanups
	h := &holdGroup{kc: kc, released: make(chan struct{})}
	for _, key := range []kmsg.Key{kmsg.Heartbeat, kmsg.JoinGroup, kmsg.SyncGroup} {
		kc.ControlKey(int16(key), h.control)
	}
	t.Cleanup(func() {
		select {
		case <-h.released:
		default:
			h.release()
		}
	})
	conn := stream.ConnConfig{Brokers: kc.ListenAddrs(), DialTimeout: 5 * time.Second}
	// s owns everything, then r joins and is given the upper half (the sticky balancer keeps
	// each member's first partitions in partition order).
	s := startReplica(t, statefulConfig(conn, "s"))
	waitfor.Cond(t, 60*time.Second, "s owning every partition", func() bool { return ownership(s) != nil })
	r := startReplica(t, statefulConfig(conn, "r"))
	waitfor.Cond(t, 60*time.Second, "r and s sharing the partitions", func() bool {
		return ownership(s, r) != nil && len(r.m.Owned()) > 0 && len(s.m.Owned()) > 0
	})
	before := r.m.Owned()
	dir := testDirectory(t, conn)
	members, err := dir.Members(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var rid string
	for _, m := range members {
		if m.Replica == "r" {
			rid = m.MemberID
		}
	}
	if rid == "" {
		t.Fatalf("r is not among the group's members %+v", members)
	}
	lastGen := r.m.LastGeneration()

	// r pauses: the group evicts it, and s takes (and claims) every partition.
	h.hold(rid)
	waitfor.Cond(t, 60*time.Second, "s owning every partition again", func() bool {
		return len(s.m.Owned()) == testPartitions && s.m.Generation() > lastGen
	})
	waitfor.Cond(t, 30*time.Second, "s claiming r's partitions", func() bool {
		for _, p := range before {
			if c, ok := claimInForce(t, conn, p); !ok || c.Replica != "s" {
				return false
			}
		}
		return true
	})
	// r resumes, and the group gives it back partitions it held before.
	h.release()
	waitfor.Cond(t, 60*time.Second, "r back in the group with partitions", func() bool {
		return r.m.Generation() > lastGen && len(r.m.Owned()) > 0 && ownership(s, r) != nil
	})
	back := slices.DeleteFunc(r.m.Owned(), func(p int) bool { return !slices.Contains(before, p) })
	if len(back) == 0 {
		t.Fatalf("r was given %v after its pause, none of %v it held before: the test shows nothing", r.m.Owned(), before)
	}
	for _, p := range back {
		waitfor.Cond(t, 30*time.Second, "r's claim in force on the partitions it got back", func() bool {
			c, ok := claimInForce(t, conn, p)
			return ok && c.Replica == "r" && c.Generation == r.m.LastGeneration()
		})
	}
}

// claimInForce is the claim in force on partition p of the state topic (the greatest by term,
// then generation); ok is false when p holds none.
func claimInForce(t *testing.T, conn stream.ConnConfig, p int) (c Claim, ok bool) {
	t.Helper()
	for _, msg := range kafkatest.ReadPartition(t, conn.Brokers, testStateTopic, p) {
		if !isClaim(msg.Key) {
			continue
		}
		got, err := DecodeClaim(p, msg.Key, msg.Value)
		if err != nil {
			t.Fatal(err)
		}
		if !ok || got.after(c) {
			c, ok = got, true
		}
	}
	return c, ok
}

// A client that joins the CE group with member data the cluster's key did not sign (a replica
// with another key file, or anyone the broker lets in) is given no partition by the leader,
// which counts and logs it once, and is no member to a Directory: no question, and no token,
// goes to the URL it names.
func TestMemberOutsideTheClusterGetsNothing(t *testing.T) {
	_, conn := startBroker(t)
	var mu sync.Mutex
	refused := map[string]int{}
	cfg := memberConfig(conn, "r1")
	cfg.OnUnauthenticated = func(source string, p int, off int64) {
		mu.Lock()
		defer mu.Unlock()
		refused[source]++
	}
	r1 := startReplica(t, cfg)
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition", func() bool { return ownership(r1) != nil })
	gen := r1.m.Generation()

	evil := memberConfig(conn, "evil")
	other, err := clusterkey.Parse([]byte("t1:"+strings.Repeat("a5", 32)), "another cluster's")
	if err != nil {
		t.Fatal(err)
	}
	evil.Keys = other
	outsider := startReplica(t, evil)
	waitfor.Cond(t, 60*time.Second, "a generation with the outsider", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return r1.m.Generation() > gen && outsider.m.Generation() > 0 && refused[GroupSource(testGroup)] > 0
	})
	if got := outsider.m.Owned(); len(got) != 0 {
		t.Errorf("the outsider was given %v", got)
	}
	if ownership(r1) == nil {
		t.Errorf("r1 owns %v of %d partitions with an outsider in the group", r1.m.Owned(), testPartitions)
	}
	mu.Lock()
	if n := refused[GroupSource(testGroup)]; n != 1 || len(refused) != 1 {
		t.Errorf("refusals counted %v, want the outsider once under %q", refused, GroupSource(testGroup))
	}
	mu.Unlock()

	dir := testDirectory(t, conn)
	members, err := dir.Members(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(members) != 1 || members[0].Replica != "r1" {
		t.Errorf("the directory's members %+v, want r1 only", members)
	}
	owners, err := dir.Owners(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for p, o := range owners {
		if o.Replica != "r1" {
			t.Errorf("partition %d owned by %+v, want r1", p, o)
		}
	}

	// Once the outsider left the group, the directory's next look-up forgets it: the members
	// it refused do not pile up with every one that came and went.
	dir.rmu.Lock()
	n := len(dir.refused)
	dir.rmu.Unlock()
	if n != 1 {
		t.Fatalf("the directory refused %d members, want the outsider", n)
	}
	outsider.stop(t)
	waitfor.Cond(t, 30*time.Second, "the group without the outsider", func() bool {
		g, err := dir.describe(context.Background())
		return err == nil && len(g.Members) == 1
	})
	dir.MinRefresh = 0
	waitfor.Cond(t, 30*time.Second, "r1 owning every partition again", func() bool {
		_, err := dir.Owners(context.Background())
		return err == nil
	})
	dir.rmu.Lock()
	defer dir.rmu.Unlock()
	if len(dir.refused) != 0 {
		t.Errorf("the directory still remembers %v, which left the group", dir.refused)
	}
}

// A Directory asks the broker one look-up at a time, and a caller waiting for the look-up in
// flight gives up when its own context ends, not when the broker answers the other caller.
func TestDirectoryCallerGivesUpWhileALookUpIsSlow(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	conn := stream.ConnConfig{Brokers: kc.ListenAddrs(), DialTimeout: 5 * time.Second}
	r := startReplica(t, memberConfig(conn, "r1"))
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition", func() bool { return ownership(r) != nil })
	dir := testDirectory(t, conn)
	dir.MaxAge, dir.MinRefresh = 0, 0 // every question looks the group up

	var mu sync.Mutex
	described := 0
	slow := make(chan struct{})
	defer func() {
		select {
		case <-slow:
		default:
			close(slow)
		}
	}()
	kc.ControlKey(int16(kmsg.DescribeGroups), func(kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		mu.Lock()
		described++
		mu.Unlock()
		kc.SleepControl(func() { <-slow })
		return nil, nil, false
	})
	first := make(chan error, 1)
	go func() {
		_, err := dir.Owners(context.Background())
		first <- err
	}()
	waitfor.Cond(t, 10*time.Second, "the first look-up at the broker", func() bool { mu.Lock(); defer mu.Unlock(); return described == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := dir.Owner(ctx, "a")
		done <- err
	}()
	// The look-up in flight is held until the end of the test: a caller that returns at all
	// returned at its own deadline.
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("a caller whose context ended still waits for another caller's look-up")
	}
	mu.Lock()
	if described != 1 {
		t.Errorf("%d look-ups asked of the broker, want 1 (the one in flight)", described)
	}
	mu.Unlock()
	close(slow)
	if err := <-first; err != nil {
		t.Errorf("the first caller: %v", err)
	}
}

// A release that takes long (a large share's deletion) does not hold the member's other
// partitions: they are taken up after ReleaseWait while the release goes on, to its end. A
// partition given back meanwhile is acquired only once its release ended.
func TestSlowReleaseGoesOnInTheBackground(t *testing.T) {
	b, conn := startBroker(t)
	gate := make(chan struct{})
	l := newLedger()
	var mu sync.Mutex
	releasing := map[int]bool{}
	var overlaps []int
	l.release = func(ctx context.Context, p int) {
		mu.Lock()
		releasing[p] = true
		mu.Unlock()
		select {
		case <-gate:
		case <-ctx.Done():
		}
		mu.Lock()
		delete(releasing, p)
		mu.Unlock()
	}
	l.acquire = func(p int) {
		mu.Lock()
		defer mu.Unlock()
		if releasing[p] {
			overlaps = append(overlaps, p)
		}
	}
	cfg := memberConfig(conn, "r1")
	cfg.ReleaseWait = 200 * time.Millisecond
	r1 := startReplicaOn(t, cfg, l)
	waitfor.Cond(t, 60*time.Second, "r1 owning every partition", func() bool { return ownership(r1) != nil })
	r2 := startReplica(t, memberConfig(conn, "r2"))
	reps := []*replica{r1, r2}
	var owner map[int]string
	waitfor.Cond(t, 60*time.Second, "r1 and r2 sharing the partitions", func() bool {
		owner = ownership(reps...)
		return owner != nil && len(r1.m.Owned()) > 0 && len(r2.m.Owned()) > 0
	})
	gave := testPartitions - len(r1.m.Owned())

	// r1's releases are held: requests of every partition are applied all the same.
	pr := testProducer(t, conn)
	want := produced{}
	produce(t, pr, "a", 60, want)
	waitfor.Cond(t, 30*time.Second, "the owners applying every request while r1's releases run", func() bool { return caughtUp(b, reps, owner) })
	if got := l.releases(); len(got) != 0 {
		t.Fatalf("r1 released %v while its releases were held", got)
	}
	if got := r1.m.Releasing(); len(got) != gave {
		t.Errorf("r1 is releasing %v, want the %d partitions it gave r2", got, gave)
	}
	checkShares(t, b, reps, owner, want)

	// r2 leaves: r1 is given back the partitions it is still releasing, and waits for them.
	gen := r1.m.Generation()
	r2.stop(t)
	waitfor.Cond(t, 60*time.Second, "r1 in a generation without r2", func() bool {
		g := r1.m.Generation()
		return g > gen && len(r1.m.Assigned()) == testPartitions
	})
	if got := len(r1.m.Owned()); got != testPartitions-gave {
		t.Errorf("r1 holds %d partitions while %d of its %d are still being released", got, gave, testPartitions)
	}
	close(gate)
	waitfor.Cond(t, 30*time.Second, "r1 owning every partition again", func() bool { return ownership(r1) != nil })
	if len(l.releases()) != gave {
		t.Errorf("r1 released %v, want the %d partitions it gave r2", l.releases(), gave)
	}
	mu.Lock()
	if len(overlaps) > 0 {
		t.Errorf("partitions %v acquired while their release still ran", overlaps)
	}
	mu.Unlock()
	produce(t, pr, "b", 60, want)
	owner = ownership(r1)
	waitfor.Cond(t, 30*time.Second, "r1 applying every request", func() bool { return caughtUp(b, []*replica{r1}, owner) })
}
