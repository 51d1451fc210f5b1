package ceshare

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/stream"
)

// A partition whose acquisition a generation's end cut short (its claim on the CE state topic
// not yet written, or its states not yet read) is acquired afresh by the next generation that
// gives it to the member, even one that keeps it: it is claimed then, as any partition acquired
// afresh, so that the claim in force on each partition names its owner.
func TestAcquisitionCutShortByAGenerationEndIsDoneAgain(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the members' cleanups
	// The state topic's offsets cannot be listed (a transient error, retried) until released.
	var mu sync.Mutex
	refused := map[int32]bool{}
	released := false
	kc.ControlKey(int16(kmsg.ListOffsets), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		mu.Lock()
		defer mu.Unlock()
		for _, tp := range req.(*kmsg.ListOffsetsRequest).Topics {
			if tp.Topic == testStateTopic && !released {
				for _, p := range tp.Partitions {
					refused[p.Partition] = true
				}
				return nil, errors.New("connection closed by the test"), true
			}
		}
		return nil, nil, false
	})
	conn := stream.ConnConfig{Brokers: kc.ListenAddrs(), DialTimeout: 5 * time.Second}
	r1 := startReplica(t, statefulConfig(conn, "r1"))
	waitfor.Cond(t, 60*time.Second, "r1 acquiring every partition, held at the state topic", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(refused) == testPartitions
	})
	first := r1.m.LastGeneration()
	// r2 joins: the generation whose acquisitions are held ends, and r1 keeps some partitions.
	r2 := startReplica(t, statefulConfig(conn, "r2"))
	waitfor.Cond(t, 60*time.Second, "a generation that shares the partitions between r1 and r2", func() bool {
		g := r1.m.Generation()
		return g > first && r2.m.Generation() == g && len(r1.m.Assigned()) > 0 && len(r2.m.Assigned()) > 0
	})
	kept := r1.m.Assigned()
	mu.Lock()
	released = true
	mu.Unlock()
	var owner map[int]string
	waitfor.Cond(t, 60*time.Second, "r1 and r2 owning every partition, caught up", func() bool {
		owner = ownership(r1, r2)
		return owner != nil
	})
	if !slices.Equal(r1.m.Owned(), kept) {
		t.Fatalf("r1 owns %v, not the %v it kept: the test shows nothing", r1.m.Owned(), kept)
	}
	// A partition is ready only once its acquisition, the claim included, is done.
	for p := range testPartitions {
		if c, ok := claimInForce(t, conn, p); !ok || c.Replica != owner[p] {
			t.Errorf("partition %d, owned by %s: the claim in force is %+v (any: %v)", p, owner[p], c, ok)
		}
	}
}

// endHooks is a ledger whose Acquire or Apply (hold), while holding, waits for the generation's
// end and returns its context's error, as a store's call cut short by the end does.
type endHooks struct {
	*ledger
	hold    string
	holding atomic.Bool
	held    atomic.Int64 // calls held
}

func (h *endHooks) wait(ctx context.Context) error {
	h.held.Add(1)
	<-ctx.Done()
	h.holding.Store(false)
	return ctx.Err()
}

func (h *endHooks) Acquire(ctx context.Context, p int) (int64, *Witness, error) {
	if h.hold == "Acquire" && h.holding.Load() {
		return 0, nil, h.wait(ctx)
	}
	return h.ledger.Acquire(ctx, p)
}

func (h *endHooks) Apply(ctx context.Context, p int, reqs []Request, next int64, w *Witness) error {
	if h.hold == "Apply" && h.holding.Load() {
		return h.wait(ctx)
	}
	return h.ledger.Apply(ctx, p, reqs, next, w)
}

// A hook that returns its context's error because the generation ended (a rebalance) does not
// stop the member: it takes part in the next generation and reads its partitions there.
func TestHookCutShortByAGenerationEndDoesNotStopTheMember(t *testing.T) {
	for _, hold := range []string{"Acquire", "Apply"} {
		t.Run(hold, func(t *testing.T) {
			b, conn := startBroker(t)
			createTopic(t, conn)
			want := produced{}
			produce(t, testProducer(t, conn), "a", 60, want)
			l := newLedger()
			h := &endHooks{ledger: l, hold: hold}
			h.holding.Store(true)
			r1 := startReplicaWith(t, memberConfig(conn, "r1"), l, h, testLog(t))
			waitfor.Cond(t, 60*time.Second, "a call of "+hold+" held", func() bool { return h.held.Load() > 0 })
			r2 := startReplica(t, memberConfig(conn, "r2"))
			reps := []*replica{r1, r2}
			var owner map[int]string
			waitfor.Cond(t, 60*time.Second, "r1 and r2 sharing the partitions, caught up", func() bool {
				owner = ownership(reps...)
				return owner != nil && len(r1.m.Owned()) > 0 && len(r2.m.Owned()) > 0 && caughtUp(b, reps, owner)
			})
			checkShares(t, b, reps, owner, want)
			if g := r1.m.Stats().Generations; g < 2 {
				t.Errorf("r1 took part in %d generations, want the one that ended and the one it shares", g)
			}
		})
	}
}
