package ledger

import (
	"fmt"
	"testing"
)

// A publisher that pages through the outbox with Outbox(after, max) and acknowledges each page
// with AckOutbox sees every entry exactly once, in order, whatever the page size: an off-by-one
// in either (the seek, the page bound, the acknowledged bound) loses or repeats events.
func TestOutboxPagingLosesNothing(t *testing.T) {
	const n = 23
	for _, max := range []int{1, 2, 3, 5, n - 1, n, n + 1} {
		t.Run(fmt.Sprintf("pages of %d", max), func(t *testing.T) {
			l, _ := openTest(t, Options{Policy: testPolicy()})
			for i := 1; i <= n; i += 4 { // several transactions, several entries each
				var evs []OutboxEntry
				for j := i; j < min(i+4, n+1); j++ {
					evs = append(evs, OutboxEntry{Key: fmt.Sprint(j), Value: []byte(fmt.Sprintf("event %d", j))})
				}
				if err := l.Checkpoint(&Checkpoint{Events: evs}); err != nil {
					t.Fatal(err)
				}
			}
			// Before any acknowledgement, from every position.
			for a := 0; a <= n; a++ {
				page, err := l.Outbox(uint64(a), n)
				if err != nil || len(page) != n-a || len(page) > 0 && page[0].Seq != uint64(a+1) {
					t.Fatalf("Outbox(%d, %d) = %d entries (%v), want %d from %d", a, n, len(page), err, n-a, a+1)
				}
			}
			var seen []uint64
			after := uint64(0)
			for {
				page, err := l.Outbox(after, max)
				if err != nil {
					t.Fatal(err)
				}
				if want := min(max, n-int(after)); len(page) != want {
					t.Fatalf("Outbox(%d, %d) returned %d entries, want %d", after, max, len(page), want)
				}
				if len(page) == 0 {
					break
				}
				for _, e := range page {
					if string(e.Value) != fmt.Sprintf("event %d", e.Seq) || e.Key != fmt.Sprint(e.Seq) {
						t.Fatalf("entry %d holds %q %q", e.Seq, e.Key, e.Value)
					}
					seen = append(seen, e.Seq)
				}
				after = page[len(page)-1].Seq
				if err := l.AckOutbox(after); err != nil {
					t.Fatal(err)
				}
				left, err := l.OutboxLen()
				if err != nil {
					t.Fatal(err)
				}
				if left != n-int(after) {
					t.Fatalf("after acknowledging %d: %d entries left, want %d", after, left, n-int(after))
				}
				// What a restarted publisher reads: from the first unacknowledged entry.
				if rest, err := l.Outbox(0, n); err != nil || len(rest) != n-int(after) || len(rest) > 0 && rest[0].Seq != after+1 {
					t.Fatalf("after acknowledging %d, Outbox(0) = %d entries (%v), want %d from %d", after, len(rest), err, n-int(after), after+1)
				}
				checkInvariants(t, l)
			}
			if len(seen) != n {
				t.Fatalf("published %d entries, want %d: %v", len(seen), n, seen)
			}
			for i, s := range seen {
				if s != uint64(i+1) {
					t.Fatalf("entry %d published as sequence %d: %v", i+1, s, seen)
				}
			}
		})
	}
}
