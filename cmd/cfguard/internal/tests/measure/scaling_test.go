package measure

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// requireMeasure skips the test unless CFGUARD_MEASURE_REPLICAS=1.
func requireMeasure(t *testing.T) {
	t.Helper()
	if os.Getenv("CFGUARD_MEASURE_REPLICAS") != "1" {
		t.Skip("a measurement of replica processes: set CFGUARD_MEASURE_REPLICAS=1 to run it")
	}
}

// measureCluster is a broker process, the model the replicas start from, and the data set.
type measureCluster struct {
	Root     string
	Data     *dataset.Set
	model    *bnn.Model
	ModelDir string
	Brokers  []string
	broker   *proc.BrokerProc
}

func newMeasureCluster(t *testing.T) *measureCluster {
	t.Helper()
	root := t.TempDir()
	data, model, modelDir := proc.TrainModel(t, root)
	b, brokers := proc.StartBrokerCmd(t, "--listen", "127.0.0.1:0", "--nodes", "3", "--partitions", "3",
		"--topics", "cfguard.records,cfguard.records.dlq,cfguard.events", "--group-min-session-timeout", "1s")
	return &measureCluster{Root: root, Data: data, model: model, ModelDir: modelDir, Brokers: brokers, broker: b}
}

// brokerCPU is the CPU seconds (user and system) the broker process has used (tooltest.CPU).
func (c *measureCluster) brokerCPU(t *testing.T) float64 {
	t.Helper()
	d, err := tooltest.CPU(c.broker.Cmd.Process.Pid)
	if err != nil {
		t.Fatalf("the broker's CPU time: %v", err)
	}
	return d.Seconds()
}

// measureSamples is certify.samples of the measured replicas, the process tests' value: at the
// default certify.delta and certify.verdict_alpha, a CE whose p1 is near 1 is certified only
// when its lower confidence bound, p1 - 7 ln(2/alpha) / (3 (samples - 1)) and a variance term,
// reaches 1 - delta, which 250 draws miss (0.9499 for p1 = 0.9997).
const measureSamples = 400

// replicas starts n replicas named prefix1..prefixN (in root/prefixK) with the extra
// configuration, samples networks per version instead of the process tests' 400.
func (c *measureCluster) replicas(t *testing.T, prefix string, n, samples int, extra ...string) []*proc.ReplicaProc {
	t.Helper()
	reps := make([]*proc.ReplicaProc, n)
	for i := range reps {
		reps[i] = c.replica(t, fmt.Sprintf("%s%d", prefix, i+1), samples, extra...)
	}
	t.Cleanup(func() { // before the starts: a replica that does not get ready shows its log
		if t.Failed() {
			for _, r := range reps {
				if r.Child != nil {
					t.Logf("%s's log:\n%s", r.ID, r.Child.Log.String())
				}
			}
		}
	})
	for _, r := range reps {
		r.Start(t)
	}
	return reps
}

