package ceshare

import (
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/waitfor"
)

// A replica that was down while the CE topic was deleted and created again, and that finds the
// new partition grown past the offset it had read, does not read on from that offset: the record
// before it (the store's Witness) is another one, so the partition is reset (Reset) and read from
// offset 0, and every request of the new log is applied.
func TestPartitionRecreatedPastItsOffsetIsReadAgain(t *testing.T) {
	_, conn := startBroker(t)
	createTopic(t, conn)
	p := Partition("old-0", testPartitions)
	var old, fresh []kafka.Message
	var want []string
	for i := range 3 {
		old = append(old, readableRequest(t, idIn(p, fmt.Sprintf("old%d", i))))
	}
	for i := range 5 { // more than the old log held: the stored offset is inside the new log
		id := idIn(p, fmt.Sprintf("new%d", i))
		fresh = append(fresh, readableRequest(t, id))
		want = append(want, KindRegister+"/"+id)
	}
	writeSigned(t, conn, p, old...)
	l := newLedger()
	r := startReplicaOn(t, memberConfig(conn, "r1"), l)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to offset 3", p), func() bool { return l.stored(p) == 3 })
	r.stop(t)

	deleteTopic(t, conn, testTopic)
	createTopic(t, conn)
	writeSigned(t, conn, p, fresh...)
	startReplicaOn(t, memberConfig(conn, "r1"), l)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read again from offset 0, to 5", p), func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return slices.Contains(l.resets, p) && l.next[p] == 5
	})
	applied := l.applied(p)
	for _, w := range want {
		if !slices.Contains(applied, w) {
			t.Errorf("%s of the new log not applied; applied %v", w, applied)
		}
	}
	if bad := l.problems(); len(bad) != 0 {
		t.Errorf("broken rules: %v", bad)
	}
}

// An owner that keeps its partition (no new generation) while the CE topic is deleted and
// created again, and whose next fetch finds the new partition grown past its offset (or up to
// it), reads the new log's later requests (or none) first; the next check of the record it had
// read before (WitnessEvery), or of the store's Witness while it read none since it acquired
// the partition, finds another record there, and the partition is reset once and read from
// offset 0, so that every request of the new log is applied.
func TestPartitionRecreatedUnderItsOwnerIsReadAgain(t *testing.T) {
	for _, c := range []struct {
		name    string
		n       int           // requests of the new log (the old one has 3)
		every   time.Duration // WitnessEvery
		restart bool          // the owner acquires the partition again before the topic is recreated, and reads nothing more
	}{
		{"grown past its offset, a check before every fetch", 5, time.Nanosecond, false},
		{"grown up to its offset, a check before every fetch", 3, time.Nanosecond, false},
		{"recreated before the first check", 5, 300 * time.Millisecond, false},
		{"idle since a restart", 5, 300 * time.Millisecond, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, conn := startBroker(t)
			createTopic(t, conn)
			p := Partition("old-0", testPartitions)
			var old, fresh []kafka.Message
			var want []string
			for i := range 3 {
				old = append(old, readableRequest(t, idIn(p, fmt.Sprintf("old%d", i))))
			}
			for i := range c.n {
				id := idIn(p, fmt.Sprintf("new%d", i))
				fresh = append(fresh, readableRequest(t, id))
				want = append(want, KindRegister+"/"+id)
			}
			writeSigned(t, conn, p, old...)

			hold, held := make(chan struct{}), make(chan struct{})
			var armed atomic.Bool
			var atEnd atomic.Int64 // reads from offset n once the topic is recreated
			var at3 atomic.Int64   // reads from offset 3
			cfg := memberConfig(conn, "r1")
			cfg.WitnessEvery = c.every
			cfg.beforeFetch = func(q int, next int64) {
				if q != p {
					return
				}
				if next == 3 {
					at3.Add(1)
				}
				if next == 3 && armed.CompareAndSwap(true, false) {
					close(held)
					<-hold
					return
				}
				if next == int64(c.n) && !armed.Load() {
					atEnd.Add(1)
				}
			}
			l := newLedger()
			r := startReplicaOn(t, cfg, l)
			waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to offset 3", p), func() bool { return l.stored(p) == 3 })
			if c.restart {
				r.stop(t)
				started := time.Now()
				r = startReplicaOn(t, cfg, l)
				at3.Store(0)
				// Checked at its acquisition, then every WitnessEvery, not at every read (one
				// every FetchWait, 100 ms, while the partition is idle).
				waitfor.Cond(t, 30*time.Second, "three checks of the store's Witness and 15 reads", func() bool {
					return r.m.Stats().Checks >= 3 && at3.Load() >= 15
				})
				if n, most := r.m.Stats().Checks, 2+int64(time.Since(started)/c.every); n > most {
					t.Errorf("%d checks in %v with WitnessEvery %v, want at most %d", n, time.Since(started).Round(time.Millisecond), c.every, most)
				}
			}
			armed.Store(true)
			select {
			case <-held:
			case <-time.After(30 * time.Second):
				t.Fatalf("partition %d's read did not come back to offset 3 within 30s", p)
			}
			gens := r.m.Stats().Generations
			deleteTopic(t, conn, testTopic)
			createTopic(t, conn)
			writeSigned(t, conn, p, fresh...)
			atEnd.Store(0)
			close(hold)

			// Each read from offset n after the reset follows a check: three of them show that
			// the reset's check was the last to find another log (with a check before every
			// fetch; with longer intervals, that no check found one for a while).
			waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read again from offset 0, to %d, and checked after", p, c.n), func() bool {
				l.mu.Lock()
				defer l.mu.Unlock()
				return slices.Contains(l.resets, p) && l.next[p] == int64(c.n) && atEnd.Load() >= 3
			})
			if g := r.m.Stats().Generations; g != gens {
				t.Errorf("the member went through %d more generations: the check at acquisition found the new log, not the check while owned", g-gens)
			}
			l.mu.Lock()
			resets := slices.Clone(l.resets)
			l.mu.Unlock()
			if !slices.Equal(resets, []int{p}) {
				t.Errorf("resets %v, want one of partition %d", resets, p)
			}
			applied := l.applied(p)
			for _, w := range want {
				if !slices.Contains(applied, w) {
					t.Errorf("%s of the new log not applied; applied %v", w, applied)
				}
			}
			if bad := l.problems(); len(bad) != 0 {
				t.Errorf("broken rules: %v", bad)
			}
		})
	}
}

