package stream

import "testing"

// TestStatsCaughtUp: a consumer is caught up when it holds no record or dead letter it has not
// handed out and its fetch position is at every partition's high watermark; a fetch past a
// transaction marker moves the position past it, so a marker after the last record handed out
// (Lag 1) leaves it caught up.
func TestStatsCaughtUp(t *testing.T) {
	for _, tc := range []struct {
		name                string
		next, hwm, handed   int64
		buffered, deadAhead int
		want                bool
	}{
		{"everything handed out", 10, 10, 10, 0, 0, true},
		{"a marker past the last record", 11, 11, 10, 0, 0, true},
		{"records held", 10, 10, 6, 4, 0, false},
		{"dead letters held", 10, 10, 8, 0, 2, false},
		{"records past the fetch position", 10, 12, 10, 0, 0, false},
	} {
		c := &Consumer{parts: map[int]*partState{0: {part: 0, next: tc.next, hwm: tc.hwm}, 1: {part: 1, next: 3, hwm: 3}},
			handed: map[int]int64{0: tc.handed, 1: 3}, buffered: tc.buffered, deadAhead: tc.deadAhead}
		if got := c.Stats().CaughtUp; got != tc.want {
			t.Errorf("%s: CaughtUp %t, want %t (Lag %d)", tc.name, got, tc.want, c.Stats().Lag)
		}
	}
}