// replica writes the configuration of one replica without starting it.
func (c *measureCluster) replica(t *testing.T, id string, samples int, extra ...string) *proc.ReplicaProc {
	t.Helper()
	dir := filepath.Join(c.Root, id)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := proc.WriteReplicaConfig(t, dir, id, c.Brokers, c.ModelDir, extra...)
	raw, err := os.ReadFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// proc.WriteReplicaConfig's certify block holds only samples: 400.
	raw = bytes.Replace(raw, []byte("  samples: 400\n"), fmt.Appendf(nil, "  samples: %d\n", samples), 1)
	if err := os.WriteFile(cfg, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	return &proc.ReplicaProc{ID: id, Dir: dir, Config: cfg}
}

// ceLines returns n registration requests (NDJSON lines, ids prefix-0..), each pairing a row the
// model puts in "malignant" with one it puts in "benign" with high confidence.
func (c *measureCluster) ceLines(t *testing.T, prefix string, n int) [][]byte {
	t.Helper()
	xs, cfs := proc.CandidatePairs(t, c.model, c.Data, 400, 0.985, 0.002, true)
	if len(xs) == 0 || len(cfs) == 0 {
		t.Fatalf("no candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	lines := make([][]byte, n)
	for k := range n {
		x, cf := xs[k%len(xs)], cfs[(k/len(xs))%len(cfs)]
		lines[k], _ = json.Marshal(map[string]any{"id": fmt.Sprintf("%s-%d", prefix, k), "x": c.Data.X[x], "x_cf": c.Data.X[cf], "target": "benign"})
	}
	return lines
}

// bulkRegister posts lines to POST /v1/counterfactuals:bulk at r, chunk lines a request, and
// fails the test unless every line is stored.
func bulkRegister(t *testing.T, r *proc.ReplicaProc, lines [][]byte, chunk int) {
	t.Helper()
	cl := http.Client{Timeout: 10 * time.Minute}
	for lo := 0; lo < len(lines); lo += chunk {
		hi := min(lo+chunk, len(lines))
		body := bytes.Join(lines[lo:hi], []byte("\n"))
		resp, err := cl.Post("http://"+r.Child.Addr()+"/v1/counterfactuals:bulk", "application/x-ndjson", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var out struct{ Stored, Exists, Refused int }
		if resp.StatusCode != http.StatusOK || json.Unmarshal(raw, &out) != nil || out.Stored != hi-lo {
			t.Fatalf("bulk registration of lines %d..%d at %s: %d %.500s", lo, hi, r.ID, resp.StatusCode, raw)
		}
	}
}

func cpus(t *testing.T, reps []*proc.ReplicaProc) []float64 {
	t.Helper()
	out := make([]float64, len(reps))
	for i, r := range reps {
		out[i] = r.CPU(t)
	}
	return out
}

// waitShared waits until the replicas' ledgers hold n CEs in all, none twice (the sum of their
// shares), and every replica is ready (no CE partition restoring).
func waitShared(t *testing.T, reps []*proc.ReplicaProc, n int, within time.Duration) {
	t.Helper()
	var seen []string
	defer func() {
		if t.Failed() {
			t.Logf("CEs stored, readiness and CE partitions per replica at the last look: %v", seen)
		}
	}()
	waitfor.Cond(t, within, fmt.Sprintf("%d CEs stored by their owners", n), func() bool {
		sum, all := 0, true
		seen = seen[:0]
		for _, r := range reps {
			k, ok := r.Stored(), r.Ready()
			parts, _ := r.CEPartitions()
			seen = append(seen, fmt.Sprintf("%s: %d %v %v", r.ID, k, ok, parts))
			all = all && k >= 0 && ok
			sum += k
		}
		return all && sum == n
	})
}

// produceRecords writes n labelled records from row from on (labels flipped when flip is set)
// to the records topic and returns when every one is acknowledged.
func (c *measureCluster) produceRecords(t *testing.T, from, n int, flip bool) {
	t.Helper()
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(c.Brokers...), Topic: "cfguard.records", Balancer: &kafka.RoundRobin{},
		RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond, BatchSize: 64}
	defer w.Close()
	msgs := make([]kafka.Message, n)
	for i := range msgs {
		k := (from + i) % c.Data.Len()
		label := c.Data.Y[k]
		if flip {
			label = 1 - label
		}
		v, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("rec-%d", from+i), "features": c.Data.X[k], "label": label})
		msgs[i] = kafka.Message{Value: v}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatalf("producing records: %v", err)
	}
}

// settled waits until every replica covers want records at the same entry and has no CE
// waiting for a Monte-Carlo measurement.
func settled(t *testing.T, what string, reps []*proc.ReplicaProc, want int) proc.ModelView {
	t.Helper()
	v := proc.WaitAgree(t, what, reps, want)
	waitfor.Cond(t, 10*time.Minute, what+": no renewal pending", func() bool {
		for _, r := range reps {
			b, ok1 := r.Metric("cfguard_counterfactuals_renewal_pending")
			u, ok2 := r.Metric("cfguard_counterfactuals_unconfirmed")
			if !ok1 || !ok2 || b != 0 || u != 0 {
				return false
			}
		}
		return true
	})
	return v
}

// renewals is each replica's cfguard_counterfactuals_renewed_total.
func renewals(t *testing.T, reps []*proc.ReplicaProc) []float64 {
	t.Helper()
	out := make([]float64, len(reps))
	for i, r := range reps {
		v, ok := r.Metric("cfguard_counterfactuals_renewed_total")
		if !ok {
			t.Fatalf("%s: no cfguard_counterfactuals_renewed_total", r.ID)
		}
		out[i] = v
	}
	return out
}

// confirmed is, per replica, how many CEs its confirmer measured so far in batches that renewed
// or changed a CE (the sum of "measured" over its "counterfactuals measured" log lines; a batch
// that changes nothing is not logged).
func confirmed(reps []*proc.ReplicaProc) []int {
	out := make([]int, len(reps))
	for i, r := range reps {
		for _, line := range strings.Split(r.Child.Log.String(), "\n") {
			if !strings.Contains(line, `msg="counterfactuals measured"`) {
				continue
			}
			for _, f := range strings.Fields(line) {
				if v, ok := strings.CutPrefix(f, "measured="); ok {
					n, _ := strconv.Atoi(v)
					out[i] += n
				}
			}
		}
	}
	return out
}

// waitServed waits until every replica is ready, the CE partitions are split between them, each
// owned once, and each of ids is in one ledger, then reads every one of ids at each replica.
func waitServed(t *testing.T, reps []*proc.ReplicaProc, ids []string, within time.Duration) {
	t.Helper()
	var seen []string
	defer func() {
		if t.Failed() {
			t.Logf("at the last look: %v", seen)
		}
	}()
	waitfor.Cond(t, within, "every CE partition owned once, every CE in one ledger, every replica ready", func() bool {
		var all []int
		seen = seen[:0]
		ok, sum := true, 0
		for _, r := range reps {
			parts, answered := r.CEPartitions()
			ready, k := r.Ready(), r.Stored()
			seen = append(seen, fmt.Sprintf("%s: ready %v, partitions %v, %d CEs", r.ID, ready, parts, k))
			ok = ok && answered && ready && len(parts) > 0 && k >= 0
			all = append(all, parts...)
			sum += k
		}
		slices.Sort(all)
		return ok && sum == len(ids) && len(all) == ceParts && len(slices.Compact(all)) == ceParts
	})
	// A rebalance may still be under way (answered 503, Retry-After): wait until every CE reads.
	last := ""
	defer func() {
		if t.Failed() {
			t.Logf("last refusal: %s", last)
		}
	}()
	waitfor.Cond(t, within, "every CE readable at every replica", func() bool {
		for _, r := range reps {
			for _, id := range ids {
				if code, b := r.GetCE(id); code != http.StatusOK {
					last = fmt.Sprintf("GET %s at %s: %d %s", id, r.ID, code, b)
					return false
				}
			}
		}
		return true
	})
}

func loadAverage() string {
	raw, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	return strings.Join(strings.Fields(string(raw))[:3], " ")
}

// TestMeasureWorkDivides registers the same CEs at one replica of 1, 2 and 3, then measures
// each replica's CPU seconds over a drift (records with flipped labels, a learning rate at which
// certificates lapse: re-certification, confirmations and renewals) and over a full audit
// started at every replica at once (each audits its share). The CPU of one replica should be
// about 1/N of the single replica's, plus what every replica does whatever its share (following
// the log) and what the updater alone does (the updates): the same drift over no CE measures
// that part. The confirmer measures a replica's share again under each newer posterior it finds
// when a pass ends, so its work is (passes x share), and the number of passes depends on how
// long a pass takes against how long versions keep coming; "measured" counts only the CEs of
// batches that renewed or changed one (the confirmer logs no others).
func TestMeasureWorkDivides(t *testing.T) {
	requireMeasure(t)
	const (
		records = 640 // 20 increments of kafka.max_records 32
		samples = 1000
	)
	type row struct {
		n, ces             int // replicas, CEs registered
		id                 string
		updater            bool
		share              int
		idle               float64 // CPU seconds per second, before the drift
		drift, audit       float64 // CPU seconds
		audited            int
		renewed            float64 // certificates renewed during the drift
		measured           int     // CEs the confirmer measured by Monte-Carlo during the drift, in batches that renewed or changed one
		driftWall, audWall time.Duration
	}
	var rows []row
	// The same drift without CEs gives what each replica spends whatever its share: following
	// the log (and, on the updater, the updates); the increments are the same records, so the
	// same posteriors.
	for _, ces := range []int{0, 10_000} {
		for n := 1; n <= 3; n++ {
			t.Run(fmt.Sprintf("ces=%d/replicas=%d", ces, n), func(t *testing.T) {
				c := newMeasureCluster(t)
				reps := c.replicas(t, "r", n, samples, "update:\n  solver: adam\n  objective: prior\n  kl_weight: 0\n  memory_records: 0\n  learning_rate: 0.003\n")
				if ces > 0 {
					bulkRegister(t, reps[0], c.ceLines(t, "ce", ces), 1000)
				}
				waitShared(t, reps, ces, 5*time.Minute)
				for k := range min(ces, 3) {
					id := fmt.Sprintf("ce-%d", k*ces/3)
					for _, r := range reps {
						if code, b := r.GetCE(id); code != http.StatusOK {
							t.Fatalf("GET %s at %s: %d %s", id, r.ID, code, b)
						}
					}
				}
				// A first increment of true labels, so that the drift starts from a settled cluster.
				c.produceRecords(t, 0, 32, false)
				settled(t, "before the drift", reps, 32)
				idle0, at := cpus(t, reps), time.Now()
				waitfor.Cond(t, time.Minute, "an idle interval", func() bool { return time.Since(at) >= 5*time.Second })
				idle1, idleWall := cpus(t, reps), time.Since(at)

				c0, r0, m0, start := cpus(t, reps), renewals(t, reps), confirmed(reps), time.Now()
				c.produceRecords(t, 32, records, true)
				v := settled(t, "after the drift", reps, 32+records)
				c1, r1, m1, driftWall := cpus(t, reps), renewals(t, reps), confirmed(reps), time.Since(start)

				a0, a1, audWall := make([]float64, n), make([]float64, n), time.Duration(0)
				evaluated := make([]int, n)
				if ces > 0 {
					a0, start = cpus(t, reps), time.Now()
					var wg sync.WaitGroup
					for i, r := range reps {
						wg.Go(func() { evaluated[i] = r.Audit(t) })
					}
					wg.Wait()
					a1, audWall = cpus(t, reps), time.Since(start)
				}
				total := 0
				for _, e := range evaluated {
					total += e
				}
				if total != ces {
					t.Errorf("the audits evaluated %v CEs, %d in all, want %d", evaluated, total, ces)
				}
				for i, r := range reps {
					rv, _ := r.View()
					rows = append(rows, row{n: n, ces: ces, id: r.ID, updater: rv.Replication.Updater, share: r.Stored(),
						idle: (idle1[i] - idle0[i]) / idleWall.Seconds(), drift: c1[i] - c0[i], audit: a1[i] - a0[i],
						audited: evaluated[i], renewed: r1[i] - r0[i], measured: m1[i] - m0[i], driftWall: driftWall, audWall: audWall})
				}
				t.Logf("%d replicas, %d CEs: posterior version %d after the drift (entry %d, %s)", n, ces, v.Version, v.Replication.Entry, v.Replication.SHA[:12])
			})
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "work divides: certify.samples %d, drift of %d flipped records (learning rate 0.003); load average %s\n", samples, records, loadAverage())
	fmt.Fprintf(&b, "| CEs | replicas | replica | updater | CEs owned | idle CPU s/s | drift CPU s | measured (logged batches) | renewed | drift wall | audited | audit CPU s | audit wall |\n")
	fmt.Fprintf(&b, "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %d | %d | %s | %v | %d | %.3f | %.2f | %d | %.0f | %v | %d | %.2f | %v |\n", r.ces, r.n, r.id, r.updater, r.share, r.idle, r.drift, r.measured, r.renewed,
			r.driftWall.Round(time.Millisecond), r.audited, r.audit, r.audWall.Round(time.Millisecond))
	}
	t.Log("\n" + b.String())
}

// ceParts is replication.ce_partitions at its default, the partition count of the CE topic the
// first replica creates.
const ceParts = 12

// durations summarises takeover times: median and worst.
func durations(ds []time.Duration) (median, worst time.Duration) {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2], s[len(s)-1]
}

