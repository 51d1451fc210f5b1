package ceshare

import (
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/stream"
)

// recreation is a CE topic whose partition p held an old log of 3 requests (written by
// newRecreation) and is to hold a new one of the requests fresh (written by recreate), each a
// registration (want: their kind/id).
type recreation struct {
	conn  stream.ConnConfig
	p     int
	fresh []kafka.Message
	want  []string
}

// newRecreation starts a broker, creates the topic and writes the old log's 3 requests.
func newRecreation(t *testing.T, n int) *recreation {
	t.Helper()
	_, conn := startBroker(t)
	return newRecreationOn(t, conn, n)
}

// newRecreationOn is newRecreation on the broker of conn.
func newRecreationOn(t *testing.T, conn stream.ConnConfig, n int) *recreation {
	t.Helper()
	createTopic(t, conn)
	rc := &recreation{conn: conn, p: Partition("old-0", testPartitions)}
	var old []kafka.Message
	for i := range 3 {
		old = append(old, readableRequest(t, idIn(rc.p, fmt.Sprintf("old%d", i))))
	}
	for i := range n {
		id := idIn(rc.p, fmt.Sprintf("new%d", i))
		rc.fresh = append(rc.fresh, readableRequest(t, id))
		rc.want = append(rc.want, KindRegister+"/"+id)
	}
	writeSigned(t, conn, rc.p, old...)
	return rc
}

// recreate deletes the topic, creates it again and writes msgs to p.
func (rc *recreation) recreate(t *testing.T, msgs []kafka.Message) {
	t.Helper()
	deleteTopic(t, rc.conn, testTopic)
	createTopic(t, rc.conn)
	writeSigned(t, rc.conn, rc.p, msgs...)
}

// resetOnceTo waits until p was reset and read again to offset to (and done, when set, holds),
// then checks that it was reset once, that every request of the new log was applied, and the
// ledger's rules.
func (rc *recreation) resetOnceTo(t *testing.T, l *ledger, to int64, done func() bool) {
	t.Helper()
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d reset and read again to offset %d", rc.p, to), func() bool {
		l.mu.Lock()
		reset := slices.Contains(l.resets, rc.p) && l.next[rc.p] == to
		l.mu.Unlock()
		return reset && (done == nil || done())
	})
	l.mu.Lock()
	resets := slices.Clone(l.resets)
	l.mu.Unlock()
	if !slices.Equal(resets, []int{rc.p}) {
		t.Errorf("resets %v, want one of partition %d", resets, rc.p)
	}
	applied := l.applied(rc.p)
	for _, w := range rc.want {
		if !slices.Contains(applied, w) {
			t.Errorf("%s of the new log not applied; applied %v", w, applied)
		}
	}
	if bad := l.problems(); len(bad) != 0 {
		t.Errorf("broken rules: %v", bad)
	}
}

// stop holds a partition's read before its fetch from offset at, once armed (reach, from
// MemberConfig.beforeFetch), until released.
type stop struct {
	at         int64
	armed      atomic.Bool
	held, hold chan struct{}
}

func newStop(at int64) *stop {
	return &stop{at: at, held: make(chan struct{}), hold: make(chan struct{})}
}

// reach holds the read when it is armed and about to fetch from s.at, and reports whether it did.
func (s *stop) reach(next int64) bool {
	if next != s.at || !s.armed.CompareAndSwap(true, false) {
		return false
	}
	close(s.held)
	<-s.hold
	return true
}

// arm makes the next read from s.at wait there.
func (s *stop) arm() { s.armed.Store(true) }

// holdRead arms s and waits until the read is held there.
func (s *stop) holdRead(t *testing.T) {
	t.Helper()
	s.arm()
	s.wait(t)
}

// wait waits until the read is held at s.
func (s *stop) wait(t *testing.T) {
	t.Helper()
	select {
	case <-s.held:
	case <-time.After(30 * time.Second):
		t.Fatalf("the partition's read did not come to offset %d within 30s", s.at)
	}
}

// release lets the held read go on.
func (s *stop) release() { close(s.hold) }

