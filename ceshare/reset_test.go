package ceshare

import (
	"fmt"
	"slices"
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
