package endtoend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

func TestRejectPolicyKeepsThePosterior(t *testing.T) {
	r := launch.Daemon(t, func(c *config.Config) { daemontest.PaperLearner(c, 1e-3); c.Certify.OnBreach = "reject" })
	data := daemontest.Bundled(t)
	daemontest.RegisterCEs(t, r, data, 3, "")
	before := r.D.Posterior()
	r.Produce(t, daemontest.Flipped(data, 64)...)
	waitfor.Cond(t, 30*time.Second, "64 held records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "held") == 64 })
	if r.D.Posterior() != before || r.Metric(t, "cfguard_records_total", "result", "applied") != 0 {
		t.Fatal("a rejected update changed the posterior")
	}
	if r.Metric(t, "cfguard_updates_total", "outcome", "rejected") != 2 || r.Metric(t, "cfguard_kl_over_budget") != 1 {
		t.Fatal("rejections not counted or not alerted")
	}
	if r.Metric(t, "cfguard_counterfactuals", "status", "certified") != 3 {
		t.Fatal("CEs changed status although the posterior was kept")
	}
	// The breach is an event with a time: the last rejected update's, from the KL history.
	hist, err := r.D.Ledger().KLHistory(1)
	if err != nil || len(hist) != 1 {
		t.Fatalf("KL history: %v, %v", hist, err)
	}
	if at, want := r.Metric(t, "cfguard_kl_breach_last_timestamp_seconds"), float64(hist[0].At.UnixNano())/1e9; at != want || hist[0].KL <= certify.KLBudget(r.Config.Certify.Delta) {
		t.Fatalf("cfguard_kl_breach_last_timestamp_seconds = %v, want the last update's time %v (KL %v, budget %v)", at, want, hist[0].KL, certify.KLBudget(r.Config.Certify.Delta))
	}
	st, _ := r.D.Ledger().State()
	if st.Counters["held"] != 64 || st.Offsets[0] < 64 {
		t.Fatalf("held increments not checkpointed: %+v", st)
	}
	// Each held increment's event names the posterior kept (not the candidate rejected), and the
	// events carry every held record.
	waitfor.Cond(t, 30*time.Second, "the outbox drained", func() bool { return r.Metric(t, "cfguard_events_pending") == 0 })
	// The over-budget events count the labels of the increments they describe: every held record
	// was a malignant row labelled with class 0.
	held, labelled := 0, map[string]int{}
	for _, m := range kafkatest.ReadPartition(t, r.D.BrokerAddrs(), r.Config.Kafka.EventsTopic, 0) {
		var e daemon.Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			continue
		}
		if e.Type == "kl_over_budget" {
			for k, n := range e.Labels {
				labelled[k] += n
			}
		}
		if e.Type != "increment_held" {
			continue
		}
		if e.PosteriorVersion != before.Version || e.KL == nil || !(*e.KL > certify.KLBudget(r.Config.Certify.Delta)) {
			t.Errorf("increment_held event %s: want posterior_version %d (the one kept) and a KL over the budget", m.Value, before.Version)
		}
		held += len(e.Records)
	}
	if held != 64 {
		t.Errorf("increment_held events name %d records, want the 64 held", held)
	}
	if cl := before.Classes; len(labelled) != len(cl) || labelled[cl[0]] != 64 || labelled[cl[1]] != 0 {
		t.Errorf("kl_over_budget events count the labels %v, want %d of %q and none of %q", labelled, 64, cl[0], cl[1])
	}
}

