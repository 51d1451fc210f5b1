package daemon

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/ledger"
)

// TestCrashConsistency kills the daemon with SIGKILL at random points across many increments,
// restarts it, and compares the applied-record count and the posterior, bit for bit, with an
// uninterrupted run over the same records: nothing lost, nothing doubled.
func TestCrashConsistency(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills daemon processes")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	brokerAddr := proc.StartBroker(t).Addrs()[0]

	// One model for both runs, trained once.
	set, _, modelDir := proc.TrainModel(t, t.TempDir())

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
		httpAddr := proc.AnyPort
		cfg := proc.WriteConfig(t, dir, brokerAddr, httpAddr, name, modelDir)
		for k := 0; ; k++ {
			c := proc.StartChild(t, cfg, httpAddr)
			target := int64(good)
			if k < len(killAt) {
				target = killAt[k]
			}
			c.WaitApplied(t, target, fmt.Sprintf("%s: restart %d", name, k))
			if k < len(killAt) {
				time.Sleep(time.Duration(rng.IntN(60)) * time.Millisecond)
				c.Cmd.Process.Signal(syscall.SIGKILL)
				c.Wait()
				t.Logf("%s: SIGKILL %d once %d+ records were applied", name, k+1, target)
				continue
			}
			c.Cmd.Process.Signal(syscall.SIGTERM)
			if err := c.Wait(); err != nil {
				t.Fatalf("%s: exit after SIGTERM: %v; log:\n%s", name, err, c.Log.String())
			}
			if !strings.Contains(c.Log.String(), `msg="cfguard stopping" cause="terminated signal received"`) ||
				!strings.Contains(c.Log.String(), "cfguard stopped") {
				t.Fatalf("%s: no clean stop in log, naming its signal:\n%s", name, c.Log.String())
			}
			return proc.FinalState(t, dir)
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
	set, _, modelDir := proc.TrainModel(t, dir)
	httpAddr := proc.AnyPort
	cfg := proc.WriteConfig(t, dir, "", httpAddr, "cfguard", modelDir)
	// One open increment holds every record until max_wait: at the kill nothing is applied yet, so
	// after the restart the records can only come from the embedded broker's disk.
	proc.EditConfig(t, cfg, "  brokers: []\n", "  brokers: []\n  embedded_listen: "+proc.AnyPort+"\n")
	proc.EditConfig(t, cfg, "  max_records: 16\n  max_records_backlog: 16\n", "  max_records: 1000\n  max_records_backlog: 1000\n")
	c := proc.StartChild(t, cfg, httpAddr)
	c.WaitUp(t)
	const n = 48
	brokerAddr := c.BrokerAddr()
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
	if got := c.AppliedAnswer(t); got != 0 {
		t.Fatalf("%d records applied before the kill; the test needs them pending", got)
	}
	c.Cmd.Process.Signal(syscall.SIGKILL) // right after the acknowledgement
	c.Wait()
	// The restarted daemon need not hold the records until an increment of 1000 fills: with a
	// short max_wait it applies them as soon as it has read them back from the broker's disk.
	proc.EditConfig(t, cfg, "  max_wait: 10s\n", "  max_wait: 300ms\n")
	c = proc.StartChild(t, cfg, httpAddr)
	waitUntil := time.Now().Add(90 * time.Second)
	for c.Applied() != n {
		if time.Now().After(waitUntil) {
			t.Fatalf("applied %d of %d acknowledged records after the crash; log:\n%s", c.Applied(), n, c.Log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.Cmd.Process.Signal(syscall.SIGTERM)
	if err := c.Wait(); err != nil {
		t.Fatal(err)
	}
}

// restartBound is how soon a restarted daemon must apply records again: a consumer group's
// session timeout (10 s), which a group member restarted after a kill would wait for and the
// daemon, a consumer that joins no group, must not, plus a few seconds for the process to start,
// load its state and apply an increment.
const restartBound = 15 * time.Second

// TestRestartAfterTwoQuickKills runs restart trials against an external broker (a kfake cluster
// this test starts; the daemon does not embed it): SIGKILL the running daemon, start it, SIGKILL
// the new process soon after it comes up, start it once more, produce an increment's worth of
// records and measure how long the last process takes to apply them. Every trial must finish
// within restartBound.
//
// The consumer joins no consumer group, so a restart waits for no session to expire. A group
// member would: the killed member's session (10 s), and on kfake, which never expires a member
// whose JoinGroup reply went to a dead connection (the second kill lands while the join waits
// for the first member to expire), for good when the range balancer hands that member the only
// partition. Such a stall came in about 2 restarts of 10, which 20 trials catch.
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
	brokerAddr := proc.StartBroker(t).Addrs()[0]
	dir := t.TempDir()
	set, _, modelDir := proc.TrainModel(t, dir)
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
	kill := func(c *proc.Child) {
		c.Cmd.Process.Signal(syscall.SIGKILL)
		c.Wait()
	}
	waitApplied := func(c *proc.Child, want int64, deadline time.Time, what string) {
		for n := c.Applied(); n < want; n = c.Applied() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: applied %d, want %d; log:\n%s", what, n, want, c.Log.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}

	httpAddr := proc.AnyPort
	cfg := proc.WriteConfig(t, dir, brokerAddr, httpAddr, "restarts", modelDir)
	c := proc.StartChild(t, cfg, httpAddr)
	produce16()
	applied := int64(16)
	waitApplied(c, applied, time.Now().Add(60*time.Second), "first start")
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	var took []time.Duration
	for trial := range trials {
		kill(c)
		second := proc.StartChild(t, cfg, httpAddr)
		up := time.Now().Add(30 * time.Second)
		for second.Applied() < 0 {
			if time.Now().After(up) {
				t.Fatalf("trial %d: the second process did not come up; log:\n%s", trial, second.Log.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(time.Duration(rng.IntN(1000)) * time.Millisecond) // its consumer starting
		kill(second)
		t0 := time.Now()
		c = proc.StartChild(t, cfg, httpAddr)
		produce16()
		applied += 16
		waitApplied(c, applied, t0.Add(restartBound), fmt.Sprintf("trial %d: restart after two quick kills (bound %v)", trial, restartBound))
		took = append(took, time.Since(t0))
		t.Logf("trial %d: applying again %v after the restart", trial, took[trial].Round(time.Millisecond))
	}
	c.Cmd.Process.Signal(syscall.SIGTERM)
	if err := c.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v; log:\n%s", err, c.Log.String())
	}
	slices.Sort(took)
	t.Logf("%d trials, time from restart to applying again: min %v, median %v, p90 %v, max %v (bound %v)", trials,
		took[0].Round(time.Millisecond), took[len(took)/2].Round(time.Millisecond),
		took[(len(took)*9)/10].Round(time.Millisecond), took[len(took)-1].Round(time.Millisecond), restartBound)
}
