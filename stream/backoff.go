package stream

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
)

// ErrClosed is returned by Consumer and Publisher methods after Close (or after the context
// given to their constructor ended).
var ErrClosed = errors.New("stream: closed")

// ErrStopped wraps the error Consumer.Next returns when the consumer has stopped for good: a
// configuration-class error (authentication, authorization, an invalid topic or group, a
// certificate the broker or we refuse, a dead letter the dead-letter topic refuses as too
// large on its own) that no retry can fix, or a topic whose identity changed
// (TopicResetError). The consumer's Health then reports it; the caller decides what
// to do (the daemon keeps serving and turns /readyz false).
var ErrStopped = errors.New("stream: consumer stopped")

// retryable reports whether a broker operation that failed with err is worth retrying. Only
// configuration-class errors are not (see permanent), and ErrClosed: waiting does not fix
// them. Everything else is retried with backoff: network errors, connections closed by the
// broker (io.EOF), leader changes, rebalances, coordinator moves, and timeouts: a per-request
// deadline (context.DeadlineExceeded from a client's own timeout) means a slow broker or an
// overloaded machine, not a broken configuration. A caller tells its own context's end apart
// by checking ctx.Err() before asking (as every retry loop here does), so a
// context.Canceled or DeadlineExceeded seen while ctx is alive came from a single request.
func retryable(err error) bool {
	return err != nil && !errors.Is(err, ErrClosed) && !permanent(err)
}

// permanent reports whether err is configuration-class: retrying cannot fix it, the operator
// must (credentials, ACLs, topic or group names, TLS certificates). A kafka.WriteErrors (a
// writer's error per message) is when one of its errors is.
func permanent(err error) bool {
	var werrs kafka.WriteErrors
	if errors.As(err, &werrs) {
		return slices.ContainsFunc(werrs, func(e error) bool { return e != nil && permanent(e) })
	}
	var ke kafka.Error
	if errors.As(err, &ke) {
		switch ke {
		case kafka.SASLAuthenticationFailed, kafka.UnsupportedSASLMechanism, kafka.IllegalSASLState,
			kafka.TopicAuthorizationFailed, kafka.GroupAuthorizationFailed, kafka.ClusterAuthorizationFailed,
			kafka.TransactionalIDAuthorizationFailed, kafka.InvalidTopic, kafka.InvalidGroupId:
			return true
		}
		return false
	}
	var (
		unknownCA   x509.UnknownAuthorityError
		invalidCert x509.CertificateInvalidError
		hostname    x509.HostnameError
		verify      *tls.CertificateVerificationError
		header      tls.RecordHeaderError // TLS spoken to a plain listener, or the reverse
		op          *net.OpError
	)
	// A TLS alert the broker sent about the handshake (crypto/tls reports it as a "remote
	// error"): it refused our certificate, wants one we do not present, or speaks no version we
	// do. Other alerts (an internal error of the broker's) come and go.
	remote := errors.As(err, &op) && op.Op == "remote error" && op.Err != nil && slices.ContainsFunc(handshakeAlerts,
		func(a string) bool { return strings.Contains(op.Err.Error(), a) })
	return errors.As(err, &unknownCA) || errors.As(err, &invalidCert) || errors.As(err, &hostname) ||
		errors.As(err, &verify) || errors.As(err, &header) || remote
}

// errUnanswered marks an offsets request that failed on the network (OffsetsError).
var errUnanswered = errors.New("kafka-go answers a partition whose offsets request failed on the network (a connection reset) with error -1, Unknown")

// OffsetsError is a partition's error in a kafka.Client ListOffsets answer, marked transient
// where it may stand for a request that failed on the network: kafka-go's ListOffsets splits a
// request by broker and answers every partition of a part that failed with kafka.Unknown (-1),
// dropping the cause (protocol/listoffsets, Response.Merge). A broker's own unknown error is
// then retried too, as a transient one would be. Other errors, and nil, are returned as they are.
func OffsetsError(err error) error {
	if errors.Is(err, kafka.Unknown) {
		return errors.Join(err, errUnanswered)
	}
	return err
}

// handshakeAlerts are the words of crypto/tls's alert texts that configuration causes.
var handshakeAlerts = []string{"certificate", "access denied", "handshake failure", "protocol version", "unknown certificate authority"}

// Transient reports whether err is a broker operation's failure that comes and goes with the
// broker or the network: a network error (a refused or reset connection, a read timeout), a
// connection the broker closed (io.EOF), a request's own deadline (context.DeadlineExceeded from
// a client's timeout: check the caller's ctx.Err() first), an offsets answer's Unknown
// (OffsetsError) or a Kafka error code that kafka-go marks temporary (a leader or coordinator moving), or a group's rebalance; a writer's errors when one of them is (and
// none is configuration-class). Unlike Retryable, which takes every error
// but the configuration-class ones, it holds for those alone: a caller whose steps also fail for
// reasons no wait fixes (a damaged file, a refused entry) retries only these.
func Transient(err error) bool {
	if err == nil || permanent(err) || errors.Is(err, ErrClosed) {
		return false
	}
	if errors.Is(err, errUnanswered) {
		return true
	}
	var werrs kafka.WriteErrors
	if errors.As(err, &werrs) {
		return slices.ContainsFunc(werrs, Transient)
	}
	var ke kafka.Error
	if errors.As(err, &ke) {
		return ke.Temporary() || ke == kafka.RebalanceInProgress
	}
	var ne net.Error
	return errors.As(err, &ne) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF)
}

// Retryable reports whether a broker operation that failed with err is worth retrying with
// backoff: every error except the configuration-class ones (authentication, authorization,
// invalid topic or group names, refused certificates), which only the operator can fix.
func Retryable(err error) bool { return retryable(err) }

// GroupJoinError is err, from joining a consumer group, with what to change when the broker
// refused the session timeout asked for (key names the setting that gives it): kafka-go's own
// message names neither the setting nor the broker's bounds, and the join is retried for ever.
func GroupJoinError(err error, key string, session time.Duration) error {
	if !errors.Is(err, kafka.InvalidSessionTimeout) {
		return err
	}
	return fmt.Errorf("%w: %s %s is outside the broker's group.min.session.timeout.ms .. group.max.session.timeout.ms "+
		"(Kafka's defaults: 6s .. 30m; cfguard broker: --group-min-session-timeout, 6s by default): set %s within them, "+
		"or lower the broker's floor, and restart", err, key, session, key)
}
