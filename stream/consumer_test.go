package stream

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// readTopic reads n messages from partition 0 of topic, from the start, without a group.
func readTopic(t *testing.T, conn ConnConfig, topic string, n int) []kafka.Message {
	t.Helper()
	if err := conn.applyDefaults(); err != nil {
		t.Fatal(err)
	}
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: conn.Brokers, Topic: topic, Dialer: conn.dialer(), MaxWait: kafkatest.MaxWait})
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out []kafka.Message
	for len(out) < n {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			t.Fatalf("reading %s after %d of %d messages: %v", topic, len(out), n, err)
		}
		out = append(out, m)
	}
	return out
}

func header(m kafka.Message, key string) string {
	for _, h := range m.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func TestConsumeBothForms(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0,
		`{"id":"arr-idx","features":[1,2,3],"label":1}`,
		`{"id":"arr-name","features":[4,5,6],"label":"benign","ts":"2024-01-02T03:04:05Z"}`,
		`{"id":"map-idx","features":{"c":9,"b":8,"a":7},"label":0,"ts":1700000000}`,
		`{"id":"map-name","features":{"a":-1,"b":-2,"c":-3},"label":"malicious"}`,
	)
	before := time.Now().Add(-time.Minute)
	c := newConsumer(t, consumerConfig(conn, "forms"))
	incs := collect(t, c, 4, 20*time.Second)
	want := []Record{
		{ID: "arr-idx", X: []float64{1, 2, 3}, Label: 1, Offset: 0},
		{ID: "arr-name", X: []float64{4, 5, 6}, Label: 0, Offset: 1, Time: time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)},
		{ID: "map-idx", X: []float64{7, 8, 9}, Label: 0, Offset: 2, Time: time.Unix(1700000000, 0)},
		{ID: "map-name", X: []float64{-1, -2, -3}, Label: 1, Offset: 3},
	}
	var got []Record
	for _, inc := range incs {
		got = append(got, inc.Records...)
	}
	if len(got) != len(want) {
		t.Fatalf("got %d records, want %d", len(got), len(want))
	}
	for i, w := range want {
		g := got[i]
		if g.ID != w.ID || !slices.Equal(g.X, w.X) || g.Label != w.Label || g.Partition != 0 || g.Offset != w.Offset {
			t.Errorf("record %d = %+v, want %+v", i, g, w)
		}
		// Without ts, Time is the Kafka message time, which the producer set just now.
		if !w.Time.IsZero() && !g.Time.Equal(w.Time) || w.Time.IsZero() && g.Time.Before(before) {
			t.Errorf("record %s time %v, want %v", g.ID, g.Time, w.Time)
		}
	}
	X, y := incs[0].XY()
	if len(X) != len(incs[0].Records) || !slices.Equal(X[0], got[0].X) || y[0] != got[0].Label {
		t.Errorf("XY() = %v, %v", X, y)
	}
	if s := c.Stats(); s.Decoded != 4 || s.Fetched != 4 || s.Increments != int64(len(incs)) {
		t.Errorf("stats %+v", s)
	}
}

