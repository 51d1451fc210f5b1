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
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kmsg"
	"golang.org/x/sync/semaphore"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/internal/waitfor"
)

// dialIdle opens a TCP connection to addr that sends nothing; it is closed with the test.
func dialIdle(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByPeer waits until the broker closes c: a read returns EOF or a reset. The deadline
// only keeps a broken broker from hanging the test.
func closedByPeer(t *testing.T, c net.Conn, what string) {
	t.Helper()
	if err := c.SetReadDeadline(time.Now().Add(60 * time.Second)); err != nil {
		t.Fatal(err)
	}
	_, err := c.Read(make([]byte, 1))
	if !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("%s: read = %v, want the broker to close the connection", what, err)
	}
}

// TestConnectionLimits floods a broker with idle connections, partial requests and an oversized
// size prefix: connections beyond the limit are closed at once and Healthy says the broker is
// full; idle ones are closed after the idle timeout, partial ones after the request timeout, the
// oversized one at once; then a real client produces and consumes.
func TestConnectionLimits(t *testing.T) {
	const max = 8
	start := func(cfg Config) (*Broker, string) {
		cfg.Topics = []string{"t"}
		b, err := Start(context.Background(), cfg, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(b.Close)
		return b, b.Addrs()[0]
	}
	// The limit, with an idle timeout no test run reaches: the flood's connections stay until
	// the test closes them.
	b, addr := start(Config{MaxConnections: max, IdleTimeout: time.Hour})
	var idle []net.Conn
	for range max {
		idle = append(idle, dialIdle(t, addr))
	}
	waitfor.Cond(t, 30*time.Second, "the broker holding the idle connections", func() bool { return b.Connections().Open == max })
	if err := b.Healthy(); err == nil || !strings.Contains(err.Error(), "connection limit") || !strings.Contains(err.Error(), "kafka.embedded_max_connections") {
		t.Errorf("Healthy at the limit = %v, want it to say so", err)
	}
	for i := range 5 {
		closedByPeer(t, dialIdle(t, addr), "a connection beyond the limit")
		if got := b.Connections().Refused; got != int64(i+1) {
			t.Errorf("refused %d connections, want %d", got, i+1)
		}
	}
	for _, c := range idle {
		c.Close()
	}
	waitfor.Cond(t, 30*time.Second, "the flood's connections released", func() bool { return b.Connections().Open == 0 })
	if err := b.Healthy(); err != nil {
		t.Errorf("Healthy once the flood ended: %v", err)
	}

	// The timeouts, short, the request timeout longer than the idle one: a request that
	// arrives a byte at a time, each within the idle timeout, is still cut at the request
	// timeout from its first byte.
	b, addr = start(Config{IdleTimeout: time.Second, RequestTimeout: 3 * time.Second})
	idle = nil
	for range max {
		idle = append(idle, dialIdle(t, addr))
	}
	for _, c := range idle {
		closedByPeer(t, c, "an idle connection")
	}
	waitfor.Cond(t, 30*time.Second, "every idle connection released", func() bool { return b.Connections().Open == 0 })
	if s := b.Connections(); s.Idle != max || s.Partial != 0 || s.Refused != 0 {
		t.Errorf("after the idle connections: %+v, want %d idle closed, none partial or refused", s, max)
	}

	// A request that never completes: part of a size prefix; a size prefix and part of its body;
	// a body that drips in.
	half := dialIdle(t, addr)
	if _, err := half.Write([]byte{0, 0}); err != nil {
		t.Fatal(err)
	}
	closedByPeer(t, half, "half a size prefix")
	body := dialIdle(t, addr)
	if _, err := body.Write([]byte{0, 0, 0, 64, 0, 3, 0}); err != nil {
		t.Fatal(err)
	}
	closedByPeer(t, body, "part of a request body")
	// A byte every 300 ms of a 200-byte request: 60 s of dripping, each byte well within the
	// idle timeout; the request timeout cuts it 3 s after its first byte (12 s allowed for a
	// busy machine).
	drip := dialIdle(t, addr)
	dripped := make(chan struct{})
	dripStart := time.Now()
	go func() {
		defer close(dripped)
		for i := range 4 + 200 {
			c := byte(0)
			if i == 3 {
				c = 200
			}
			if _, err := drip.Write([]byte{c}); err != nil {
				return
			}
			time.Sleep(300 * time.Millisecond)
		}
	}()
	closedByPeer(t, drip, "a request that drips in")
	if took := time.Since(dripStart); took > 12*time.Second {
		t.Errorf("a request that drips in was cut after %v, want its request timeout (3s) from its first byte", took)
	}
	<-dripped
	// Size prefixes past MaxRequestBytes, one that would make kfake allocate 2 GiB.
	for _, size := range []uint32{MaxRequestBytes + 1, 1<<31 - 1} {
		huge := dialIdle(t, addr)
		if _, err := huge.Write(binary.BigEndian.AppendUint32(nil, size)); err != nil {
			t.Fatal(err)
		}
		closedByPeer(t, huge, fmt.Sprintf("a request of %d bytes", size))
	}
	waitfor.Cond(t, 30*time.Second, "the partial and oversized connections released", func() bool { return b.Connections().Open == 0 })
	if s := b.Connections(); s.Partial != 3 || s.Oversized != 2 {
		t.Errorf("after partial and oversized requests: %+v, want 3 partial, 2 oversized", s)
	}

	// A real client, after the flood (TestConnDeadlines: a request in flight is not idle).
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()...), Topic: "t", RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	defer w.Close()
	if err := w.WriteMessages(ctx, kafka.Message{Value: []byte("after the flood")}); err != nil {
		t.Fatalf("producing after the flood: %v", err)
	}
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: b.Addrs(), Topic: "t", Partition: 0, MaxWait: 3 * time.Second})
	defer r.Close()
	m, err := r.ReadMessage(ctx)
	if err != nil || string(m.Value) != "after the flood" {
		t.Fatalf("consuming after the flood: %q, %v", m.Value, err)
	}
}

