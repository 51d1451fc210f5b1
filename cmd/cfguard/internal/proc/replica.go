package proc

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cfguard/cfguard/cmd/cfguard/internal/command"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/segmentio/kafka-go"
)

// Replicas in these tests: the updater group's session is short so that takeovers are quick;
// the broker's group.min.session.timeout.ms is lowered to allow it.
const (
	ReplicaSession   = 3 * time.Second
	ReplicaHeartbeat = 300 * time.Millisecond
)

// ReplicaProc is one `cfguard run` process of a replicated deployment.
type ReplicaProc struct {
	ID, Dir, Config string
	Child           *Child
}

// ModelView is what GET /v1/model says of a replica.
type ModelView struct {
	Version     uint64            `json:"posterior_version"`
	Applied     int64             `json:"applied"`
	Counters    map[string]int64  `json:"counters"`
	KLHistory   []json.RawMessage `json:"kl_history"`
	Replication struct {
		Writer  string        `json:"writer"`
		Updater bool          `json:"updater"`
		Entry   uint64        `json:"entry"`
		Term    uint64        `json:"term"`
		SHA     string        `json:"posterior_sha256"`
		Covers  map[int]int64 `json:"covers"`
		Stopped string        `json:"stopped"`
		Lag     int64         `json:"lag_records"`
		// CEPartitions are the CE partitions the replica owns.
		CEPartitions []int `json:"ce_partitions"`
	} `json:"replication"`
}

