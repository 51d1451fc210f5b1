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
	start := time.Now()
	for !cond() {
		if time.Since(start) > within {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(Interval)
	}
	return time.Since(start)
}
