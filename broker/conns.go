package broker

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"
	"golang.org/x/sync/semaphore"
)

// Defaults of the connection limits (Config.MaxConnections, IdleTimeout, RequestTimeout).
const (
	// DefaultMaxConnections bounds the connections the broker holds open, across its nodes:
	// far above what the daemon and a few producers use, far below a process's descriptors.
	DefaultMaxConnections = 1024
	// DefaultIdleTimeout closes a connection with no request in progress for this long. Kafka
	// clients reconnect by themselves (Kafka's own connections.max.idle.ms is 10 minutes).
	DefaultIdleTimeout = 2 * time.Minute
	// DefaultRequestTimeout bounds the time from a request's first byte to its last, and the
	// write of a response.
	DefaultRequestTimeout = 30 * time.Second
)

// LimitNames are what an operator sets to change the connection limits: Config.LimitNames.
type LimitNames struct {
	MaxConnections, IdleTimeout string
}

// maxHold is the longest the broker may hold a request before it answers (a JoinGroup waits
// for a rebalance up to the group's session timeout, at most kfake's group.max.session.timeout,
// 5 minutes): a connection whose request is in flight is not idle until then.
const maxHold = maxSessionTimeout

// ConnStats are the broker's connection counters.
type ConnStats struct {
	Open, Max int   // connections open now, and the limit (Config.MaxConnections)
	Refused   int64 // connections closed at once because Max were open
	Idle      int64 // connections closed after IdleTimeout without a request, or IdleTimeout + maxHold without an answer
	Partial   int64 // connections closed because a request took longer than RequestTimeout to arrive
	Oversized int64 // connections closed for a request larger than MaxRequestBytes, or than MaxBufferedBytes had left
	Invalid   int64 // connections closed for a request the broker does not take (see gate)
	Clamped   int64 // fetches cut to MaxFetchBytes or MaxFetchWait
}

// warnEvery is how often at most the broker logs a WARN line of one kind of refusal (connections
// beyond the limit, requests refused), each naming how many there were since the last.
const warnEvery = time.Minute

// connLimits is what every node's listener shares: the count of open connections, the bytes of
// requests being read, and the timeouts each connection gets.
type connLimits struct {
	max                 int
	idle, request, hold time.Duration // hold: maxHold
	names               LimitNames
	log                 *slog.Logger
	open                atomic.Int64
	budget              *semaphore.Weighted // MaxBufferedBytes: request bytes past a first readChunk
	buffered            atomic.Int64        // bytes of budget held (for tests)
	waiting             atomic.Int64        // requests waiting for budget (for tests)
	refused             atomic.Int64
	idleClosed          atomic.Int64
	partialClosed       atomic.Int64
	oversized           atomic.Int64
	invalid             atomic.Int64
	clamped             atomic.Int64
	refusals            rateLog // connections beyond the limit
	rejections          rateLog // requests refused
}

// rateLog logs one WARN line of a kind at most every warnEvery, with the count since the last.
type rateLog struct {
	mu     sync.Mutex
	last   time.Time
	missed int64
}

// note counts one event and reports whether to log it now, with the events not logged since
// the last line.
func (r *rateLog) note(now time.Time) (log bool, missed int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.last.IsZero() && now.Sub(r.last) < warnEvery {
		r.missed++
		return false, 0
	}
	missed, r.last, r.missed = r.missed, now, 0
	return true, missed
}

// admit takes a slot for a new connection, or reports that none is free. The slot is taken only
// when one is free (compare and swap), so that the count never passes the limit, not even while a
// connection beyond it is refused: stats, full and the scrape read it meanwhile.
func (l *connLimits) admit() bool {
	for {
		open := l.open.Load()
		if open < int64(l.max) {
			if l.open.CompareAndSwap(open, open+1) {
				return true
			}
			continue
		}
		if ok, missed := l.refusals.note(time.Now()); ok {
			l.log.Warn("embedded broker at its connection limit: closing new connections until a slot frees ("+l.names.MaxConnections+")",
				"max_connections", l.max, "idle_timeout", l.idle, "refused_since_last_line", missed)
		}
		l.refused.Add(1) // after the line: whoever sees the count finds the line
		return false
	}
}

// release frees a slot.
func (l *connLimits) release() { l.open.Add(-1) }

func (l *connLimits) stats() ConnStats {
	return ConnStats{Open: int(l.open.Load()), Max: l.max, Refused: l.refused.Load(), Idle: l.idleClosed.Load(),
		Partial: l.partialClosed.Load(), Oversized: l.oversized.Load(), Invalid: l.invalid.Load(), Clamped: l.clamped.Load()}
}

