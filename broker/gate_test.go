package broker

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"log/slog"
	"math"
	"net"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// startGated starts a broker with topics "t" (2 partitions) and returns it and node 0's address.
func startGated(t *testing.T) (*Broker, string) {
	t.Helper()
	b, err := Start(context.Background(), Config{Topics: []string{"t"}, Partitions: 2}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b, b.Addrs()[0]
}

// request returns r at version v as written on the wire: size prefix, header, body.
func request(r kmsg.Request, v int16) []byte {
	r.SetVersion(v)
	return (&kmsg.RequestFormatter{}).AppendRequest(nil, r, 7)
}

// framed is a size prefix and body.
func framed(body []byte) []byte {
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
}

// roundTrip writes frame on a new connection and returns the size of the response's body.
func roundTrip(t *testing.T, addr string, frame []byte, within time.Duration) int {
	t.Helper()
	c := dialIdle(t, addr)
	if _, err := c.Write(frame); err != nil {
		t.Fatal(err)
	}
	if err := c.SetReadDeadline(time.Now().Add(within)); err != nil {
		t.Fatal(err)
	}
	var size [4]byte
	if _, err := io.ReadFull(c, size[:]); err != nil {
		t.Fatalf("no response within %v: %v", within, err)
	}
	n := int(binary.BigEndian.Uint32(size[:]))
	if _, err := io.CopyN(io.Discard, c, int64(n)); err != nil {
		t.Fatal(err)
	}
	return n
}

// fetch is a Fetch v4 of topic t's partitions parts from offset 0.
func fetch(maxBytes, maxWait, minBytes int32, parts ...int32) []byte {
	r := kmsg.NewPtrFetchRequest()
	r.ReplicaID, r.MaxBytes, r.MaxWaitMillis, r.MinBytes = -1, maxBytes, maxWait, minBytes
	topic := kmsg.NewFetchRequestTopic()
	topic.Topic = "t"
	for _, p := range parts {
		fp := kmsg.NewFetchRequestTopicPartition()
		fp.Partition, fp.PartitionMaxBytes = p, maxBytes
		topic.Partitions = append(topic.Partitions, fp)
	}
	r.Topics = append(r.Topics, topic)
	return request(r, 4)
}

// TestGateRefusesWhatKfakeCannotTake: requests kfake would crash on (an unknown API key: it
// dereferences the nil request kmsg gives for one) or that do not parse, and a fetch naming a
// partition twice, close their connection and are counted; the broker goes on serving.
func TestGateRefusesWhatKfakeCannotTake(t *testing.T) {
	b, addr := startGated(t)
	header := func(key, version int16) []byte {
		h := binary.BigEndian.AppendUint16(nil, uint16(key))
		h = binary.BigEndian.AppendUint16(h, uint16(version))
		h = binary.BigEndian.AppendUint32(h, 1) // correlation id
		h = binary.BigEndian.AppendUint16(h, 1) // client id, 1 byte
		return append(h, 'x')
	}
	cases := []struct {
		name  string
		frame []byte
	}{
		{"an unknown API key", framed(header(1000, 0))},
		{"a version past the key's", framed(header(int16(kmsg.Metadata), 99))},
		{"a header cut short", framed([]byte{0, 3, 0, 4, 0, 0})},
		{"a produce that does not parse", framed(append(header(int16(kmsg.Produce), 7), 0xff, 0xff, 0xff))},
		{"a fetch naming a partition twice", fetch(1<<20, 0, 1, 0, 0)},
	}
	for i, tc := range cases {
		c := dialIdle(t, addr)
		if _, err := c.Write(tc.frame); err != nil {
			t.Fatal(err)
		}
		closedByPeer(t, c, tc.name)
		waitfor.Cond(t, 10*time.Second, tc.name+" counted", func() bool { return b.Connections().Invalid == int64(i+1) })
	}

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(addr), Topic: "t", Balancer: &kafka.Hash{}, BatchTimeout: time.Millisecond}
	defer w.Close()
	if err := w.WriteMessages(ctx, kafka.Message{Key: []byte("k"), Value: []byte("still serving")}); err != nil {
		t.Fatalf("producing after the refused requests: %v", err)
	}
}

// TestFetchIsCut: a fetch asking for every byte of a partition of several MiB gets at most
// MaxFetchBytes (and one batch more), and one asking to wait for ever on an empty partition is
// answered after MaxFetchWait: the broker holds neither for a client that asks.
func TestFetchIsCut(t *testing.T) {
	t.Parallel() // waits MaxFetchWait
	b, addr := startGated(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(addr), Topic: "t", Balancer: kafka.BalancerFunc(func(kafka.Message, ...int) int { return 0 }),
		BatchSize: 4, BatchTimeout: time.Millisecond}
	defer w.Close()
	value := bytes.Repeat([]byte("x"), 100<<10)
	const batches = 48 // of 4 x 100 KiB: 18.8 MiB in partition 0
	for range batches {
		if err := w.WriteMessages(ctx, kafka.Message{Value: value}, kafka.Message{Value: value}, kafka.Message{Value: value}, kafka.Message{Value: value}); err != nil {
			t.Fatal(err)
		}
	}
	n := roundTrip(t, addr, fetch(math.MaxInt32, 0, 1, 0), 30*time.Second)
	t.Logf("a fetch of every byte of partition 0 got %d bytes", n)
	if n > MaxFetchBytes+(1<<20) || n < MaxFetchBytes/2 {
		t.Errorf("a fetch of every byte got %d bytes, want about MaxFetchBytes (%d)", n, MaxFetchBytes)
	}
	start := time.Now()
	roundTrip(t, addr, fetch(1<<20, math.MaxInt32, math.MaxInt32, 1), 4*MaxFetchWait*time.Millisecond)
	t.Logf("a fetch asking to wait for ever on an empty partition was answered after %v", time.Since(start).Round(time.Millisecond))
	if got := b.Connections().Clamped; got != 2 {
		t.Errorf("%d fetches clamped, want 2", got)
	}
}

// TestRequestBuffersAreBounded: requests are buffered as their bytes arrive, and those being read
// hold at most MaxBufferedBytes together: a request that would pass it closes its connection.
func TestRequestBuffersAreBounded(t *testing.T) {
	b, addr := startGated(t)
	const part = 15 << 20 // of a MaxRequestBytes request; four of them leave less than one part
	prefix := binary.BigEndian.AppendUint32(nil, MaxRequestBytes)
	var held []net.Conn
	for range 4 {
		c := dialIdle(t, addr)
		if _, err := c.Write(append(prefix, make([]byte, part)...)); err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	waitfor.Cond(t, 30*time.Second, "four parts of requests buffered", func() bool { return b.conns.buffered.Load() >= 4*part })
	over := dialIdle(t, addr)
	go func() { _, _ = over.Write(append(prefix, make([]byte, part)...)) }()
	closedByPeer(t, over, "a request past MaxBufferedBytes")
	if got := b.Connections().Oversized; got != 1 {
		t.Errorf("%d connections closed as oversized, want 1", got)
	}
	for _, c := range held {
		c.Close()
	}
	waitfor.Cond(t, 30*time.Second, "the buffers released", func() bool { return b.conns.buffered.Load() == 0 })
}
