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
// more CPU than the work awaited. It returns at most interval after the condition holds.
func CondEvery(t testing.TB, interval, within time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > within {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(interval)
	}
	return time.Since(start)
}