// ClusterKey returns the cluster key file of the replicas under root, written on the first call.
func ClusterKey(t *testing.T, root string) string {
	t.Helper()
	p := filepath.Join(root, "cluster.key")
	if _, err := os.Stat(p); err == nil {
		return p
	}
	line, err := clusterkey.Generate("k1")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(line), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// WriteReplicaConfig writes the configuration of replica id in dir; the replicas whose
// directories share a parent share its cluster key (ClusterKey).
func WriteReplicaConfig(t *testing.T, dir, id string, brokers []string, modelDir string, extra ...string) string {
	t.Helper()
	cfg := fmt.Sprintf(`http:
  listen: %s
state_dir: %s
model:
  path: %s
kafka:
  brokers: [%s]
  max_records: 32
  max_records_backlog: 32
  max_wait: 300ms
certify:
  samples: 400
audit:
  schedule: ""
log:
  level: info
replication:
  enabled: true
  replica_id: %s
  session_timeout: %s
  heartbeat_interval: %s
  key_file: %s
`, AnyPort, filepath.Join(dir, "state"), modelDir, strings.Join(brokers, ", "), id, ReplicaSession, ReplicaHeartbeat, ClusterKey(t, filepath.Dir(dir)))
	cfg += strings.Join(extra, "")
	p := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(p, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func (r *ReplicaProc) Start(t *testing.T) {
	t.Helper()
	r.Child = StartChild(t, r.Config, AnyPort)
	waitfor.Cond(t, 60*time.Second, r.ID+" ready", func() bool {
		if r.Child.Exited() {
			t.Fatalf("%s exited: %s", r.ID, r.Child.Log.String())
		}
		addr := r.Child.Addr()
		if addr == "" {
			return false
		}
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// Predict asks the replica for a prediction of x and returns the posterior version it answered
// under; anything but a 200 fails the test.
func (r *ReplicaProc) Predict(t *testing.T, x []float64) uint64 {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"x": x})
	cl := http.Client{Timeout: 10 * time.Second}
	resp, err := cl.Post("http://"+r.Child.Addr()+"/v1/predict", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatalf("%s: POST /v1/predict: %v", r.ID, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: POST /v1/predict: %d %s", r.ID, resp.StatusCode, b)
	}
	var answer struct {
		Version *uint64 `json:"posterior_version"`
	}
	if err := json.Unmarshal(b, &answer); err != nil || answer.Version == nil {
		t.Fatalf("%s: POST /v1/predict: no posterior_version in %s (%v)", r.ID, b, err)
	}
	return *answer.Version
}

// View reads GET /v1/model; ok is false while the replica does not answer.
func (r *ReplicaProc) View() (ModelView, bool) {
	var v ModelView
	addr := r.Child.Addr()
	if addr == "" {
		return v, false
	}
	cl := http.Client{Timeout: 2 * time.Second}
	resp, err := cl.Get("http://" + addr + "/v1/model")
	if err != nil {
		return v, false
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || json.NewDecoder(resp.Body).Decode(&v) != nil {
		return v, false
	}
	return v, true
}

// WaitView is View for a test that needs the answer: it asks until r answers, failing the test
// when r has not for 60 s. View gives up after 2 s, a poll's timeout; a replica holds GET
// /v1/model while it commits an increment (the ledger's recertification and fsync), which on a
// busy machine can take longer.
func (r *ReplicaProc) WaitView(t *testing.T) ModelView {
	t.Helper()
	var v ModelView
	waitfor.Cond(t, 60*time.Second, r.ID+" answering GET /v1/model", func() bool {
		var ok bool
		v, ok = r.View()
		return ok
	})
	return v
}

// Signal sends sig to the replica's process.
func (r *ReplicaProc) Signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := r.Child.Cmd.Process.Signal(sig); err != nil {
		t.Fatalf("%s: %v", r.ID, err)
	}
}

// Terminate stops the replica with SIGTERM and checks it exits 0.
func (r *ReplicaProc) Terminate(t *testing.T) {
	t.Helper()
	r.Signal(t, syscall.SIGTERM)
	if code := ExitOf(t, r.Child, 30*time.Second); code != 0 {
		t.Fatalf("%s exited %d after SIGTERM:\n%s", r.ID, code, r.Child.Log.String())
	}
}

// Kill stops the replica with SIGKILL.
func (r *ReplicaProc) Kill(t *testing.T) {
	t.Helper()
	r.Signal(t, syscall.SIGKILL)
	r.Child.Wait()
}

// RecordStream produces labelled records (every 40th one invalid, for the dead-letter topic) until
// stopped, and counts them.
type RecordStream struct {
	Mu       sync.Mutex
	Produced int
	Stop     chan struct{}
	Done     chan struct{}
	Err      error
}

// StreamEvery is how often the tests' record streams produce 16 records: 80 records a second,
// two or three increments of max_records 32. Each increment costs every replica a posterior and
// its predictive pools, so the rate, more than a test's length, sets a replica test's CPU.
const StreamEvery = 200 * time.Millisecond

// StartStream produces 16 records every StreamEvery.
func StartStream(brokers []string, data *dataset.Set) *RecordStream {
	return StartStreamFlip(brokers, data, false, StreamEvery)
}

// StartStreamFlip produces 16 records every period, with every label flipped when flip is set:
// the drift of a model learning the opposite of what it knew.
func StartStreamFlip(brokers []string, data *dataset.Set, flip bool, every time.Duration) *RecordStream {
	s := &RecordStream{Stop: make(chan struct{}), Done: make(chan struct{})}
	tr := &kafka.Transport{} // not kafka.DefaultTransport: see kafkatest.Transport
	w := &kafka.Writer{Transport: tr, Addr: kafka.TCP(brokers...), Topic: "cfguard.records", Balancer: &kafka.RoundRobin{},
		RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond, BatchSize: 64}
	go func() {
		defer close(s.Done)
		defer tr.CloseIdleConnections()
		defer w.Close()
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-s.Stop:
				return
			case <-tick.C:
			}
			s.Mu.Lock()
			n := s.Produced
			s.Mu.Unlock()
			msgs := make([]kafka.Message, 16)
			for i := range msgs {
				k := (n + i) % data.Len()
				label := data.Y[k]
				if flip {
					label = 1 - label
				}
				v, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("rec-%d", n+i), "features": data.X[k], "label": label})
				if (n+i)%40 == 39 {
					v = []byte(`{"id":"bad","features":[1,2]}`)
				}
				msgs[i] = kafka.Message{Value: v}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			err := w.WriteMessages(ctx, msgs...)
			cancel()
			if err != nil {
				s.Err = err
				return
			}
			s.Mu.Lock()
			s.Produced += len(msgs)
			s.Mu.Unlock()
		}
	}()
	return s
}

func (s *RecordStream) End(t *testing.T) int {
	t.Helper()
	close(s.Stop)
	<-s.Done
	if s.Err != nil {
		t.Fatalf("producing records: %v", s.Err)
	}
	return s.Produced
}

// StreamingCluster is what StreamingReplicas started.
type StreamingCluster struct {
	Brokers        []string
	Root, ModelDir string // the replicas' parent directory (its cluster key) and the model's
	Data           *dataset.Set
	Reps           []*ReplicaProc
	Stream         *RecordStream
}

// StreamingReplicas starts a three-node broker, two replica processes of a model trained on
// the bundled data, and a stream of its records, and waits until the posterior log covers 64 of
// them.
func StreamingReplicas(t *testing.T) StreamingCluster {
	t.Helper()
	c := StreamingCluster{Brokers: StartClusterBroker(t), Root: t.TempDir()}
	c.Data, _, c.ModelDir = TrainModel(t, c.Root)
	c.Reps = StartReplicas(t, c.Root, 2, c.Brokers, c.ModelDir)
	c.Stream = StartStream(c.Brokers, c.Data)
	best := int64(0) // the most the replica said the log covers
	waitfor.Progress(t, 60*time.Second, "the log to cover 64 records", func() (bool, string) {
		if v, ok := c.Reps[0].View(); ok {
			best = max(best, Covered(v))
		}
		return best >= 64, fmt.Sprintf("covers %d", best)
	})
	return c
}

// WaitAgree waits until every live replica answers with the same entry and posterior hash,
// covering want records when want >= 0, and returns the common view.
func WaitAgree(t *testing.T, what string, live []*ReplicaProc, want int) ModelView {
	t.Helper()
	var v0 ModelView
	// The replicas apply the records at the CPU they get: the wait fails when no replica moves for
	// 90 s, not after a total time.
	waitfor.Progress(t, 90*time.Second, what+": the replicas agree", func() (bool, string) {
		var state strings.Builder
		agree := true
		for i, r := range live {
			v, ok := r.View()
			if !ok {
				agree = false
				continue
			}
			fmt.Fprintf(&state, "%s: entry %d covers %d; ", r.ID, v.Replication.Entry, Covered(v))
			if i == 0 {
				v0 = v
				agree = want < 0 || Covered(v0) == int64(want)
			} else if v.Replication.Entry != v0.Replication.Entry || v.Replication.SHA != v0.Replication.SHA || v.Version != v0.Version {
				agree = false
			}
		}
		return agree, state.String()
	})
	return v0
}

func Covered(v ModelView) int64 {
	n := int64(0)
	for _, to := range v.Replication.Covers {
		n += to
	}
	return n
}

// UpdaterOf waits until exactly one live replica says it is the updater, of a term above
// minTerm, and returns it.
func UpdaterOf(t *testing.T, live []*ReplicaProc, minTerm uint64, within time.Duration) *ReplicaProc {
	t.Helper()
	var u *ReplicaProc
	waitfor.Cond(t, within, fmt.Sprintf("an updater of a term above %d", minTerm), func() bool {
		u = nil
		for _, r := range live {
			if v, ok := r.View(); ok && v.Replication.Updater && v.Replication.Term > minTerm {
				if u != nil {
					return false
				}
				u = r
			}
		}
		return u != nil
	})
	return u
}

// StartClusterBroker runs `cfguard broker` with three nodes, the daemon's topics in three
// partitions and a group min session timeout of 1 s (the replicas' is ReplicaSession), and
// returns its nodes' addresses.
func StartClusterBroker(t *testing.T) []string {
	t.Helper()
	_, brokers := StartBrokerCmd(t, "--listen", "127.0.0.1:0", "--nodes", "3", "--partitions", "3",
		"--topics", "cfguard.records,cfguard.records.dlq,cfguard.events", "--group-min-session-timeout", "1s")
	return brokers
}

// StartReplicas starts n replicas (r1, r2, ...) against brokers with the extra configuration,
// and logs their output if the test fails.
func StartReplicas(t *testing.T, root string, n int, brokers []string, modelDir string, extra ...string) []*ReplicaProc {
	t.Helper()
	reps := make([]*ReplicaProc, n)
	for i := range reps {
		id := fmt.Sprintf("r%d", i+1)
		dir := filepath.Join(root, id)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		reps[i] = &ReplicaProc{ID: id, Dir: dir, Config: WriteReplicaConfig(t, dir, id, brokers, modelDir, extra...)}
	}
	for _, r := range reps {
		r.Start(t)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, r := range reps {
				t.Logf("%s's log:\n%s", r.ID, r.Child.Log.String())
			}
		}
	})
	return reps
}