// deadlineConn records the last read deadline set on a connection.
type deadlineConn struct {
	net.Conn
	mu   sync.Mutex
	last time.Time
}

func (d *deadlineConn) SetReadDeadline(t time.Time) error {
	d.mu.Lock()
	d.last = t
	d.mu.Unlock()
	return d.Conn.SetReadDeadline(t)
}

func (d *deadlineConn) readDeadline() time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.last
}

// A connection's read deadline, as set on the socket, follows its requests: idle at a boundary;
// from the first byte while a request arrives; held (up to the longest request the broker
// holds) while its request is in flight; idle again once the response is written. A produce
// with acks=0 gets no response and is never in flight; a response written while the next
// request arrives leaves that request's deadline alone.
func TestConnDeadlines(t *testing.T) {
	srv, cli := net.Pipe()
	defer srv.Close()
	defer cli.Close()
	go io.Copy(io.Discard, cli)
	l := &connLimits{max: 1, idle: time.Minute, request: 10 * time.Second, hold: maxHold, log: slog.New(slog.DiscardHandler),
		budget: semaphore.NewWeighted(MaxBufferedBytes)}
	l.open.Store(1)
	dc := &deadlineConn{Conn: srv}
	c := newLimitedConn(dc, l)
	near := func(what string, want time.Duration) {
		t.Helper()
		if got := time.Until(dc.readDeadline()); got > want || got < want-5*time.Second {
			t.Errorf("%s: read deadline in %v, want %v", what, got.Round(time.Second), want)
		}
	}
	send := func(b []byte) {
		go func() { _, _ = cli.Write(b) }()
	}
	// readWhole reads n bytes, on the test's goroutine or another (t.Error: FailNow is for the
	// test's own).
	readWhole := func(n int) {
		t.Helper()
		buf := make([]byte, n)
		if _, err := io.ReadFull(c, buf); err != nil {
			t.Error(err)
		}
	}
	meta := kmsg.NewPtrMetadataRequest()
	meta.SetVersion(4)
	frame := (&kmsg.RequestFormatter{}).AppendRequest(nil, meta, 1)

	// At a boundary, then within a request: kfake's read blocks on the socket.
	send(frame[:1])
	readDone := make(chan struct{})
	go func() { defer close(readDone); readWhole(len(frame)) }()
	waitfor.Cond(t, 10*time.Second, "the request's first byte read", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.reading
	})
	near("within a request", 10*time.Second)
	// A response to an earlier request written meanwhile does not lift that deadline.
	if _, err := c.Write([]byte("earlier response")); err != nil {
		t.Fatal(err)
	}
	near("within a request, after a response", 10*time.Second)
	send(frame[1:])
	<-readDone
	// In flight: the next request is not read until the first is answered.
	send(frame)
	readDone = make(chan struct{})
	go func() { defer close(readDone); readWhole(len(frame)) }()
	waitfor.Cond(t, 10*time.Second, "the next read waiting for the answer", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.muted && c.inflight == 1 && !c.reading
	})
	select {
	case <-readDone:
		t.Fatal("the next request was read while one was in flight")
	default:
	}
	if _, err := c.Write([]byte("response")); err != nil {
		t.Fatal(err)
	}
	<-readDone
	if _, err := c.Write([]byte("response")); err != nil {
		t.Fatal(err)
	}
	near("after the responses", time.Minute)

	// A produce with acks=0: no response comes, and the connection is idle after it.
	prod := kmsg.NewPtrProduceRequest()
	prod.SetVersion(7)
	prod.Acks = 0
	frame = (&kmsg.RequestFormatter{}).AppendRequest(nil, prod, 2)
	send(frame)
	readWhole(len(frame))
	if err := c.awaitRequest(time.Now()); err != nil {
		t.Fatal(err)
	}
	near("after a produce with acks=0", time.Minute)

	c.Close()
	c.Close()
	if n := l.open.Load(); n != 0 {
		t.Errorf("%d slots held after Close twice, want 0", n)
	}
}

