package broker_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"

	"github.com/cfguard/cfguard/broker"
)

func testLogger(t *testing.T) *slog.Logger {
	return tooltest.Logger(t)
}

func start(t *testing.T, ctx context.Context, cfg broker.Config) *broker.Broker {
	t.Helper()
	b, err := broker.Start(ctx, cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b
}

func produce(t *testing.T, addr, topic string, values ...string) {
	t.Helper()
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(addr), Topic: topic, RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	defer w.Close()
	msgs := make([]kafka.Message, len(values))
	for i, v := range values {
		msgs[i] = kafka.Message{Value: []byte(v)}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatalf("produce to %s: %v", topic, err)
	}
}

// readAll reads partition 0 of topic from offset 0 until it has n messages.
func readAll(t *testing.T, addr, topic string, n int) []string {
	t.Helper()
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: []string{addr}, Topic: topic, MaxWait: kafkatest.MaxWait})
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got []string
	for len(got) < n {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			t.Fatalf("reading %s after %d messages: %v", topic, len(got), err)
		}
		got = append(got, string(m.Value))
	}
	return got
}

func TestPersistsAcrossRestart(t *testing.T) {
	dir := t.TempDir()
	cfg := broker.Config{DataDir: dir, Topics: []string{"records"}}
	b := start(t, context.Background(), cfg)
	want := []string{"a", "b", "c"}
	produce(t, b.Addrs()[0], "records", want...)
	if hw := b.HighWatermarks("records"); len(hw) != 1 || hw[0] != 3 {
		t.Fatalf("high watermarks before restart = %v, want [3]", hw)
	}
	b.Close()

	// Restart with the same data dir, asking for one more topic: the old topic keeps its
	// records, the new one is created.
	cfg.Topics = append(cfg.Topics, "events")
	b2 := start(t, context.Background(), cfg)
	if got := readAll(t, b2.Addrs()[0], "records", 3); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after restart read %v, want %v", got, want)
	}
	if hw := b2.HighWatermarks("events"); len(hw) != 1 || hw[0] != 0 {
		t.Fatalf("new topic high watermarks = %v, want [0]", hw)
	}
	produce(t, b2.Addrs()[0], "records", "d")
	if hw := b2.HighWatermarks("records"); hw[0] != 4 {
		t.Fatalf("offsets continue after restart: high watermark %d, want 4", hw[0])
	}
}

func TestMemoryBrokerForgets(t *testing.T) {
	b := start(t, context.Background(), broker.Config{Topics: []string{"records"}, Partitions: 3})
	produce(t, b.Addrs()[0], "records", "x")
	b.Close()
	b2 := start(t, context.Background(), broker.Config{Topics: []string{"records"}, Partitions: 3})
	hw := b2.HighWatermarks("records")
	if len(hw) != 3 || hw[0]+hw[1]+hw[2] != 0 {
		t.Fatalf("fresh memory broker high watermarks = %v, want [0 0 0]", hw)
	}
}

func TestStopsOnContextCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	b := start(t, ctx, broker.Config{Topics: []string{"records"}})
	addr := b.Addrs()[0]
	conn, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatalf("dial running broker: %v", err)
	}
	conn.Close()
	cancel()
	select {
	case <-b.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("broker did not stop within 10s of context cancel")
	}
	if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		t.Fatal("broker still accepts connections after context cancel")
	}
	if hw := b.HighWatermarks("records"); hw != nil {
		t.Fatalf("HighWatermarks after stop = %v, want nil", hw)
	}
	b.Close() // idempotent after cancel
}

func TestListenOnGivenPort(t *testing.T) {
	b, cfg := startOnUnassigned(t, 1)
	if got := b.Addrs(); len(got) != 1 || got[0] != cfg.Listen {
		t.Fatalf("Addrs() = %v, want [%s]", got, cfg.Listen)
	}
}

func TestConfigRejected(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  broker.Config
		want string
	}{
		{"public address", broker.Config{Listen: "0.0.0.0:0"}, "loopback"},
		{"no port", broker.Config{Listen: "127.0.0.1"}, "Listen"},
		{"negative partitions", broker.Config{Partitions: -1}, "Partitions"},
		{"duplicate topic", broker.Config{Topics: []string{"a", "a"}}, `"a" is named twice`},
		{"topic name", broker.Config{Topics: []string{"a/b"}}, `Topics: "a/b" holds '/'`},
		{"unknown mechanism", broker.Config{SASL: &broker.SASLConfig{Mechanism: "GSSAPI", User: "u", Password: "p"}}, "GSSAPI"},
		{"no password", broker.Config{SASL: &broker.SASLConfig{Mechanism: "PLAIN", User: "u"}}, "Password"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := broker.Start(context.Background(), tc.cfg, nil)
			if err == nil {
				b.Close()
				t.Fatal("Start accepted a bad config")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not mention %q", err, tc.want)
			}
		})
	}
}

func TestDataDirUnusable(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "notadir")
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	b, err := broker.Start(context.Background(), broker.Config{DataDir: f.Name(), Topics: []string{"t"}}, nil)
	if err == nil {
		b.Close()
		t.Fatal("Start accepted a regular file as DataDir")
	}
	var pe *os.PathError
	t.Logf("error: %v (path error: %v)", err, errors.As(err, &pe))
}
