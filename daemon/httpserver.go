package daemon

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// limitListener accepts at most n connections at once: Accept waits for one of them to close
// before it takes the next from the kernel's backlog (as golang.org/x/net/netutil's does). The
// gauge counts the connections it holds, raised after a slot is taken and lowered before it is
// given back, so it never reads more than n.
type limitListener struct {
	net.Listener
	slots chan struct{}
	conns prometheus.Gauge
	done  chan struct{} // closed by Close: a waiting Accept returns
	once  sync.Once
}

func newLimitListener(l net.Listener, n int, conns prometheus.Gauge) *limitListener {
	return &limitListener{Listener: l, slots: make(chan struct{}, n), conns: conns, done: make(chan struct{})}
}

func (l *limitListener) Accept() (net.Conn, error) {
	select {
	case l.slots <- struct{}{}:
	case <-l.done:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.slots
		return nil, err
	}
	l.conns.Inc()
	lc := &limitConn{Conn: c, release: func() { l.conns.Dec(); <-l.slots }}
	lc.lastRead.Store(time.Now().UnixNano())
	return lc, nil
}

func (l *limitListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// limitConn gives its slot back once, on the first Close, and records when it last read
// something (unusedConns).
type limitConn struct {
	net.Conn
	once     sync.Once
	release  func()
	lastRead atomic.Int64 // Unix nanoseconds: the accept, then the last Read that returned bytes
}

func (c *limitConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.lastRead.Store(time.Now().UnixNano())
	}
	return n, err
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// unusedGrace is how long a connection that has not carried a request must have read nothing
// before a drain closes it (unusedConns).
const unusedGrace = time.Second

// unusedConns tracks the server's connections that have not carried a request yet
// (http.StateNew), so that a drain closes those a client keeps without using them.
// http.Server.Shutdown closes idle keep-alive connections at once, but waits for a connection in
// StateNew until it has been so for 5 s (golang/go#22682), and HTTP clients keep such
// connections: Go's Transport pools the connection it dialed for a request that another one,
// freed meanwhile, served. A peer replica's client does: without this, a replica's stop would
// wait 5 s for a connection nobody uses, and fail as not drained with http.shutdown_timeout
// under 5 s. Closing one loses no request: the server answers none whose header it reads after
// Shutdown began. unusedGrace spares a connection whose request's header the server has just
// read, before it marks it active.
type unusedConns struct {
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	log   *slog.Logger
}

func newUnusedConns(log *slog.Logger) *unusedConns {
	return &unusedConns{conns: map[net.Conn]struct{}{}, log: log}
}

// track is the server's http.Server.ConnState.
func (u *unusedConns) track(c net.Conn, st http.ConnState) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if st == http.StateNew {
		u.conns[c] = struct{}{}
		return
	}
	delete(u.conns, c)
}

// closeStale closes the tracked connections that have read nothing for grace before now.
func (u *unusedConns) closeStale(now time.Time, grace time.Duration) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for c := range u.conns {
		lc := limitConnOf(c)
		if lc == nil || now.Sub(time.Unix(0, lc.lastRead.Load())) < grace {
			continue
		}
		u.log.Debug("closing a connection that carried no request, to drain", "remote", c.RemoteAddr().String())
		c.Close()
		delete(u.conns, c)
	}
}

// sweep closes stale connections (closeStale with unusedGrace) every 100 ms until ctx ends:
// while Shutdown drains. It starts with a pause, so that Shutdown has begun (from then on the
// server answers no request it had not read) before it closes anything.
func (u *unusedConns) sweep(ctx context.Context) {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		u.closeStale(time.Now(), unusedGrace)
	}
}

// limitConnOf is the limitConn under c (a TLS connection's NetConn), or nil.
func limitConnOf(c net.Conn) *limitConn {
	for c != nil {
		if lc, ok := c.(*limitConn); ok {
			return lc
		}
		u, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			return nil
		}
		c = u.NetConn()
	}
	return nil
}

// inputBudget bounds the inputs of the prediction requests admitted at once (running, or
// waiting for a shared engine call: see batcher). Like slots, acquire never waits: a request
// whose inputs would pass the bound is answered 429 with Retry-After at once. A request is always
// admitted when none is, so one of any allowed size is served even above the bound.
type inputBudget struct {
	mu       sync.Mutex
	held     int
	max      int
	rejected prometheus.Counter // may be nil
}

// newInputBudget bounds admitted inputs at n, or at perCPU per CPU (GOMAXPROCS) when n <= 0.
func newInputBudget(n, perCPU int) *inputBudget {
	if n <= 0 {
		n = perCPU * runtime.GOMAXPROCS(0)
	}
	return &inputBudget{max: n}
}

// acquire admits a request of n inputs, or reports ok false (and counts a rejection) when the
// inputs admitted already leave no room for it.
func (b *inputBudget) acquire(n int) (release func(), ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.held > 0 && b.held+n > b.max {
		if b.rejected != nil {
			b.rejected.Inc()
		}
		return nil, false
	}
	b.held += n
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			b.held -= n
			b.mu.Unlock()
		})
	}, true
}

// slots bound how many requests of one kind run at once. acquire never waits: a request over
// the bound is answered 429 with Retry-After at once, rather than queued behind work that may
// take seconds (a client retrying later costs nothing while it waits).
type slots struct {
	c        chan struct{}
	rejected prometheus.Counter // may be nil
}

func newSlots(n int) *slots {
	if n <= 0 {
		n = runtime.GOMAXPROCS(0)
	}
	return &slots{c: make(chan struct{}, n)}
}

// acquire takes a slot without waiting; release gives it back. ok is false when every slot is
// taken.
func (s *slots) acquire() (release func(), ok bool) {
	select {
	case s.c <- struct{}{}:
		return func() { <-s.c }, true
	default:
		if s.rejected != nil {
			s.rejected.Inc()
		}
		return nil, false
	}
}
