// Package episode tracks an episode of failures of one kind of attempt (ledger commits,
// checkpoints): when it began, its last error and how many attempts failed, so that a caller
// logs and reports it once per episode rather than once per attempt.
package episode

import (
	"sync"
	"time"
)

// Episode is a run of failed attempts ended by the first success. The zero value is an
// episode not running; it is safe for concurrent use.
type Episode struct {
	mu       sync.Mutex
	since    time.Time
	err      error
	attempts int
}

// Fail records an attempt that failed with err (not nil) at now; it reports whether it began
// the episode.
func (e *Episode) Fail(err error, now time.Time) (first bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	first = e.err == nil
	if first {
		e.since = now
	}
	e.err = err
	e.attempts++
	return first
}

// Clear ends the episode at now, after an attempt that succeeded; it returns how long the
// episode lasted and how many attempts failed in it (0 when none was running).
func (e *Episode) Clear(now time.Time) (took time.Duration, attempts int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.err == nil {
		return 0, 0
	}
	took, attempts = now.Sub(e.since), e.attempts
	e.err, e.attempts = nil, 0
	return took, attempts
}

// State returns when the running episode began and its last error, or a nil error when none
// is running.
func (e *Episode) State() (since time.Time, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.since, e.err
}