func fmtDurations(ds []time.Duration) string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = d.Round(time.Millisecond).String()
	}
	return strings.Join(out, ", ")
}

// TestMeasureTakeovers times, over five trials each, how long three replicas take to replace
// the updater after SIGKILL and after SIGTERM (until another replica says it is the updater),
// and to serve a SIGKILLed CE owner's CEs again (until one CE of each of its partitions answers
// 200 at both other replicas; then every one of its CEs is read there). The killed replica is
// started again between trials. The bound each must meet is the session timeout plus a
// rebalance.
func TestMeasureTakeovers(t *testing.T) {
	requireMeasure(t)
	const (
		trials = 5
		ces    = 600
	)
	c := newMeasureCluster(t)
	reps := c.replicas(t, "r", 3, measureSamples)
	others := func(r *proc.ReplicaProc) []*proc.ReplicaProc {
		return slices.DeleteFunc(slices.Clone(reps), func(o *proc.ReplicaProc) bool { return o == r })
	}
	lines := c.ceLines(t, "ce", ces)
	bulkRegister(t, reps[0], lines, 1000)
	waitShared(t, reps, ces, 2*time.Minute)
	c.produceRecords(t, 0, 64, false)
	proc.WaitAgree(t, "records applied", reps, 64)

	ids := make([]string, ces)
	for k := range ids {
		ids[k] = fmt.Sprintf("ce-%d", k)
	}
	bound := proc.ReplicaSession + 10*time.Second
	updaterTakeover := func(stop func(u *proc.ReplicaProc)) []time.Duration {
		var out []time.Duration
		for range trials {
			u := proc.UpdaterOf(t, reps, 0, 60*time.Second)
			uv, ok := u.View()
			if !ok {
				t.Fatalf("%s does not answer", u.ID)
			}
			at := time.Now()
			stop(u)
			next := proc.UpdaterOf(t, others(u), uv.Replication.Term, bound)
			out = append(out, time.Since(at))
			t.Logf("%s stopped, %s updater of term > %d after %v", u.ID, next.ID, uv.Replication.Term, out[len(out)-1].Round(time.Millisecond))
			u.Start(t)
			waitServed(t, reps, ids, 2*time.Minute)
		}
		return out
	}
	kills := updaterTakeover(func(u *proc.ReplicaProc) { u.Kill(t) })
	terms := updaterTakeover(func(u *proc.ReplicaProc) { u.Terminate(t) })

	// SIGKILL of a CE owner that is not the updater, a different one each trial when it can be.
	var owners []time.Duration
	var moved []int
	for trial := range trials {
		u := proc.UpdaterOf(t, reps, 0, 60*time.Second)
		cand := others(u)
		victim := cand[trial%len(cand)]
		parts, ok := victim.CEPartitions()
		if !ok || len(parts) == 0 {
			t.Fatalf("%s owns no CE partition (%v, %v)", victim.ID, parts, ok)
		}
		var mine []string
		probe := map[int]string{} // one CE of each of the victim's partitions
		for _, id := range ids {
			if p := ceshare.Partition(id, ceParts); slices.Contains(parts, p) {
				mine = append(mine, id)
				if _, ok := probe[p]; !ok {
					probe[p] = id
				}
			}
		}
		if len(probe) != len(parts) {
			t.Fatalf("%s owns partitions %v; the CEs fall in %d of them", victim.ID, parts, len(probe))
		}
		live := others(victim)
		at := time.Now()
		victim.Kill(t)
		waitfor.Cond(t, bound, "the killed owner's partitions served again", func() bool {
			for _, r := range live {
				for _, id := range probe {
					if code, _ := r.GetCE(id); code != http.StatusOK {
						return false
					}
				}
			}
			return true
		})
		owners, moved = append(owners, time.Since(at)), append(moved, len(mine))
		for _, r := range live {
			for _, id := range mine {
				if code, b := r.GetCE(id); code != http.StatusOK {
					t.Fatalf("after the takeover, GET %s at %s: %d %s", id, r.ID, code, b)
				}
			}
		}
		t.Logf("%s killed (partitions %v, %d CEs): served again after %v", victim.ID, parts, len(mine), owners[len(owners)-1].Round(time.Millisecond))
		victim.Start(t)
		waitServed(t, reps, ids, 2*time.Minute)
	}

	var b strings.Builder
	fmt.Fprintf(&b, "takeovers: 3 replicas, session_timeout %v, heartbeat_interval %v, %d CEs; load average %s\n", proc.ReplicaSession, proc.ReplicaHeartbeat, ces, loadAverage())
	fmt.Fprintf(&b, "| fault | trials | median | worst | test limit | each |\n|---|---|---|---|---|---|\n")
	for _, r := range []struct {
		what string
		ds   []time.Duration
	}{{"SIGKILL of the updater -> another reports updater", kills}, {"SIGTERM of the updater -> another reports updater", terms},
		{fmt.Sprintf("SIGKILL of a CE owner (%v CEs) -> its CEs answer at the others", moved), owners}} {
		med, worst := durations(r.ds)
		fmt.Fprintf(&b, "| %s | %d | %v | %v | %v | %s |\n", r.what, len(r.ds), med.Round(time.Millisecond), worst.Round(time.Millisecond), bound, fmtDurations(r.ds))
	}
	t.Log("\n" + b.String())
}

