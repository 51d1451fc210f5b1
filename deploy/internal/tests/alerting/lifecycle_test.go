package alerting

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/deploy/internal/deploytest"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// restartable runs one daemon configuration in-process, stopped and started again on the same
// state directory and addresses, as a restart of the process would. The addresses are ports the
// test holds (testnet) from start to end: nothing else can take them while the daemon is down.
type restartable struct {
	t      *testing.T
	cfg    config.Config
	http   *testnet.Port // cfg.HTTP.Listen
	broker *testnet.Port // cfg.Kafka.EmbeddedListen; nil with an external broker (kafka.brokers)
	d      *daemon.Daemon
	cancel context.CancelFunc
	done   chan error
}

func (r *restartable) start() *daemon.Daemon {
	t := r.t
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan *daemon.Daemon, 1), make(chan error, 1)
	cfg := r.cfg
	log := slog.New(slog.NewTextHandler(tooltest.LogWriter(t), &slog.HandlerOptions{Level: slog.LevelWarn}))
	opts := daemon.Options{Config: &cfg, Logger: log, Registry: prometheus.NewRegistry(), Ready: ready, HTTPListener: r.http.Listen(t)}
	if r.broker != nil {
		opts.BrokerListener = r.broker.Listen(t)
	}
	go func() { done <- daemon.Run(ctx, opts) }()
	select {
	case r.d = <-ready:
	case err := <-done:
		cancel()
		t.Fatalf("daemon failed to start: %v", err)
	case <-time.After(60 * time.Second):
		cancel()
		t.Fatal("daemon did not start within 60 s")
	}
	r.cancel, r.done = cancel, done
	return r.d
}

func (r *restartable) stop() {
	r.t.Helper()
	if r.cancel == nil {
		return
	}
	r.cancel()
	select {
	case err := <-r.done:
		if err != nil {
			r.t.Errorf("daemon stopped with %v", err)
		}
	case <-time.After(30 * time.Second):
		r.t.Fatal("daemon did not stop within 30 s of cancel")
	}
	r.cancel = nil
}

// startDefault runs a restartable daemon at the default settings but for loopback ports the test
// holds, a temporary state, the tokens given and mutate's changes (nil: none), and waits for its
// /readyz.
func startDefault(t *testing.T, token, metricsToken string, mutate func(*config.Config)) (*restartable, *daemon.Daemon) {
	t.Helper()
	cfg := config.Default()
	cfg.StateDir = t.TempDir()
	cfg.Model.ExportDir = ""
	httpPort, brokerPort := testnet.Reserve(t), testnet.Reserve(t)
	cfg.HTTP.Listen, cfg.Kafka.EmbeddedListen = httpPort.Addr(), brokerPort.Addr()
	cfg.HTTP.Token, cfg.HTTP.MetricsToken = token, metricsToken
	if mutate != nil {
		mutate(&cfg)
	}
	proc := &restartable{t: t, cfg: cfg, http: httpPort, broker: brokerPort}
	if !cfg.Embedded() {
		proc.broker = nil
	}
	t.Cleanup(proc.stop)
	d := proc.start()
	waitfor.Cond(t, 20*time.Second, "the daemon's /readyz", func() bool {
		code, _, err := deploytest.HTTPGet("http://"+d.HTTPAddr()+"/readyz", "")
		return err == nil && code == 200
	})
	return proc, d
}

// metricsSample reads one unlabelled (or exactly labelled) sample from the daemon's /metrics.
func metricsSample(t *testing.T, addr, token, series string) (float64, bool) {
	t.Helper()
	_, body, err := deploytest.HTTPGet("http://"+addr+"/metrics", token)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range splitLines(string(body)) {
		if len(line) > len(series) && line[:len(series)] == series && line[len(series)] == ' ' {
			v, err := strconv.ParseFloat(line[len(series)+1:], 64)
			return v, err == nil
		}
	}
	return 0, false
}

func splitLines(s string) []string {
	var out []string
	for len(s) > 0 {
		i := 0
		for i < len(s) && s[i] != '\n' {
			i++
		}
		out = append(out, s[:i])
		if i < len(s) {
			i++
		}
		s = s[i:]
	}
	return out
}