// A partition recreated shorter than its owner's offset is reset once: the records the owner
// read of the old log are no witnesses of the new one, even once the new log grows past them.
func TestPartitionRecreatedShorterIsResetOnce(t *testing.T) {
	_, conn := startBroker(t)
	createTopic(t, conn)
	p := Partition("old-0", testPartitions)
	var old, fresh []kafka.Message
	for i := range 3 {
		old = append(old, readableRequest(t, idIn(p, fmt.Sprintf("old%d", i))))
	}
	for i := range 5 {
		fresh = append(fresh, readableRequest(t, idIn(p, fmt.Sprintf("new%d", i))))
	}
	writeSigned(t, conn, p, old...)

	// Holds at offset 3 (before the topic is recreated) and at offset 0 (after the reset, before
	// the new log grows past the old records' offsets); counts the reads from offset 5 after.
	type stop struct {
		armed      atomic.Bool
		held, hold chan struct{}
	}
	at3, at0 := &stop{held: make(chan struct{}), hold: make(chan struct{})}, &stop{held: make(chan struct{}), hold: make(chan struct{})}
	var at5 atomic.Int64
	cfg := memberConfig(conn, "r1")
	cfg.WitnessEvery = time.Nanosecond // a check before every fetch
	cfg.beforeFetch = func(q int, next int64) {
		if q != p {
			return
		}
		for off, s := range map[int64]*stop{3: at3, 0: at0} {
			if next == off && s.armed.CompareAndSwap(true, false) {
				close(s.held)
				<-s.hold
			}
		}
		if next == 5 {
			at5.Add(1)
		}
	}
	wait := func(s *stop, what string) {
		t.Helper()
		select {
		case <-s.held:
		case <-time.After(30 * time.Second):
			t.Fatalf("partition %d's read did not come to %s within 30s", p, what)
		}
	}
	l := newLedger()
	startReplicaOn(t, cfg, l)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to offset 3", p), func() bool { return l.stored(p) == 3 })
	at3.armed.Store(true)
	wait(at3, "offset 3")
	deleteTopic(t, conn, testTopic)
	createTopic(t, conn)
	writeSigned(t, conn, p, fresh[0])
	at0.armed.Store(true)
	close(at3.hold)
	wait(at0, "offset 0 after its reset")
	writeSigned(t, conn, p, fresh[1:]...)
	close(at0.hold)

	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to offset 5 and checked after", p), func() bool {
		return l.stored(p) == 5 && at5.Load() >= 2
	})
	l.mu.Lock()
	resets := slices.Clone(l.resets)
	l.mu.Unlock()
	if !slices.Equal(resets, []int{p}) {
		t.Errorf("resets %v, want one of partition %d", resets, p)
	}
	if bad := l.problems(); len(bad) != 0 {
		t.Errorf("broken rules: %v", bad)
	}
}

// An owner that read into a recreated partition and stopped (a crash, or the partition moved)
// before its next check left the store a Witness of the old log, not the record it read last:
// its next acquisition finds the new log, resets the partition and applies every request of it.
func TestPartitionReadIntoANewLogBeforeACheckIsFoundAtAcquisition(t *testing.T) {
	_, conn := startBroker(t)
	createTopic(t, conn)
	p := Partition("old-0", testPartitions)
	var old, fresh []kafka.Message
	var want []string
	for i := range 3 {
		old = append(old, readableRequest(t, idIn(p, fmt.Sprintf("old%d", i))))
	}
	for i := range 5 {
		id := idIn(p, fmt.Sprintf("new%d", i))
		fresh = append(fresh, readableRequest(t, id))
		want = append(want, KindRegister+"/"+id)
	}
	writeSigned(t, conn, p, old...)

	hold, held := make(chan struct{}), make(chan struct{})
	var armed atomic.Bool
	cfg := memberConfig(conn, "r1")
	cfg.WitnessEvery = time.Hour // no check while the test runs but at acquisitions
	cfg.beforeFetch = func(q int, next int64) {
		if q == p && next == 3 && armed.CompareAndSwap(true, false) {
			close(held)
			<-hold
		}
	}
	l := newLedger()
	r := startReplicaOn(t, cfg, l)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to offset 3", p), func() bool { return l.stored(p) == 3 })
	armed.Store(true)
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatalf("partition %d's read did not come back to offset 3 within 30s", p)
	}
	deleteTopic(t, conn, testTopic)
	createTopic(t, conn)
	writeSigned(t, conn, p, fresh...)
	close(hold)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read on into the new log, to 5", p), func() bool { return l.stored(p) == 5 })
	r.stop(t)

	startReplicaOn(t, cfg, l)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d reset at its acquisition and read again to 5", p), func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return slices.Contains(l.resets, p) && l.next[p] == 5
	})
	applied := l.applied(p)
	for _, w := range want {
		if !slices.Contains(applied, w) {
			t.Errorf("%s of the new log not applied; applied %v", w, applied)
		}
	}
	if bad := l.problems(); len(bad) != 0 {
		t.Errorf("broken rules: %v", bad)
	}
}
