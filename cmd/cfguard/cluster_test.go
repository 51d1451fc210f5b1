package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
)

// Replicas in these tests: the updater group's session is short so that takeovers are quick;
// the broker's group.min.session.timeout.ms is lowered to allow it.
const (
	replicaSession   = 3 * time.Second
	replicaHeartbeat = 300 * time.Millisecond
)

// replicaProc is one `cfguard run` process of a replicated deployment.
type replicaProc struct {
	id, dir, cfg string
	c            *child
}

// modelView is what GET /v1/model says of a replica.
type modelView struct {
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

// clusterKey returns the cluster key file of the replicas under root, written on the first call.
func clusterKey(t *testing.T, root string) string {
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

// writeReplicaConfig writes the configuration of replica id in dir; the replicas whose
// directories share a parent share its cluster key (clusterKey).
func writeReplicaConfig(t *testing.T, dir, id string, brokers []string, modelDir string, extra ...string) string {
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
`, anyPort, filepath.Join(dir, "state"), modelDir, strings.Join(brokers, ", "), id, replicaSession, replicaHeartbeat, clusterKey(t, filepath.Dir(dir)))
	cfg += strings.Join(extra, "")
	p := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(p, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func (r *replicaProc) start(t *testing.T) {
	t.Helper()
	r.c = startChild(t, r.cfg, anyPort)
	waitfor.Cond(t, 60*time.Second, r.id+" ready", func() bool {
		if r.c.exited() {
			t.Fatalf("%s exited: %s", r.id, r.c.log.String())
		}
		addr := r.c.addr()
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

// predict asks the replica for a prediction of x and returns the posterior version it answered
// under; anything but a 200 fails the test.
func (r *replicaProc) predict(t *testing.T, x []float64) uint64 {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"x": x})
	cl := http.Client{Timeout: 10 * time.Second}
	resp, err := cl.Post("http://"+r.c.addr()+"/v1/predict", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatalf("%s: POST /v1/predict: %v", r.id, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: POST /v1/predict: %d %s", r.id, resp.StatusCode, b)
	}
	var answer struct {
		Version *uint64 `json:"posterior_version"`
	}
	if err := json.Unmarshal(b, &answer); err != nil || answer.Version == nil {
		t.Fatalf("%s: POST /v1/predict: no posterior_version in %s (%v)", r.id, b, err)
	}
	return *answer.Version
}

// view reads GET /v1/model; ok is false while the replica does not answer.
func (r *replicaProc) view() (modelView, bool) {
	var v modelView
	addr := r.c.addr()
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

// signal sends sig to the replica's process.
func (r *replicaProc) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := r.c.cmd.Process.Signal(sig); err != nil {
		t.Fatalf("%s: %v", r.id, err)
	}
}

// terminate stops the replica with SIGTERM and checks it exits 0.
func (r *replicaProc) terminate(t *testing.T) {
	t.Helper()
	r.signal(t, syscall.SIGTERM)
	if code := exitOf(t, r.c, 30*time.Second); code != 0 {
		t.Fatalf("%s exited %d after SIGTERM:\n%s", r.id, code, r.c.log.String())
	}
}

// kill stops the replica with SIGKILL.
func (r *replicaProc) kill(t *testing.T) {
	t.Helper()
	r.signal(t, syscall.SIGKILL)
	r.c.wait()
}

// recordStream produces labelled records (every 40th one invalid, for the dead-letter topic) until
// stopped, and counts them.
type recordStream struct {
	mu       sync.Mutex
	produced int
	stop     chan struct{}
	done     chan struct{}
	err      error
}

// streamEvery is how often the tests' record streams produce 16 records: 80 records a second,
// two or three increments of max_records 32. Each increment costs every replica a posterior and
// its predictive pools, so the rate, more than a test's length, sets a replica test's CPU.
const streamEvery = 200 * time.Millisecond

// startStream produces 16 records every streamEvery.
func startStream(brokers []string, data *dataset.Set) *recordStream {
	return startStreamFlip(brokers, data, false, streamEvery)
}

// startStreamFlip produces 16 records every period, with every label flipped when flip is set:
// the drift of a model learning the opposite of what it knew.
func startStreamFlip(brokers []string, data *dataset.Set, flip bool, every time.Duration) *recordStream {
	s := &recordStream{stop: make(chan struct{}), done: make(chan struct{})}
	tr := &kafka.Transport{} // not kafka.DefaultTransport: see kafkatest.Transport
	w := &kafka.Writer{Transport: tr, Addr: kafka.TCP(brokers...), Topic: "cfguard.records", Balancer: &kafka.RoundRobin{},
		RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond, BatchSize: 64}
	go func() {
		defer close(s.done)
		defer tr.CloseIdleConnections()
		defer w.Close()
		tick := time.NewTicker(every)
		defer tick.Stop()
		for {
			select {
			case <-s.stop:
				return
			case <-tick.C:
			}
			s.mu.Lock()
			n := s.produced
			s.mu.Unlock()
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
				s.err = err
				return
			}
			s.mu.Lock()
			s.produced += len(msgs)
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *recordStream) end(t *testing.T) int {
	t.Helper()
	close(s.stop)
	<-s.done
	if s.err != nil {
		t.Fatalf("producing records: %v", s.err)
	}
	return s.produced
}

// streamingCluster is what streamingReplicas started.
type streamingCluster struct {
	brokers        []string
	root, modelDir string // the replicas' parent directory (its cluster key) and the model's
	data           *dataset.Set
	reps           []*replicaProc
	s              *recordStream
}

// streamingReplicas starts a three-node broker, two replica processes of a model trained on
// the bundled data, and a stream of its records, and waits until the posterior log covers 64 of
// them.
func streamingReplicas(t *testing.T) streamingCluster {
	t.Helper()
	c := streamingCluster{brokers: startClusterBroker(t), root: t.TempDir()}
	c.data, _, c.modelDir = trainModel(t, c.root)
	c.reps = startReplicas(t, c.root, 2, c.brokers, c.modelDir)
	c.s = startStream(c.brokers, c.data)
	best := int64(0) // the most the replica said the log covers
	waitfor.Progress(t, 60*time.Second, "the log to cover 64 records", func() (bool, string) {
		if v, ok := c.reps[0].view(); ok {
			best = max(best, covered(v))
		}
		return best >= 64, fmt.Sprintf("covers %d", best)
	})
	return c
}

// waitAgree waits until every live replica answers with the same entry and posterior hash,
// covering want records when want >= 0, and returns the common view.
func waitAgree(t *testing.T, what string, live []*replicaProc, want int) modelView {
	t.Helper()
	var v0 modelView
	// The replicas apply the records at the CPU they get: the wait fails when no replica moves for
	// 90 s, not after a total time.
	waitfor.Progress(t, 90*time.Second, what+": the replicas agree", func() (bool, string) {
		var state strings.Builder
		agree := true
		for i, r := range live {
			v, ok := r.view()
			if !ok {
				agree = false
				continue
			}
			fmt.Fprintf(&state, "%s: entry %d covers %d; ", r.id, v.Replication.Entry, covered(v))
			if i == 0 {
				v0 = v
				agree = want < 0 || covered(v0) == int64(want)
			} else if v.Replication.Entry != v0.Replication.Entry || v.Replication.SHA != v0.Replication.SHA || v.Version != v0.Version {
				agree = false
			}
		}
		return agree, state.String()
	})
	return v0
}

func covered(v modelView) int64 {
	n := int64(0)
	for _, to := range v.Replication.Covers {
		n += to
	}
	return n
}

// updaterOf waits until exactly one live replica says it is the updater, of a term above
// minTerm, and returns it.
func updaterOf(t *testing.T, live []*replicaProc, minTerm uint64, within time.Duration) *replicaProc {
	t.Helper()
	var u *replicaProc
	waitfor.Cond(t, within, fmt.Sprintf("an updater of a term above %d", minTerm), func() bool {
		u = nil
		for _, r := range live {
			if v, ok := r.view(); ok && v.Replication.Updater && v.Replication.Term > minTerm {
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

// readLog reads the whole posterior topic and replays it through an independent chain: it
// returns the accepted entries, the records not accepted, and the posterior of every version
// (the genesis body and the recorded last layers, each checked against its entry's hash).
func readLog(t *testing.T, brokers []string, keyFile string) (accepted, ignored []*postlog.Entry, posteriors map[uint64]*bnn.Model) {
	t.Helper()
	keys, err := clusterkey.Load(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	chain := postlog.NewChain(keys)
	posteriors = map[uint64]*bnn.Model{}
	var m *bnn.Model
	for _, msg := range kafkatest.ReadPartition(t, brokers, "cfguard.posterior", 0) {
		rec := postlog.Record{Offset: msg.Offset, Value: msg.Value}
		for _, h := range msg.Headers {
			if h.Key == clusterkey.Header {
				rec.Auth = h.Value
			}
		}
		e, reason, err := chain.Offer(rec)
		if err != nil {
			t.Fatal(err)
		}
		if reason != postlog.Accepted {
			if e != nil {
				ignored = append(ignored, e)
			}
			continue
		}
		if e.Kind == postlog.Genesis {
			if m, err = e.Body.Model(e.PosteriorSHA256); err != nil {
				t.Fatal(err)
			}
		} else if m, err = e.Apply(m); err != nil {
			t.Fatalf("entry %d: %v", e.Seq, err)
		}
		posteriors[m.Version] = m
		accepted = append(accepted, e)
	}
	return accepted, ignored, posteriors
}

// TestReplicasAsProcesses runs three replicas as processes against a three-node broker process
// while records stream, through the faults a Deployment meets: SIGKILL and SIGSTOP of the
// updater, a rolling restart, a wiped replica and a restored backup. After each, every replica
// applies the same entries to the same posterior bit for bit, and at the end the log covers every
// record produced exactly once.
func TestReplicasAsProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("three replica processes through faults: not with -short")
	}
	root := t.TempDir()
	data, model, modelDir := trainModel(t, root)
	brokers := startClusterBroker(t)
	reps := startReplicas(t, root, 3, brokers, modelDir)
	ces := registerRoundRobin(t, reps, data, model, 12)
	s := startStream(brokers, data)
	defer func() {
		select {
		case <-s.done:
		default:
			s.end(t)
		}
	}()
	waitfor.Cond(t, 60*time.Second, "records applied", func() bool { v, ok := reps[0].view(); return ok && v.Version >= 3 })
	v := waitAgree(t, "streaming", reps, -1)
	others := func(r *replicaProc) []*replicaProc {
		return slices.DeleteFunc(slices.Clone(reps), func(o *replicaProc) bool { return o == r })
	}

	// SIGKILL of the updater: another replica claims the next term once the group's session
	// expires, and goes on from the log's head.
	u := updaterOf(t, reps, 0, 30*time.Second)
	killed := time.Now()
	u.kill(t)
	// Meanwhile the others predict, under the last version each applied (a session's wait).
	during := 0
	for _, r := range others(u) {
		before, ok := r.view()
		if !ok {
			t.Fatalf("%s does not answer GET /v1/model after the updater's SIGKILL", r.id)
		}
		got := r.predict(t, data.X[0])
		after, _ := r.view()
		if got < before.Version || got > after.Version {
			t.Errorf("%s predicted under posterior version %d after the updater's SIGKILL, between views of versions %d and %d", r.id, got, before.Version, after.Version)
		}
		if after.Replication.Term == v.Replication.Term {
			during++
		}
	}
	t.Logf("%d of %d predictions after the updater's SIGKILL answered before another replica claimed its term", during, len(reps)-1)
	next := updaterOf(t, others(u), v.Replication.Term, 3*replicaSession+10*time.Second)
	t.Logf("takeover after SIGKILL of %s: %s became updater in %v (session timeout %v)", u.id, next.id, time.Since(killed).Round(time.Millisecond), replicaSession)
	u.start(t)
	v = waitAgree(t, "after SIGKILL", reps, -1)

	// SIGSTOP of the updater past its session: another takes over; SIGCONT: the resumed one's
	// term is over, and whatever it appends is ignored by every replica (no fork).
	u = updaterOf(t, reps, 0, 30*time.Second)
	stoppedTerm := v.Replication.Term
	if uv, ok := u.view(); ok {
		stoppedTerm = uv.Replication.Term
	}
	paused := time.Now()
	u.signal(t, syscall.SIGSTOP)
	next = updaterOf(t, others(u), stoppedTerm, 3*replicaSession+10*time.Second)
	t.Logf("takeover after SIGSTOP of %s: %s became updater in %v", u.id, next.id, time.Since(paused).Round(time.Millisecond))
	waitfor.Cond(t, 30*time.Second, "entries of the new term", func() bool {
		nv, ok := next.view()
		return ok && nv.Replication.Entry > v.Replication.Entry+2
	})
	u.signal(t, syscall.SIGCONT)
	v = waitAgree(t, "after SIGSTOP and SIGCONT", reps, -1)

	// A rolling restart while records stream.
	for _, r := range reps {
		r.terminate(t)
		r.start(t)
	}
	v = waitAgree(t, "after a rolling restart", reps, -1)

	// A replica wiped and restarted rebuilds from Kafka.
	wiped := reps[2]
	wiped.terminate(t)
	if err := os.RemoveAll(filepath.Join(wiped.dir, "state")); err != nil {
		t.Fatal(err)
	}
	wiped.start(t)
	v = waitAgree(t, "after a wiped replica rebuilt", reps, -1)

	// A backup restored while records stream: the restored replica replays the log's entries
	// after its backup's head, to the same posteriors.
	restored := reps[1]
	backup := filepath.Join(root, "r2.backup")
	var out, errOut bytes.Buffer
	if code := run(context.Background(), []string{"backup", "--config", restored.cfg, "--out", backup, "--url", "http://" + restored.c.addr()}, &out, &errOut); code != 0 {
		t.Fatalf("cfguard backup: %d: %s", code, errOut.String())
	}
	waitfor.Cond(t, 30*time.Second, "entries after the backup", func() bool {
		nv, ok := reps[0].view()
		return ok && nv.Replication.Entry > v.Replication.Entry+3
	})
	restored.terminate(t)
	if err := os.Rename(filepath.Join(restored.dir, "state"), filepath.Join(restored.dir, "state.aside")); err != nil {
		t.Fatal(err)
	}
	if code := run(context.Background(), []string{"restore", "--config", restored.cfg, "--from", backup}, io.Discard, &errOut); code != 0 {
		t.Fatalf("cfguard restore: %d: %s", code, errOut.String())
	}
	restored.start(t)

	produced := s.end(t)
	v = waitAgree(t, "at the end", reps, produced)

	// Every CE reads the same at every replica after the faults: held by one owner, found by
	// all (its owner may still be confirming the last versions: the answers settle).
	for _, id := range ces {
		sameEverywhere(t, reps, id)
	}

	// Coverage: every record produced was applied or dead-lettered, once.
	for _, r := range reps {
		rv, _ := r.view()
		if rv.Replication.Stopped != "" {
			t.Errorf("%s stopped following: %s", r.id, rv.Replication.Stopped)
		}
	}
	accepted, ignored, _ := readLog(t, brokers, clusterKey(t, root))
	var applied, dead int64
	claims := map[uint64]string{}
	for _, e := range accepted {
		if e.Counts != nil {
			applied += e.Counts.Applied
			dead += e.Counts.DeadLettered
		}
		switch e.Kind {
		case postlog.Claim:
			if _, dup := claims[e.Term]; dup {
				t.Errorf("two accepted claims of term %d", e.Term)
			}
			claims[e.Term] = e.Writer
		case postlog.Increment:
			if claims[e.Term] != e.Writer {
				t.Errorf("entry %d of term %d written by %s, the term's claimant is %s", e.Seq, e.Term, e.Writer, claims[e.Term])
			}
		}
	}
	if applied+dead != int64(produced) || dead != int64(produced/40) {
		t.Errorf("the log applies %d and dead-letters %d records, want %d in all with %d dead letters", applied, dead, produced, produced/40)
	}
	last := accepted[len(accepted)-1]
	if last.PosteriorSHA256 != v.Replication.SHA || last.Seq != v.Replication.Entry {
		t.Errorf("an independent replay of the log ends at entry %d, posterior %s; the replicas are at %d, %s", last.Seq, last.PosteriorSHA256, v.Replication.Entry, v.Replication.SHA)
	}
	// The replicas' KL histories (version and KL of each update) are the same record for record.
	h0, _ := reps[0].view()
	for _, r := range reps[1:] {
		rv, _ := r.view()
		if !slices.EqualFunc(h0.KLHistory, rv.KLHistory, func(a, b json.RawMessage) bool { return klKey(a) == klKey(b) }) {
			t.Errorf("%s's KL history differs from %s's", r.id, reps[0].id)
		}
	}
	t.Logf("%d records produced, %d applied, %d dead-lettered; %d entries accepted over %d terms, %d records ignored; posterior version %d (%s)",
		produced, applied, dead, len(accepted), len(claims), len(ignored), v.Version, v.Replication.SHA[:12])
	// Every increment re-executes from the input records it covers to its entry's bits.
	verifyLog(t, reps[0].cfg, len(accepted)-len(claims)-1)

	// The first claim, SIGKILL, SIGSTOP and the updater's turn in the rolling restart each open a term.
	if len(claims) < 4 {
		t.Errorf("%d terms: the faults should have made at least 4", len(claims))
	}
}

// klKey is what an entry of the KL history says of the update (the version, its KL and
// outcome); the time and the anchors' KL are the replica's own.
func klKey(raw json.RawMessage) string {
	var e struct {
		Version uint64  `json:"posterior_version"`
		KL      float64 `json:"kl"`
		Outcome string  `json:"outcome"`
	}
	if json.Unmarshal(raw, &e) != nil {
		return string(raw)
	}
	return fmt.Sprintf("%d %x %s", e.Version, e.KL, e.Outcome)
}

// startClusterBroker runs `cfguard broker` with three nodes, the daemon's topics in three
// partitions and a group min session timeout of 1 s (the replicas' is replicaSession), and
// returns its nodes' addresses.
func startClusterBroker(t *testing.T) []string {
	t.Helper()
	_, brokers := startBrokerCmd(t, "--listen", "127.0.0.1:0", "--nodes", "3", "--partitions", "3",
		"--topics", "cfguard.records,cfguard.records.dlq,cfguard.events", "--group-min-session-timeout", "1s")
	return brokers
}

// startReplicas starts n replicas (r1, r2, ...) against brokers with the extra configuration,
// and logs their output if the test fails.
func startReplicas(t *testing.T, root string, n int, brokers []string, modelDir string, extra ...string) []*replicaProc {
	t.Helper()
	reps := make([]*replicaProc, n)
	for i := range reps {
		id := fmt.Sprintf("r%d", i+1)
		dir := filepath.Join(root, id)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		reps[i] = &replicaProc{id: id, dir: dir, cfg: writeReplicaConfig(t, dir, id, brokers, modelDir, extra...)}
	}
	for _, r := range reps {
		r.start(t)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, r := range reps {
				t.Logf("%s's log:\n%s", r.id, r.c.log.String())
			}
		}
	})
	return reps
}

// registerRoundRobin registers n CEs (ce-0, ce-1, ...) at the replicas in turn and returns their ids.
func registerRoundRobin(t *testing.T, reps []*replicaProc, data *dataset.Set, model *bnn.Model, n int) []string {
	t.Helper()
	xs, cfs := candidatePairs(t, model, data, 400, 0.985, 0.002, true)
	if len(xs) < n || len(cfs) < n {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	var ids []string
	for k := range n {
		id := fmt.Sprintf("ce-%d", k)
		body, _ := json.Marshal(map[string]any{"id": id, "x": data.X[xs[k]], "x_cf": data.X[cfs[k]], "target": "benign"})
		r := reps[k%len(reps)]
		resp, err := http.Post("http://"+r.c.addr()+"/v1/counterfactuals", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("register %s at %s: %d %s", id, r.id, resp.StatusCode, b)
		}
		ids = append(ids, id)
	}
	return ids
}

// sameEverywhere waits until every replica answers GET /v1/counterfactuals/{id} with 200 and
// the same bytes in one pass, and returns them.
func sameEverywhere(t *testing.T, reps []*replicaProc, id string) []byte {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var first []byte
		last := ""
		for _, r := range reps {
			code, b := r.getCE(id)
			switch {
			case code != http.StatusOK:
				last = fmt.Sprintf("%s answers %d %s", r.id, code, b)
			case first == nil:
				first = b
			case !bytes.Equal(first, b):
				last = fmt.Sprintf("%s answers\n%s\n%s answered\n%s", r.id, b, reps[0].id, first)
			}
			if last != "" {
				break
			}
		}
		if last == "" {
			return first
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s does not read the same at every replica within 30 s: %s", id, last)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// getCE reads GET /v1/counterfactuals/{id} at r.
func (r *replicaProc) getCE(id string) (int, []byte) {
	cl := http.Client{Timeout: 15 * time.Second}
	resp, err := cl.Get("http://" + r.c.addr() + "/v1/counterfactuals/" + id)
	if err != nil {
		return 0, []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// TestReplicaOwnerKilledDuringDrift registers CEs round-robin at three replicas, streams records
// that teach the model the opposite labels, and SIGKILLs one replica mid-drift. Its CE
// partitions move; afterwards every CE is readable at every replica with one answer, its bound
// is Theorem 1 recomputed from the posterior log (the anchor it was measured under against the
// last posterior), and its status is the one the newest status change on the events topic
// names.
func TestReplicaOwnerKilledDuringDrift(t *testing.T) {
	if testing.Short() {
		t.Skip("three replica processes and a drift: not with -short")
	}
	root := t.TempDir()
	data, model, modelDir := trainModel(t, root)
	brokers := startClusterBroker(t)
	reps := startReplicas(t, root, 3, brokers, modelDir, "update:\n  solver: adam\n  objective: prior\n  kl_weight: 0\n  memory_records: 0\n  learning_rate: 0.003\n")

	const n = 24
	registerRoundRobin(t, reps, data, model, n)
	s := startStreamFlip(brokers, data, true, streamEvery)
	defer func() {
		select {
		case <-s.done:
		default:
			s.end(t)
		}
	}()
	waitfor.Cond(t, 60*time.Second, "the drift under way", func() bool { v, ok := reps[0].view(); return ok && v.Version >= 5 })
	victim := reps[1]
	killed := time.Now()
	victim.kill(t)
	live := []*replicaProc{reps[0], reps[2]}
	waitfor.Cond(t, 3*replicaSession+20*time.Second, "every CE readable at the live replicas", func() bool {
		for _, r := range live {
			for k := range n {
				if code, _ := r.getCE(fmt.Sprintf("ce-%d", k)); code != http.StatusOK {
					return false
				}
			}
		}
		return true
	})
	t.Logf("the killed owner's CEs answered again after %v", time.Since(killed).Round(time.Millisecond))
	// Each CE keeps what the dead owner last wrote of it on the CE state topic: its anchor is that
	// state's or a renewal's since, and its history holds that state's.
	written := lastStatesOf(t, brokers, victim.id)
	if len(written) == 0 {
		t.Fatalf("%s wrote no CE state before its SIGKILL", victim.id)
	}
	entries := 0
	for id, was := range written {
		entries += len(was.History)
		code, b := live[0].getCE(id)
		var now ceState
		if code != http.StatusOK || json.Unmarshal(b, &now) != nil {
			t.Fatalf("GET %s after the move: %d %s", id, code, b)
		}
		if now.AnchorVersion < was.AnchorVersion {
			t.Errorf("%s: anchored to version %d after the move; %s's last state of it was anchored to %d", id, now.AnchorVersion, victim.id, was.AnchorVersion)
		}
		for _, h := range was.History {
			if !slices.Contains(now.History, h) {
				t.Errorf("%s: its history after the move lacks %+v of %s's last state", id, h, victim.id)
			}
		}
	}
	t.Logf("%d CEs whose last state %s wrote holds %d history entries: each kept them when it moved", len(written), victim.id, entries)
	victim.start(t)
	produced := s.end(t)
	v := waitAgree(t, "after the drift", reps, produced)
	// The restarted victim's ledger still held the partitions that moved: it releases those it
	// is not given back, so that each CE is in one ledger (one replica re-certifies, confirms
	// and audits it).
	waitfor.Cond(t, 60*time.Second, "each CE in one replica's ledger", func() bool {
		sum := 0
		for _, r := range reps {
			k := r.stored()
			if k < 0 {
				return false
			}
			sum += k
		}
		return sum == n
	})
	// Let the owners confirm what the drift made lapse, then read every CE at every replica.
	waitfor.Cond(t, 60*time.Second, "no renewal pending", func() bool {
		for k := range n {
			code, b := reps[0].getCE(fmt.Sprintf("ce-%d", k))
			if code != http.StatusOK || bytes.Contains(b, []byte(`"renewal_pending":true`)) {
				return false
			}
		}
		return true
	})
	_, _, posteriors := readLog(t, brokers, clusterKey(t, root))
	last := posteriors[v.Version]
	events := readEvents(t, brokers)
	statuses := map[string]int{}
	for k := range n {
		id := fmt.Sprintf("ce-%d", k)
		first := sameEverywhere(t, reps, id)
		var ce struct {
			Status        string  `json:"status"`
			AnchorVersion uint64  `json:"anchor_version"`
			P1            float64 `json:"p1"`
			Var1          float64 `json:"var1"`
			Samples       int     `json:"samples"`
			Delta         float64 `json:"delta"`
			Epsilon       float64 `json:"epsilon"`
			Bound         float64 `json:"bound"`
			KL            float64 `json:"kl_from_anchor"`
		}
		if err := json.Unmarshal(first, &ce); err != nil {
			t.Fatal(err)
		}
		statuses[ce.Status]++
		if ce.Status != "uncertified" {
			anchor, ok := posteriors[ce.AnchorVersion]
			if !ok {
				t.Fatalf("%s is anchored to version %d, which the log does not hold", id, ce.AnchorVersion)
			}
			kl, _, err := certify.KL(last, anchor)
			if err != nil {
				t.Fatal(err)
			}
			b := certify.DefaultPolicy().Bounds(certify.Certificate{P1: ce.P1, Var1: ce.Var1, Samples: ce.Samples, Delta: ce.Delta, Epsilon: ce.Epsilon}, kl)
			if ce.KL != kl || ce.Bound != b.ProbLower {
				t.Errorf("%s: KL %v and bound %v at its owner; from the log, KL(q%d || q%d) = %v and bound %v", id, ce.KL, ce.Bound, v.Version, ce.AnchorVersion, kl, b.ProbLower)
			}
		}
		if got, ok := events[id]; ce.Status != "certified" && (!ok || got.To != ce.Status) {
			t.Errorf("%s is %s; the newest status change on the events topic says %+v (found: %v)", id, ce.Status, got, ok)
		}
	}
	t.Logf("after the drift (%d records, posterior version %d): %v", produced, v.Version, statuses)
	verifyLog(t, reps[0].cfg, -1)
	if statuses["certified"] == n {
		t.Error("the drift changed no status: the test tests nothing")
	}
}

// verifyLog runs `cfguard verify-log` on a replica's configuration and checks that every
// increment (want of them, when want >= 0) re-executes to its entry's bits.
func verifyLog(t *testing.T, cfg string, want int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := run(context.Background(), []string{"verify-log", "--config", cfg}, &out, &errOut)
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

// ceState is what TestReplicaOwnerKilledDuringDrift compares of a CE before and after it moved:
// its anchor and its history, as GET /v1/counterfactuals/{id} and the CE state topic hold them.
type ceState struct {
	AnchorVersion uint64 `json:"anchor_version"`
	History       []struct {
		At, From, To     string
		PosteriorVersion uint64 `json:"posterior_version"`
		Renewal          bool   `json:"renewal"`
	} `json:"history"`
}

// lastStatesOf reads the CE state topic (every partition of the default cfguard.ce.state) to
// its end and returns, per CE, the last state replica wrote of it (tombstones end a CE's).
func lastStatesOf(t *testing.T, brokers []string, replica string) map[string]ceState {
	t.Helper()
	out := map[string]ceState{}
	for p := range 12 { // replication.ce_partitions' default
		for _, msg := range kafkatest.ReadPartition(t, brokers, "cfguard.ce.state", p) {
			if msg.Value == nil {
				delete(out, string(msg.Key))
				continue
			}
			var st struct {
				ID      string   `json:"id"`
				Replica string   `json:"replica"`
				CE      *ceState `json:"ce"`
			}
			if err := json.Unmarshal(msg.Value, &st); err != nil || st.ID != string(msg.Key) || st.CE == nil {
				continue // a claim of the partition
			}
			if st.Replica == replica {
				out[st.ID] = *st.CE
			}
		}
	}
	return out
}

// statusEvent is a status change on the events topic.
type statusEvent struct {
	Type             string `json:"type"`
	ID               string `json:"id"`
	From, To         string
	PosteriorVersion uint64 `json:"posterior_version"`
}

// readEvents reads the events topic to its end and returns, per CE, the status change of the
// newest posterior version (the last published among equals).
func readEvents(t *testing.T, brokers []string) map[string]statusEvent {
	t.Helper()
	out := map[string]statusEvent{}
	for p := 0; p < 3; p++ {
		for _, msg := range kafkatest.ReadPartition(t, brokers, "cfguard.events", p) {
			var e statusEvent
			if json.Unmarshal(msg.Value, &e) != nil || e.Type != "status_changed" {
				continue
			}
			if old, ok := out[e.ID]; !ok || e.PosteriorVersion >= old.PosteriorVersion {
				out[e.ID] = e
			}
		}
	}
	return out
}
