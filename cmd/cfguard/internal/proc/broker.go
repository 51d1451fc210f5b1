package proc

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/segmentio/kafka-go"
)

// BrokerProc is a `cfguard broker` process a test started.
type BrokerProc struct {
	Cmd    *exec.Cmd
	Stdout *tooltest.Output
	Stderr *tooltest.Output
	Child  *Child // the process, waited for
}

// StartBrokerCmd runs `cfguard broker args...` in a new process and waits for its "brokers:"
// line, returning the process and the node addresses it printed.
func StartBrokerCmd(t *testing.T, args ...string) (*BrokerProc, []string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"broker"}, args...)...)
	cmd.Env = append(os.Environ(), "CFGUARD_TEST_MAIN=1")
	p := &BrokerProc{Cmd: cmd, Stdout: &tooltest.Output{}, Stderr: &tooltest.Output{}}
	cmd.Stdout, cmd.Stderr = p.Stdout, p.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p.Child = Watch(t, cmd, "", p.Stderr)
	var addrs []string
	waitfor.Cond(t, 30*time.Second, "the broker's \"brokers:\" line", func() bool {
		addrs = BrokersLine(p.Stdout.String())
		return addrs != nil
	})
	return p, addrs
}

// BrokersLine parses the "brokers: a,b,c" line of the command's stdout (nil until it is complete).
func BrokersLine(out string) []string {
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "brokers: "); ok && strings.HasSuffix(out, "\n") {
			return strings.Split(v, ",")
		}
	}
	return nil
}

// Stop sends SIGTERM and returns the exit code, failing the test if the process does not exit
// within 30 s.
func (p *BrokerProc) Stop(t *testing.T) int {
	t.Helper()
	if err := p.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	return ExitOf(t, p.Child, 30*time.Second)
}

// KafkaClient produces and reads with kcat when it is installed (CI installs it), else with
// kafka-go; a missing kcat fails the test when tooltest.RequireEnv is 1.
type KafkaClient struct{ kcat string }

func NewKafkaClient(t *testing.T) KafkaClient {
	p, err := exec.LookPath("kcat")
	if err != nil {
		if os.Getenv(tooltest.RequireEnv) == "1" {
			t.Fatalf("kcat not on PATH (install: apt-get install kcat), and %s=1", tooltest.RequireEnv)
		}
		t.Log("kcat not on PATH: producing and reading with kafka-go")
	}
	return KafkaClient{kcat: p}
}

// Produce writes one record per value, keyed "k<value>", through the node at addr.
func (k KafkaClient) Produce(t *testing.T, addr, topic string, values []string) {
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

// ReadAll reads every partition of topic (which has the given partitions) to its end through
// the node at addr and returns the values by partition.
func (k KafkaClient) ReadAll(t *testing.T, addr, topic string, partitions int) [][]string {
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
