package stream

import (
	"context"
	"errors"
	"io"

	"github.com/segmentio/kafka-go"
)

// ErrClosed is returned by Consumer and Publisher methods after Close (or after the context
// given to their constructor ended).
var ErrClosed = errors.New("stream: closed")

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
