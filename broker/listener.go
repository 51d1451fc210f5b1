package broker

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"syscall"
	"time"
)

// Accept retries: the first after acceptRetryMin, doubling up to acceptRetryMax (net/http's
// Server.Serve does the same).
const (
	acceptRetryMin = 5 * time.Millisecond
	acceptRetryMax = time.Second
)

// listener is the net.Listener kfake gets. kfake's accept loop returns on the first error
// from Accept and closes the listener, so a single EMFILE (the process at its file descriptor
// limit, e.g. under a flood of slow HTTP clients) would stop the broker from accepting for
// good. listener.Accept retries such temporary errors itself with backoff, as net/http does,
// and returns an error only when the listener is closed or fails for good; it records that
// failure for Broker.Healthy.
type listener struct {
	net.Listener
	log    *slog.Logger
	limits *connLimits // shared by every node's listener
	tls    *tls.Config // when set, connections speak TLS (below limitedConn, which sees requests)

	closing   chan struct{} // closed by Close
	closeOnce sync.Once

	mu   sync.Mutex
	dead error // the error that ended the accept loop, unless Close did
}

func newListener(inner net.Listener, limits *connLimits, tc *tls.Config, log *slog.Logger) *listener {
	return &listener{Listener: inner, limits: limits, tls: tc, log: log, closing: make(chan struct{})}
}

// Accept waits for the next connection, retrying temporary errors (see temporaryAcceptError)
// with backoff. The first failure of an episode logs one WARN line, the recovery one INFO line.
// A connection beyond the limit (Config.MaxConnections) is closed at once, and Accept waits for
// the next; the others get the timeouts of limitedConn.
func (l *listener) Accept() (net.Conn, error) {
	var (
		delay  time.Duration
		failed int
		since  time.Time
	)
	for {
		conn, err := l.Listener.Accept()
		if err == nil {
			if failed > 0 {
				l.log.Info("embedded broker accepts connections again", "addr", l.Addr().String(),
					"failed_accepts", failed, "for", time.Since(since).Round(time.Millisecond))
				failed, delay = 0, 0
			}
			if !l.limits.admit() {
				conn.Close()
				continue
			}
			if l.tls != nil {
				conn = tls.Server(conn, l.tls)
			}
			return newLimitedConn(conn, l.limits), nil
		}
		select {
		case <-l.closing:
			return nil, net.ErrClosed
		default:
		}
		if !temporaryAcceptError(err) {
			l.mu.Lock()
			l.dead = err
			l.mu.Unlock()
			l.log.Error("embedded broker listener failed; Kafka clients cannot connect until the daemon is restarted",
				"addr", l.Addr().String(), "err", err)
			return nil, err
		}
		if failed == 0 {
			since = time.Now()
			l.log.Warn("embedded broker cannot accept a connection; retrying with backoff (5 ms doubling to 1 s)",
				"addr", l.Addr().String(), "err", err)
		}
		failed++
		delay = min(max(2*delay, acceptRetryMin), acceptRetryMax)
		t := time.NewTimer(delay)
		select {
		case <-l.closing:
			t.Stop()
			return nil, net.ErrClosed
		case <-t.C:
		}
	}
}

// Close stops Accept, also while it waits to retry.
func (l *listener) Close() error {
	l.closeOnce.Do(func() { close(l.closing) })
	return l.Listener.Close()
}

// healthy is nil while the listener accepts (or retries), the error that ended it otherwise.
func (l *listener) healthy() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.dead != nil {
		return fmt.Errorf("embedded broker listener on %s stopped accepting: %w", l.Addr(), l.dead)
	}
	return nil
}

// temporaryAcceptError reports whether an Accept error may go away by itself: descriptor
// or buffer exhaustion, a connection aborted before it was accepted, an interrupted call, or
// a timeout. net.ErrClosed and anything else are final.
func temporaryAcceptError(err error) bool {
	if errors.Is(err, net.ErrClosed) {
		return false
	}
	for _, errno := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM,
		syscall.ECONNABORTED, syscall.ECONNRESET, syscall.EINTR, syscall.EAGAIN, syscall.ETIMEDOUT} {
		if errors.Is(err, errno) {
			return true
		}
	}
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
