package daemon

import (
	"net"
	"runtime"
	"sync"

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
	return &limitConn{Conn: c, release: func() { l.conns.Dec(); <-l.slots }}, nil
}

func (l *limitListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// limitConn gives its slot back once, on the first Close.
type limitConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
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
