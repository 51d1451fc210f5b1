// Package backoff is the capped exponential backoff with jitter that cfguard's retry loops share
// (the Kafka consumer, the dead-letter writer, group commits, the outbox publisher, failed
// checkpoints).
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff is a capped exponential backoff with equal jitter: the n-th consecutive wait
// (n = 0, 1, ...) is
//
//	d_n = min(Max, Min * 2^n),   wait ~ U[d_n/2, d_n]
//
// so waits never collapse to zero and concurrent retriers spread out. Reset starts over after
// a success. The zero value is not useful: set Min and Max.
type Backoff struct {
	Min, Max time.Duration
	n        int
}

// Next returns the next wait.
func (b *Backoff) Next() time.Duration {
	d := b.Max
	// Min*2^n < Max, tested without shifting Min, which would overflow once Min > MaxInt64>>n
	// (Min = 20s at n = 29): for n < 63, Min<<n <= Max-1 exactly when Min <= (Max-1)>>n.
	if b.n < 30 && b.Min <= (b.Max-1)>>b.n {
		d = b.Min << b.n
	}
	b.n++
	return d/2 + rand.N(d-d/2+1) // d/2 rounded down, so that an odd d_n is reached too
}

// Reset starts over at Min.
func (b *Backoff) Reset() { b.n = 0 }

// Wait sleeps for the next wait or until ctx ends, whichever is first (then it returns ctx.Err()).
func (b *Backoff) Wait(ctx context.Context) error { return Sleep(ctx, b.Next()) }

// Sleep sleeps for d or until ctx ends, whichever is first (then it returns ctx.Err()).
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
