package broker

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"
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

// send writes b to c, which the broker may close before it has read all of b (it refuses a
// request at its first chunk): a write that meets that close is no failure.
func send(t *testing.T, c net.Conn, b []byte) {
	t.Helper()
	if _, err := c.Write(b); err != nil && !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.EPIPE) {
		t.Fatal(err)
	}
}

// manyPartitions is a fetch of n partitions of topic t.
func manyPartitions(n int) []byte {
	parts := make([]int32, n)
	for i := range parts {
		parts[i] = int32(i)
	}
	return fetch(1<<20, 0, 1, parts...)
}

// createTopics asks for topics (default "many"), each with n partitions.
func createTopics(n int32, topics ...string) []byte {
	r := kmsg.NewPtrCreateTopicsRequest()
	if len(topics) == 0 {
		topics = []string{"many"}
	}
	for _, name := range topics {
		topic := kmsg.NewCreateTopicsRequestTopic()
		topic.Topic, topic.NumPartitions, topic.ReplicationFactor = name, n, 1
		r.Topics = append(r.Topics, topic)
	}
	r.TimeoutMillis = 5000
	return request(r, 4)
}

// createPartitions asks for topic t to have n partitions.
func createPartitions(n int32) []byte {
	r := kmsg.NewPtrCreatePartitionsRequest()
	topic := kmsg.NewCreatePartitionsRequestTopic()
	topic.Topic, topic.Count = "t", n
	r.Topics = append(r.Topics, topic)
	r.TimeoutMillis = 5000
	return request(r, 1)
}