// phase is one timed step of a measurement, for its table.
type phase struct {
	what string
	took time.Duration
	note string
}

func phaseTable(title string, ps []phase) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n| step | took | note |\n|---|---|---|\n", title)
	for _, p := range ps {
		fmt.Fprintf(&b, "| %s | %v | %s |\n", p.what, p.took.Round(time.Millisecond), p.note)
	}
	return b.String()
}

// stopTimed sends SIGTERM to r and times its exit; a replica stopping releases its share (its
// ledger's CEs are deleted), and the daemon's shutdown deadline may cut that short (exit 1),
// which the note says with the partitions whose release failed.
func stopTimed(t *testing.T, r *proc.ReplicaProc, what string) phase {
	t.Helper()
	at := time.Now()
	r.Signal(t, syscall.SIGTERM)
	code := proc.ExitOf(t, r.Child, 10*time.Minute)
	took := time.Since(at)
	failed := strings.Count(r.Child.Log.String(), `msg="releasing a CE partition failed"`)
	return phase{what, took, fmt.Sprintf("exit %d; %d CE partition releases failed", code, failed)}
}

// startTimed starts r and returns how long it took until /readyz answered 200, and then until
// its ledger held want CEs and it owned every CE partition (it is the only live replica).
func startTimed(t *testing.T, r *proc.ReplicaProc, want int) (ready, all time.Duration) {
	t.Helper()
	at := time.Now()
	r.Start(t)
	ready = time.Since(at)
	waitfor.Cond(t, 30*time.Minute, fmt.Sprintf("%s holds the %d CEs", r.ID, want), func() bool {
		parts, _ := r.CEPartitions()
		return len(parts) == ceParts && r.Ready() && r.Stored() == want
	})
	return ready, time.Since(at)
}