// full says why the broker refuses new connections, nil while it has a free slot.
func (l *connLimits) full() error {
	if open := l.open.Load(); open >= int64(l.max) {
		return fmt.Errorf("embedded broker at its connection limit (%d of %s %d open): new Kafka clients are "+
			"refused until a connection closes (idle ones after %s %v)", open, l.names.MaxConnections, l.max, l.names.IdleTimeout, l.idle)
	}
	return nil
}

// reject counts a request refused (its connection closes) and logs it, at most every warnEvery.
func (l *connLimits) reject(remote net.Addr, err error) {
	if ok, missed := l.rejections.note(time.Now()); ok {
		l.log.Warn("embedded broker refused a request and closed its connection", "remote", remote.String(), "err", err,
			"refused_since_last_line", missed)
	}
	// After the line: whoever sees the count finds the line.
	if errors.Is(err, errOversized) {
		l.oversized.Add(1)
	} else {
		l.invalid.Add(1)
	}
}

// limitedConn is an accepted connection that holds a slot until it is closed. It reads each
// request whole from the socket before kfake sees a byte of it, so that gate can refuse or cut
// it, and reads the next only once the last is answered (as Kafka mutes a connection while it
// handles a request). It gives its reads and writes deadlines: at a request boundary,
// IdleTimeout; within a request, RequestTimeout from its first byte; with a request in flight
// (the broker holds it), IdleTimeout + maxHold for its answer; a write, RequestTimeout.
//
// kfake reads a connection from one goroutine at a time and writes it from another; mu guards
// what both touch, and each sets the read deadline under it.
type limitedConn struct {
	net.Conn
	l    *connLimits
	once sync.Once

	pending []byte // the current request as gate passed it, not yet read by kfake

	mu       sync.Mutex
	held     int64 // budget held for the last request read (released when the next starts, or at Close)
	inflight int   // requests handed to kfake whose response is not written yet
	reading  bool  // part of a request has arrived: its RequestTimeout deadline stands
	muted    bool  // the next request waits for the answer to the one in flight (awaitAnswer; read by tests)

	answered chan struct{} // a response was written (cap 1)
	done     chan struct{} // closed by Close
}

func newLimitedConn(conn net.Conn, l *connLimits) *limitedConn {
	return &limitedConn{Conn: conn, l: l, answered: make(chan struct{}, 1), done: make(chan struct{})}
}

var errOversized = errors.New("broker: request too large")

// awaitAnswer waits, before the next request is read, until kfake has answered the one in
// flight: a request read behind one the broker holds (a JoinGroup waiting for a rebalance) would
// sit in kfake, with its budget, for as long as that one is held, and would lift the held one's
// deadline. It waits IdleTimeout + maxHold at most; then the connection closes, counted idle.
func (c *limitedConn) awaitAnswer() error {
	c.mu.Lock()
	c.muted = c.inflight > 0
	muted := c.muted
	c.mu.Unlock()
	if !muted {
		return nil // answered already: no timer
	}
	defer func() {
		c.mu.Lock()
		c.muted = false
		c.mu.Unlock()
	}()
	t := time.NewTimer(c.l.idle + c.l.hold)
	defer t.Stop()
	for {
		c.mu.Lock()
		n := c.inflight
		c.mu.Unlock()
		if n == 0 {
			return nil
		}
		select {
		case <-c.answered:
		case <-c.done:
			return net.ErrClosed
		case <-t.C:
			c.l.idleClosed.Add(1)
			return fmt.Errorf("broker: no answer to a request in %v: %w", c.l.idle+c.l.hold, os.ErrDeadlineExceeded)
		}
	}
}

// awaitRequest sets the read deadline of a connection at a request boundary: the idle timeout
// from now.
func (c *limitedConn) awaitRequest(now time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reading = false
	return c.Conn.SetReadDeadline(now.Add(c.l.idle))
}

// requestStarted sets the read deadline of a request whose first byte arrived at now.
func (c *limitedConn) requestStarted(now time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reading = true
	return c.Conn.SetReadDeadline(now.Add(c.l.request))
}

// requestRead marks the request read whole, and in flight when it is answered.
func (c *limitedConn) requestRead(answered bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reading = false
	if answered {
		c.inflight++
	}
}

// Read hands kfake the current request, reading the next whole one when none is left.
func (c *limitedConn) Read(p []byte) (int, error) {
	if len(c.pending) == 0 {
		frame, err := c.next()
		if err != nil {
			return 0, err
		}
		c.pending = frame
	}
	n := copy(p, c.pending)
	c.pending = c.pending[n:]
	if len(c.pending) == 0 {
		c.pending = nil
	}
	return n, nil
}

// readChunk bounds one read of a request's body: its buffer grows with the bytes that arrived,
// not with the size the request declares.
const readChunk = 64 << 10

