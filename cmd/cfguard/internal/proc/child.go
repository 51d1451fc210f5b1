package proc

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// AnyPort is the listen address tests give a child daemon: it binds an ephemeral port and logs
// which (Child.Addr), so that no test reserves a port, frees it and hopes nobody takes it before
// the child binds it (under parallel test binaries somebody did).
const AnyPort = "127.0.0.1:0"

// Child is a cfguard process a test started: the test binary re-executed as the command (Main).
type Child struct {
	Cmd   *exec.Cmd
	HTTP  string // the configured http.listen (AnyPort: see Addr)
	Log   *tooltest.Output
	Token string        // http.token, when the configuration sets one
	Done  chan struct{} // closed once the process exited and was waited for (err set)
	Err   error         // cmd.Wait's
}

// Wait waits for the process to exit and returns cmd.Wait's error (any number of times).
func (c *Child) Wait() error {
	<-c.Done
	return c.Err
}

// Exited says whether the process has exited.
func (c *Child) Exited() bool {
	select {
	case <-c.Done:
		return true
	default:
		return false
	}
}

// Addr is the child's HTTP address: the configured one, or with AnyPort the one it logged ("" if
// it has not yet).
func (c *Child) Addr() string {
	if c.HTTP != AnyPort {
		return c.HTTP
	}
	return c.Log.Logged("HTTP API listening", "addr")
}