func TestDeadLetters(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	// One bad record per reason, each between two good ones.
	bad := map[string]string{
		ReasonBadJSON:        `{"id":"b1","features":[1,2,3],"label":0`,
		ReasonTooLarge:       `{"id":"b2","features":[1,2,3],"label":0,"pad":"` + strings.Repeat("x", 600) + `"}`,
		ReasonUnknownField:   `{"id":"b3","features":[1,2,3],"label":0,"weight":2}`,
		ReasonDuplicateField: `{"id":"b4","features":[1,2,3],"label":0,"label":1}`,
		ReasonMissingField:   `{"id":"b5","features":[1,2,3]}`,
		ReasonBadType:        `{"id":"b6","features":[1,"2",3],"label":0}`,
		ReasonBadID:          `{"id":"../b7","features":[1,2,3],"label":0}`, // the rule of CE ids (ident.Check)
		ReasonWrongDimension: `{"id":"b8","features":[1,2],"label":0}`,
		ReasonNotFinite:      `{"id":"b9","features":[1,"NaN",3],"label":0}`,
		ReasonUnknownFeature: `{"id":"b10","features":{"a":1,"b":2,"zz":3},"label":0}`,
		ReasonMissingFeature: `{"id":"b11","features":{"a":1,"b":2},"label":0}`,
		ReasonUnknownLabel:   `{"id":"b12","features":[1,2,3],"label":"spam"}`,
		ReasonBadTimestamp:   `{"id":"b13","features":[1,2,3],"label":0,"ts":"soon"}`,
		ReasonOutOfRange:     `{"id":"b14","features":[1,2e9,3],"label":0}`, // 2e9 standard deviations of 1 from 0
	}
	var values, wantGood, wantReasons []string
	values = append(values, goodRecord("g0", 0))
	wantGood = append(wantGood, "g0")
	for i, reason := range Reasons() {
		values = append(values, bad[reason], goodRecord(fmt.Sprintf("g%d", i+1), i+1))
		wantGood = append(wantGood, fmt.Sprintf("g%d", i+1))
		wantReasons = append(wantReasons, reason)
	}
	if len(bad) != len(Reasons()) {
		t.Fatalf("test covers %d reasons, there are %d", len(bad), len(Reasons()))
	}
	produce(t, conn, recordsTopic, 0, values...)

	cfg := consumerConfig(conn, "dlq")
	scaled, err := testSchema(t).WithScale([]float64{0, 0, 0}, []float64{1, 1, 1})
	if err != nil {
		t.Fatal(err)
	}
	c, err := NewConsumer(context.Background(), cfg, scaled, testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	incs := collect(t, c, len(wantGood), 20*time.Second)
	if got := ids(incs); !slices.Equal(got, wantGood) {
		t.Fatalf("good ids %v, want %v", got, wantGood)
	}
	nDead := 0
	for _, inc := range incs {
		nDead += inc.DeadLettered
	}
	if nDead != len(wantReasons) {
		t.Fatalf("increments report %d dead letters, want %d", nDead, len(wantReasons))
	}
	// The dead letters are on the broker as soon as Next has returned: before any commit.
	if hw := b.HighWatermarks(deadTopic); len(hw) != 1 || hw[0] != int64(len(wantReasons)) {
		t.Fatalf("dead-letter topic high watermark %v before commit, want [%d]", hw, len(wantReasons))
	}
	dl := readTopic(t, conn, deadTopic, len(wantReasons))
	for i, m := range dl {
		reason := wantReasons[i]
		srcOffset := int64(2*i + 1)
		if got := header(m, HeaderReason); got != reason {
			t.Errorf("dead letter %d: reason %q, want %q", i, got, reason)
		}
		if header(m, HeaderError) == "" {
			t.Errorf("dead letter %d (%s): no error detail", i, reason)
		}
		if header(m, HeaderSourceTopic) != recordsTopic || header(m, HeaderSourcePartition) != "0" ||
			header(m, HeaderSourceOffset) != strconv.FormatInt(srcOffset, 10) {
			t.Errorf("dead letter %d (%s): source headers %v", i, reason, m.Headers)
		}
		if string(m.Value) != bad[reason] || string(m.Key) != fmt.Sprintf("p0/%d", srcOffset) {
			t.Errorf("dead letter %d (%s): key %q value %q, want the original", i, reason, m.Key, m.Value)
		}
	}
	s := c.Stats()
	for _, r := range Reasons() {
		if s.DeadLettered[r] != 1 {
			t.Errorf("Stats().DeadLettered[%s] = %d, want 1", r, s.DeadLettered[r])
		}
	}
	// Restarting from the checkpoint shows the bad records are consumed for good.
	c.Close()
	produce(t, conn, recordsTopic, 0, goodRecord("after", 99))
	cfg.Resume = checkpoint(incs)
	c2 := newConsumer(t, cfg)
	if got := ids(collect(t, c2, 1, 20*time.Second)); !slices.Equal(got, []string{"after"}) {
		t.Fatalf("after commit and restart got %v, want [after]", got)
	}
}

func TestIncrementBounds(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("r", 25)...)
	cfg := consumerConfig(conn, "bounds")
	cfg.MaxRecords, cfg.MaxRecordsBacklog = 10, 10 // increments of a fixed size
	cfg.MaxWait = 400 * time.Millisecond
	produced := time.Now() // the records arrive after this
	c := newConsumer(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var sizes []int
	for range 3 {
		inc, err := c.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, len(inc.Records))
		if inc.NextOffsets[0] != int64(sumInts(sizes)) {
			t.Fatalf("increment %d NextOffsets %v, want {0:%d}", len(sizes), inc.NextOffsets, sumInts(sizes))
		}
	}
	if !slices.Equal(sizes, []int{10, 10, 5}) {
		t.Fatalf("increment sizes %v, want [10 10 5]", sizes)
	}
	// The last increment was cut by MaxWait, which starts when its first record arrived:
	// after the records were produced.
	if waited := time.Since(produced); waited < cfg.MaxWait {
		t.Fatalf("short increment returned %v after the records were produced, before MaxWait %v", waited, cfg.MaxWait)
	}
	// Nothing more: Next does not return empty increments; it waits for the context.
	short, cancelShort := context.WithTimeout(ctx, 3*cfg.MaxWait)
	defer cancelShort()
	if inc, err := c.Next(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Next on an idle topic = %+v, %v; want DeadlineExceeded", inc, err)
	}
	// A single record arriving later is returned within MaxWait.
	produce(t, conn, recordsTopic, 0, goodRecord("late", 1))
	t0 := time.Now()
	inc, err := c.Next(ctx)
	if err != nil || len(inc.Records) != 1 || inc.Records[0].ID != "late" {
		t.Fatalf("late record: %+v, %v", inc, err)
	}
	t.Logf("late record returned after %v (MaxWait %v)", time.Since(t0), cfg.MaxWait)
}

