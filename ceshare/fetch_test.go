package ceshare

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/stream"
)

// testCluster starts a kfake cluster that tests may control, closed when the test ends (after
// the members' cleanups, registered later), and returns its connection settings.
func testCluster(t *testing.T) (*kfake.Cluster, stream.ConnConfig) {
	t.Helper()
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	return kc, stream.ConnConfig{Brokers: kc.ListenAddrs(), DialTimeout: 5 * time.Second}
}

// fetchOf reports whether req is a Fetch of partition p of the CE topic, and the max bytes it
// asks of p.
func fetchOf(req kmsg.Request, p int) (maxBytes int32, ok bool) {
	for _, rt := range req.(*kmsg.FetchRequest).Topics {
		for _, rp := range rt.Partitions {
			if rt.Topic == testTopic && rp.Partition == int32(p) {
				return rp.PartitionMaxBytes, true
			}
		}
	}
	return 0, false
}

// A fetch of a partition's requests that fails with an error a retry may fix (the partition's
// leader moving, the connection closed) is tried again after a while, and the partition is read
// on once it works; one
// that no retry fixes (the member not authorized to read the topic) stops the member, and Run
// returns it, naming the partition.
func TestFetchErrorsRetriedOrFatal(t *testing.T) {
	const p = 6
	for _, tc := range []struct {
		name  string
		code  kafka.Error // 0: the connection closed
		fails int64       // fetches of p that fail, the first ones; -1: all
	}{
		{"the leader moving", kafka.NotLeaderForPartition, 3},
		{"the connection closed", 0, 3},
		{"no authorization", kafka.TopicAuthorizationFailed, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kc, conn := testCluster(t)
			createTopic(t, conn)
			want := produced{}
			produce(t, testProducer(t, conn), "a", 60, want)
			var failed atomic.Int64
			failPartitionsWhen(t, kc, kmsg.Fetch, tc.code, func(req kmsg.Request) bool {
				_, ok := fetchOf(req, p)
				return ok && (tc.fails < 0 || failed.Add(1) <= tc.fails)
			})
			l := newLedger()
			m, err := NewMember(context.Background(), memberConfig(conn, "r1"), l, testLog(t))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- m.Run(ctx) }()
			defer func() {
				cancel()
				<-done
			}()
			if tc.fails < 0 {
				select {
				case err := <-done:
					done <- nil // for the deferred wait
					if !errors.Is(err, tc.code) || !strings.Contains(err.Error(), fmt.Sprintf("partition %d", p)) {
						t.Errorf("Run: %v, want %v naming partition %d", err, tc.code, p)
					}
				case <-time.After(30 * time.Second):
					t.Fatalf("Run did not stop within 30s of fetches failing with %v", tc.code)
				}
				return
			}
			waitfor.Cond(t, 30*time.Second, "every partition read to its end", func() bool {
				for q, ids := range want {
					if len(l.applied(q)) != len(ids) {
						return false
					}
				}
				return true
			})
			if n := failed.Load(); n <= tc.fails {
				t.Errorf("%d fetches of partition %d made, want more than the %d failed", n, p, tc.fails)
			}
			if bad := l.problems(); len(bad) > 0 {
				t.Errorf("rules broken: %v", bad)
			}
		})
	}
}

// A check of the store's Witness whose fetch fails with an error a retry may fix is made again,
// not skipped: a partition recreated while its owner was down is found, reset and read again
// all the same.
func TestWitnessCheckThatFailsIsMadeAgain(t *testing.T) {
	kc, conn := testCluster(t)
	rc := newRecreationOn(t, conn, 5)
	l := newLedger()
	cfg := memberConfig(conn, "r1")
	cfg.WitnessEvery = time.Hour // no check while the test runs but at acquisitions
	r := startReplicaOn(t, cfg, l)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to offset 3", rc.p), func() bool { return l.stored(rc.p) == 3 })
	r.stop(t)
	l.mu.Lock()
	w, ok := l.witness[rc.p]
	l.mu.Unlock()
	if !ok {
		t.Fatalf("partition %d: no Witness stored", rc.p)
	}

	rc.recreate(t, rc.fresh)
	var failed atomic.Int64
	failPartitionsWhen(t, kc, kmsg.Fetch, kafka.NotLeaderForPartition, func(req kmsg.Request) bool {
		max, ok := fetchOf(req, rc.p)
		return ok && max == 1 && failed.Add(1) == 1 // the first check of the Witness's record
	})
	startReplicaOn(t, cfg, l)
	rc.resetOnceTo(t, l, 5, nil)
	if failed.Load() < 2 {
		t.Errorf("%d checks of the Witness at offset %d, want one that failed and one more", failed.Load(), w.Offset)
	}
}
