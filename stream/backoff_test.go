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

// TestClassification holds the two classifications of broker errors. Retryable: only
// configuration-class errors (and our own Close) stop the consumer; timeouts, end of stream,
// network and broker errors are retried. Transient, narrower: broker and network failures that
// come and go, and not an error that came from no broker.
func TestClassification(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		err                  error
		retryable, transient bool
	}{
		{"no error", nil, false, false},
		{"closed by us", ErrClosed, false, false},
		{"fetch timeout", fmt.Errorf("kafka.(*Client).Fetch: %w", context.DeadlineExceeded), true, true},
		{"request cancelled, our context alive", context.Canceled, true, false},
		{"connection closed by the broker", io.EOF, true, true},
		{"short read", io.ErrUnexpectedEOF, true, true},
		{"closed pipe", io.ErrClosedPipe, true, false},
		{"network timeout", &net.OpError{Op: "read", Err: os.ErrDeadlineExceeded}, true, true},
		{"connection refused", &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}, true, true},
		{"connection refused, wrapped", fmt.Errorf("topic: %w", &net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}), true, true},
		{"connection reset", &net.OpError{Op: "read", Err: syscall.ECONNRESET}, true, true},
		{"rebalance", kafka.RebalanceInProgress, true, true},
		{"leader moved", kafka.NotLeaderForPartition, true, true},
		{"coordinator moved", kafka.NotCoordinatorForGroup, true, true},
		{"topic being created", kafka.UnknownTopicOrPartition, true, true},
		{"broker overloaded", kafka.RequestTimedOut, true, true},
		{"a message too large", kafka.MessageSizeTooLarge, true, false},
		{"sasl", kafka.SASLAuthenticationFailed, false, false},
		{"sasl mechanism", kafka.UnsupportedSASLMechanism, false, false},
		{"group acl, wrapped", fmt.Errorf("join: %w", kafka.GroupAuthorizationFailed), false, false},
		{"topic acl", kafka.TopicAuthorizationFailed, false, false},
		{"cluster acl", kafka.ClusterAuthorizationFailed, false, false},
		{"invalid topic", kafka.InvalidTopic, false, false},
		{"a writer's topic acl", kafka.WriteErrors{nil, fmt.Errorf("%w: denied", kafka.TopicAuthorizationFailed)}, false, false},
		{"a writer's errors, wrapped", fmt.Errorf("writing: %w", kafka.WriteErrors{kafka.TopicAuthorizationFailed}), false, false},
		{"a writer's errors, one refused", kafka.WriteErrors{kafka.NotLeaderForPartition, kafka.TopicAuthorizationFailed}, false, false},
		{"a writer's leader moved", kafka.WriteErrors{kafka.NotLeaderForPartition, nil}, true, true},
		{"invalid group", kafka.InvalidGroupId, false, false},
		{"unknown CA", &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, false, false},
		{"wrong host name", fmt.Errorf("dial: %w", x509.HostnameError{Host: "kafka"}), false, false},
		{"TLS to a plain listener", tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"}, false, false},
		{"our certificate refused by the broker", fmt.Errorf("metadata: %w", &net.OpError{Op: "remote error", Err: tls.AlertError(42)}), false, false},
		{"a certificate the broker requires", &net.OpError{Op: "remote error", Err: tls.AlertError(116)}, false, false},
		{"the broker's internal error", &net.OpError{Op: "remote error", Err: tls.AlertError(80)}, true, true},
		{"no broker's: a damaged file", errors.New("ledger: checksum mismatch"), true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Retryable(tc.err); got != tc.retryable {
				t.Errorf("Retryable(%v) = %v, want %v", tc.err, got, tc.retryable)
			}
			if got := Transient(tc.err); got != tc.transient {
				t.Errorf("Transient(%v) = %v, want %v", tc.err, got, tc.transient)
			}
		})
	}
}
