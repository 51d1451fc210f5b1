package stream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

func TestBackoffBounds(t *testing.T) {
	bo := backoff{min: 10 * time.Millisecond, max: 300 * time.Millisecond}
	for round := range 2 {
		for n := range 40 {
			d := min(bo.max, bo.min<<min(n, 30))
			got := bo.next()
			if got < d/2 || got > d {
				t.Fatalf("round %d wait %d = %v, want in [%v, %v]", round, n, got, d/2, d)
			}
		}
		bo.reset() // starts over at min
	}
}

func TestBackoffWaitHonoursContext(t *testing.T) {
	bo := backoff{min: time.Hour, max: time.Hour}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	if err := bo.wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("wait on a cancelled context: %v", err)
	}
	if time.Since(start) > time.Second {
		t.Fatal("wait ignored the cancelled context")
	}
}

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
