package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestMain lets the test binary act as the cfguard command: crash tests re-execute it with
// CFGUARD_TEST_MAIN=1 so that the daemon runs in a separate process they can SIGKILL.
func TestMain(m *testing.M) {
	if os.Getenv("CFGUARD_TEST_MAIN") == "1" {
		main()
	}
	os.Exit(m.Run())
}

// anyPort is the listen address tests give a child daemon: it binds an ephemeral port and logs
// which (child.addr), so that no test reserves a port, frees it and hopes nobody takes it before
// the child binds it (under parallel test binaries somebody did).
const anyPort = "127.0.0.1:0"

type child struct {
	cmd   *exec.Cmd
	http  string // the configured http.listen (anyPort: see addr)
	log   *tooltest.Output
	token string        // http.token, when the configuration sets one
	done  chan struct{} // closed once the process exited and was waited for (err set)
	err   error         // cmd.Wait's
}

// wait waits for the process to exit and returns cmd.Wait's error (any number of times).
func (c *child) wait() error {
	<-c.done
	return c.err
}

// exited says whether the process has exited.
func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// addr is the child's HTTP address: the configured one, or with anyPort the one it logged ("" if
// it has not yet).
func (c *child) addr() string {
	if c.http != anyPort {
		return c.http
	}
	return c.log.Logged("HTTP API listening", "addr")
}

// waitUp waits until the child answers its API, failing the test with the child's log after 60 s.
func (c *child) waitUp(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for c.applied() < 0 {
		if time.Now().After(deadline) {
			t.Fatalf("daemon did not start; log:\n%s", c.log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// brokerAddr is the address of the child's embedded broker as it logged it ("" if not yet).
func (c *child) brokerAddr() string {
	return c.log.Logged("Kafka-protocol broker started", "addrs")
}

// startChild runs `cfguard run --config cfg` in a new process.
func startChild(t *testing.T, cfgPath, httpAddr string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "run", "--config", cfgPath)
	cmd.Env = append(os.Environ(), "CFGUARD_TEST_MAIN=1")
	log := &tooltest.Output{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return watch(t, cmd, httpAddr, log)
}

// watch is the child of cmd, started: one goroutine waits for it (a test learns of an exit at
// once, with exited, however many wait), and the test's cleanup kills it if it still runs.
func watch(t *testing.T, cmd *exec.Cmd, httpAddr string, log *tooltest.Output) *child {
	c := &child{cmd: cmd, http: httpAddr, log: log, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		close(c.done)
	}()
	t.Cleanup(func() {
		if !c.exited() {
			cmd.Process.Kill()
		}
		c.wait()
	})
	return c
}

// waitApplied waits until the daemon has applied n records. A restarted daemon reads on from its
// checkpoint at once: one whose count has not grown for 45 s is a defect and fails the test
// (with the daemon's log), while one that only goes slowly, on a busy core, does not. The count
// waited on is the largest answered (applied answers -1 for a request that timed out).
func (c *child) waitApplied(t *testing.T, n int64, what string) {
	t.Helper()
	defer func() {
		if t.Failed() {
			t.Logf("log of the daemon:\n%s", c.log.String())
		}
	}()
	best := int64(-1)
	waitfor.Progress(t, 45*time.Second, fmt.Sprintf("%s: %d records applied", what, n), func() (bool, string) {
		best = max(best, c.applied())
		return best >= n, fmt.Sprintf("applied %d", best)
	})
}

// applied asks the daemon how many records it has applied (-1 if it does not answer).
func (c *child) applied() int64 {
	addr := c.addr()
	if addr == "" {
		return -1
	}
	cl := http.Client{Timeout: time.Second}
	req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/v1/model", nil)
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := cl.Do(req)
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	var m struct{ Applied int64 }
	if json.NewDecoder(resp.Body).Decode(&m) != nil {
		return -1
	}
	return m.Applied
}

// startBroker starts a Kafka-protocol broker on loopback, external to the daemons under test,
// with the daemon's default topics (one partition each). It stops with the test.
func startBroker(t *testing.T) *broker.Broker {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"cfguard.records", "cfguard.records.dlq", "cfguard.events"}, Partitions: 1}, nil)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close(); cancel() })
	return b
}

