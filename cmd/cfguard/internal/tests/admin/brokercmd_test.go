package admin

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/internal/waitfor"
)

// groupRead reads n records of topic in consumer group g, with a 1 s session timeout, through
// the node at addr, committing each; it returns their values, sorted.
func groupRead(t *testing.T, addr, topic, group string, n int) []string {
	t.Helper()
	cfg := kafka.ReaderConfig{Brokers: []string{addr}, GroupID: group, Topic: topic, MaxWait: kafkatest.MaxWait,
		SessionTimeout: time.Second, HeartbeatInterval: 100 * time.Millisecond, RebalanceTimeout: 2 * time.Second,
		StartOffset: kafka.FirstOffset}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	r := kafka.NewReader(cfg)
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var got []string
	for len(got) < n {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			t.Fatalf("group %s read %d of %d: %v", group, len(got), n, err)
		}
		if err := r.CommitMessages(ctx, m); err != nil {
			t.Fatalf("group %s commit: %v", group, err)
		}
		got = append(got, string(m.Value))
	}
	slices.Sort(got)
	return got
}

func TestBrokerCommandServesNodesAndKeepsData(t *testing.T) {
	const partitions = 3
	dir := t.TempDir()
	args := []string{"--listen", "127.0.0.1:0", "--nodes", "3", "--data-dir", dir, "--topics", "records,events",
		"--partitions", fmt.Sprint(partitions), "--group-min-session-timeout", "1s"}
	p, addrs := proc.StartBrokerCmd(t, args...)
	if len(addrs) != 3 || len(slices.Compact(slices.Sorted(slices.Values(addrs)))) != 3 {
		t.Fatalf("brokers line %q, want three distinct addresses", addrs)
	}
	for _, a := range addrs {
		if !strings.HasPrefix(a, "127.0.0.1:") {
			t.Fatalf("node address %s is not on 127.0.0.1", a)
		}
	}
	// The child logs this line before it prints the brokers line, but stdout and stderr are two
	// pipes that os/exec copies in two goroutines: the log line may reach p.stderr after the
	// brokers line reached p.stdout. Wait for it on its own stream.
	var logged string
	waitfor.Cond(t, 30*time.Second, "the broker's \"SIGINT or SIGTERM stops the broker\" log line", func() bool {
		logged = p.Stderr.Logged("SIGINT or SIGTERM stops the broker", "brokers")
		return logged != ""
	})
	if logged != strings.Join(addrs, ",") {
		t.Fatalf("logged brokers=%q, printed %q", logged, addrs)
	}

	// Produce through node 0 and read back through node 2: the records spread over the three
	// partitions, whose leaders are the three nodes.
	k := proc.NewKafkaClient(t)
	var want []string
	for i := range 30 {
		want = append(want, fmt.Sprintf("v%02d", i))
	}
	k.Produce(t, addrs[0], "records", want)
	byPart := k.ReadAll(t, addrs[2], "records", partitions)
	if got := slices.Sorted(slices.Values(slices.Concat(byPart...))); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("read back %v, want %v", got, want)
	}
	for p, vs := range byPart {
		if len(vs) == 0 {
			t.Fatalf("partition %d got no record of 30: %v", p, byPart)
		}
	}
	// A consumer group with a 1 s session timeout (refused at Kafka's default 6 s minimum)
	// reads them all through node 1 and commits.
	if got := groupRead(t, addrs[1], "records", "g", len(want)); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("group read %v, want %v", got, want)
	}

	if code := p.Stop(t); code != 0 {
		t.Fatalf("exit code %d after SIGTERM; stderr:\n%s", code, p.Stderr.String())
	}
	if !strings.Contains(p.Stderr.String(), `msg="Kafka-protocol broker stopped"`) {
		t.Fatalf("no clean stop logged:\n%s", p.Stderr.String())
	}

	// Started again on the same directory: the records and the group's committed offsets are
	// there (the group reads only what is produced now).
	p2, addrs2 := proc.StartBrokerCmd(t, args...)
	if got := k.ReadAll(t, addrs2[1], "records", partitions); fmt.Sprint(got) != fmt.Sprint(byPart) {
		t.Fatalf("after restart read %v, want %v", got, byPart)
	}
	more := []string{"w00", "w01", "w02", "w03"}
	k.Produce(t, addrs2[2], "records", more)
	if got := groupRead(t, addrs2[0], "records", "g", len(more)); fmt.Sprint(got) != fmt.Sprint(more) {
		t.Fatalf("group after restart read %v, want only the new %v", got, more)
	}
	if code := p2.Stop(t); code != 0 {
		t.Fatalf("exit code %d after SIGTERM; stderr:\n%s", code, p2.Stderr.String())
	}
}