// TestMeasureBootstrap times the bootstrap of a replica whose share is every CE (10^5, or 10^6
// with CFGUARD_BENCH_1M=1): registered in bulk at one replica, which then stops; a wiped replica
// takes every partition over from the CE topic alone; then the same replica restarts after
// SIGKILL (from its own ledger) and after SIGTERM; finally a second replica joins and half the
// partitions move to it. Reads: a replica's ledger holds a CE exactly when GET answers it
// from there, so "readable" is the ledger's count (cfguard_counterfactuals), with a sample of
// GETs checked at the end.
func TestMeasureBootstrap(t *testing.T) {
	requireMeasure(t)
	n := 100_000
	if os.Getenv("CFGUARD_BENCH_1M") == "1" {
		n = 1_000_000
	}
	c := newMeasureCluster(t)
	var ps []phase
	first := c.replicas(t, "a", 1, measureSamples)[0]
	lines := c.ceLines(t, "ce", n)
	at := time.Now()
	bulkRegister(t, first, lines, 1000)
	took := time.Since(at)
	ps = append(ps, phase{"bulk registration at one replica (1,000 lines a request: http.max_body_bytes 1 MiB)", took, fmt.Sprintf("%.0f CEs/s", float64(n)/took.Seconds())})
	waitfor.Cond(t, 30*time.Minute, "every CE stored", func() bool { return first.Stored() == n })
	ps = append(ps, phase{"... until its ledger holds them all", time.Since(at), ""})

	ps = append(ps, stopTimed(t, first, "SIGTERM of that replica until it exits"))

	w := c.replica(t, "b", measureSamples)
	t.Cleanup(func() {
		if t.Failed() && w.Child != nil {
			t.Logf("%s's log:\n%s", w.ID, w.Child.Log.String())
		}
	})
	ready, all := startTimed(t, w, n)
	ps = append(ps, phase{"wiped replica, from the CE topic alone: start -> /readyz 200", ready, ""},
		phase{"... start -> every CE in its ledger", all, ""})

	w.Kill(t)
	ready, all = startTimed(t, w, n)
	ps = append(ps, phase{"restart after SIGKILL, from its own ledger: start -> /readyz 200", ready, ""},
		phase{"... start -> every CE in its ledger", all, ""})

	ps = append(ps, stopTimed(t, w, "SIGTERM until it exits"))
	ready, all = startTimed(t, w, n)
	ps = append(ps, phase{"restart after SIGTERM: start -> /readyz 200", ready, ""},
		phase{"... start -> every CE in its ledger", all, ""})

	// A second replica joins: half the partitions move to it.
	j := c.replica(t, "c", measureSamples)
	t.Cleanup(func() {
		if t.Failed() && j.Child != nil {
			t.Logf("%s's log:\n%s", j.ID, j.Child.Log.String())
		}
	})
	at = time.Now()
	j.Start(t)
	ready = time.Since(at)
	var parts [2][]int
	waitfor.Cond(t, 30*time.Minute, "the partitions split and both shares stored", func() bool {
		sum := 0
		for i, r := range []*proc.ReplicaProc{w, j} {
			var ok bool
			if parts[i], ok = r.CEPartitions(); !ok || len(parts[i]) == 0 || !r.Ready() {
				return false
			}
			k := r.Stored()
			if k < 0 {
				return false
			}
			sum += k
		}
		return len(parts[0])+len(parts[1]) == ceParts && sum == n
	})
	ps = append(ps, phase{"a second (wiped) replica joins: start -> /readyz 200", ready, ""},
		phase{"... start -> partitions split and each share in its owner's ledger only", time.Since(at),
			fmt.Sprintf("%s %v: %d CEs, %s %v: %d CEs", w.ID, parts[0], w.Stored(), j.ID, parts[1], j.Stored())})
	for k := 0; k < n; k += n / 100 {
		id := fmt.Sprintf("ce-%d", k)
		for _, r := range []*proc.ReplicaProc{w, j} {
			if code, b := r.GetCE(id); code != http.StatusOK {
				t.Fatalf("GET %s at %s: %d %s", id, r.ID, code, b)
			}
		}
	}
	t.Log("\n" + phaseTable(fmt.Sprintf("bootstrap of a share of %d CEs (%d CE partitions); load average %s", n, ceParts, loadAverage()), ps))
}

