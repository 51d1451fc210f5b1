package stream

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/segmentio/kafka-go"
)

// TestRetryable holds the classification: only configuration-class errors (and our own
// Close) stop the consumer; timeouts, end of stream, network and broker errors are retried.
func TestRetryable(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"no error", nil, false},
		{"closed by us", ErrClosed, false},
		{"fetch timeout", fmt.Errorf("kafka.(*Client).Fetch: %w", context.DeadlineExceeded), true},
		{"request cancelled, our context alive", context.Canceled, true},
		{"connection closed by the broker", io.EOF, true},
		{"short read", io.ErrUnexpectedEOF, true},
		{"closed pipe", io.ErrClosedPipe, true},
		{"network timeout", &net.OpError{Op: "read", Err: os.ErrDeadlineExceeded}, true},
		{"connection refused", &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}, true},
		{"connection reset", &net.OpError{Op: "read", Err: syscall.ECONNRESET}, true},
		{"rebalance", kafka.RebalanceInProgress, true},
		{"leader moved", kafka.NotLeaderForPartition, true},
		{"coordinator moved", kafka.NotCoordinatorForGroup, true},
		{"topic being created", kafka.UnknownTopicOrPartition, true},
		{"broker overloaded", kafka.RequestTimedOut, true},
		{"sasl", kafka.SASLAuthenticationFailed, false},
		{"sasl mechanism", kafka.UnsupportedSASLMechanism, false},
		{"group acl, wrapped", fmt.Errorf("join: %w", kafka.GroupAuthorizationFailed), false},
		{"topic acl", kafka.TopicAuthorizationFailed, false},
		{"cluster acl", kafka.ClusterAuthorizationFailed, false},
		{"invalid topic", kafka.InvalidTopic, false},
		{"a writer's topic acl", kafka.WriteErrors{nil, fmt.Errorf("%w: denied", kafka.TopicAuthorizationFailed)}, false},
		{"a writer's errors, wrapped", fmt.Errorf("writing: %w", kafka.WriteErrors{kafka.TopicAuthorizationFailed}), false},
		{"a writer's leader moved", kafka.WriteErrors{kafka.NotLeaderForPartition, nil}, true},
		{"invalid group", kafka.InvalidGroupId, false},
		{"unknown CA", &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, false},
		{"wrong host name", fmt.Errorf("dial: %w", x509.HostnameError{Host: "kafka"}), false},
		{"TLS to a plain listener", tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := retryable(tc.err); got != tc.want {
				t.Errorf("retryable(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
}

// TestTransient holds the narrower classification: broker and network failures that come and go
// are transient; configuration-class errors, our own Close and errors that came from no broker
// are not.
func TestTransient(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"no error", nil, false},
		{"closed by us", ErrClosed, false},
		{"a request's deadline", fmt.Errorf("metadata: kafka.(*Client).Metadata: %w", context.DeadlineExceeded), true},
		{"connection closed by the broker", io.EOF, true},
		{"short read", io.ErrUnexpectedEOF, true},
		{"network timeout", &net.OpError{Op: "read", Err: os.ErrDeadlineExceeded}, true},
		{"connection refused, wrapped", fmt.Errorf("topic: %w", &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}), true},
		{"connection reset", &net.OpError{Op: "read", Err: syscall.ECONNRESET}, true},
		{"leader moved", kafka.NotLeaderForPartition, true},
		{"coordinator moved", kafka.NotCoordinatorForGroup, true},
		{"broker overloaded", kafka.RequestTimedOut, true},
		{"a writer's leader moved", kafka.WriteErrors{kafka.NotLeaderForPartition, nil}, true},
		{"a writer's errors, wrapped, one refused", fmt.Errorf("append: %w", kafka.WriteErrors{kafka.NotLeaderForPartition, kafka.TopicAuthorizationFailed}), false},
		{"a message too large", kafka.MessageSizeTooLarge, false},
		{"rebalance", kafka.RebalanceInProgress, true},
		{"topic acl", kafka.TopicAuthorizationFailed, false},
		{"sasl", fmt.Errorf("dial: %w", kafka.SASLAuthenticationFailed), false},
		{"unknown CA", &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, false},
		{"TLS to a plain listener", tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"}, false},
		{"no broker's: a damaged file", errors.New("ledger: checksum mismatch"), false},
		{"no broker's: our context ended", context.Canceled, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Transient(tc.err); got != tc.want {
				t.Errorf("Transient(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
}