// trainModel trains the model these tests share (the bundled breast-cancer data, seed 3, five
// epochs: the same posterior every time) and saves it as dir/model. It returns the data set, the
// model and the model directory.
func trainModel(t *testing.T, dir string) (*dataset.Set, *bnn.Model, string) {
	t.Helper()
	set, ds, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	m, _, err := bnn.Fit(context.Background(), set, ds.Classes, bnn.TrainConfig{Seed: 3, Epochs: 5})
	if err != nil {
		t.Fatal(err)
	}
	modelDir := filepath.Join(dir, "model")
	if err := bnn.Save(modelDir, m); err != nil {
		t.Fatal(err)
	}
	return set, m, modelDir
}

// writeConfig writes a daemon configuration. Increments have a fixed size (max_records_backlog =
// max_records), so that runs over the same records make the same increments whatever the
// timing, and their posteriors can be compared bit for bit.
func writeConfig(t *testing.T, dir, brokerAddr, httpAddr, group, modelDir string) string {
	t.Helper()
	cfg := fmt.Sprintf(`http:
  listen: %s
state_dir: %s
model:
  path: %s
kafka:
  brokers: [%s]
  group_id: %s
  max_records: 16
  max_records_backlog: 16
  max_wait: 10s
certify:
  samples: 400
audit:
  schedule: ""
log:
  level: info
`, httpAddr, filepath.Join(dir, "state"), modelDir, brokerAddr, group)
	p := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(p, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// editConfig replaces old with new in the configuration file, failing the test when old is not
// there (a silent no-op would test another configuration than the one the test describes).
func editConfig(t *testing.T, path, old, new string) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(raw), old) {
		t.Fatalf("%s does not contain %q; the test's edit does not apply:\n%s", path, old, raw)
	}
	if err := os.WriteFile(path, []byte(strings.Replace(string(raw), old, new, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
}

// finalState opens a stopped daemon's ledger and returns its applied count and posterior bytes.
func finalState(t *testing.T, dir string) (ledger.State, []byte) {
	t.Helper()
	l, err := ledger.Open(filepath.Join(dir, "state"), ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	st, err := l.State()
	if err != nil {
		t.Fatal(err)
	}
	m, err := l.Current()
	if err != nil {
		t.Fatal(err)
	}
	_, w, err := bnn.Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	return st, w
}

// TestCrashConsistency kills the daemon with SIGKILL at random points across many increments,
// restarts it, and compares the applied-record count and the posterior, bit for bit, with an
// uninterrupted run over the same records: nothing lost, nothing doubled.
func TestCrashConsistency(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills daemon processes")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	brokerAddr := startBroker(t).Addrs()[0]

	// One model for both runs, trained once.
	set, _, modelDir := trainModel(t, t.TempDir())

	// 24 increments of 16 good records, with a bad record every 10th message.
	const good = 384
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(brokerAddr), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll, BatchSize: 100}
	var msgs []kafka.Message
	for i := 0; i < good; i++ {
		if i%10 == 9 {
			msgs = append(msgs, kafka.Message{Value: []byte(`{"id":"bad","features":[1],"label":0}`)})
		}
		v, _ := json.Marshal(map[string]any{"id": fmt.Sprint(i), "features": set.X[i], "label": set.Y[i]})
		msgs = append(msgs, kafka.Message{Value: v})
	}
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	w.Close()

	// run drives one daemon over the records. It kills it with SIGKILL once the applied count
	// passes each threshold in killAt (sorted), after a random 0-60 ms more so that kills land
	// inside increments too, then lets the last process finish and stops it with SIGTERM.
	run := func(name string, killAt []int64, rng *rand.Rand) (ledger.State, []byte) {
		dir := t.TempDir()
		httpAddr := anyPort
		cfg := writeConfig(t, dir, brokerAddr, httpAddr, name, modelDir)
		for k := 0; ; k++ {
			c := startChild(t, cfg, httpAddr)
			target := int64(good)
			if k < len(killAt) {
				target = killAt[k]
			}
			c.waitApplied(t, target, fmt.Sprintf("%s: restart %d", name, k))
			if k < len(killAt) {
				time.Sleep(time.Duration(rng.IntN(60)) * time.Millisecond)
				c.cmd.Process.Signal(syscall.SIGKILL)
				c.wait()
				t.Logf("%s: SIGKILL %d once %d+ records were applied", name, k+1, target)
				continue
			}
			c.cmd.Process.Signal(syscall.SIGTERM)
			if err := c.wait(); err != nil {
				t.Fatalf("%s: exit after SIGTERM: %v; log:\n%s", name, err, c.log.String())
			}
			if !strings.Contains(c.log.String(), `msg="cfguard stopping" cause="terminated signal received"`) ||
				!strings.Contains(c.log.String(), "cfguard stopped") {
				t.Fatalf("%s: no clean stop in log, naming its signal:\n%s", name, c.log.String())
			}
			return finalState(t, dir)
		}
	}
	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 1))
	var killAt []int64 // one threshold in each fifth of the stream
	for k := 0; k < 5; k++ {
		killAt = append(killAt, int64(k*good/5+1+rng.IntN(good/5-1)))
	}
	t.Logf("kill thresholds %v (seed %d)", killAt, seed)
	refState, refModel := run("reference", nil, rng)
	crashState, crashModel := run("crashed", killAt, rng)
	if refState.Applied != good || crashState.Applied != good {
		t.Fatalf("applied %d (reference) and %d (crashed), want %d", refState.Applied, crashState.Applied, good)
	}
	if refState.PosteriorVersion != crashState.PosteriorVersion || refState.PosteriorVersion != good/16 {
		t.Fatalf("posterior versions %d and %d, want %d", refState.PosteriorVersion, crashState.PosteriorVersion, good/16)
	}
	if !bytes.Equal(refModel, crashModel) {
		t.Fatal("the crashed run's posterior differs from the uninterrupted run's")
	}
}

// TestEmbeddedBrokerKeepsAcknowledgedRecords produces to the daemon's embedded broker, kills
// the daemon (and so the broker) with SIGKILL as soon as the records are acknowledged, restarts
// it, and requires every record to be applied. This is a process crash: kfake has written the
// records to the OS by then with or without its SyncWrites option (measured: the test passes
// without it). The daemon still sets SyncWrites, which fsyncs each batch, for machine crashes,
// which a test here cannot produce.
func TestEmbeddedBrokerKeepsAcknowledgedRecords(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills daemon processes")
	}
	dir := t.TempDir()
	set, _, modelDir := trainModel(t, dir)
	httpAddr := anyPort
	cfg := writeConfig(t, dir, "", httpAddr, "cfguard", modelDir)
	// One open increment holds every record until max_wait: at the kill nothing is applied yet, so
	// after the restart the records can only come from the embedded broker's disk.
	editConfig(t, cfg, "  brokers: []\n", "  brokers: []\n  embedded_listen: "+anyPort+"\n")
	editConfig(t, cfg, "  max_records: 16\n  max_records_backlog: 16\n", "  max_records: 1000\n  max_records_backlog: 1000\n")
	c := startChild(t, cfg, httpAddr)
	c.waitUp(t)
	const n = 48
	brokerAddr := c.brokerAddr()
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(brokerAddr), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll, BatchSize: n}
	var msgs []kafka.Message
	for i := 0; i < n; i++ {
		v, _ := json.Marshal(map[string]any{"id": fmt.Sprint(i), "features": set.X[i], "label": set.Y[i]})
		msgs = append(msgs, kafka.Message{Value: v})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	w.Close()
	if got := c.applied(); got != 0 {
		t.Fatalf("%d records applied before the kill; the test needs them pending", got)
	}
	c.cmd.Process.Signal(syscall.SIGKILL) // right after the acknowledgement
	c.wait()
	// The restarted daemon need not hold the records until an increment of 1000 fills: with a
	// short max_wait it applies them as soon as it has read them back from the broker's disk.
	editConfig(t, cfg, "  max_wait: 10s\n", "  max_wait: 300ms\n")
	c = startChild(t, cfg, httpAddr)
	waitUntil := time.Now().Add(90 * time.Second)
	for c.applied() != n {
		if time.Now().After(waitUntil) {
			t.Fatalf("applied %d of %d acknowledged records after the crash; log:\n%s", c.applied(), n, c.log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.cmd.Process.Signal(syscall.SIGTERM)
	if err := c.wait(); err != nil {
		t.Fatal(err)
	}
}

// restartBound is how soon a restarted daemon must apply records again: the consumer-group
// session timeout the daemon used to wait for (10 s), plus a few seconds for the process to
// start, load its state and apply an increment.
const restartBound = 15 * time.Second

// TestRestartAfterTwoQuickKills runs restart trials against an external broker (a kfake cluster
// this test starts; the daemon does not embed it): SIGKILL the running daemon, start it, SIGKILL
// the new process soon after it comes up, start it once more, produce an increment's worth of
// records and measure how long the last process takes to apply them. Every trial must finish
// within restartBound.
//
// The consumer used to be a kafka-go consumer-group member. Then a restart waited for the killed
// member's session to expire (10 s), and about 2 restarts in 10 stalled for good: kfake never
// expires a member whose JoinGroup reply went to a dead connection (the second kill lands while
// the join waits for the first member to expire), and the range balancer could hand that member
// the only partition, leaving the live one with nothing to read. The consumer no longer joins a
// group, so there is nothing to wait for.
func TestRestartAfterTwoQuickKills(t *testing.T) { restartTrials(t, 3) }

// TestRestartAfterTwoQuickKillsLong is the same with 20 trials.
func TestRestartAfterTwoQuickKillsLong(t *testing.T) {
	if testing.Short() {
		t.Skip("20 restart trials")
	}
	restartTrials(t, 20)
}

func restartTrials(t *testing.T, trials int) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	brokerAddr := startBroker(t).Addrs()[0]
	dir := t.TempDir()
	set, _, modelDir := trainModel(t, dir)
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(brokerAddr), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll, BatchSize: 16, BatchTimeout: time.Millisecond}
	defer w.Close()
	next := 0
	produce16 := func() {
		msgs := make([]kafka.Message, 16)
		for i := range msgs {
			v, _ := json.Marshal(map[string]any{"features": set.X[next%set.Len()], "label": set.Y[next%set.Len()]})
			msgs[i] = kafka.Message{Value: v}
			next++
		}
		if err := w.WriteMessages(ctx, msgs...); err != nil {
			t.Fatal(err)
		}
	}
	kill := func(c *child) {
		c.cmd.Process.Signal(syscall.SIGKILL)
		c.wait()
	}
	waitApplied := func(c *child, want int64, deadline time.Time, what string) {
		for n := c.applied(); n < want; n = c.applied() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: applied %d, want %d; log:\n%s", what, n, want, c.log.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}

	httpAddr := anyPort
	cfg := writeConfig(t, dir, brokerAddr, httpAddr, "restarts", modelDir)
	c := startChild(t, cfg, httpAddr)
	produce16()
	applied := int64(16)
	waitApplied(c, applied, time.Now().Add(60*time.Second), "first start")
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	var took []time.Duration
	for trial := range trials {
		kill(c)
		second := startChild(t, cfg, httpAddr)
		up := time.Now().Add(30 * time.Second)
		for second.applied() < 0 {
			if time.Now().After(up) {
				t.Fatalf("trial %d: the second process did not come up; log:\n%s", trial, second.log.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(time.Duration(rng.IntN(1000)) * time.Millisecond) // its consumer starting
		kill(second)
		t0 := time.Now()
		c = startChild(t, cfg, httpAddr)
		produce16()
		applied += 16
		waitApplied(c, applied, t0.Add(restartBound), fmt.Sprintf("trial %d: restart after two quick kills (bound %v)", trial, restartBound))
		took = append(took, time.Since(t0))
		t.Logf("trial %d: applying again %v after the restart", trial, took[trial].Round(time.Millisecond))
	}
	c.cmd.Process.Signal(syscall.SIGTERM)
	if err := c.wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v; log:\n%s", err, c.log.String())
	}
	slices.Sort(took)
	t.Logf("%d trials, time from restart to applying again: min %v, median %v, p90 %v, max %v (bound %v)", trials,
		took[0].Round(time.Millisecond), took[len(took)/2].Round(time.Millisecond),
		took[(len(took)*9)/10].Round(time.Millisecond), took[len(took)-1].Round(time.Millisecond), restartBound)
}