// TestRateLog: one line at the first event, none for warnEvery after, then one that counts the
// events in between.
func TestRateLog(t *testing.T) {
	var r rateLog
	now := time.Now()
	if ok, missed := r.note(now); !ok || missed != 0 {
		t.Fatalf("first event: log %v, missed %d; want a line", ok, missed)
	}
	for i := range 100 {
		if ok, _ := r.note(now.Add(time.Duration(i) * time.Millisecond)); ok {
			t.Fatalf("event %d within warnEvery logged", i)
		}
	}
	if ok, missed := r.note(now.Add(warnEvery)); !ok || missed != 100 {
		t.Fatalf("after warnEvery: log %v, missed %d; want a line counting 100", ok, missed)
	}
	// The next line counts the events since that line, not since the first.
	for i := range 3 {
		if ok, _ := r.note(now.Add(warnEvery + time.Duration(i+1)*time.Millisecond)); ok {
			t.Fatalf("event %d after the second line logged", i)
		}
	}
	if ok, missed := r.note(now.Add(2 * warnEvery)); !ok || missed != 3 {
		t.Fatalf("after another warnEvery: log %v, missed %d; want a line counting 3", ok, missed)
	}
}

// A request sent behind one the broker holds (a fetch waiting for records here, a JoinGroup
// waiting for a rebalance in life) is not read until that one is answered: it holds no budget
// and cannot lift the held request's deadline, and once IdleTimeout + maxHold pass without an
// answer the connection closes, counted idle, with the request behind never read.
func TestRequestsBehindAHeldOneWait(t *testing.T) {
	b, err := Start(context.Background(), Config{Topics: []string{"t"}, Partitions: 2, IdleTimeout: 300 * time.Millisecond,
		hold: 200 * time.Millisecond}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	c := dialIdle(t, b.Addrs()[0])
	// A fetch of an empty partition waiting MaxFetchWait (10 s) for a byte, then a produce at a
	// version the gate refuses once it has read it.
	bad := binary.BigEndian.AppendUint32(nil, 64)
	bad = binary.BigEndian.AppendUint16(binary.BigEndian.AppendUint16(bad, uint16(kmsg.Produce)), 99)
	bad = append(bad, make([]byte, 60)...)
	sent := time.Now()
	if _, err := c.Write(append(fetch(1<<20, 10_000, 1, 0), bad...)); err != nil {
		t.Fatal(err)
	}
	closedByPeer(t, c, "a connection whose held request got no answer in IdleTimeout + maxHold")
	if waited := time.Since(sent); waited < 500*time.Millisecond {
		t.Errorf("closed %v after the held request, before IdleTimeout + maxHold (500ms)", waited)
	}
	if s := b.Connections(); s.Invalid != 0 || s.Idle != 1 {
		t.Errorf("%+v, want the connection closed idle (1) with the request behind the held one never read (0 invalid)", s)
	}
}

// TestNegativeSizePrefixIsOversized: a size prefix of 2^31 or more is a negative int32; it is
// refused as oversized before a buffer is sized from it (a negative capacity would panic).
func TestNegativeSizePrefixIsOversized(t *testing.T) {
	for _, prefix := range [][]byte{{0xff, 0xff, 0xff, 0xff}, {0x80, 0, 0, 0}} {
		srv, cli := net.Pipe()
		l := &connLimits{max: 1, idle: time.Minute, request: 10 * time.Second, hold: maxHold, log: slog.New(slog.DiscardHandler),
			budget: semaphore.NewWeighted(MaxBufferedBytes)}
		l.open.Store(1)
		c := newLimitedConn(srv, l)
		go func() { _, _ = cli.Write(prefix) }()
		_, err := c.Read(make([]byte, 16))
		if !errors.Is(err, errOversized) || l.oversized.Load() != 1 {
			t.Errorf("size prefix %x: %v, %d oversized; want errOversized, counted", prefix, err, l.oversized.Load())
		}
		c.Close()
		cli.Close()
	}
}

// unansweredProduce is a produce request (acks=0: the broker writes no answer) of about n bytes,
// framed as on the wire.
func unansweredProduce(n int) []byte {
	r := kmsg.NewPtrProduceRequest()
	r.Acks, r.TimeoutMillis = 0, 1000
	p := kmsg.NewProduceRequestTopicPartition()
	p.Records = make([]byte, n)
	tp := kmsg.NewProduceRequestTopic()
	tp.Topic, tp.Partitions = "t", []kmsg.ProduceRequestTopicPartition{p}
	r.Topics = []kmsg.ProduceRequestTopic{tp}
	return request(r, 7)
}

// limitsForBudget are a connection's limits with a shared budget of budget bytes and
// RequestTimeout request.
func limitsForBudget(budget int64, request time.Duration) *connLimits {
	l := &connLimits{max: 1, idle: time.Minute, request: request, hold: maxHold, log: slog.New(slog.DiscardHandler),
		budget: semaphore.NewWeighted(budget)}
	l.open.Store(1)
	return l
}

// TestNextRequestGivesBackTheLastOnesBudget: the budget a request held is given back when the
// connection reads its next one (kfake has parsed the last by then), so that requests one after
// another on one connection never wait for room their own predecessor holds.
func TestNextRequestGivesBackTheLastOnesBudget(t *testing.T) {
	frame := unansweredProduce(3 * readChunk)
	rest := int64(len(frame) - 4 - readChunk)         // what a request holds past its first chunk
	l := limitsForBudget(rest+rest/2, 10*time.Second) // room for one request's rest, not two
	srv, cli := net.Pipe()
	defer cli.Close()
	c := newLimitedConn(srv, l)
	defer c.Close()
	go func() { _, _ = cli.Write(append(slices.Clone(frame), frame...)) }()
	for i := range 2 {
		buf := make([]byte, len(frame))
		if _, err := io.ReadFull(c, buf); err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
		if got := l.buffered.Load(); got != rest {
			t.Errorf("request %d read: %d bytes of budget held, want its own %d", i+1, got, rest)
		}
	}
	if s := l.partialClosed.Load(); s != 0 {
		t.Errorf("%d requests closed partial, want none", s)
	}
}

// TestRequestThatFindsNoRoomIsPartial: a request whose rest does not fit the budget within its
// RequestTimeout closes its connection, counted as partial (a request cut short), and holds
// nothing.
func TestRequestThatFindsNoRoomIsPartial(t *testing.T) {
	frame := unansweredProduce(3 * readChunk)
	l := limitsForBudget(readChunk, 100*time.Millisecond) // less than the rest
	srv, cli := net.Pipe()
	defer cli.Close()
	c := newLimitedConn(srv, l)
	defer c.Close()
	go func() { _, _ = cli.Write(frame) }()
	_, err := c.Read(make([]byte, len(frame)))
	if err == nil {
		t.Fatal("a request larger than the budget was read")
	}
	if s := l.partialClosed.Load(); s != 1 {
		t.Errorf("%d requests closed partial, want 1 (%v)", s, err)
	}
	if got := l.buffered.Load(); got != 0 {
		t.Errorf("%d bytes of budget held after the refusal, want 0", got)
	}
}

// TestSizePrefixBound: a size prefix of MaxRequestBytes is read on (here the client goes away
// before the body), one past it, or negative, is refused as oversized before a byte more is read.
func TestSizePrefixBound(t *testing.T) {
	for _, tc := range []struct {
		name      string
		size      uint32
		oversized bool
	}{
		{"MaxRequestBytes", MaxRequestBytes, false},
		{"MaxRequestBytes + 1", MaxRequestBytes + 1, true},
		{"2^31 - 1", 1<<31 - 1, true},
		{"2^32 - 1 (negative)", 1<<32 - 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := limitsForBudget(MaxBufferedBytes, 10*time.Second)
			// No body: a request read on fails at its first chunk.
			err := readSent(t, l, binary.BigEndian.AppendUint32(nil, tc.size))
			if err == nil {
				t.Fatal("a request with no body was read")
			}
			want := int64(0)
			if tc.oversized {
				want = 1
			}
			if got := errors.Is(err, errOversized); got != tc.oversized || l.oversized.Load() != want {
				t.Errorf("size prefix %d: %v, %d oversized; want oversized %v", tc.size, err, l.oversized.Load(), tc.oversized)
			}
		})
	}
}