// TestClipPolicyMeetsTheBudget: at the default learner, flipped labels move the converged
// posterior far past the budget; clip scales each step back along the path to the converged
// posterior, and its kl_over_budget event says by which fraction and to which KL.
func TestClipPolicyMeetsTheBudget(t *testing.T) {
	r := launch.Daemon(t, func(c *config.Config) { c.Certify.OnBreach = "clip" })
	data := daemontest.Bundled(t)
	r.Produce(t, daemontest.Flipped(data, 64)...)
	waitfor.Cond(t, 30*time.Second, "64 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 64 })
	if r.Metric(t, "cfguard_updates_total", "outcome", "clipped") == 0 {
		t.Fatal("no update was clipped under flipped labels")
	}
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: r.D.BrokerAddrs(), Topic: r.Config.Kafka.EventsTopic, MaxWait: kafkatest.MaxWait})
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		m, err := rd.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("no kl_over_budget event with a clip fraction: %v", err)
		}
		var e daemon.Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type != "kl_over_budget" {
			continue
		}
		if e.Policy != "clip" || e.ClipFraction == nil || e.ClippedKL == nil || !(*e.ClipFraction > 0 && *e.ClipFraction < 1) ||
			*e.ClippedKL > certify.KLBudget(r.Config.Certify.Delta)*(1+1e-9) || e.KL == nil || !(*e.KL > certify.KLBudget(r.Config.Certify.Delta)) {
			t.Fatalf("kl_over_budget event %s: want policy clip, KL over the budget, a fraction in (0, 1) and a clipped KL within it", m.Value)
		}
		break
	}
	hist, _ := r.D.Ledger().KLHistory(10)
	for _, s := range hist {
		if s.KL > certify.KLBudget(r.Config.Certify.Delta)*(1+1e-9) {
			t.Fatalf("clipped step %d has KL %v over the budget %v", s.PosteriorVersion, s.KL, certify.KLBudget(r.Config.Certify.Delta))
		}
	}
	// A clipped step is a breach: the breach time is the newest clipped update's, and the gauge
	// says whether the last update breached (CfguardKLOverBudget fires from these).
	var last *ledger.KLEntry // the newest clipped update (the history is oldest first)
	for i := len(hist) - 1; i >= 0 && last == nil; i-- {
		if hist[i].Outcome == certify.OutcomeClipped {
			last = &hist[i]
		}
	}
	if last == nil {
		t.Fatalf("no clipped update in the KL history %+v", hist)
	}
	if at, want := r.Metric(t, "cfguard_kl_breach_last_timestamp_seconds"), float64(last.At.UnixNano())/1e9; at != want {
		t.Errorf("cfguard_kl_breach_last_timestamp_seconds = %v, want the newest clipped update's time %v", at, want)
	}
	newest := hist[len(hist)-1]
	if over, want := r.Metric(t, "cfguard_kl_over_budget"), map[bool]float64{true: 1, false: 0}[newest.Breached(certify.KLBudget(r.Config.Certify.Delta))]; over != want {
		t.Errorf("cfguard_kl_over_budget = %v after an update with outcome %s and KL %v, want %v", over, newest.Outcome, newest.KL, want)
	}
	if kl := r.Metric(t, "cfguard_posterior_kl"); kl < 0.5*certify.KLBudget(r.Config.Certify.Delta) {
		t.Fatalf("clipping should use most of the budget, got KL %v", kl)
	}
}

// TestKcatProducer feeds the daemon with Debian's kcat, a Kafka client we did not write.
func TestKcatProducer(t *testing.T) {
	t.Parallel() // mostly waits for kcat
	kcat := tooltest.Command(t, "apt-get install kcat", "kcat")
	r := launch.Daemon(t, nil)
	data := daemontest.Bundled(t)
	var in bytes.Buffer
	for i := 0; i < 64; i++ {
		in.Write(daemontest.Record(fmt.Sprintf("k%d", i), data.X[i], []string{"malignant", "benign"}[data.Y[i]]))
		in.WriteByte('\n')
	}
	in.WriteString("{\"id\":\"broken\"\n")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, kcat, "-P", "-b", r.D.BrokerAddrs()[0], "-t", r.Config.Kafka.Topic)
	cmd.Stdin = &in
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("kcat: %v: %s", err, out)
	}
	waitfor.Cond(t, 30*time.Second, "64 applied records from kcat", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 64 })
	waitfor.Cond(t, 10*time.Second, "one dead letter", func() bool { return r.Metric(t, "cfguard_records_total", "result", "dead_lettered") == 1 })
	// Read the dead letter back with kcat too, with its reason header.
	out, err := exec.CommandContext(ctx, kcat, "-C", "-b", r.D.BrokerAddrs()[0], "-t", r.Config.Kafka.DeadLetterTopic, "-e", "-f", "%h|%s\n").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "cfguard-reason=bad_json") || !strings.Contains(string(out), `{"id":"broken"`) {
		t.Fatalf("dead letter via kcat: %v: %s", err, out)
	}
}

// TestExternalBrokerWithSASL points kafka.brokers at a broker that requires SCRAM: the embedded
// broker stays off, and the daemon authenticates.
func TestExternalBrokerWithSASL(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"cfguard.records", "cfguard.records.dlq", "cfguard.events"}, Partitions: 1,
		SASL: &broker.SASLConfig{Mechanism: "SCRAM-SHA-256", User: "cfguard", Password: "pw"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	r := launch.Daemon(t, func(c *config.Config) {
		c.Kafka.Brokers = b.Addrs()
		c.Kafka.SASL = config.SASL{Mechanism: "SCRAM-SHA-256", Username: "cfguard", Password: "pw"}
	})
	if got := r.D.BrokerAddrs(); len(got) != 1 || got[0] != b.Addrs()[0] {
		t.Fatalf("daemon uses %v, want the external broker %v", got, b.Addrs())
	}
	if code, _ := r.Get(t, "/readyz"); code != 200 {
		t.Fatalf("readyz %d with SASL", code)
	}
}