// A --metrics-listen address the command cannot listen on (here one this test holds) stops it
// before any broker starts, naming the flag.
func TestBrokerCommandMetricsAddressInUse(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	code, stdout, stderr := proc.RunCLI(t, "broker", "--listen", "127.0.0.1:0", "--metrics-listen", held.Addr().String())
	if want := "--metrics-listen " + held.Addr().String(); code != 1 || !strings.Contains(stderr, want) || !strings.Contains(stderr, "address already in use") || stdout != "" {
		t.Errorf("broker with --metrics-listen on an address in use: exit %d, stdout %q, stderr %q; want 1, nothing, an error naming %q", code, stdout, stderr, want)
	}
}

func TestBrokerCommandRefusals(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--listen", "0.0.0.0:9092"}, "loopback"},
		{[]string{"--listen", "192.0.2.1:0", "--nodes", "3"}, "loopback"},
		{[]string{"--listen", "127.0.0.1:0", "--nodes", "0"}, "--nodes"},
		{[]string{"--listen", "127.0.0.1:0", "--partitions", "0"}, "--partitions"},
		{[]string{"--listen", "127.0.0.1:0", "--group-min-session-timeout", "0s"}, "--group-min-session-timeout"},
		{[]string{"--listen", "127.0.0.1:0", "--sync-writes"}, "--data-dir"},
		{[]string{"--listen", "127.0.0.1:0", "--topics", "a,,b"}, `Topics: "" must name a topic`},
		{[]string{"--listen", "127.0.0.1:0", "--topics", "bad topic,x"}, `Topics: "bad topic" holds ' '; Kafka topic names may hold only`},
		{[]string{"--listen", "127.0.0.1:0", "--topics", "x,y,x"}, `Topics: "x" is named twice`},
		{[]string{"--listen", "127.0.0.1:0", "--retention", "0s"}, "--retention 0: want a positive duration"},
		{[]string{"--listen", "127.0.0.1:0", "--retention-bytes", "0"}, "--retention-bytes 0: want a positive size"},
		{[]string{"--listen", "127.0.0.1:0", "--max-connections", "0"}, "--max-connections 0: want at least 1"},
		{[]string{"--listen", "127.0.0.1:0", "--idle-timeout", "0s"}, "--idle-timeout 0s: want a positive duration"},
		{[]string{"--listen", "127.0.0.1:0", "--request-timeout", "-1s"}, "--request-timeout -1s: want a positive duration"},
	} {
		code, stdout, stderr := proc.RunCLI(t, append([]string{"broker"}, tc.args...)...)
		if code != 2 || !strings.Contains(stderr, tc.want) || stdout != "" {
			t.Errorf("%v: exit %d, stderr %q, stdout %q; want exit 2 naming %s", tc.args, code, stderr, stdout, tc.want)
		}
	}
}

