package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// brokerProc is a `cfguard broker` process a test started.
type brokerProc struct {
	cmd    *exec.Cmd
	stdout *tooltest.Output
	stderr *tooltest.Output
	c      *child // the process, waited for
}

// startBrokerCmd runs `cfguard broker args...` in a new process and waits for its "brokers:"
// line, returning the process and the node addresses it printed.
func startBrokerCmd(t *testing.T, args ...string) (*brokerProc, []string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"broker"}, args...)...)
	cmd.Env = append(os.Environ(), "CFGUARD_TEST_MAIN=1")
	p := &brokerProc{cmd: cmd, stdout: &tooltest.Output{}, stderr: &tooltest.Output{}}
	cmd.Stdout, cmd.Stderr = p.stdout, p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p.c = watch(t, cmd, "", p.stderr)
	var addrs []string
	waitfor.Cond(t, 30*time.Second, "the broker's \"brokers:\" line", func() bool {
		addrs = brokersLine(p.stdout.String())
		return addrs != nil
	})
	return p, addrs
}

// brokersLine parses the "brokers: a,b,c" line of the command's stdout (nil until it is complete).
func brokersLine(out string) []string {
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "brokers: "); ok && strings.HasSuffix(out, "\n") {
			return strings.Split(v, ",")
		}
	}
	return nil
}

// stop sends SIGTERM and returns the exit code, failing the test if the process does not exit
// within 30 s.
func (p *brokerProc) stop(t *testing.T) int {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	return exitOf(t, p.c, 30*time.Second)
}

// kafkaClient produces and reads with kcat when it is installed (CI installs it), else with
// kafka-go; a missing kcat fails the test when tooltest.RequireEnv is 1.
type kafkaClient struct{ kcat string }

func newKafkaClient(t *testing.T) kafkaClient {
	p, err := exec.LookPath("kcat")
	if err != nil {
		if os.Getenv(tooltest.RequireEnv) == "1" {
			t.Fatalf("kcat not on PATH (install: apt-get install kcat), and %s=1", tooltest.RequireEnv)
		}
		t.Log("kcat not on PATH: producing and reading with kafka-go")
	}
	return kafkaClient{kcat: p}
}

// produce writes one record per value, keyed "k<value>", through the node at addr.
func (k kafkaClient) produce(t *testing.T, addr, topic string, values []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if k.kcat != "" {
		var in strings.Builder
		for _, v := range values {
			fmt.Fprintf(&in, "k%s:%s\n", v, v)
		}
		cmd := exec.CommandContext(ctx, k.kcat, "-P", "-b", addr, "-t", topic, "-K:", "-X", "acks=all")
		cmd.Stdin = strings.NewReader(in.String())
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("kcat -P via %s: %v: %s", addr, err, out)
		}
		return
	}
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(addr), Topic: topic, Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	defer w.Close()
	msgs := make([]kafka.Message, len(values))
	for i, v := range values {
		msgs[i] = kafka.Message{Key: []byte("k" + v), Value: []byte(v)}
	}
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatalf("produce via %s: %v", addr, err)
	}
}

// readAll reads every partition of topic (which has the given partitions) to its end through
// the node at addr and returns the values by partition.
func (k kafkaClient) readAll(t *testing.T, addr, topic string, partitions int) [][]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got := make([][]string, partitions)
	if k.kcat != "" {
		out, err := exec.CommandContext(ctx, k.kcat, "-C", "-b", addr, "-t", topic, "-e", "-q", "-f", "%p %s\n").CombinedOutput()
		if err != nil {
			t.Fatalf("kcat -C via %s: %v: %s", addr, err, out)
		}
		for line := range strings.Lines(string(out)) {
			var p int
			var v string
			if _, err := fmt.Sscanf(line, "%d %s", &p, &v); err != nil || p < 0 || p >= partitions {
				t.Fatalf("kcat printed %q", line)
			}
			got[p] = append(got[p], v)
		}
		return got
	}
	for p := range partitions {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: []string{addr}, Topic: topic, Partition: p, MaxWait: kafkatest.MaxWait})
		for {
			lag, err := r.ReadLag(ctx)
			if err != nil {
				r.Close()
				t.Fatalf("lag of %s/%d: %v", topic, p, err)
			}
			if lag == 0 {
				break
			}
			m, err := r.FetchMessage(ctx)
			if err != nil {
				r.Close()
				t.Fatalf("reading %s/%d via %s: %v", topic, p, addr, err)
			}
			got[p] = append(got[p], string(m.Value))
		}
		r.Close()
	}
	return got
}

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
	p, addrs := startBrokerCmd(t, args...)
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
		logged = p.stderr.Logged("SIGINT or SIGTERM stops the broker", "brokers")
		return logged != ""
	})
	if logged != strings.Join(addrs, ",") {
		t.Fatalf("logged brokers=%q, printed %q", logged, addrs)
	}

	// Produce through node 0 and read back through node 2: the records spread over the three
	// partitions, whose leaders are the three nodes.
	k := newKafkaClient(t)
	var want []string
	for i := range 30 {
		want = append(want, fmt.Sprintf("v%02d", i))
	}
	k.produce(t, addrs[0], "records", want)
	byPart := k.readAll(t, addrs[2], "records", partitions)
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

	if code := p.stop(t); code != 0 {
		t.Fatalf("exit code %d after SIGTERM; stderr:\n%s", code, p.stderr.String())
	}
	if !strings.Contains(p.stderr.String(), `msg="Kafka-protocol broker stopped"`) {
		t.Fatalf("no clean stop logged:\n%s", p.stderr.String())
	}

	// Started again on the same directory: the records and the group's committed offsets are
	// there (the group reads only what is produced now).
	p2, addrs2 := startBrokerCmd(t, args...)
	if got := k.readAll(t, addrs2[1], "records", partitions); fmt.Sprint(got) != fmt.Sprint(byPart) {
		t.Fatalf("after restart read %v, want %v", got, byPart)
	}
	more := []string{"w00", "w01", "w02", "w03"}
	k.produce(t, addrs2[2], "records", more)
	if got := groupRead(t, addrs2[0], "records", "g", len(more)); fmt.Sprint(got) != fmt.Sprint(more) {
		t.Fatalf("group after restart read %v, want only the new %v", got, more)
	}
	if code := p2.stop(t); code != 0 {
		t.Fatalf("exit code %d after SIGTERM; stderr:\n%s", code, p2.stderr.String())
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
	} {
		code, stdout, stderr := runCLI(t, append([]string{"broker"}, tc.args...)...)
		if code != 2 || !strings.Contains(stderr, tc.want) || stdout != "" {
			t.Errorf("%v: exit %d, stderr %q, stdout %q; want exit 2 naming %s", tc.args, code, stderr, stdout, tc.want)
		}
	}
}
