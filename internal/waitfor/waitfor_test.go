package waitfor

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// recorder is a testing.TB that records Fatalf instead of stopping the goroutine.
type recorder struct {
	testing.TB
	failed string
}

func (r *recorder) Helper() {}
func (r *recorder) Fatalf(format string, args ...any) {
	r.failed = format
	panic(r)
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
	if !strings.Contains(r.failed, "waiting for %s") {
		t.Fatalf("failure message %q", r.failed)
	}
}