// next reads one request whole (its size prefix and body), within the connection's deadlines,
// and returns it as gate passed it.
func (c *limitedConn) next() (_ []byte, err error) {
	c.releaseBudget() // kfake parsed and queued the last request before it reads this one
	defer func() {
		if err != nil {
			c.releaseBudget() // what this request held: it goes no further
		}
	}()
	if err := c.awaitAnswer(); err != nil {
		return nil, err
	}
	if err := c.awaitRequest(time.Now()); err != nil {
		return nil, err
	}
	var prefix [4]byte
	if _, err := io.ReadFull(c.Conn, prefix[:1]); err != nil {
		return nil, c.readFailed(err, false)
	}
	started := time.Now()
	if err := c.requestStarted(started); err != nil {
		return nil, err
	}
	if _, err := io.ReadFull(c.Conn, prefix[1:]); err != nil {
		return nil, c.readFailed(err, true)
	}
	size := int64(int32(binary.BigEndian.Uint32(prefix[:])))
	if size < 0 || size > MaxRequestBytes {
		err := fmt.Errorf("%w: a request of %d bytes, over MaxRequestBytes (%d)", errOversized, size, MaxRequestBytes)
		c.l.reject(c.RemoteAddr(), err)
		return nil, err
	}
	frame := append(make([]byte, 0, 4+min(size, readChunk)), prefix[:]...)
	reserved := false
	for int64(len(frame)-4) < size {
		k := min(size-int64(len(frame)-4), readChunk)
		if len(frame) > 4 && !reserved {
			reserved = true
			// Past the first chunk, which holds the header: a request of a kind that may not be
			// this large is refused before any more is read, and the rest takes its budget at
			// once (a request holding part of it while waiting for more could wait on another
			// doing the same), within the request's time.
			if err := checkSize(kmsg.Key(binary.BigEndian.Uint16(frame[4:])), size); err != nil {
				c.l.reject(c.RemoteAddr(), err)
				return nil, err
			}
			if err := c.hold(started, size-int64(len(frame)-4)); err != nil {
				return nil, err
			}
			frame = slices.Grow(frame, int(size)-(len(frame)-4)) // once: the rest is reserved
		}
		if _, err := io.ReadFull(c.Conn, frame[len(frame):len(frame)+int(k)]); err != nil {
			return nil, c.readFailed(err, true)
		}
		frame = frame[:len(frame)+int(k)]
	}
	v, err := gate(frame)
	if err != nil {
		c.l.reject(c.RemoteAddr(), err)
		return nil, err
	}
	if v.clamped {
		c.l.clamped.Add(1)
	}
	c.requestRead(v.answered)
	return v.frame, nil
}

// hold takes k bytes of the shared budget for the request that started at started, waiting for
// them until its RequestTimeout ends (then the connection closes, counted as partial).
func (c *limitedConn) hold(started time.Time, k int64) error {
	ctx, cancel := context.WithDeadline(context.Background(), started.Add(c.l.request))
	defer cancel()
	c.l.waiting.Add(1)
	err := c.l.budget.Acquire(ctx, k)
	c.l.waiting.Add(-1)
	if err != nil {
		c.l.partialClosed.Add(1)
		return fmt.Errorf("broker: a request waited %v for buffer room (MaxBufferedBytes, %d, held by requests being read): %w",
			c.l.request, MaxBufferedBytes, err)
	}
	c.l.buffered.Add(k)
	c.mu.Lock()
	c.held += k
	c.mu.Unlock()
	select {
	case <-c.done: // Close may have released before this was held: give it back
		c.releaseBudget()
		return net.ErrClosed
	default:
	}
	return nil
}

// releaseBudget gives back the budget the last request held.
func (c *limitedConn) releaseBudget() {
	c.mu.Lock()
	k := c.held
	c.held = 0
	c.mu.Unlock()
	if k > 0 {
		c.l.buffered.Add(-k)
		c.l.budget.Release(k)
	}
}

// readFailed counts a read that timed out, as idle or within a request, and returns err.
func (c *limitedConn) readFailed(err error, midRequest bool) error {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		if midRequest {
			c.l.partialClosed.Add(1)
		} else {
			c.l.idleClosed.Add(1)
		}
	}
	return err
}

func (c *limitedConn) Write(p []byte) (int, error) {
	if err := c.Conn.SetWriteDeadline(time.Now().Add(c.l.request)); err != nil {
		return 0, err
	}
	n, err := c.Conn.Write(p)
	if err == nil {
		// kfake writes each response whole: the request it answers is no longer in flight, and
		// a read waiting for the next request is idle from now.
		c.mu.Lock()
		if c.inflight > 0 {
			c.inflight--
		}
		if c.inflight == 0 && !c.reading {
			err = c.Conn.SetReadDeadline(time.Now().Add(c.l.idle))
		}
		c.mu.Unlock()
		select {
		case c.answered <- struct{}{}:
		default:
		}
	}
	return n, err
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() {
		close(c.done)
		c.releaseBudget()
		c.l.release()
	})
	return err
}