// promRange is the values of a range query (one series) at step 1 s.
func promRange(t *testing.T, base, q string, from, to time.Time) map[string][]float64 {
	t.Helper()
	u := fmt.Sprintf("%s/api/v1/query_range?query=%s&start=%d&end=%d&step=1", base, url.QueryEscape(q), from.Unix(), to.Unix()+1)
	code, body, err := deploytest.HTTPGet(u, "")
	if err != nil || code != 200 {
		t.Fatalf("query_range %s: %d %v %s", q, code, err, body)
	}
	var r struct {
		Data struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
				Values [][2]any          `json:"values"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		t.Fatal(err)
	}
	out := map[string][]float64{}
	for _, s := range r.Data.Result {
		for _, v := range s.Values {
			f, _ := strconv.ParseFloat(v[1].(string), 64)
			out[s.Metric["alertname"]] = append(out[s.Metric["alertname"]], f)
		}
	}
	return out
}

// TestAlertsTellTheTruthThroughLearningAndRestarts runs the daemon at the default update.* and
// certify.* settings beside a real Prometheus and Alertmanager with the shipped rules, and shows
// the lifecycle an operator sees:
//
//	(a) 20 certified counterfactuals and 3,000 correctly labelled records (about a hundred
//	    updates, each under the KL budget, whose KL from the CEs' first anchors grows far past
//	    it): no alert fires at any evaluation, no webhook call, every CE still certified, by
//	    renewals;
//	(b) a drift at the same settings (every row of the data set with the other label, 569
//	    records) moves p below 1/2 and pages through CfguardCounterfactualsInvalidated;
//	(c) two restarts of the daemon while that alert fires: the first scrape after each start
//	    agrees with GET /v1/model, the alert keeps firing (one episode, the same startsAt at
//	    Alertmanager) and no resolved notification is sent.
//
// Only the daemon's addresses, tokens, increment size (kafka.max_records 32, so that the 3,000
// records make ~94 updates) and Prometheus' intervals (1 s) differ from the defaults.
func TestAlertsTellTheTruthThroughLearningAndRestarts(t *testing.T) {
	if testing.Short() {
		t.Skip("about a minute of real Prometheus and Alertmanager")
	}
	tooltest.Command(t, "apt-get install prometheus", "prometheus")
	tooltest.Command(t, "apt-get install prometheus-alertmanager", "prometheus-alertmanager", "alertmanager")
	root := tooltest.RepoRoot(t)
	const token, metricsToken, nCEs, nRecords = "t0ken", "m3trics", 20, 3000

	proc, d := startDefault(t, token, metricsToken, func(cfg *config.Config) {
		cfg.Kafka.MaxRecords, cfg.Kafka.MaxRecordsBacklog, cfg.Kafka.MaxWait = 32, 32, 200*time.Millisecond
		cfg.Audit.Schedule = ""
	})
	cfg := proc.cfg
	mon := startMonitoring(t, root, cfg.HTTP.Listen, metricsToken)
	data, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	deploytest.RegisterCounterfactuals(t, d, token, data.X, nCEs)
	produce := func(d *daemon.Daemon, recs []kafka.Message) {
		t.Helper()
		w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(d.BrokerAddrs()...), Topic: cfg.Kafka.Topic, RequiredAcks: kafka.RequireAll, BatchSize: 500}
		defer w.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		if err := w.WriteMessages(ctx, recs...); err != nil {
			t.Fatal(err)
		}
	}
	applied := func() float64 {
		v, _ := metricsSample(t, cfg.HTTP.Listen, metricsToken, `cfguard_records_total{result="applied"}`)
		return v
	}
	metric := func(series string) float64 {
		v, ok := metricsSample(t, cfg.HTTP.Listen, metricsToken, series)
		if !ok {
			t.Fatalf("/metrics has no %s", series)
		}
		return v
	}

	// (a) Normal learning: correctly labelled records.
	phaseA := time.Now()
	var recs []kafka.Message
	for i := 0; len(recs) < nRecords; i++ {
		k := i % len(data.X)
		b, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("r%d", i), "features": data.X[k], "label": data.Y[k]})
		recs = append(recs, kafka.Message{Value: b})
	}
	produce(d, recs)
	waitfor.Cond(t, 5*time.Minute, "3,000 records applied and every lapsed certificate measured", func() bool {
		return applied() == nRecords && metric("cfguard_counterfactuals_renewal_pending") == 0
	})
	version := metric("cfguard_posterior_version")
	waitfor.Cond(t, 30*time.Second, "Prometheus to evaluate the final state", func() bool {
		v, ok := promValue(t, mon.prom, `cfguard_posterior_version{job="cfguard"}`)
		return ok && v == strconv.FormatFloat(version, 'f', -1, 64)
	})
	time.Sleep(2 * time.Second) // two more evaluations of the rules on that state
	renewed := metric("cfguard_counterfactuals_renewed_total")
	code, body := deploytest.APIDo(t, d, token, "GET", "/v1/model", nil)
	var model struct {
		KLHistory []struct {
			KL          float64 `json:"kl"`
			MaxAnchorKL float64 `json:"max_anchor_kl"`
		} `json:"kl_history"`
		Counterfactuals map[string]int `json:"counterfactuals"`
	}
	if code != 200 || json.Unmarshal(body, &model) != nil {
		t.Fatalf("GET /v1/model: %d %s", code, body)
	}
	maxStep, maxAnchor := 0.0, 0.0
	for _, h := range model.KLHistory {
		maxStep, maxAnchor = max(maxStep, h.KL), max(maxAnchor, h.MaxAnchorKL)
	}
	budget := metric("cfguard_kl_budget")
	t.Logf("(a) %d records in %v: %v posterior versions, largest update KL %.3g (budget %.4g), largest anchor KL %.3g, %v renewals, statuses %v",
		nRecords, time.Since(phaseA).Round(time.Millisecond), version, maxStep, budget, maxAnchor, renewed, model.Counterfactuals)
	if model.Counterfactuals["certified"] != nCEs {
		t.Errorf("after normal learning: statuses %v, want all %d certified", model.Counterfactuals, nCEs)
	}
	// Under correct labels the update KLs shrink; whether the anchors' KL passes the budget within
	// 3,000 records depends on the data. If certificates lapsed, they were renewed.
	if maxAnchor > budget && renewed == 0 {
		t.Errorf("anchor KL up to %v (budget %v) and no renewal: lapsed certificates were not renewed", maxAnchor, budget)
	}
	if maxStep > budget/2 {
		t.Errorf("largest update KL %v under correct labels, want well inside the budget (%v)", maxStep, budget)
	}
	// No alert fires. One may be pending for a moment: CfguardIngestStalled's condition holds
	// while the first records wait and none has been applied yet (the last-ingest gauge is 0),
	// as it must for a daemon that never starts ingesting; it fires only after 5 minutes of it.
	if res := promRange(t, mon.prom, `ALERTS{alertstate="firing"}`, phaseA, time.Now()); len(res) != 0 {
		t.Errorf("alerts firing during normal learning: %v", res)
	}
	if res := promRange(t, mon.prom, `ALERTS{alertstate="pending"}`, phaseA, time.Now()); len(res) != 0 {
		t.Logf("alerts pending during normal learning (samples at 1 s): %v", res)
	}
	mon.hook.mu.Lock()
	calls := len(mon.hook.posts["/page"]) + len(mon.hook.posts["/ticket"])
	mon.hook.mu.Unlock()
	if calls != 0 {
		t.Errorf("%d webhook calls during normal learning, want none", calls)
	}

	// (b) A drift at the default settings: every row of the data set with the other label.
	recs = recs[:0]
	for i := range data.X {
		b, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("flip%d", i), "features": data.X[i], "label": 1 - data.Y[i]})
		recs = append(recs, kafka.Message{Value: b})
	}
	t0 := time.Now()
	produce(d, recs)
	var tMetric, tRule, tHook time.Duration
	waitfor.Cond(t, 90*time.Second, "the invalidated alert at the paging webhook", func() bool {
		now := time.Since(t0)
		if v, ok := metricsSample(t, cfg.HTTP.Listen, metricsToken, `cfguard_counterfactuals{status="invalidated"}`); tMetric == 0 && ok && v > 0 {
			tMetric = now
		}
		if _, ok := promRuleFiring(t, mon.prom, alertInvalidated); tRule == 0 && ok {
			tRule = now
		}
		if at, ok := mon.hook.firstWith("/page", alertInvalidated); ok {
			tHook = at.Sub(t0)
		}
		return tHook > 0
	})
	t.Logf("(b) first drift record to %s: daemon metric %v, Prometheus rule firing %v, paging webhook %v (scrape and evaluation every 1 s, group_wait 1 s)",
		alertInvalidated, tMetric.Round(time.Millisecond), tRule.Round(time.Millisecond), tHook.Round(time.Millisecond))
	as := alertmanagerAlerts(t, mon.am, alertInvalidated)
	if len(as) != 1 {
		t.Fatalf("%d %s alerts at Alertmanager, want 1", len(as), alertInvalidated)
	}
	startsAt := as[0].StartsAt

	// (c) Two restarts while the alert fires.
	firing := time.Now()
	for i := range 2 {
		proc.stop()
		stopped := time.Now()
		d = proc.start()
		// The first scrape after the start already says what the ledger says.
		code, body := deploytest.APIDo(t, d, token, "GET", "/v1/model", nil)
		var m struct {
			PosteriorVersion uint64         `json:"posterior_version"`
			Counterfactuals  map[string]int `json:"counterfactuals"`
		}
		if code != 200 || json.Unmarshal(body, &m) != nil {
			t.Fatalf("GET /v1/model after restart %d: %d %s", i+1, code, body)
		}
		if v := metric("cfguard_posterior_version"); v != float64(m.PosteriorVersion) {
			t.Errorf("restart %d: first scrape says posterior version %v, GET /v1/model %d", i+1, v, m.PosteriorVersion)
		}
		for _, s := range []string{"certified", "at_risk", "invalidated", "uncertified"} {
			if v := metric(`cfguard_counterfactuals{status="` + s + `"}`); v != float64(m.Counterfactuals[s]) {
				t.Errorf("restart %d: first scrape says %v %s, GET /v1/model %d", i+1, v, s, m.Counterfactuals[s])
			}
		}
		scrapedSince(t, mon, stopped)
	}
	evaluatedAfter(t, mon, time.Now().Add(3*time.Second))
	oneEpisode(t, mon, alertInvalidated, firing, startsAt)
	noResolved(t, mon)
}

// oneEpisode fails unless Prometheus held alertname firing at every evaluation from `from` to
// now, without a gap, and Alertmanager holds it once, started at startsAt.
func oneEpisode(t *testing.T, mon monitoring, alertname string, from, startsAt time.Time) {
	t.Helper()
	fr := promRange(t, mon.prom, `ALERTS{alertname="`+alertname+`",alertstate="firing"}`, from, time.Now())[alertname]
	gaps := 0
	for i := 1; i < len(fr); i++ {
		if fr[i] != fr[i-1] {
			gaps++
		}
	}
	if len(fr) == 0 || gaps != 0 {
		t.Errorf("%s across the restarts: %d samples with %d changes, want one episode firing throughout", alertname, len(fr), gaps)
	}
	if as := alertmanagerAlerts(t, mon.am, alertname); len(as) != 1 || !as[0].StartsAt.Equal(startsAt) {
		t.Errorf("after the restarts Alertmanager holds %+v, want the one %s alert that started at %v", as, alertname, startsAt)
	}
}

// evaluatedAfter waits until Prometheus has evaluated every rule group after at (its
// /api/v1/rules lastEvaluation): with evaluations every second, an alert a restart resolved
// has been resolved at Prometheus by then, sent to Alertmanager, and, with group_wait and
// group_interval of 1 s, notified, when at is a few seconds ahead.
func evaluatedAfter(t *testing.T, mon monitoring, at time.Time) {
	t.Helper()
	waitfor.Cond(t, 60*time.Second, "Prometheus to evaluate its rules after "+at.Format(time.RFC3339Nano), func() bool {
		resp, err := http.Get(mon.prom + "/api/v1/rules")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var rules struct {
			Data struct {
				Groups []struct {
					Name           string    `json:"name"`
					LastEvaluation time.Time `json:"lastEvaluation"`
				} `json:"groups"`
			} `json:"data"`
		}
		if json.NewDecoder(resp.Body).Decode(&rules) != nil || len(rules.Data.Groups) == 0 {
			return false
		}
		for _, g := range rules.Data.Groups {
			if !g.LastEvaluation.After(at) {
				return false
			}
		}
		return true
	})
}

// noResolved fails if a resolved notification reached the webhooks: the tests call it while
// every alert they raised still holds.
func noResolved(t *testing.T, mon monitoring) {
	t.Helper()
	mon.hook.mu.Lock()
	defer mon.hook.mu.Unlock()
	for path, posts := range mon.hook.posts {
		for _, p := range posts {
			var msg struct {
				Alerts []struct {
					Status string            `json:"status"`
					Labels map[string]string `json:"labels"`
				} `json:"alerts"`
			}
			json.Unmarshal(p.body, &msg)
			for _, a := range msg.Alerts {
				if a.Status == "resolved" {
					t.Errorf("a resolved notification for %s reached %s while the condition still held", a.Labels["alertname"], path)
				}
			}
		}
	}
}

// scrapedSince waits until Prometheus has scraped and evaluated the restarted daemon a few
// times: a successful scrape more than 3 s after `stopped`.
func scrapedSince(t *testing.T, mon monitoring, stopped time.Time) {
	t.Helper()
	waitfor.Cond(t, 30*time.Second, "Prometheus to scrape the restarted daemon", func() bool {
		res, err := promQuery(t, mon.prom, `timestamp(up{job="cfguard"} == 1)`)
		if err != nil || len(res) != 1 {
			return false
		}
		ts, _ := strconv.ParseFloat(res[0].Value[1].(string), 64)
		return ts > float64(stopped.Add(3*time.Second).Unix())
	})
}