// TestBrokerCommandLimitsConnections: --max-connections bounds the connections open at once
// and --idle-timeout closes one that sends nothing; the line the broker logs at its limit names
// the flag to change, not the daemon's configuration key.
func TestBrokerCommandLimitsConnections(t *testing.T) {
	p, addrs := proc.StartBrokerCmd(t, "--listen", "127.0.0.1:0", "--max-connections", "2", "--idle-timeout", "1s", "--metrics-listen", "127.0.0.1:0")
	defer p.Stop(t)
	// The metrics line comes before the brokers line on the same pipe.
	m := regexp.MustCompile(`(?m)^metrics: (http://127\.0\.0\.1:[0-9]+/metrics)$`).FindStringSubmatch(p.Stdout.String())
	if m == nil {
		t.Fatalf("no metrics line before the brokers line:\n%s", p.Stdout.String())
	}
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range 3 {
		c, err := net.Dial("tcp", addrs[0])
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	// The third is closed at once; the first two once they have been idle for a second.
	closed := func(c net.Conn) <-chan time.Duration {
		ch := make(chan time.Duration, 1)
		go func() {
			start := time.Now()
			c.SetReadDeadline(time.Now().Add(30 * time.Second))
			_, err := c.Read(make([]byte, 1))
			if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				ch <- -1
				return
			}
			ch <- time.Since(start)
		}()
		return ch
	}
	waits := []<-chan time.Duration{closed(conns[0]), closed(conns[1]), closed(conns[2])}
	for i, w := range waits {
		if d := <-w; d < 0 {
			t.Errorf("connection %d of 3 still open after 30 s, with --max-connections 2 --idle-timeout 1s", i+1)
		}
	}
	waitfor.Cond(t, 30*time.Second, "the line at the connection limit", func() bool {
		return strings.Contains(p.Stderr.String(), "embedded broker at its connection limit")
	})
	if line := p.Stderr.String(); !strings.Contains(line, "(--max-connections)") || strings.Contains(line, "kafka.embedded_max_connections") {
		t.Errorf("the broker's line at its limit does not name --max-connections alone:\n%s", line)
	}
	// /metrics counts what happened: one connection closed at the limit, two idle ones, and none
	// open once the broker has released the last (it may count it a moment after closing it).
	wants := []string{
		`cfguard_embedded_broker_max_connections 2`,
		`cfguard_embedded_broker_connections 0`,
		`cfguard_embedded_broker_connections_closed_total{reason="limit"} 1`,
		`cfguard_embedded_broker_connections_closed_total{reason="idle"} 2`,
		`cfguard_embedded_broker_write_failing 0`,
	}
	waitMetrics(t, m[1], "/metrics counting the three connections closed", wants)
}

// TestBrokerCommandClosesASlowRequest: --request-timeout closes a connection whose request stops
// arriving part way, long before --idle-timeout would, and /metrics counts it as partial, not idle.
func TestBrokerCommandClosesASlowRequest(t *testing.T) {
	p, addrs := proc.StartBrokerCmd(t, "--listen", "127.0.0.1:0", "--idle-timeout", "10m", "--request-timeout", "1s", "--metrics-listen", "127.0.0.1:0")
	defer p.Stop(t)
	m := regexp.MustCompile(`(?m)^metrics: (http://127\.0\.0\.1:[0-9]+/metrics)$`).FindStringSubmatch(p.Stdout.String())
	if m == nil {
		t.Fatalf("no metrics line before the brokers line:\n%s", p.Stdout.String())
	}
	if !strings.Contains(p.Stderr.String(), "request_timeout=1s") {
		t.Errorf("the broker's start line does not give --request-timeout 1s:\n%s", p.Stderr.String())
	}
	c, err := net.Dial("tcp", addrs[0])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte{0, 0}); err != nil { // half of a request's size prefix, and no more
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Minute)) // well inside --idle-timeout 10m
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a request stalled after 2 bytes was not closed (read: %v), with --request-timeout 1s", err)
	}
	wants := []string{
		`cfguard_embedded_broker_connections_closed_total{reason="partial"} 1`,
		`cfguard_embedded_broker_connections_closed_total{reason="idle"} 0`,
	}
	waitMetrics(t, m[1], "/metrics counting the connection closed mid-request", wants)
}

// waitMetrics waits until the broker's /metrics at url holds every line of wants, and logs what it
// last answered when the test fails.
func waitMetrics(t *testing.T, url, what string, wants []string) {
	t.Helper()
	var body []byte
	defer func() {
		if t.Failed() {
			t.Logf("%s last answered:\n%s", url, body)
		}
	}()
	waitfor.Cond(t, 30*time.Second, what, func() bool {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if body, err = io.ReadAll(resp.Body); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d %v", url, resp.StatusCode, err)
		}
		for _, want := range wants {
			if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(want) + `$`).Match(body) {
				return false
			}
		}
		return true
	})
}
