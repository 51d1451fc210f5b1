package waitfor

import (
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