// GetCE reads GET /v1/counterfactuals/{id} at r.
func (r *ReplicaProc) GetCE(id string) (int, []byte) {
	code, b, _ := r.GetCEAnswer(id)
	return code, b
}

// GetCEAnswer is GetCE with the answer's Retry-After header ("" when it has none).
func (r *ReplicaProc) GetCEAnswer(id string) (code int, body []byte, retryAfter string) {
	cl := http.Client{Timeout: 15 * time.Second}
	resp, err := cl.Get("http://" + r.Child.Addr() + "/v1/counterfactuals/" + id)
	if err != nil {
		return 0, []byte(err.Error()), ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b, resp.Header.Get("Retry-After")
}

// VerifyLog runs `cfguard verify-log` on a replica's configuration and checks that every
// increment (want of them, when want >= 0) re-executes to its entry's bits.
func VerifyLog(t *testing.T, cfg string, want int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := command.Run(context.Background(), []string{"verify-log", "--config", cfg}, &out, &errOut)
	var rep struct {
		Increments, Matched      int
		Mismatches, Unverifiable []json.RawMessage
	}
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil || code != 0 {
		t.Fatalf("cfguard verify-log: exit %d, %v:\n%s\n%s", code, err, out.String(), errOut.String())
	}
	if rep.Matched != rep.Increments || len(rep.Mismatches)+len(rep.Unverifiable) > 0 || (want >= 0 && rep.Increments != want) || rep.Increments == 0 {
		t.Errorf("verify-log: %s", out.String())
	}
	t.Logf("verify-log: %d increments re-executed from their input records to their entries' bits", rep.Matched)
}

// Metric reads one series (name with its labels, as exposed) from r's /metrics; ok is false
// when r does not answer or lacks it.
func (r *ReplicaProc) Metric(series string) (float64, bool) {
	v := r.Child.MetricValues(series)[0]
	return v, v >= 0
}

// Stored is how many CEs r's ledger holds (every status), -1 when r does not answer.
func (r *ReplicaProc) Stored() int {
	n := 0
	for _, st := range []string{"certified", "at_risk", "invalidated", "uncertified"} {
		v, ok := r.Metric(`cfguard_counterfactuals{status="` + st + `"}`)
		if !ok {
			return -1
		}
		n += int(v)
	}
	return n
}

// CPU is r's process_cpu_seconds_total.
func (r *ReplicaProc) CPU(t *testing.T) float64 {
	t.Helper()
	v, ok := r.Metric("process_cpu_seconds_total")
	if !ok {
		t.Fatalf("%s: no process_cpu_seconds_total", r.ID)
	}
	return v
}

// Ready reports whether r answers /readyz 200.
func (r *ReplicaProc) Ready() bool {
	addr := r.Child.Addr()
	if addr == "" {
		return false
	}
	cl := http.Client{Timeout: 2 * time.Second}
	resp, err := cl.Get("http://" + addr + "/readyz")
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// Audit runs POST /v1/audit at r and returns how many CEs it evaluated.
func (r *ReplicaProc) Audit(t *testing.T) int {
	t.Helper()
	cl := http.Client{Timeout: 30 * time.Minute}
	resp, err := cl.Post("http://"+r.Child.Addr()+"/v1/audit", "application/json", nil)
	if err != nil {
		t.Fatalf("%s: POST /v1/audit: %v", r.ID, err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var rep struct{ Evaluated int }
	if resp.StatusCode != http.StatusOK || json.Unmarshal(raw, &rep) != nil {
		t.Fatalf("%s: POST /v1/audit: %d %s", r.ID, resp.StatusCode, raw)
	}
	// GET /v1/audit says it is over.
	resp, err = cl.Get("http://" + r.Child.Addr() + "/v1/audit")
	if err != nil {
		t.Fatal(err)
	}
	raw, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	var st struct{ Running bool }
	if json.Unmarshal(raw, &st) != nil || st.Running {
		t.Fatalf("%s: GET /v1/audit after the audit answered: %s", r.ID, raw)
	}
	return rep.Evaluated
}

// CEPartitions is the CE partitions r owns (GET /v1/model .replication.ce_partitions).
func (r *ReplicaProc) CEPartitions() ([]int, bool) {
	v, ok := r.View()
	return v.Replication.CEPartitions, ok
}
