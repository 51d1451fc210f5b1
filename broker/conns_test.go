package broker

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

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

	// The timeouts, short.
	b, addr = start(Config{IdleTimeout: time.Second, RequestTimeout: time.Second})
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

	// A request that never completes: part of a size prefix; a size prefix and part of its body.
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
	// A size prefix that would make kfake allocate 2 GiB.
	huge := dialIdle(t, addr)
	if _, err := huge.Write(binary.BigEndian.AppendUint32(nil, 1<<31-1)); err != nil {
		t.Fatal(err)
	}
	closedByPeer(t, huge, "an oversized request")
	waitfor.Cond(t, 30*time.Second, "the partial and oversized connections released", func() bool { return b.Connections().Open == 0 })
	if s := b.Connections(); s.Partial != 2 || s.Oversized != 1 {
		t.Errorf("after partial and oversized requests: %+v, want 2 partial, 1 oversized", s)
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

// A connection's read deadline follows its requests: idle at a boundary; from the first byte
// while a request arrives; held (up to the longest request the broker holds) while its request
// is in flight; idle again once the response is written.
func TestConnDeadlines(t *testing.T) {
	srv, cli := net.Pipe()
	defer srv.Close()
	defer cli.Close()
	go io.Copy(io.Discard, cli)
	l := &connLimits{max: 1, idle: time.Minute, request: 10 * time.Second, framed: true, log: slog.New(slog.DiscardHandler)}
	l.open.Store(1)
	c := &limitedConn{Conn: srv, l: l}
	now := time.Now()
	if d := c.readDeadline(now); !d.Equal(now.Add(time.Minute)) {
		t.Errorf("at a boundary: deadline in %v, want the idle timeout", d.Sub(now))
	}
	if err := c.consume([]byte{0, 0, 0, 4, 1}); err != nil {
		t.Fatal(err)
	}
	if d := c.readDeadline(now); !d.Equal(c.started.Add(10 * time.Second)) {
		t.Errorf("within a request: deadline %v after its first byte, want the request timeout", d.Sub(c.started))
	}
	if err := c.consume([]byte{2, 3, 4}); err != nil {
		t.Fatal(err)
	}
	if d := c.readDeadline(now); !d.Equal(now.Add(time.Minute+maxHold)) || c.inflight != 1 {
		t.Errorf("with a request in flight: deadline in %v (%d in flight), want idle + %v", d.Sub(now), c.inflight, maxHold)
	}
	if _, err := c.Write([]byte("response")); err != nil {
		t.Fatal(err)
	}
	if d := c.readDeadline(now); !d.Equal(now.Add(time.Minute)) || c.inflight != 0 {
		t.Errorf("after the response: deadline in %v (%d in flight), want the idle timeout", d.Sub(now), c.inflight)
	}
	if err := c.consume([]byte{0x80, 0, 0, 0}); err == nil {
		t.Error("a negative size was accepted")
	}
	c.Close()
	c.Close()
	if n := l.open.Load(); n != 0 {
		t.Errorf("%d slots held after Close twice, want 0", n)
	}
}