func sumInts(xs []int) int {
	s := 0
	for _, x := range xs {
		s += x
	}
	return s
}

// checkpoint is what a daemon would checkpoint after applying incs: the largest next offset
// per partition.
func checkpoint(incs []*Increment) map[int]int64 {
	next := map[int]int64{}
	for _, inc := range incs {
		for p, o := range inc.NextOffsets {
			next[p] = max(next[p], o)
		}
	}
	return next
}

// TestResumeStartsAtCheckpoint: each partition is read from its checkpointed next offset, and a
// partition without one from its earliest offset; nothing below the checkpoint is fetched.
func TestResumeStartsAtCheckpoint(t *testing.T) {
	b := startBroker(t, broker.Config{Topics: []string{recordsTopic, deadTopic}, Partitions: 3})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("p0-", 5)...)
	produce(t, conn, recordsTopic, 1, goodRecords("p1-", 5)...)
	produce(t, conn, recordsTopic, 2, goodRecords("p2-", 2)...)
	cfg := consumerConfig(conn, "resume")
	cfg.Resume = map[int]int64{0: 3, 1: 1} // the checkpoint says these were applied
	c := newConsumer(t, cfg)
	incs := collect(t, c, 8, 20*time.Second)
	got := ids(incs)
	slices.Sort(got)
	if want := []string{"p0-3", "p0-4", "p1-1", "p1-2", "p1-3", "p1-4", "p2-0", "p2-1"}; !slices.Equal(got, want) {
		t.Fatalf("after Resume got %v, want %v", got, want)
	}
	if next := checkpoint(incs); next[0] != 5 || next[1] != 5 || next[2] != 2 {
		t.Fatalf("next offsets %v, want 0:5 1:5 2:2", next)
	}
	if s := c.Stats(); s.Fetched != 8 || s.Partitions != 3 {
		t.Fatalf("fetched %d messages of 3 partitions (%d): records below the checkpoint were fetched", s.Fetched, s.Partitions)
	}
}

func TestPendingSurvivesCancelledNext(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("r", 3)...)
	cfg := consumerConfig(conn, "pending")
	cfg.MaxWait = 1500 * time.Millisecond
	c := newConsumer(t, cfg)
	// Wait for the records to be fetched into the pending increment, then give up early.
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { _, err := c.Next(ctx); errc <- err }()
	waitfor.Cond(t, 20*time.Second, "3 pending records", func() bool { return c.Stats().Pending == 3 })
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Next: %v", err)
	}
	// Nothing fetched was lost.
	if got := ids(collect(t, c, 3, 20*time.Second)); !slices.Equal(got, []string{"r0", "r1", "r2"}) {
		t.Fatalf("after a cancelled Next got %v, want [r0 r1 r2]", got)
	}
}