// A replica that was down while the CE topic was deleted and created again, and that finds the
// new partition grown past the offset it had read, does not read on from that offset: the record
// before it (the store's Witness) is another one, so the partition is reset (Reset, told the new
// log's end and the offset after the Witness, from which the store may have read the new log)
// and read from offset 0, and every request of the new log is applied.
func TestPartitionRecreatedPastItsOffsetIsReadAgain(t *testing.T) {
	rc := newRecreation(t, 5) // more than the old log held: the stored offset is inside the new log
	l := newLedger()
	r := startReplicaOn(t, memberConfig(rc.conn, "r1"), l)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to offset 3", rc.p), func() bool { return l.stored(rc.p) == 3 })
	r.stop(t)
	l.mu.Lock()
	w := l.witness[rc.p]
	l.mu.Unlock()

	rc.recreate(t, rc.fresh)
	h := &gapHooks{ledger: l}
	startReplicaWith(t, memberConfig(rc.conn, "r1"), l, h, testLog(t))
	rc.resetOnceTo(t, l, 5, nil)
	if want := [][2]int64{{5, w.Offset + 1}}; !slices.Equal(h.resets, want) {
		t.Errorf("Reset(end, from) calls %v, want %v (the Witness at offset %d)", h.resets, want, w.Offset)
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
			rc := newRecreation(t, c.n)
			at3 := newStop(3)
			var atEnd atomic.Int64 // reads from offset n once the topic is recreated
			var reads3 atomic.Int64
			cfg := memberConfig(rc.conn, "r1")
			cfg.WitnessEvery = c.every
			cfg.beforeFetch = func(q int, next int64) {
				if q != rc.p {
					return
				}
				if next == 3 {
					reads3.Add(1)
				}
				if at3.reach(next) {
					return
				}
				if next == int64(c.n) {
					atEnd.Add(1)
				}
			}
			l := newLedger()
			r := startReplicaOn(t, cfg, l)
			waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to offset 3", rc.p), func() bool { return l.stored(rc.p) == 3 })
			if c.restart {
				r.stop(t)
				started := time.Now()
				r = startReplicaOn(t, cfg, l)
				reads3.Store(0)
				// Checked at its acquisition, then every WitnessEvery, not at every read (one
				// every FetchWait, 100 ms, while the partition is idle).
				waitfor.Cond(t, 30*time.Second, "three checks of the store's Witness and 15 reads", func() bool {
					return r.m.Stats().Checks >= 3 && reads3.Load() >= 15
				})
				if n, most := r.m.Stats().Checks, 2+int64(time.Since(started)/c.every); n > most {
					t.Errorf("%d checks in %v with WitnessEvery %v, want at most %d", n, time.Since(started).Round(time.Millisecond), c.every, most)
				}
			}
			at3.holdRead(t)
			gens := r.m.Stats().Generations
			rc.recreate(t, rc.fresh)
			atEnd.Store(0)
			at3.release()

			// Each read from offset n after the reset follows a check: three of them show that
			// the reset's check was the last to find another log (with a check before every
			// fetch; with longer intervals, that no check found one for a while).
			rc.resetOnceTo(t, l, int64(c.n), func() bool { return atEnd.Load() >= 3 })
			if g := r.m.Stats().Generations; g != gens {
				t.Errorf("the member went through %d more generations: the check at acquisition found the new log, not the check while owned", g-gens)
			}
		})
	}
}

// A partition recreated shorter than its owner's offset is reset once: the records the owner
// read of the old log are no witnesses of the new one, even once the new log grows past them.
func TestPartitionRecreatedShorterIsResetOnce(t *testing.T) {
	rc := newRecreation(t, 5)
	// Held at offset 3 (before the topic is recreated) and at offset 0 (after the reset, before
	// the new log grows past the old records' offsets); the reads from offset 5 after counted.
	at3, at0 := newStop(3), newStop(0)
	var at5 atomic.Int64
	cfg := memberConfig(rc.conn, "r1")
	cfg.WitnessEvery = time.Nanosecond // a check before every fetch
	cfg.beforeFetch = func(q int, next int64) {
		if q != rc.p || at3.reach(next) || at0.reach(next) {
			return
		}
		if next == 5 {
			at5.Add(1)
		}
	}
	l := newLedger()
	startReplicaOn(t, cfg, l)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to offset 3", rc.p), func() bool { return l.stored(rc.p) == 3 })
	at3.holdRead(t)
	rc.recreate(t, rc.fresh[:1])
	at0.arm()
	at3.release()
	at0.wait(t)
	writeSigned(t, rc.conn, rc.p, rc.fresh[1:]...)
	at0.release()
	rc.resetOnceTo(t, l, 5, func() bool { return at5.Load() >= 2 })
}

// An owner that read into a recreated partition and stopped (a crash, or the partition moved)
// before its next check left the store a Witness of the old log, not the record it read last:
// its next acquisition finds the new log, resets the partition and applies every request of it.
func TestPartitionReadIntoANewLogBeforeACheckIsFoundAtAcquisition(t *testing.T) {
	rc := newRecreation(t, 5)
	at3 := newStop(3)
	cfg := memberConfig(rc.conn, "r1")
	cfg.WitnessEvery = time.Hour // no check while the test runs but at acquisitions
	cfg.beforeFetch = func(q int, next int64) {
		if q == rc.p {
			at3.reach(next)
		}
	}
	l := newLedger()
	r := startReplicaOn(t, cfg, l)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to offset 3", rc.p), func() bool { return l.stored(rc.p) == 3 })
	at3.holdRead(t)
	rc.recreate(t, rc.fresh)
	at3.release()
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read on into the new log, to 5", rc.p), func() bool { return l.stored(rc.p) == 5 })
	r.stop(t)

	startReplicaOn(t, cfg, l)
	rc.resetOnceTo(t, l, 5, nil)
}

// A Witness the store returns at the offset it returns (or past it) is no record the store read
// before that offset: it is not checked, and the partition is read on from the offset, not reset.
func TestWitnessAtTheStoredOffsetIsNotChecked(t *testing.T) {
	_, conn := startBroker(t)
	createTopic(t, conn)
	const p = 7
	var ids []string
	for i := range 3 {
		ids = append(ids, idIn(p, fmt.Sprintf("w%d", i)))
		writeSigned(t, conn, p, readableRequest(t, ids[i]))
	}
	l := newLedger()
	l.next[p] = 2
	l.witness[p] = Witness{Offset: 2} // the hash of no record
	r := startReplicaOn(t, memberConfig(conn, "r1"), l)
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to its end, 3", p), func() bool { return l.stored(p) == 3 && r.m.Ready(p) })
	l.mu.Lock()
	resets := slices.Clone(l.resets)
	l.mu.Unlock()
	if got := l.applied(p); len(resets) != 0 || !slices.Equal(got, []string{KindRegister + "/" + ids[2]}) {
		t.Errorf("resets %v, applied %v; want no reset and the request at offset 2 alone", resets, got)
	}
}
