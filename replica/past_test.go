package replica

import (
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

// A play for past posteriors starts from the latest place at or before the lowest version asked
// for, among where the last play stopped and the kept places, never from one past the log's end
// (until + 1: a log recreated shorter), nor from a place before the genesis (no posterior).
func TestPastStartsFromTheLatestUsablePlace(t *testing.T) {
	at := func(version uint64, next int64) pastCursor {
		return pastCursor{m: &bnn.Model{Version: version}, next: next}
	}
	for _, tc := range []struct {
		name     string
		last     *pastCursor
		kept     []pastCursor
		lo       uint64
		until    int64
		wantNext int64 // 0: none
	}{
		{"nothing known", nil, nil, 5, 10, 0},
		{"where the last play stopped", &pastCursor{m: &bnn.Model{Version: 4}, next: 7}, nil, 5, 10, 7},
		{"a kept place later than the last stop", &pastCursor{m: &bnn.Model{Version: 2}, next: 3}, []pastCursor{at(4, 6), at(3, 5)}, 5, 10, 6},
		{"the place of the version asked for", nil, []pastCursor{at(5, 8), at(4, 6)}, 5, 10, 8},
		{"not a place of a later version", nil, []pastCursor{at(6, 9), at(4, 6)}, 5, 10, 6},
		{"at the log's end", nil, []pastCursor{at(4, 11)}, 5, 10, 11},
		{"not past the end of a log recreated shorter", &pastCursor{m: &bnn.Model{Version: 4}, next: 12}, []pastCursor{at(3, 12), at(2, 2)}, 5, 10, 2},
		{"not before the genesis", &pastCursor{next: 4}, nil, 5, 10, 0},
	} {
		var k keptCursors
		for _, c := range tc.kept {
			k.put(c)
		}
		got := k.from(tc.last, tc.lo, tc.until)
		switch {
		case tc.wantNext == 0 && got != nil:
			t.Errorf("%s: from = version %d at %d, want none", tc.name, got.m.Version, got.next)
		case tc.wantNext != 0 && (got == nil || got.next != tc.wantNext):
			t.Errorf("%s: from = %+v, want the place at %d", tc.name, got, tc.wantNext)
		}
	}
}