// TestWriteDeadlineIsRequestTimeout: a response the client does not read fails after
// RequestTimeout, not IdleTimeout.
func TestWriteDeadlineIsRequestTimeout(t *testing.T) {
	l := limitsForBudget(MaxBufferedBytes, 100*time.Millisecond) // idle: a minute, past the bound below
	srv, cli := net.Pipe()                                       // nobody reads cli
	defer cli.Close()
	c := newLimitedConn(srv, l)
	defer c.Close()
	written := make(chan error, 1)
	go func() {
		_, err := c.Write([]byte("a response nobody reads"))
		written <- err
	}()
	select {
	case err := <-written:
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Errorf("a write nobody reads: %v, want a deadline exceeded", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a write nobody reads still blocks after 30s, want it cut at RequestTimeout (100ms)")
	}
}

// TestFailedRequestGivesBackItsBudget: a request that holds budget and then fails (the gate
// refuses it whole, or its client goes away mid-body) gives the budget back as its read fails,
// before the connection is closed.
func TestFailedRequestGivesBackItsBudget(t *testing.T) {
	refused := unansweredProduce(3 * readChunk)
	binary.BigEndian.PutUint16(refused[6:], 99) // a produce version past the broker's
	for _, tc := range []struct {
		name  string
		bytes []byte // what the client sends before it goes away
		err   error
	}{
		{"refused by the gate", refused, errInvalidRequest},
		{"cut short", unansweredProduce(3 * readChunk)[:4+2*readChunk+10], io.ErrUnexpectedEOF},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := limitsForBudget(MaxBufferedBytes, 10*time.Second)
			err := readSent(t, l, tc.bytes)
			if !errors.Is(err, tc.err) {
				t.Fatalf("read = %v, want %v", err, tc.err)
			}
			if got := l.buffered.Load(); got != 0 {
				t.Errorf("%d bytes of budget held after the failed read, want 0", got)
			}
		})
	}
}

