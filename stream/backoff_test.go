package stream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/segmentio/kafka-go"
)

func TestRetryable(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{context.Canceled, false},
		{fmt.Errorf("fetch: %w", context.DeadlineExceeded), false},
		{io.EOF, false},
		{io.ErrClosedPipe, false},
		{ErrClosed, false},
		{kafka.SASLAuthenticationFailed, false},
		{fmt.Errorf("join: %w", kafka.GroupAuthorizationFailed), false},
		{kafka.TopicAuthorizationFailed, false},
		{io.ErrUnexpectedEOF, true},
		{kafka.RebalanceInProgress, true},
		{kafka.NotLeaderForPartition, true},
		{kafka.NotCoordinatorForGroup, true},
		{&net.OpError{Op: "dial", Err: errors.New("connection refused")}, true},
	} {
		if got := retryable(tc.err); got != tc.want {
			t.Errorf("retryable(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
