package stream

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"slices"

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
	)
	return errors.As(err, &unknownCA) || errors.As(err, &invalidCert) || errors.As(err, &hostname) ||
		errors.As(err, &verify) || errors.As(err, &header)
}

// Retryable reports whether a broker operation that failed with err is worth retrying with
// backoff: every error except the configuration-class ones (authentication, authorization,
// invalid topic or group names, refused certificates), which only the operator can fix.
func Retryable(err error) bool { return retryable(err) }
