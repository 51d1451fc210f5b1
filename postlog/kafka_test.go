package postlog

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/stream"
)

// A posterior topic whose settings lose entries: a compacted one is refused by a writer (a
// replica's Open, cfguard new-epoch's OpenExistingWriter), with the key, the setting and the
// command that mends it, and read with a WARN line by a reader (verify-log's OpenExisting); one
// with a finite retention is opened with an ERROR line naming the setting. A topic Open creates
// keeps its records for ever, and is opened without a word.
func TestOpenChecksTheTopicsSettings(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"other"}, Partitions: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	conn := stream.ConnConfig{Brokers: b.Addrs()}
	keys, err := clusterkey.Parse([]byte("k1:"+strings.Repeat("5a", 32)), "test")
	if err != nil {
		t.Fatal(err)
	}
	cl := &kafka.Client{Addr: kafka.TCP(b.Addrs()...), Transport: kafkatest.Transport(t)}
	for _, tc := range []struct {
		name    string
		configs []kafka.ConfigEntry // nil: Open creates the topic
		refused string              // in a writer's error
		reader  string              // in a reader's log
		logged  string              // in a writer's log
	}{
		{name: "created by Open"},
		{name: "compacted", configs: []kafka.ConfigEntry{{ConfigName: "cleanup.policy", ConfigValue: "compact"}},
			refused: "cleanup.policy=compact", reader: `level=WARN msg="the posterior log is compacted"`},
		{name: "compacted and deleted", configs: []kafka.ConfigEntry{{ConfigName: "cleanup.policy", ConfigValue: "compact,delete"},
			{ConfigName: "retention.ms", ConfigValue: "-1"}, {ConfigName: "retention.bytes", ConfigValue: "-1"}},
			refused: "cleanup.policy=compact,delete", reader: `level=WARN msg="the posterior log is compacted"`},
		{name: "a retention", configs: []kafka.ConfigEntry{{ConfigName: "cleanup.policy", ConfigValue: "delete"},
			{ConfigName: "retention.ms", ConfigValue: "3600000"}, {ConfigName: "retention.bytes", ConfigValue: "-1"}},
			logged: "retention.ms=3600000", reader: "retention.ms=3600000"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			topic := "posterior." + strings.ReplaceAll(tc.name, " ", "-")
			if tc.configs != nil {
				res, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 1,
					ReplicationFactor: -1, ConfigEntries: tc.configs}}})
				if err == nil {
					err = res.Errors[topic]
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			var logs bytes.Buffer
			lg := slog.New(slog.NewTextHandler(&logs, nil))
			l, err := Open(ctx, conn, topic, keys, lg)
			switch {
			case tc.refused == "" && err != nil:
				t.Fatalf("Open: %v", err)
			case tc.refused != "" && err == nil:
				l.Close()
				t.Fatalf("Open of a topic with %v opened it; want a refusal", tc.configs)
			case tc.refused != "":
				for _, want := range []string{"replication.posterior_topic " + topic, tc.refused, "--add-config cleanup.policy=delete"} {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("Open's refusal %q does not say %q", err, want)
					}
				}
				if w, err := OpenExistingWriter(ctx, conn, topic, keys, lg); err == nil {
					w.Close()
					t.Error("OpenExistingWriter opened a compacted topic; want a refusal")
				}
			default:
				l.Close()
			}
			if !strings.Contains(logs.String(), tc.logged) || tc.logged == "" && strings.Contains(logs.String(), "level=ERROR") {
				t.Errorf("a writer's log:\n%s\nwant %q and no other ERROR line", logs.String(), tc.logged)
			}
			logs.Reset()
			r, err := OpenExisting(ctx, conn, topic, lg)
			if err != nil {
				t.Fatalf("OpenExisting: %v", err)
			}
			r.Close()
			if !strings.Contains(logs.String(), tc.reader) || tc.reader == "" && logs.Len() > 0 {
				t.Errorf("a reader's log:\n%s\nwant %q", logs.String(), tc.reader)
			}
		})
	}
}

// The tests' kafka-go readers wait as cfguard's do: kafkatest cannot import this package (its
// tests import kafkatest), so the two constants are kept equal here.
func TestTestReadersWaitAsCfguardsDo(t *testing.T) {
	if ReaderMaxWait != kafkatest.MaxWait {
		t.Fatalf("postlog.ReaderMaxWait %v, kafkatest.MaxWait %v: keep them equal", ReaderMaxWait, kafkatest.MaxWait)
	}
}

// testBroker starts an in-process broker on loopback for a test of the log.
func testBroker(ctx context.Context, t *testing.T) stream.ConnConfig {
	t.Helper()
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"other"}, Partitions: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return stream.ConnConfig{Brokers: b.Addrs()}
}