// TestBudgetWaitEndsAtRequestTimeoutFromFirstByte: a request waiting for budget waits until
// RequestTimeout from its first byte, not from when it starts to wait.
func TestBudgetWaitEndsAtRequestTimeoutFromFirstByte(t *testing.T) {
	t.Parallel() // it waits out a request's time
	const request, firstChunkAfter = 8 * time.Second, 7 * time.Second
	frame := unansweredProduce(3 * readChunk)
	l := limitsForBudget(readChunk, request) // less than the rest: it waits
	srv, cli := net.Pipe()
	defer cli.Close()
	c := newLimitedConn(srv, l)
	defer c.Close()
	go func() { _, _ = cli.Write(frame[:1]) }()
	read := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, len(frame)))
		read <- err
	}()
	waitfor.Cond(t, 10*time.Second, "the request's first byte read", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.reading
	})
	first := time.Now() // not before the first byte's
	go func() {
		time.Sleep(firstChunkAfter) // the rest of the first chunk, late but within the request's time
		_, _ = cli.Write(frame[1 : 4+readChunk])
	}()
	var err error
	select {
	case err = <-read:
	case <-time.After(60 * time.Second):
		t.Fatal("the request still waits after 60s")
	}
	// RequestTimeout from the first byte ends 8s after it; from the wait's start, 15s at least.
	// 4s are allowed for a busy machine's timers and scheduling, short of the 7s between them.
	if took := time.Since(first); err == nil || took > request+4*time.Second {
		t.Errorf("the request waiting for budget failed after %v (%v), want its RequestTimeout (%v) from its first byte", took, err, request)
	}
	if s := l.partialClosed.Load(); s != 1 {
		t.Errorf("%d requests closed partial, want 1", s)
	}
}

