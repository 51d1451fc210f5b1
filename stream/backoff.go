package stream

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"time"

	"github.com/segmentio/kafka-go"
)

// ErrClosed is returned by Consumer and Publisher methods after Close (or after the context
// given to their constructor ended).
var ErrClosed = errors.New("stream: closed")

// backoff is a capped exponential backoff with equal jitter: the n-th consecutive wait
// (n = 0, 1, ...) is
//
//	d_n = min(max, min * 2^n),   wait ~ U[d_n/2, d_n]
//
// so waits never collapse to zero and concurrent retriers spread out. reset starts over after
// a success.
type backoff struct {
	min, max time.Duration
	n        int
}

func (b *backoff) next() time.Duration {
	d := b.max
	if b.n < 30 && b.min<<b.n < b.max {
		d = b.min << b.n
	}
	b.n++
	return d/2 + rand.N(d/2+1)
}

func (b *backoff) reset() { b.n = 0 }

// wait sleeps for the next backoff or until ctx ends, whichever is first.
func (b *backoff) wait(ctx context.Context) error {
	t := time.NewTimer(b.next())
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// retryable reports whether a broker operation that failed with err is worth retrying.
// Context ends, closed clients and authentication or authorization failures are not: waiting
// does not fix them. Everything else (network errors, leader changes, rebalances, coordinator
// moves) is.
func retryable(err error) bool {
	switch {
	case err == nil,
		errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrClosedPipe), errors.Is(err, ErrClosed):
		return false
	}
	var ke kafka.Error
	if errors.As(err, &ke) {
		switch ke {
		case kafka.SASLAuthenticationFailed, kafka.UnsupportedSASLMechanism, kafka.IllegalSASLState,
			kafka.TopicAuthorizationFailed, kafka.GroupAuthorizationFailed, kafka.ClusterAuthorizationFailed,
			kafka.InvalidTopic, kafka.InvalidGroupId:
			return false
		}
	}
	return true
}