func TestConsumerStopsOnContextCancel(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	ctx, cancel := context.WithCancel(context.Background())
	c, err := NewConsumer(ctx, consumerConfig(conn, "cancel"), testSchema(t), testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { _, err := c.Next(context.Background()); errc <- err }()
	cancel()
	select {
	case err := <-errc:
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("Next after the consumer's context ended: %v, want ErrClosed", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Next did not return within 20s of the consumer's context ending")
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestConsumerConfigRejected(t *testing.T) {
	good := ConsumerConfig{Conn: ConnConfig{Brokers: []string{"127.0.0.1:1"}}, Topic: "t", GroupID: "g", DeadLetterTopic: "d"}
	for _, tc := range []struct {
		name string
		edit func(*ConsumerConfig)
		want string
	}{
		{"no brokers", func(c *ConsumerConfig) { c.Conn.Brokers = nil }, "Brokers"},
		{"bad broker", func(c *ConsumerConfig) { c.Conn.Brokers = []string{"localhost"} }, "host:port"},
		{"negative dial timeout", func(c *ConsumerConfig) { c.Conn.DialTimeout = -time.Second }, "DialTimeout -1s"},
		{"no topic", func(c *ConsumerConfig) { c.Topic = "" }, "Topic"},
		{"no group", func(c *ConsumerConfig) { c.GroupID = "" }, "GroupID"},
		{"no dlq", func(c *ConsumerConfig) { c.DeadLetterTopic = "" }, "DeadLetterTopic"},
		{"dlq is topic", func(c *ConsumerConfig) { c.DeadLetterTopic = "t" }, "differ"},
		{"negative max records", func(c *ConsumerConfig) { c.MaxRecords = -1 }, "MaxRecords"},
		{"negative max wait", func(c *ConsumerConfig) { c.MaxWait = -time.Second }, "MaxWait"},
		{"backlog below max records", func(c *ConsumerConfig) { c.MaxRecords, c.MaxRecordsBacklog = 100, 10 }, "MaxRecordsBacklog"},
		{"retry bounds", func(c *ConsumerConfig) { c.RetryMin, c.RetryMax = time.Second, time.Millisecond }, "RetryMax"},
		{"bad resume", func(c *ConsumerConfig) { c.Resume = map[int]int64{0: -1} }, "Resume"},
		{"a negative partition resumed", func(c *ConsumerConfig) { c.Resume = map[int]int64{-1: 0} }, "Resume[-1] = 0"},
		{"a mark at a negative offset", func(c *ConsumerConfig) {
			c.Resume, c.ResumeMarks = map[int]int64{0: 5}, map[int]RecordMark{0: {Offset: -1}}
		}, "ResumeMarks[0] at offset -1"},
		{"a mark at the resume offset", func(c *ConsumerConfig) {
			c.Resume, c.ResumeMarks = map[int]int64{0: 5}, map[int]RecordMark{0: {Offset: 5}}
		}, "ResumeMarks[0] at offset 5"},
		{"a mark of a partition not resumed", func(c *ConsumerConfig) {
			c.Resume, c.ResumeMarks = map[int]int64{0: 5}, map[int]RecordMark{1: {Offset: 4}}
		}, "ResumeMarks[1]"},
		{"sasl mechanism", func(c *ConsumerConfig) { c.Conn.SASL = &SASL{Mechanism: "GSSAPI", User: "u"} }, "GSSAPI"},
		{"sasl user", func(c *ConsumerConfig) { c.Conn.SASL = &SASL{Mechanism: "PLAIN"} }, "User"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := good
			tc.edit(&cfg)
			c, err := NewConsumer(context.Background(), cfg, testSchema(t), nil)
			if err == nil {
				c.Close()
				t.Fatal("NewConsumer accepted a bad config")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not name %q", err, tc.want)
			}
		})
	}
}

func TestDeadLetterTruncatesHugeValue(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	huge := `{"id":"huge","features":[1,2,3],"label":0,"pad":"` + strings.Repeat("x", maxDeadLetterValue+1000) + `"}`
	produce(t, conn, recordsTopic, 0, huge, goodRecord("after", 1))
	c := newConsumer(t, consumerConfig(conn, "huge"))
	incs := collect(t, c, 1, 20*time.Second)
	if got := ids(incs); !slices.Equal(got, []string{"after"}) || incs[0].DeadLettered != 1 {
		t.Fatalf("got %v with %d dead letters", got, incs[0].DeadLettered)
	}
	m := readTopic(t, conn, deadTopic, 1)[0]
	if header(m, HeaderReason) != ReasonTooLarge || len(m.Value) != maxDeadLetterValue ||
		header(m, HeaderTruncated) != strconv.Itoa(len(huge)) || string(m.Value) != huge[:maxDeadLetterValue] {
		t.Fatalf("dead letter: reason %q, %d bytes, truncated header %q",
			header(m, HeaderReason), len(m.Value), header(m, HeaderTruncated))
	}
}

// TestDeadLetterOfAHugeRecordFits: a bad record whose key or headers alone are close to the
// broker's 1 MB limit is dead-lettered cut to fit (the headers saying what was cut), and the
// partition reads on past it.
func TestDeadLetterOfAHugeRecordFits(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	hugeKey := append([]byte("p0/"), bytes.Repeat([]byte("k"), 1_000_100-3)...)
	bigHeaders := []kafka.Header{{Key: "a", Value: bytes.Repeat([]byte("a"), 40<<10)},
		{Key: "b", Value: bytes.Repeat([]byte("b"), 40<<10)}, {Key: "c", Value: []byte("c")}}
	produceMessages(t, conn, recordsTopic,
		kafka.Message{Key: hugeKey, Value: []byte(`{"id":"huge-key","features":[1,2,3]}`)},
		kafka.Message{Key: []byte("p0/headers"), Value: []byte(`{"id":"big-headers","features":[1,2,3]}`), Headers: bigHeaders})
	produce(t, conn, recordsTopic, 0, goodRecord("after", 1))
	c := newConsumer(t, consumerConfig(conn, "hugekey"))
	incs := collect(t, c, 1, 20*time.Second)
	if got, n := ids(incs), c.Stats().DeadLettered[ReasonMissingField]; !slices.Equal(got, []string{"after"}) || incs[0].DeadLettered != 2 || n != 2 {
		t.Fatalf("got %v with %d dead letters (%d counted), want [after] with 2", got, incs[0].DeadLettered, n)
	}
	dl := readTopic(t, conn, deadTopic, 2)
	if m := dl[0]; !bytes.Equal(m.Key, hugeKey[:maxDeadLetterKey]) || header(m, HeaderTruncatedKey) != strconv.Itoa(len(hugeKey)) {
		t.Errorf("dead letter of the huge key: key of %d bytes, %s %q", len(m.Key), HeaderTruncatedKey, header(m, HeaderTruncatedKey))
	}
	m := dl[1]
	if header(m, HeaderTruncatedHeaders) != strconv.Itoa(3+80<<10+1) || header(m, "a") != string(bigHeaders[0].Value) ||
		len(headerValues(m, "b")) != 0 || len(headerValues(m, "c")) != 0 {
		t.Errorf("dead letter of the big headers: %s %q, headers a, b, c of %d, %d, %d bytes; want the first alone", HeaderTruncatedHeaders,
			header(m, HeaderTruncatedHeaders), len(header(m, "a")), len(header(m, "b")), len(header(m, "c")))
	}
}

// TestDeadLetterMessageIsBounded: whatever the source record and the detail, a dead letter
// fits one produce request of the dead-letter writer, and says what was cut.
func TestDeadLetterMessageIsBounded(t *testing.T) {
	big := bytes.Repeat([]byte("x"), 1<<20)
	var headers []kafka.Header
	total := 0
	for i := range 1000 {
		headers = append(headers, kafka.Header{Key: fmt.Sprint("h", i), Value: big[:1000]})
		total += len(headers[i].Key) + 1000
	}
	detail := strings.Repeat("é", 1<<19) // two bytes a character: the cut falls inside one
	m := deadLetterMessage(strings.Repeat("t", 249), 7, 42, big, big, headers, time.Now(), &DecodeError{Reason: ReasonBadJSON, Detail: detail})
	size := len(m.Key) + len(m.Value)
	for _, h := range m.Headers {
		size += len(h.Key) + len(h.Value) + headerOverhead
	}
	if size > writerBatchBytes-100 { // kafka-go adds a record's fixed fields
		t.Fatalf("dead letter of %d bytes, over the writer's %d", size, writerBatchBytes)
	}
	d := header(m, HeaderError)
	if len(d) > maxDeadLetterDetail || !strings.HasSuffix(d, "...") || !utf8.ValidString(d) {
		t.Errorf("detail of %d bytes, valid UTF-8 %v, ends %q", len(d), utf8.ValidString(d), d[max(0, len(d)-5):])
	}
	if header(m, HeaderTruncatedKey) != strconv.Itoa(len(big)) || header(m, HeaderTruncated) != strconv.Itoa(len(big)) ||
		header(m, HeaderTruncatedHeaders) != strconv.Itoa(total) {
		t.Errorf("truncation headers: key %q, value %q, headers %q", header(m, HeaderTruncatedKey), header(m, HeaderTruncated), header(m, HeaderTruncatedHeaders))
	}
}

// headerValues returns the values of m's headers named key, in order.
func headerValues(m kafka.Message, key string) []string {
	var out []string
	for _, h := range m.Headers {
		if h.Key == key {
			out = append(out, string(h.Value))
		}
	}
	return out
}

// TestReplayedDeadLetterCarriesOneReason: a dead letter replayed to the topic that fails again
// (for another reason) is dead-lettered with one header of each cfguard name, the new one; the
// source's other headers are kept.
func TestReplayedDeadLetterCarriesOneReason(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produceMessages(t, conn, recordsTopic, kafka.Message{Key: []byte("p0/replayed"), Value: []byte(`{"id":"r","features":[1,2,3]}`),
		Headers: []kafka.Header{
			{Key: HeaderReason, Value: []byte(ReasonBadJSON)}, {Key: HeaderError, Value: []byte("invalid JSON")},
			{Key: HeaderSourceTopic, Value: []byte(recordsTopic)}, {Key: HeaderSourcePartition, Value: []byte("0")},
			{Key: HeaderSourceOffset, Value: []byte("41")}, {Key: "trace-id", Value: []byte("abc")},
		}})
	produce(t, conn, recordsTopic, 0, goodRecord("after", 1))
	c := newConsumer(t, consumerConfig(conn, "replay"))
	if incs := collect(t, c, 1, 20*time.Second); incs[0].DeadLettered != 1 {
		t.Fatalf("%d dead letters, want 1", incs[0].DeadLettered)
	}
	m := readTopic(t, conn, deadTopic, 1)[0]
	for key, want := range map[string]string{HeaderReason: ReasonMissingField, HeaderSourceTopic: recordsTopic,
		HeaderSourcePartition: "0", HeaderSourceOffset: "0", "trace-id": "abc"} {
		if got := headerValues(m, key); !slices.Equal(got, []string{want}) {
			t.Errorf("dead letter's %s headers %q, want [%q]", key, got, want)
		}
	}
	if got := headerValues(m, HeaderError); len(got) != 1 || got[0] == "invalid JSON" {
		t.Errorf("dead letter's %s headers %q, want the new detail alone", HeaderError, got)
	}
}

// TestCloseJoinsGoroutines checks that a Consumer and a Publisher leave no goroutine behind
// once closed (kafka-go's included), whether closed by Close or by their context.
func TestCloseJoinsGoroutines(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("r", 3)...)
	before := runtime.NumGoroutine()

	ctx, cancel := context.WithCancel(context.Background())
	c, err := NewConsumer(ctx, consumerConfig(conn, "leak"), testSchema(t), testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewPublisher(ctx, PublisherConfig{Conn: conn, Topic: eventsTopic}, testLog(t))
	if err != nil {
		t.Fatal(err)
	}
	incs := collect(t, c, 3, 20*time.Second)
	c.MarkDurable(incs[0])
	if err := p.Publish(ctx, "k", map[string]int{"n": 1}); err != nil {
		t.Fatal(err)
	}
	if runtime.NumGoroutine() <= before {
		t.Fatal("consumer and publisher started no goroutines: the check below would prove nothing")
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	cancel() // the publisher stops with its context
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 10*time.Second, fmt.Sprintf("goroutines back to %d", before), func() bool {
		return runtime.NumGoroutine() <= before
	})
}

// An increment cut in the middle of a chunk holding records and dead letters takes them in
// offset order: its checkpoint (next) covers exactly the dead letters it counts, so a restart
// from it neither dead-letters one twice nor skips one.
func TestTakeCutsInOffsetOrder(t *testing.T) {
	ch := &chunk{part: 0, at: time.Now(), next: 5, recs: []Record{{Offset: 0}, {Offset: 2}, {Offset: 4}},
		dead: []deadMark{{offset: 1, reason: ReasonBadJSON}, {offset: 3, reason: ReasonBadJSON}}}
	for i, want := range []struct {
		done bool
		rec  int64 // the offset of the one record taken
		dead int
		next int64
	}{
		{false, 0, 0, 1},
		{false, 2, 1, 3},
		{true, 4, 1, 5},
	} {
		var p pending
		done := p.take(ch, 1)
		if done != want.done || len(p.recs) != 1 || p.recs[0].Offset != want.rec || p.dead != want.dead || p.next[0] != want.next {
			t.Errorf("increment %d: used up %v, records %v, %d dead letters, next %d; want %v, [%d], %d, %d",
				i, done, p.recs, p.dead, p.next[0], want.done, want.rec, want.dead, want.next)
		}
	}
}