// A record Append writes is read back at its offset, with its value and its authenticator, which
// verifies under the cluster's keys; End is the offset after the last record, InputEnds a topic's
// end offsets, and a reader from an offset starts there. A reader of the log (OpenExisting) has no
// key and cannot append.
func TestAppendIsReadBackAuthenticated(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn := testBroker(ctx, t)
	lg := slog.New(slog.DiscardHandler)
	l, err := Open(ctx, conn, "posterior.roundtrip", testKeys(), lg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	vals := [][]byte{[]byte(`{"n":0}`), []byte(`{"n":1}`), []byte(`{"n":2}`)}
	for i, v := range vals {
		if err := l.Append(ctx, "e/"+strconv.Itoa(i), v); err != nil {
			t.Fatal(err)
		}
	}
	if end, err := l.End(ctx); end != 3 || err != nil {
		t.Errorf("End = %d, %v; want 3", end, err)
	}
	if ends, err := l.InputEnds(ctx, l.Topic()); err != nil || len(ends) != 1 || ends[0] != 3 {
		t.Errorf("InputEnds of the log's topic = %v, %v; want partition 0 at 3", ends, err)
	}
	rd, err := l.Read(1)
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	for want := int64(1); want < 3; want++ {
		rec, err := rd.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if rec.Offset != want || !bytes.Equal(rec.Value, vals[want]) || rec.Time.IsZero() {
			t.Errorf("record %d: offset %d value %s time %v", want, rec.Offset, rec.Value, rec.Time)
		}
		if err := Authenticate(testKeys(), rec); err != nil {
			t.Errorf("record %d: %v (authenticator %q)", want, err, rec.Auth)
		}
	}
	r, err := OpenExisting(ctx, conn, l.Topic(), lg)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := r.Append(ctx, "e/3", vals[0]); err == nil || !strings.Contains(err.Error(), "opened without a key") {
		t.Errorf("a reader's Append: %v, want a refusal", err)
	}
}

// Brokers that cannot be reached are named, with kafka.brokers and what to check.
func TestOpenNamesUnreachableBrokers(t *testing.T) {
	addr := testnet.Reserve(t).Addr() // refuses connections, and no other socket can take it
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := OpenExisting(ctx, stream.ConnConfig{Brokers: []string{addr}}, "posterior", slog.New(slog.DiscardHandler))
	want := "replication.posterior_topic posterior: metadata from kafka.brokers [" + addr + "]: "
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "check that the brokers kafka.brokers names are up and reachable") {
		t.Errorf("OpenExisting with no broker listening: %v, want %q and what to check", err, want)
	}
}

// The log must be one partition (the acceptance rule needs one order): a topic of two is refused
// by a writer and a reader alike, and a reader (a tool) refuses a missing topic rather than
// create it.
func TestOpenRefusesALogItCannotOrder(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn := testBroker(ctx, t)
	lg := slog.New(slog.DiscardHandler)
	kafkatest.CreateTopic(t, conn.Brokers, "posterior.two", 2)
	open := func(topic string) (*Log, error) { return Open(ctx, conn, topic, testKeys(), lg) }
	openExisting := func(topic string) (*Log, error) { return OpenExisting(ctx, conn, topic, lg) }
	for _, tc := range []struct {
		name, topic, want string
		open              func(string) (*Log, error)
	}{
		{"Open of a topic of 2 partitions", "posterior.two", "has 2 partitions", open},
		{"OpenExisting of a topic of 2 partitions", "posterior.two", "has 2 partitions", openExisting},
		{"OpenExisting of a missing topic", "posterior.missing", "does not exist", openExisting},
	} {
		l, err := tc.open(tc.topic)
		if err == nil {
			l.Close()
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want a refusal saying %q", tc.name, err, tc.want)
		}
	}
}

// Append refuses, before it writes, a record over MaxRecordBytes counting its key, header and
// batch framing (a record within the framing of the limit too), and one over the topic's own
// max.message.bytes, naming the setting; nothing is written.
func TestAppendRefusesATooLargeRecord(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	conn := testBroker(ctx, t)
	lg := slog.New(slog.DiscardHandler)
	const topic, key = "posterior.limits", "e/1"
	l, err := Open(ctx, conn, topic, testKeys(), lg)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	// A value whose record (key, value, header) comes within 32 bytes of the limit: the batch's
	// framing (some 70 bytes) takes it over.
	near := MaxRecordBytes - 32 - len(key) - len(clusterkey.Header) - len(Sign(testKeys(), nil))
	for _, n := range []int{MaxRecordBytes, near} {
		if err := l.Append(ctx, key, make([]byte, n)); err == nil || !strings.Contains(err.Error(), "postlog.MaxRecordBytes") {
			t.Errorf("a value of %d bytes: %v, want a refusal naming postlog.MaxRecordBytes", n, err)
		}
	}
	kafkatest.SetTopicConfig(t, conn.Brokers, topic, "max.message.bytes", "1000")
	small, err := Open(ctx, conn, topic, testKeys(), lg)
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	if err := small.Append(ctx, key, make([]byte, 2000)); err == nil || !strings.Contains(err.Error(), "over the topic's max.message.bytes (1000)") {
		t.Errorf("a value of 2000 bytes on a topic of max.message.bytes 1000: %v, want a refusal naming it", err)
	}
	if end, err := l.End(ctx); end != 0 || err != nil {
		t.Errorf("End = %d, %v; want nothing written", end, err)
	}
}

// sizeRefused finds the broker's "too large" in a write's error, also inside the WriteErrors of
// kafka-go's writer, and nothing else.
func TestSizeRefused(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{kafka.MessageSizeTooLarge, true},
		{fmt.Errorf("write: %w", kafka.MessageSizeTooLarge), true},
		{kafka.WriteErrors{nil, kafka.MessageSizeTooLarge}, true},
		{kafka.WriteErrors{kafka.LeaderNotAvailable}, false},
		{io.EOF, false},
	} {
		if got := sizeRefused(tc.err); got != tc.want {
			t.Errorf("sizeRefused(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