// TestMeasureRegistrationRate registers CEs one POST /v1/counterfactuals each, from clients that
// spread them round-robin over 1, 2 and 3 replicas, and reports the rate (registrations
// answered 201 per second of wall time) and how many were answered 202 (accepted, their owner
// had not stored them within the wait).
func TestMeasureRegistrationRate(t *testing.T) {
	requireMeasure(t)
	const total = 2000
	type row struct {
		n, clients      int
		created, queued int
		took            time.Duration
		cpu, brokerCPU  float64 // CPU seconds of all replicas, and of the broker, over the phase
	}
	var rows []row
	for _, clients := range []int{16, 64} {
		for n := 1; n <= 3; n++ {
			t.Run(fmt.Sprintf("clients=%d/replicas=%d", clients, n), func(t *testing.T) {
				c := newMeasureCluster(t)
				reps := c.replicas(t, "r", n, measureSamples)
				lines := c.ceLines(t, "ce", total)
				var (
					mu              sync.Mutex
					next            int
					created, queued int
					failure         string
					wg              sync.WaitGroup
				)
				cl := http.Client{Timeout: time.Minute}
				c0, b0, at := cpus(t, reps), c.brokerCPU(t), time.Now()
				for range clients {
					wg.Go(func() {
						for {
							mu.Lock()
							k := next
							next++
							mu.Unlock()
							if k >= total {
								return
							}
							resp, err := cl.Post("http://"+reps[k%n].Child.Addr()+"/v1/counterfactuals", "application/json", bytes.NewReader(lines[k]))
							if err != nil {
								mu.Lock()
								failure = err.Error()
								mu.Unlock()
								return
							}
							b, _ := io.ReadAll(resp.Body)
							resp.Body.Close()
							mu.Lock()
							switch resp.StatusCode {
							case http.StatusCreated:
								created++
							case http.StatusAccepted:
								queued++
							default:
								failure = fmt.Sprintf("registration %d at %s: %d %s", k, reps[k%n].ID, resp.StatusCode, b)
							}
							mu.Unlock()
						}
					})
				}
				wg.Wait()
				c1, b1, took := cpus(t, reps), c.brokerCPU(t), time.Since(at)
				if failure != "" {
					t.Fatal(failure)
				}
				waitShared(t, reps, total, 5*time.Minute)
				cpu := 0.0
				for i := range reps {
					cpu += c1[i] - c0[i]
				}
				rows = append(rows, row{n: n, clients: clients, created: created, queued: queued, took: took, cpu: cpu, brokerCPU: b1 - b0})
			})
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "registration rate: %d CEs, one POST /v1/counterfactuals each, clients round-robin over the replicas, certify.samples %d; load average %s\n", total, measureSamples, loadAverage())
	fmt.Fprintf(&b, "| clients | replicas | answered 201 | answered 202 | wall | CEs/s | replicas' CPU s | broker CPU s |\n|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %d | %d | %d | %d | %v | %.0f | %.2f | %.2f |\n", r.clients, r.n, r.created, r.queued, r.took.Round(time.Millisecond),
			float64(total)/r.took.Seconds(), r.cpu, r.brokerCPU)
	}
	t.Log("\n" + b.String())
}