func TestReadyzFailsWhenBrokerGone(t *testing.T) {
	t.Parallel() // mostly waits for the consumer to find the broker gone
	b := daemontest.StartCluster(t, 1)
	r := launch.Daemon(t, func(c *config.Config) { c.Kafka.Brokers = b.Addrs() })
	b.Close()
	waitfor.Cond(t, 20*time.Second, "readyz to fail", func() bool { code, _ := r.Get(t, "/readyz"); return code == http.StatusServiceUnavailable })
}

// TestReplicasReadyzFailsWhenBrokerGone: replicas whose brokers are all gone answer /readyz 503
// naming the posterior log they cannot read, the updater and a follower alike (no entry can be
// known to wait, and no replica can be the updater meanwhile), as a single daemon does.
func TestReplicasReadyzFailsWhenBrokerGone(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas: not with -short")
	}
	t.Parallel() // mostly waits for the replicas to find the broker gone
	b := daemontest.StartCluster(t, 1)
	reps := []*launch.Running{launch.Replica(t, b, "r1"), launch.Replica(t, b, "r2")}
	b.Close()
	for _, r := range reps {
		waitfor.Cond(t, 30*time.Second, r.Config.Replication.ReplicaID+"'s readyz to name the posterior log", func() bool {
			code, body := r.Get(t, "/readyz")
			return code == http.StatusServiceUnavailable && strings.Contains(string(body), "the posterior log cannot be read: its end has not been read for")
		})
	}
}

// TestExplainStoresACertifiedCounterfactual: the first POST /v1/explain of a daemon trains the
// VAE (none is in its state directory), saves it under state_dir/vae, and stores the
// counterfactual it generates, certified and anchored to the current posterior. The VAE it saved
// is the shared one that the other tests' daemons start with (daemontest.WithSharedVAE).
func TestExplainStoresACertifiedCounterfactual(t *testing.T) {
	if testing.Short() {
		t.Skip("trains the VAE")
	}
	r := launch.Daemon(t, nil)
	vae := filepath.Join(r.Config.StateDir, "vae")
	if _, err := os.Stat(vae); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("%s before the first explanation: %v, want none", vae, err)
	}
	data := daemontest.Bundled(t)
	var x []float64
	p, _ := r.D.Posterior().Predict(data.X[:40], 200, 1)
	for i := 0; i < 40; i++ {
		if p.Argmax(i) == 0 && p.P(i, 0) > 0.9 {
			x = data.X[i]
			break
		}
	}
	code, body := r.Do(t, "POST", "/v1/explain", "", map[string]any{"id": "psce-1", "x": x, "target": "benign"})
	if code != http.StatusCreated {
		t.Fatalf("explain: %d %s", code, body)
	}
	var resp struct {
		Counterfactual ledger.CE `json:"counterfactual"`
		Generation     struct {
			InSet, Valid bool
			P1           float64
		} `json:"generation"`
	}
	if err := json.Unmarshal(body, &resp); err != nil {
		t.Fatal(err)
	}
	ce := resp.Counterfactual
	if ce.ID != "psce-1" || ce.Status != certify.Certified || ce.P1 < 0.95 || ce.Var1 > 0.01 || !resp.Generation.Valid {
		t.Fatalf("explain stored %+v", ce)
	}
	if ce.AnchorVersion != r.D.Posterior().Version {
		t.Fatal("the CE is not anchored to the current posterior")
	}
	daemontest.SameVAE(t, vae, daemontest.SharedVAEDir(t))
}

