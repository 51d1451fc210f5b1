// Package waitfor is the tests' one way to wait for something to happen: poll a condition until
// it holds, or fail the test saying what did not happen in time.
package waitfor

import (
	"testing"
	"time"
)

// Interval is how often Cond polls.
const Interval = 10 * time.Millisecond

// Cond polls cond every Interval until it holds and returns how long that took. If it does not
// hold within the given time, the test fails, naming what it waited for.
func Cond(t testing.TB, within time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	return CondEvery(t, Interval, within, what, cond)
}

// CondEvery is Cond polling every interval instead: for a wait of seconds on a condition whose
// check costs CPU (a scan of thousands of records), where checking it every Interval would spend
// more CPU than the work awaited.
//
// Either way a check that takes longer than a ninth of the interval spaces the next one by nine
// times its duration (at most MaxPause): on a core shared with many busy processes a check's
// requests and scans take that much longer, and checking every interval would take most of the
// CPU left to the process, from the work the test waits for. Cond returns at most that pause after
// the condition holds.
func CondEvery(t testing.TB, interval, within time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	took, ok := poll(interval, within, func() (bool, string) { return cond(), "" })
	if !ok {
		t.Fatalf("timed out after %v waiting for %s", within, what)
	}
	return took
}

// MaxPause bounds the pause between two checks of Cond and CondEvery.
const MaxPause = time.Second

// pause is the time between two checks: interval, or nine times a check that took took, at most
// MaxPause (but never less than interval), so that checks take at most a tenth of the wait's time.
func pause(interval, took time.Duration) time.Duration {
	return max(interval, min(MaxPause, 9*took))
}

// Progress polls check as Cond does until it reports done, and fails the test when the state it
// reports has not changed for stall: for a wait on work that moves by steps (records applied,
// versions followed), whose total time is the CPU the work gets, while a stop of it shows at
// once. It returns how long the wait took.
func Progress(t testing.TB, stall time.Duration, what string, check func() (done bool, state string)) time.Duration {
	t.Helper()
	var state string
	took, ok := poll(Interval, stall, func() (bool, string) {
		var done bool
		done, state = check()
		return done, state
	})
	if !ok {
		t.Fatalf("waiting for %s: no progress for %v (after %v; state %s)", what, stall, took.Round(time.Millisecond), state)
	}
	return took
}

// poll runs check, pausing between runs (pause), until it reports done (ok true) or the state it
// reports has stood still for stall (ok false; a check whose state never changes has stall in
// all). It returns how long it polled.
func poll(interval, stall time.Duration, check func() (done bool, state string)) (took time.Duration, ok bool) {
	start := time.Now()
	last, since := "", start
	for {
		c0 := time.Now()
		done, state := check()
		took := time.Since(c0)
		if done {
			return time.Since(start), true
		}
		if state != last {
			last, since = state, time.Now()
		} else if time.Since(since) > stall {
			return time.Since(start), false
		}
		time.Sleep(pause(interval, took))
	}
}