// TestGateRefusesWhatKfakeCannotTake: requests kfake would crash on (an unknown API key: it
// dereferences the nil request kmsg gives for one; a CreateTopics of 2^31 - 1 partitions takes
// the process's memory) or that do not parse, a fetch naming a partition twice or too many, a
// share-group request and a large request other than a produce close their connection and are
// counted; the broker goes on serving.
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
		{"a fetch naming MaxFetchPartitions + 1 partitions", manyPartitions(MaxFetchPartitions + 1)},
		{"a CreateTopics of two topics of MaxPartitions partitions", createTopics(MaxPartitions, "many", "more")},
		{"a CreateTopics of 2^31 - 1 partitions", createTopics(math.MaxInt32)},
		{"a CreatePartitions to 2^31 - 1", createPartitions(math.MaxInt32)},
		{"a share fetch", request(kmsg.NewPtrShareFetchRequest(), 1)},
		{"a metadata request of 2 MiB", framed(append(header(int16(kmsg.Metadata), 4), make([]byte, 2<<20)...))},
	}
	for i, tc := range cases {
		c := dialIdle(t, addr)
		send(t, c, tc.frame)
		closedByPeer(t, c, tc.name)
		waitfor.Cond(t, 10*time.Second, tc.name+" counted", func() bool {
			s := b.Connections()
			return s.Invalid+s.Oversized == int64(i+1)
		})
	}
	// An ApiVersions newer than the broker's is answered (UNSUPPORTED_VERSION with its range),
	// as clients that negotiate expect, and so is a CreateTopics within the bound.
	if n := roundTrip(t, addr, request(kmsg.NewPtrApiVersionsRequest(), 6), 10*time.Second); n == 0 {
		t.Error("an empty answer to ApiVersions v6")
	}
	roundTrip(t, addr, createTopics(3), 10*time.Second)
	// A fetch of every partition of a wide topic (more than MaxPartitions) passes the gate.
	if _, err := gate(manyPartitions(2 * MaxPartitions)); err != nil {
		t.Errorf("a fetch of %d partitions: %v", 2*MaxPartitions, err)
	}
	if p := len(b.Leaders("many")); p != 3 {
		t.Errorf("a CreateTopics of 3 partitions made %d", p)
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
// hold at most the budget together (MaxBufferedBytes, smaller here) past their first readChunk,
// each the whole of its rest at once: a request past it waits for room, while a small request is
// served at once, and two large ones that do not fit together are read one after the other (one
// holding part of the budget while waiting for more could wait for ever on the other). A request
// of another kind than a produce or a fetch over MaxOtherRequestBytes is refused at its first chunk.
func TestRequestBuffersAreBounded(t *testing.T) {
	const budget = 4 << 20
	b, err := Start(context.Background(), Config{Topics: []string{"t"}, Partitions: 2, bufferedBytes: budget}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	addr := b.Addrs()[0]
	// Two produce requests of 3 MiB at a version the gate refuses once they are whole.
	head := binary.BigEndian.AppendUint32(nil, 3<<20)
	head = binary.BigEndian.AppendUint16(binary.BigEndian.AppendUint16(head, uint16(kmsg.Produce)), 99)
	body := make([]byte, 3<<20-4)
	first, second := dialIdle(t, addr), dialIdle(t, addr)
	if _, err := first.Write(append(head, body[:5<<19]...)); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 30*time.Second, "the first request's rest reserved", func() bool { return b.conns.buffered.Load() == 3<<20-readChunk })
	go func() { _, _ = second.Write(append(head, body[:5<<19]...)) }()
	waitfor.Cond(t, 30*time.Second, "the second request waiting for room", func() bool { return b.conns.waiting.Load() == 1 })
	if got := b.conns.buffered.Load(); got != 3<<20-readChunk {
		t.Errorf("%d bytes of budget held while the second request waits, want the first's %d", got, 3<<20-readChunk)
	}
	meta := kmsg.NewPtrMetadataRequest()
	if n := roundTrip(t, addr, request(meta, 4), 10*time.Second); n == 0 {
		t.Fatal("an empty answer to a metadata request while the budget is taken")
	}
	for _, c := range []net.Conn{first, second} {
		go func() { _, _ = c.Write(body[5<<19:]) }()
	}
	closedByPeer(t, first, "the first large request, whole")
	closedByPeer(t, second, "the second large request, whole")
	if s := b.Connections(); s.Invalid != 2 || s.Partial != 0 {
		t.Errorf("after two large requests that do not fit the budget together: %+v, want both read whole (2 invalid, none partial)", s)
	}
	waitfor.Cond(t, 30*time.Second, "the budget given back", func() bool { return b.conns.buffered.Load() == 0 })

	// A metadata request declaring 100 MiB: closed at its first chunk, before the rest is read.
	big := dialIdle(t, addr)
	mh := binary.BigEndian.AppendUint32(nil, 100<<20)
	mh = binary.BigEndian.AppendUint16(binary.BigEndian.AppendUint16(mh, uint16(kmsg.Metadata)), 4)
	send(t, big, append(mh, make([]byte, 2<<20)...))
	closedByPeer(t, big, "a metadata request of 100 MiB")
	if s := b.Connections(); s.Oversized != 1 {
		t.Errorf("%+v, want the metadata request of 100 MiB refused as oversized", s)
	}
}

// TestGateLetsFranzGoProduceLargeRequests: franz-go's producer packs a batch of every partition
// in one produce request, here of 21 MB (24 partitions of a 900 kB record), which the broker
// reads and stores.
func TestGateLetsFranzGoProduceLargeRequests(t *testing.T) {
	b, err := Start(context.Background(), Config{Topics: []string{"wide"}, Partitions: 24}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	cl, err := kgo.NewClient(kgo.SeedBrokers(b.Addrs()...), kgo.DefaultProduceTopic("wide"), kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerLinger(200*time.Millisecond), kgo.ProducerBatchCompression(kgo.NoCompression()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	value := make([]byte, 900_000)
	for i := range value {
		value[i] = byte(i * 7919 % 251) // incompressible enough
	}
	var recs []*kgo.Record
	for p := range 24 {
		recs = append(recs, &kgo.Record{Partition: int32(p), Value: value})
	}
	// kgo resends a refused request for ever, ProduceSync past its context: the test waits 60 s.
	done := make(chan error, 1)
	go func() { done <- cl.ProduceSync(ctx, recs...).FirstErr() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("producing 24 partitions of 900 kB in one request: %v (broker %+v)", err, b.Connections())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("producing 24 partitions of 900 kB in one request: no answer in 60 s (broker %+v)", b.Connections())
	}
	cl.Close()
	for p, hw := range b.HighWatermarks("wide") {
		if hw != 1 {
			t.Fatalf("partition %d holds %d records, want 1", p, hw)
		}
	}
}

// TestGateUnit pins gate's rules one by one on frames built in memory (no broker): each
// request breaks one rule and is refused with the kind of error that counts it, or is within
// the rule and passes with the verdict its kind gets.
func TestGateUnit(t *testing.T) {
	hdr := func(key, version int16, body ...byte) []byte {
		h := binary.BigEndian.AppendUint16(nil, uint16(key))
		h = binary.BigEndian.AppendUint16(h, uint16(version))
		return append(h, body...)
	}
	// A flexible Metadata (v9) header whose one tagged field claims 100 bytes, with none there.
	tagPastEnd := hdr(int16(kmsg.Metadata), 9, 0, 0, 0, 1, 0xff, 0xff, 1, 0, 100)
	// A CreateTopics leaving its partition count to an assignment of MaxPartitions + 1
	// partitions.
	assigned := kmsg.NewPtrCreateTopicsRequest()
	topic := kmsg.NewCreateTopicsRequestTopic()
	topic.Topic, topic.NumPartitions, topic.ReplicationFactor = "assigned", -1, -1
	for p := range int32(MaxPartitions + 1) {
		a := kmsg.NewCreateTopicsRequestTopicReplicaAssignment()
		a.Partition, a.Replicas = p, []int32{0}
		topic.ReplicaAssignment = append(topic.ReplicaAssignment, a)
	}
	assigned.Topics = append(assigned.Topics, topic)
	// A CreatePartitions whose first count is negative, to hide the second's excess in the sum.
	negative := kmsg.NewPtrCreatePartitionsRequest()
	for i, n := range []int32{math.MinInt32, MaxPartitions + 1} {
		cp := kmsg.NewCreatePartitionsRequestTopic()
		cp.Topic, cp.Count = fmt.Sprintf("t%d", i), n
		negative.Topics = append(negative.Topics, cp)
	}
	for _, tc := range []struct {
		name  string
		frame []byte
		want  error
	}{
		{"8 bytes", framed(hdr(int16(kmsg.Metadata), 4, 0, 0, 0, 1)), errInvalidRequest},
		{"9 bytes", framed(hdr(int16(kmsg.Metadata), 4, 0, 0, 0, 1, 0)), errInvalidRequest},
		{"a negative version", framed(hdr(int16(kmsg.Metadata), -1, 0, 0, 0, 1, 0xff, 0xff)), errInvalidRequest},
		{"a header tag past the end", framed(tagPastEnd), errInvalidRequest},
		{"a CreateTopics by replica assignment", request(assigned, 4), errInvalidRequest},
		{"a CreatePartitions with a negative count", request(negative, 1), errInvalidRequest},
		{"a metadata request of 2 MiB", framed(append(hdr(int16(kmsg.Metadata), 4, 0, 0, 0, 1, 0xff, 0xff), make([]byte, 2<<20)...)), errOversized},
	} {
		if _, err := gate(tc.frame); !errors.Is(err, tc.want) {
			t.Errorf("%s: gate = %v, want %v", tc.name, err, tc.want)
		}
	}

	// A produce with acks=0 gets no answer, one with acks=1 does; a one-byte client id is
	// skipped whole.
	for _, acks := range []int16{0, 1} {
		r := kmsg.NewPtrProduceRequest()
		r.SetVersion(7)
		r.Acks, r.TimeoutMillis = acks, 1000
		v, err := gate(kmsg.NewRequestFormatter(kmsg.FormatterClientID("x")).AppendRequest(nil, r, 3))
		if err != nil || v.answered != (acks != 0) {
			t.Errorf("a produce with acks=%d: answered %v, err %v", acks, v.answered, err)
		}
	}

	// A fetch asking for more is rewritten to ask for the bounds, field by field.
	v, err := gate(fetch(1<<30, 60_000, 1, 0, 1))
	if err != nil || !v.clamped {
		t.Fatalf("clamped %v, err %v", v.clamped, err)
	}
	h, _, err := readHeader(v.frame[4:])
	if err != nil {
		t.Fatal(err)
	}
	if got := int(binary.BigEndian.Uint32(v.frame)); got != len(v.frame)-4 {
		t.Errorf("size prefix %d, frame body %d bytes", got, len(v.frame)-4)
	}
	r := kmsg.NewPtrFetchRequest()
	r.SetVersion(4)
	if err := r.ReadFrom(v.frame[4+h.len:]); err != nil {
		t.Fatal(err)
	}
	if r.MaxWaitMillis != MaxFetchWait || r.MaxBytes != MaxFetchBytes {
		t.Errorf("max wait %d ms, max bytes %d; want %d, %d", r.MaxWaitMillis, r.MaxBytes, MaxFetchWait, MaxFetchBytes)
	}
	for _, p := range r.Topics[0].Partitions {
		if p.PartitionMaxBytes != MaxFetchBytes {
			t.Errorf("partition %d: max bytes %d, want %d", p.Partition, p.PartitionMaxBytes, MaxFetchBytes)
		}
	}
	if v, err := gate(fetch(MaxFetchBytes, MaxFetchWait, 1, 0)); err != nil || v.clamped {
		t.Errorf("a fetch within the bounds: clamped %v, err %v", v.clamped, err)
	}
}

// TestCheckSize: each kind's bound is inclusive, and each kind has its own.
func TestCheckSize(t *testing.T) {
	for _, tc := range []struct {
		key   kmsg.Key
		limit int64
	}{{kmsg.Produce, MaxRequestBytes}, {kmsg.Fetch, MaxFetchRequestBytes}, {kmsg.Metadata, MaxOtherRequestBytes}, {kmsg.JoinGroup, MaxOtherRequestBytes}} {
		if err := checkSize(tc.key, tc.limit); err != nil {
			t.Errorf("%v of %d bytes: %v", tc.key, tc.limit, err)
		}
		if err := checkSize(tc.key, tc.limit+1); !errors.Is(err, errOversized) {
			t.Errorf("%v of %d bytes: %v, want errOversized", tc.key, tc.limit+1, err)
		}
	}
}