// TestExplainCertifiesUnderASmallDelta: at certify.delta 0.02 (with the default verdict_alpha a
// confirmation of explain's 500 draws could never show p >= 0.98: its margin alone is 0.025, and
// every search ran to its iteration cap) PSCE's searches reach the set, and the daemon stores
// every one as certified: the search's final estimate is the registration's own (the pool the
// posterior's registrations are measured with), so the registration finds what the search
// stopped on. certify.samples is 1000 (400, these tests' usual, could admit none at this delta).
func TestExplainCertifiesUnderASmallDelta(t *testing.T) {
	if testing.Short() {
		t.Skip("PSCE with the VAE")
	}
	r := launch.Daemon(t, daemontest.WithSharedVAE(t, func(c *config.Config) { c.Certify.Delta, c.Certify.Samples = 0.02, 1000 }))
	data := daemontest.Bundled(t)
	p, _ := r.D.Posterior().Predict(data.X[:80], 200, 1)
	tried := 0
	for i := 0; i < 80 && tried < 4; i++ {
		if p.Argmax(i) != 0 || p.P(i, 0) <= 0.9 {
			continue
		}
		tried++
		id := fmt.Sprintf("strict-%d", i)
		code, body := r.Do(t, "POST", "/v1/explain", "", map[string]any{"id": id, "x": data.X[i], "target": "benign"})
		var resp struct {
			Counterfactual ledger.CE `json:"counterfactual"`
			Result         struct {
				P1      float64 `json:"p1"`
				Var1    float64 `json:"var1"`
				Samples int     `json:"samples"`
			} `json:"generation"`
		}
		if err := json.Unmarshal(body, &resp); err != nil || code != http.StatusCreated {
			t.Errorf("explain %s at delta 0.02: %d %.600s", id, code, body)
			continue
		}
		ce, res := resp.Counterfactual, resp.Result
		if ce.Status != certify.Certified || !ce.Certificate().Admits(r.Config.Certify.VerdictAlpha) {
			t.Errorf("%s stored %s: p1 %.4f, var1 %.5f from %d draws", id, ce.Status, ce.P1, ce.Var1, ce.Samples)
		}
		if math.Abs(ce.P1-res.P1) > 1e-12 || math.Abs(ce.Var1-res.Var1) > 1e-12 || ce.Samples != res.Samples {
			t.Errorf("%s: the search's final estimate p1 %v, var1 %v from %d draws; the registration's %v, %v from %d", id,
				res.P1, res.Var1, res.Samples, ce.P1, ce.Var1, ce.Samples)
		}
	}
	if tried < 4 {
		t.Fatalf("only %d rows to explain", tried)
	}
}

// Under certify.uncertified: store a registration is certified by the rule that admits it under
// refuse and renews certificates (the lower confidence bound of p1 at least 1 - delta), not by
// its point estimate: a CE with p1 >= 1 - delta whose bound falls short is stored uncertified.
func TestStoredCEIsCertifiedOnlyByItsEvidence(t *testing.T) {
	r := launch.Daemon(t, func(c *config.Config) { c.Certify.Uncertified = certify.Store })
	data := daemontest.Bundled(t)
	m := r.D.Posterior()
	p, err := m.Predict(data.X, 400, 1)
	if err != nil {
		t.Fatal(err)
	}
	x := -1
	var cfs []int // x_cf rows near the threshold: classified benign with p a little over 1 - delta
	for i := range data.X {
		switch pb := p.P(i, 1); {
		case x < 0 && p.Argmax(i) == 0 && p.P(i, 0) > 0.9:
			x = i
		case pb > 0.93 && pb < 0.985:
			cfs = append(cfs, i)
		}
	}
	if x < 0 || len(cfs) == 0 {
		t.Fatalf("no pair near the threshold (x %d, %d x_cf)", x, len(cfs))
	}
	edge := 0 // CEs in the set by their point estimate, not by their bound
	for k, cf := range cfs {
		code, body := r.Do(t, "POST", "/v1/counterfactuals", "", map[string]any{"id": fmt.Sprintf("edge-%d", k), "x": data.X[x], "x_cf": data.X[cf], "target": "benign"})
		if code != http.StatusCreated {
			t.Fatalf("register edge-%d: %d %s", k, code, body)
		}
		var ce ledger.CE
		if err := json.Unmarshal(body, &ce); err != nil {
			t.Fatal(err)
		}
		cert := ce.Certificate()
		if cert.InSet() && !cert.Admits(r.Config.Certify.VerdictAlpha) {
			edge++
		}
		if want := map[bool]certify.Status{true: certify.Certified, false: certify.Uncertified}[cert.Admits(r.Config.Certify.VerdictAlpha)]; ce.Status != want {
			t.Errorf("edge-%d: p1 %.4f, var1 %.5f from %d draws: stored %s, want %s", k, ce.P1, ce.Var1, ce.Samples, ce.Status, want)
		}
	}
	if edge == 0 {
		t.Fatalf("none of %d CEs had p1 >= 1 - delta with a bound below it: the test shows nothing", len(cfs))
	}
	t.Logf("%d of %d CEs in the set by their point estimate only, stored uncertified", edge, len(cfs))
}
