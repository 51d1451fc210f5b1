package waitfor

import (
	"fmt"
	"strings"
	"testing"
	"testing/synctest"
	"time"
)

// recorder is a testing.TB that records Fatalf's message instead of stopping the goroutine.
type recorder struct {
	testing.TB
	failed string
}

func (r *recorder) Helper() {}
func (r *recorder) Fatalf(format string, args ...any) {
	r.failed = fmt.Sprintf(format, args...)
	panic(r)
}

// fatal runs f, which must end in r.Fatalf, and returns the message.
func (r *recorder) fatal(f func()) string {
	r.Helper()
	func() {
		defer func() {
			if v := recover(); v != r {
				r.TB.Fatalf("recovered %v, want the recorder's Fatalf", v)
			}
		}()
		f()
	}()
	return r.failed
}

func TestCondReturnsWhenTheConditionHolds(t *testing.T) {
	n := 0
	took := Cond(t, time.Second, "three polls", func() bool { n++; return n == 3 })
	if n != 3 || took < 2*Interval {
		t.Fatalf("polled %d times in %v", n, took)
	}
}

func TestCondEveryPollsAtItsInterval(t *testing.T) {
	const every = 5 * Interval
	n := 0
	took := CondEvery(t, every, 10*time.Second, "three polls", func() bool { n++; return n == 3 })
	if n != 3 || took < 2*every {
		t.Fatalf("polled %d times in %v, want 3 polls %v apart", n, took, every)
	}
}

// A slow check spaces the next by nine times its duration: three checks of 20 ms are 180 ms
// apart, so that the checks take a tenth of the wait.
func TestSlowChecksArePacedByTheirCost(t *testing.T) {
	n := 0
	took := Cond(t, 10*time.Second, "three slow checks", func() bool {
		time.Sleep(20 * time.Millisecond)
		n++
		return n == 3
	})
	if want := 3*20*time.Millisecond + 2*180*time.Millisecond; n != 3 || took < want {
		t.Fatalf("three checks of 20 ms in %v, want at least %v", took, want)
	}
}

func TestPause(t *testing.T) {
	for _, tc := range []struct{ interval, took, want time.Duration }{
		{Interval, 0, Interval},
		{Interval, time.Millisecond, Interval},
		{Interval, 5 * time.Millisecond, 45 * time.Millisecond},
		{Interval, 500 * time.Millisecond, MaxPause},
		{2 * time.Second, 300 * time.Millisecond, 2 * time.Second},
	} {
		if got := pause(tc.interval, tc.took); got != tc.want {
			t.Errorf("pause(%v, %v) = %v, want %v", tc.interval, tc.took, got, tc.want)
		}
	}
}

// Progress waits as long as the state moves, and fails once it stands still for the stall.
func TestProgressWaitsWhileTheStateMoves(t *testing.T) {
	n := 0
	took := Progress(t, 100*time.Millisecond, "twenty steps", func() (bool, string) {
		time.Sleep(2 * time.Millisecond)
		n++
		return n == 20, fmt.Sprint(n)
	})
	if n != 20 || took < 20*2*time.Millisecond {
		t.Fatalf("%d steps in %v", n, took)
	}
	r := &recorder{TB: t}
	func() {
		defer func() {
			if v := recover(); v != r {
				t.Fatalf("recovered %v", v)
			}
		}()
		Progress(r, 50*time.Millisecond, "a stuck state", func() (bool, string) { return false, "stuck" })
	}()
	if !strings.Contains(r.failed, "no progress for") {
		t.Fatalf("failure message %q", r.failed)
	}
}

func TestCondFailsNamingWhat(t *testing.T) {
	r := &recorder{TB: t}
	func() {
		defer func() {
			if v := recover(); v != r {
				t.Fatalf("recovered %v", v)
			}
		}()
		Cond(r, 30*time.Millisecond, "the impossible", func() bool { return false })
	}()
	if !strings.Contains(r.failed, "waiting for the impossible") {
		t.Fatalf("failure message %q", r.failed)
	}
}

// On the synctest clock, where a check takes no time: Cond checks at once and then every
// Interval (three checks take 2 Interval), and gives up once the condition has not held for
// within (at the latest at the first check more than within after the first one), naming within
// and what it waited for; CondEvery does the same every interval.
func TestCondOnTheFakeClock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		if took := Cond(t, time.Second, "a condition that holds", func() bool { return true }); took != 0 {
			t.Errorf("a condition that holds at once took %v", took)
		}
		n := 0
		if took := Cond(t, time.Second, "three checks", func() bool { n++; return n == 3 }); took != 2*Interval {
			t.Errorf("three checks took %v, want %v", took, 2*Interval)
		}
		for _, tc := range []struct {
			interval, within, last time.Duration // last: the first check past within
		}{
			{Interval, 3 * Interval, 4 * Interval},
			{50 * time.Millisecond, 120 * time.Millisecond, 150 * time.Millisecond},
		} {
			r := &recorder{TB: t}
			start := time.Now()
			msg := r.fatal(func() {
				CondEvery(r, tc.interval, tc.within, "the impossible", func() bool { return false })
			})
			want := fmt.Sprintf("timed out after %v waiting for the impossible", tc.within)
			if took := time.Since(start); took < tc.within || took > tc.last || msg != want {
				t.Errorf("every %v within %v: failed after %v with %q, want in [%v, %v] with %q", tc.interval, tc.within, took, msg, tc.within, tc.last, want)
			}
		}
	})
}

// On the synctest clock: Progress counts the stall from the last change of the state, not from
// the start, and fails once the state has stood still for stall (at the latest at the first
// check past it), saying what it waited for, the stall, how long it waited and the state it
// stood at.
func TestProgressOnTheFakeClock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// Checks every Interval: the state moves at checks 1..10 (the last change at 9 Interval)
		// and the work is done at check 14 (13 Interval), 4 Interval after the last change: under
		// the stall of 5 Interval, though 13 Interval from the start.
		k := 0
		took := Progress(t, 5*Interval, "fourteen checks", func() (bool, string) {
			k++
			return k == 14, fmt.Sprint(min(k, 10))
		})
		if k != 14 || took != 13*Interval {
			t.Errorf("%d checks in %v, want 14 in %v", k, took, 13*Interval)
		}

		// A state that never moves: set at the first check, standing still from then on.
		r := &recorder{TB: t}
		start := time.Now()
		msg := r.fatal(func() {
			Progress(r, 5*Interval, "a stuck state", func() (bool, string) { return false, "stuck" })
		})
		took = time.Since(start)
		want := fmt.Sprintf("waiting for a stuck state: no progress for %v (after %v; state stuck)", 5*Interval, took)
		if took < 5*Interval || took > 6*Interval || msg != want {
			t.Errorf("failed after %v with %q, want in [%v, %v] with %q", took, msg, 5*Interval, 6*Interval, want)
		}
	})
}
