package ledger

import (
	"fmt"
	"testing"
)

// OutboxNewest returns the newest unacknowledged entries, newest first, for every page size and
// after acknowledgements: an off-by-one shows as a missing newest entry or an acknowledged one.
func TestOutboxNewestReadsBackwardsFromTheLast(t *testing.T) {
	const n = 11
	l, _ := openTest(t, Options{Policy: testPolicy()})
	for i := 1; i <= n; i += 3 {
		var evs []OutboxEntry
		for j := i; j < min(i+3, n+1); j++ {
			evs = append(evs, OutboxEntry{Key: fmt.Sprint(j), Value: []byte(fmt.Sprintf("event %d", j))})
		}
		if err := l.Checkpoint(&Checkpoint{Events: evs}); err != nil {
			t.Fatal(err)
		}
	}
	check := func(acked, max int) {
		t.Helper()
		got, err := l.OutboxNewest(max)
		if err != nil {
			t.Fatal(err)
		}
		want := min(max, n-acked)
		if len(got) != want {
			t.Fatalf("acknowledged %d: OutboxNewest(%d) = %d entries, want %d", acked, max, len(got), want)
		}
		for i, e := range got {
			if seq := uint64(n - i); e.Seq != seq || string(e.Value) != fmt.Sprintf("event %d", seq) {
				t.Fatalf("acknowledged %d: OutboxNewest(%d)[%d] = %d %q, want entry %d", acked, max, i, e.Seq, e.Value, seq)
			}
		}
	}
	for _, acked := range []int{0, 4, n} {
		if acked > 0 {
			if err := l.AckOutbox(uint64(acked)); err != nil {
				t.Fatal(err)
			}
		}
		for _, max := range []int{1, 2, n - acked, n + 5} {
			check(acked, max)
		}
	}
}

// OutboxNewest lists events only: a replica's CE states in the outbox are passed over.
func TestOutboxNewestListsEventsOnly(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	var entries []OutboxEntry
	for j := range 6 {
		e := OutboxEntry{Key: fmt.Sprint(j), Value: []byte(fmt.Sprintf("event %d", j))}
		if j%2 == 1 {
			e.Stream, e.Value = StreamStates, []byte(fmt.Sprintf(`{"state":%d}`, j))
		}
		entries = append(entries, e)
	}
	if err := l.Checkpoint(&Checkpoint{Events: entries}); err != nil {
		t.Fatal(err)
	}
	got, err := l.OutboxNewest(2)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || string(got[0].Value) != "event 4" || string(got[1].Value) != "event 2" {
		t.Fatalf("OutboxNewest(2) = %+v; want events 4 and 2", got)
	}
}