// readSent reads, under l, a connection whose client sends b and goes away, and returns the
// read's error. The connection stays open until the test ends.
func readSent(t *testing.T, l *connLimits, b []byte) error {
	srv, cli := net.Pipe()
	c := newLimitedConn(srv, l)
	t.Cleanup(func() { c.Close() })
	go func() {
		_, _ = cli.Write(b)
		cli.Close()
	}()
	_, err := c.Read(make([]byte, 16))
	return err
}

// The count of open connections never passes the limit, not even for an instant while a
// connection beyond it is refused: stats, the readiness check (full) and the scrape read it while
// the nodes' accept loops admit at once.
func TestAdmitNeverCountsPastTheLimit(t *testing.T) {
	l := &connLimits{max: 1, log: slog.New(slog.DiscardHandler)}
	if !l.admit() {
		t.Fatal("the first connection was refused")
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 { // four nodes' accept loops, each refusing a flood
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if l.admit() {
					t.Error("a connection past the limit was admitted")
					l.release()
				}
			}
		}()
	}
	// Read while the loops refuse 200,000 connections (on one core too: the loops are preempted).
	over, reads := 0, 0
	for l.refused.Load() < 200000 {
		if l.stats().Open > l.max {
			over++
		}
		if reads++; reads%1000 == 0 {
			runtime.Gosched()
		}
	}
	close(stop)
	wg.Wait()
	if over > 0 {
		t.Errorf("%d of %d reads counted more open connections than the limit %d (%d refused meanwhile)", over, reads, l.max, l.refused.Load())
	}
}