// WaitUp waits until the child answers its API, failing the test with the child's log after 60 s.
func (c *Child) WaitUp(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for c.Applied() < 0 {
		if time.Now().After(deadline) {
			t.Fatalf("daemon did not start; log:\n%s", c.Log.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// BrokerAddr is the address of the child's embedded broker as it logged it ("" if not yet).
func (c *Child) BrokerAddr() string {
	return c.Log.Logged("Kafka-protocol broker started", "addrs")
}

// StartChild runs `cfguard run --config cfg` in a new process, with flags after the config's.
func StartChild(t *testing.T, cfgPath, httpAddr string, flags ...string) *Child {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"run", "--config", cfgPath}, flags...)...)
	cmd.Env = append(os.Environ(), "CFGUARD_TEST_MAIN=1")
	log := &tooltest.Output{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return Watch(t, cmd, httpAddr, log)
}

// Watch is the child of cmd, started: one goroutine waits for it (a test learns of an exit at
// once, with Exited, however many wait), and the test's cleanup kills it if it still runs.
func Watch(t *testing.T, cmd *exec.Cmd, httpAddr string, log *tooltest.Output) *Child {
	c := &Child{Cmd: cmd, HTTP: httpAddr, Log: log, Done: make(chan struct{})}
	go func() {
		c.Err = cmd.Wait()
		close(c.Done)
	}()
	t.Cleanup(func() {
		if !c.Exited() {
			cmd.Process.Kill()
		}
		c.Wait()
	})
	return c
}

// WaitApplied waits until the daemon has applied n records. A restarted daemon reads on from its
// checkpoint at once: one whose count has not grown for 45 s is a defect and fails the test
// (with the daemon's log), while one that only goes slowly, on a busy core, does not. The count
// waited on is the largest answered (applied answers -1 for a request that timed out).
func (c *Child) WaitApplied(t *testing.T, n int64, what string) {
	t.Helper()
	defer func() {
		if t.Failed() {
			t.Logf("log of the daemon:\n%s", c.Log.String())
		}
	}()
	best := int64(-1)
	waitfor.Progress(t, 45*time.Second, fmt.Sprintf("%s: %d records applied", what, n), func() (bool, string) {
		best = max(best, c.Applied())
		return best >= n, fmt.Sprintf("applied %d", best)
	})
}

// Applied asks the daemon how many records it has applied (-1 if it does not answer).
func (c *Child) Applied() int64 {
	addr := c.Addr()
	if addr == "" {
		return -1
	}
	cl := http.Client{Timeout: time.Second}
	req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/v1/model", nil)
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
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

// AppliedAnswer is Applied for a test that needs the answer: it asks until the daemon answers,
// failing the test (with the daemon's log) when the daemon exits or has not answered for 60 s.
// Applied gives up after 1 s, a poll's timeout, which a daemon busy on a loaded machine can take
// longer than.
func (c *Child) AppliedAnswer(t *testing.T) int64 {
	t.Helper()
	n := int64(-1)
	waitfor.Cond(t, 60*time.Second, "the daemon's answer to GET /v1/model", func() bool {
		if n = c.Applied(); n < 0 && c.Exited() {
			t.Fatalf("the daemon exited (%v); log:\n%s", c.Err, c.Log.String())
		}
		return n >= 0
	})
	return n
}

// StartBroker starts a Kafka-protocol broker on loopback, external to the daemons under test,
// with the daemon's default topics (one partition each). It stops with the test.
func StartBroker(t *testing.T) *broker.Broker {
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

// TrainModel trains the model these tests share (the bundled breast-cancer data, seed 3, five
// epochs: the same posterior every time) and saves it as dir/model. It returns the data set, the
// model and the model directory.
func TrainModel(t *testing.T, dir string) (*dataset.Set, *bnn.Model, string) {
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

// MetricValues reads unlabelled metrics from one scrape (-1 for each when it fails or lacks one),
// so that values the daemon reads from one ledger transaction are compared as one moment.
func (c *Child) MetricValues(names ...string) []float64 {
	out := make([]float64, len(names))
	for i := range out {
		out[i] = -1
	}
	addr := c.Addr()
	if addr == "" {
		return out
	}
	cl := http.Client{Timeout: time.Second}
	resp, err := cl.Get("http://" + addr + "/metrics")
	if err != nil {
		return out
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 2 {
			continue
		}
		for i, name := range names {
			if f[0] == name {
				if v, err := strconv.ParseFloat(f[1], 64); err == nil {
					out[i] = v
				}
			}
		}
	}
	return out
}

// Admitted says whether a CE measured at (p, v) from S draws is admitted as certified, with a
// margin of 0.01 for the daemon's own draws (as many or more): registration takes the rule that
// renews a certificate, lower(p) >= 1 - delta at confidence 1 - certify.verdict_alpha.
func Admitted(p, v float64, S int) bool {
	lo, _ := certify.Evidence{P: p, Var: v, Samples: S}.Interval(certify.DefaultVerdictAlpha)
	return lo >= 0.96
}

// CandidatePairs are the rows of set the model puts in "malignant" with p > 0.9 (candidates for
// x) and in "benign" with p > minP and variance below maxVar (candidates for x'), measured with S
// draws; with admit, only x' that registration admits as certified (see Admitted).
func CandidatePairs(t *testing.T, m *bnn.Model, set *dataset.Set, S int, minP, maxVar float64, admit bool) (xs, cfs []int) {
	t.Helper()
	p, err := m.Predict(set.X, S, 1)
	if err != nil {
		t.Fatal(err)
	}
	for i := range set.X {
		switch {
		case p.Argmax(i) == 0 && p.P(i, 0) > 0.9:
			xs = append(xs, i)
		case p.P(i, 1) > minP && p.V(i, 1) < maxVar && (!admit || Admitted(p.P(i, 1), p.V(i, 1), S)):
			cfs = append(cfs, i)
		}
	}
	return xs, cfs
}

// ExitOf waits for a child that should stop by itself within limit and returns its exit code.
func ExitOf(t *testing.T, c *Child, limit time.Duration) int {
	t.Helper()
	select {
	case <-c.Done:
		err := c.Err
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0
	case <-time.After(limit):
		c.Cmd.Process.Kill()
		c.Wait()
		t.Fatalf("the daemon was still running after %v; log:\n%s", limit, c.Log.String())
		return -1
	}
}

// CELines writes n counterfactual lines of the bundled data ("ce-0".."ce-{n-1}"): x rows the
// model classifies malignant, x_cf rows it classifies benign with p > 0.985.
func CELines(t *testing.T, set *dataset.Set, xs, cfs []int, n int) []string {
	t.Helper()
	lines := make([]string, n)
	for k := range lines {
		b, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("ce-%d", k), "x": set.X[xs[k%len(xs)]], "x_cf": set.X[cfs[(7*k)%len(cfs)]], "target": "benign"})
		lines[k] = string(b)
	}
	return lines
}

// Get answers GET url's status and body (0 when it does not answer).
func Get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// WriteConfig writes a daemon configuration. Increments have a fixed size (max_records_backlog =
// max_records), so that runs over the same records make the same increments whatever the
// timing, and their posteriors can be compared bit for bit.
func WriteConfig(t *testing.T, dir, brokerAddr, httpAddr, group, modelDir string) string {
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

// EditConfig replaces old with new in the configuration file, failing the test when old is not
// there (a silent no-op would test another configuration than the one the test describes).
func EditConfig(t *testing.T, path, old, new string) {
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

// FinalState opens a stopped daemon's ledger and returns its applied count and posterior bytes.
func FinalState(t *testing.T, dir string) (ledger.State, []byte) {
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
