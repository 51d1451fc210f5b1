package broker

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"
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

// MaxRequestBytes is the largest request the broker reads (Kafka's socket.request.max.bytes,
// 100 MiB): a larger size prefix closes the connection before anything is allocated for it.
const MaxRequestBytes = 100 << 20

// maxHold is the longest the broker may hold a request before it answers (a JoinGroup waits
// for a rebalance up to the group's session timeout, at most kfake's group.max.session.timeout,
// 5 minutes): a connection whose request is in flight is not idle until then.
const maxHold = maxSessionTimeout

// ConnStats are the broker's connection counters.
type ConnStats struct {
	Open, Max int   // connections open now, and the limit (Config.MaxConnections)
	Refused   int64 // connections closed at once because Max were open
	Idle      int64 // connections closed after IdleTimeout without a request
	Partial   int64 // connections closed because a request took longer than RequestTimeout to arrive
	Oversized int64 // connections closed for a request larger than MaxRequestBytes
}

// connLimits is what every node's listener shares: the count of open connections and the
// timeouts each connection gets.
type connLimits struct {
	max              int
	idle, request    time.Duration
	framed           bool // the listener sees Kafka's framing (not TLS records)
	log              *slog.Logger
	open             atomic.Int64
	refused          atomic.Int64
	idleClosed       atomic.Int64
	partialClosed    atomic.Int64
	oversized        atomic.Int64
	mu               sync.Mutex
	refusingSince    time.Time // the first refusal of the current episode, zero when none
	refusedInEpisode int64
}

// admit takes a slot for a new connection, or reports that none is free.
func (l *connLimits) admit() bool {
	if l.open.Add(1) > int64(l.max) {
		l.open.Add(-1)
		l.refused.Add(1)
		l.mu.Lock()
		if l.refusingSince.IsZero() {
			l.refusingSince = time.Now()
			l.log.Warn("embedded broker at its connection limit: closing new connections until a slot frees (kafka.embedded_max_connections)",
				"max_connections", l.max, "idle_timeout", l.idle)
		}
		l.refusedInEpisode++
		l.mu.Unlock()
		return false
	}
	return true
}

// release frees a slot; the first release after refusals ends the episode.
func (l *connLimits) release() {
	l.open.Add(-1)
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.refusingSince.IsZero() {
		l.log.Info("embedded broker below its connection limit again", "refused", l.refusedInEpisode,
			"for", time.Since(l.refusingSince).Round(time.Millisecond))
		l.refusingSince, l.refusedInEpisode = time.Time{}, 0
	}
}

func (l *connLimits) stats() ConnStats {
	return ConnStats{Open: int(l.open.Load()), Max: l.max, Refused: l.refused.Load(), Idle: l.idleClosed.Load(),
		Partial: l.partialClosed.Load(), Oversized: l.oversized.Load()}
}

// full says why the broker refuses new connections, nil while it has a free slot.
func (l *connLimits) full() error {
	if open := l.open.Load(); open >= int64(l.max) {
		return fmt.Errorf("embedded broker at its connection limit (%d of kafka.embedded_max_connections %d open): new Kafka clients are "+
			"refused until a connection closes (idle ones after kafka.embedded_idle_timeout %v)", open, l.max, l.idle)
	}
	return nil
}

// limitedConn is an accepted connection that holds a slot until it is closed, and whose reads
// and writes have deadlines: at a request boundary with nothing in flight, IdleTimeout; within
// a request, RequestTimeout from its first byte; with a request in flight (the broker holds it),
// IdleTimeout after the response is written (maxHold at most); a write, RequestTimeout.
//
// kfake reads a connection from one goroutine at a time and writes it from another; mu guards
// the framing state both touch.
type limitedConn struct {
	net.Conn
	l    *connLimits
	once sync.Once

	mu        sync.Mutex
	hdr       [4]byte
	hdrN      int       // bytes of the current request's size prefix read
	remaining int64     // bytes of the current request's body still to read
	started   time.Time // when the current request's first byte arrived
	inflight  int       // requests read and not answered yet
}

var errOversized = errors.New("broker: request larger than MaxRequestBytes")

// midRequest reports whether part of a request has been read. Callers hold mu.
func (c *limitedConn) midRequest() bool { return c.hdrN > 0 || c.remaining > 0 }

// readDeadline is the deadline of a read that starts at now. Callers hold mu.
func (c *limitedConn) readDeadline(now time.Time) time.Time {
	switch {
	case !c.l.framed:
		// TLS records hide the requests: only a silence longer than a request may be held.
		return now.Add(c.l.idle + maxHold)
	case c.midRequest():
		return c.started.Add(c.l.request)
	case c.inflight > 0:
		return now.Add(c.l.idle + maxHold)
	}
	return now.Add(c.l.idle)
}

func (c *limitedConn) Read(p []byte) (int, error) {
	c.mu.Lock()
	d := c.readDeadline(time.Now())
	c.mu.Unlock()
	if err := c.Conn.SetReadDeadline(d); err != nil {
		return 0, err
	}
	n, err := c.Conn.Read(p)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.l.framed {
		if ferr := c.consume(p[:n]); ferr != nil {
			c.l.oversized.Add(1)
			return 0, ferr
		}
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		if c.midRequest() {
			c.l.partialClosed.Add(1)
		} else {
			c.l.idleClosed.Add(1)
		}
	}
	return n, err
}

// consume follows Kafka's framing (a 4-byte big-endian size, then the request) over b. Callers
// hold mu.
func (c *limitedConn) consume(b []byte) error {
	for len(b) > 0 {
		if c.remaining == 0 {
			if c.hdrN == 0 {
				c.started = time.Now()
			}
			k := copy(c.hdr[c.hdrN:], b)
			c.hdrN += k
			b = b[k:]
			if c.hdrN < 4 {
				return nil
			}
			c.hdrN = 0
			size := int64(int32(binary.BigEndian.Uint32(c.hdr[:])))
			if size < 0 || size > MaxRequestBytes {
				return fmt.Errorf("%w: a request of %d bytes", errOversized, size)
			}
			c.remaining = size
			if size == 0 {
				c.inflight++
			}
			continue
		}
		k := int64(len(b))
		if k > c.remaining {
			k = c.remaining
		}
		c.remaining -= k
		b = b[k:]
		if c.remaining == 0 {
			c.inflight++
		}
	}
	return nil
}

func (c *limitedConn) Write(p []byte) (int, error) {
	if err := c.Conn.SetWriteDeadline(time.Now().Add(c.l.request)); err != nil {
		return 0, err
	}
	n, err := c.Conn.Write(p)
	if err == nil && c.l.framed {
		// kfake writes each response whole: the request it answers is no longer in flight, and
		// a read waiting for the next request is idle from now.
		c.mu.Lock()
		if c.inflight > 0 {
			c.inflight--
		}
		if c.inflight == 0 && !c.midRequest() {
			err = c.Conn.SetReadDeadline(time.Now().Add(c.l.idle))
		}
		c.mu.Unlock()
	}
	return n, err
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.l.release)
	return err
}
