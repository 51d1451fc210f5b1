package alerting

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"
	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/deploy/internal/deploytest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// process is an external program a test started; the test's cleanup stops it.
type process struct {
	name   string
	cmd    *exec.Cmd
	out    tooltest.Output
	exited chan struct{} // closed when the process has exited; err is then its Wait error
	err    error
}

// startProcess starts path with args in a process group of its own and, when the test ends,
// stops the whole group (SIGTERM, then SIGKILL after 10 s), logging its output if the test
// failed.
func startProcess(t *testing.T, name, path string, args ...string) *process {
	t.Helper()
	p := &process{name: name, cmd: exec.Command(path, args...), exited: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", name, err)
	}
	pgid := p.cmd.Process.Pid // Setpgid: the group's id is the leader's pid
	go func() { p.err = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		syscall.Kill(-pgid, syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(10 * time.Second):
			t.Errorf("%s did not stop within 10 s of SIGTERM; killing its process group", name)
			syscall.Kill(-pgid, syscall.SIGKILL)
			<-p.exited
		}
		// Anything the program left in its group goes too (ESRCH when the group is empty).
		syscall.Kill(-pgid, syscall.SIGKILL)
		if t.Failed() {
			t.Logf("%s output:\n%s", name, p.out.String())
		}
	})
	return p
}

// listening waits until the process has logged msg="Listening on" (Prometheus and Alertmanager,
// started with --web.listen-address=127.0.0.1:0 and at least --log.level=info) and returns the
// address it bound.
func (p *process) listening(t *testing.T) string {
	t.Helper()
	var addr string
	waitfor.Cond(t, 30*time.Second, p.name+" to log its listen address", func() bool {
		select {
		case <-p.exited:
			t.Fatalf("%s exited: %v\n%s", p.name, p.err, p.out.String())
		default:
		}
		addr = p.out.Logged("Listening on", "address")
		return addr != ""
	})
	return addr
}

// waitReady waits for GET url to answer 200 while the process runs.
func (p *process) waitReady(t *testing.T, url string) {
	t.Helper()
	waitfor.Cond(t, 30*time.Second, p.name+" to be ready", func() bool {
		select {
		case <-p.exited:
			t.Fatalf("%s exited: %v\n%s", p.name, p.err, p.out.String())
		default:
		}
		code, _, err := deploytest.HTTPGet(url, "")
		return err == nil && code == 200
	})
}

// hookRecorder is a webhook receiver: it keeps every POST by path.
type hookRecorder struct {
	mu    sync.Mutex
	posts map[string][]hookPost
}

type hookPost struct {
	at   time.Time
	body []byte
}

func (h *hookRecorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	h.mu.Lock()
	h.posts[r.URL.Path] = append(h.posts[r.URL.Path], hookPost{time.Now(), b})
	h.mu.Unlock()
}

// firstWith returns the time of the first POST to path whose payload carries alertname with
// status firing.
func (h *hookRecorder) firstWith(path, alertname string) (time.Time, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, p := range h.posts[path] {
		var msg struct {
			Alerts []struct {
				Status string            `json:"status"`
				Labels map[string]string `json:"labels"`
			} `json:"alerts"`
		}
		if json.Unmarshal(p.body, &msg) != nil {
			continue
		}
		for _, a := range msg.Alerts {
			if a.Labels["alertname"] == alertname && a.Status == "firing" {
				return p.at, true
			}
		}
	}
	return time.Time{}, false
}

func readYAMLMap(t *testing.T, path string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := yaml.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func writeYAML(t *testing.T, path string, v any) {
	t.Helper()
	b, err := yaml.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

// amAlert is one alert of Alertmanager's GET /api/v2/alerts.
type amAlert struct {
	Labels   map[string]string `json:"labels"`
	StartsAt time.Time         `json:"startsAt"`
	Status   struct {
		State string `json:"state"`
	} `json:"status"`
}

func alertmanagerAlerts(t *testing.T, base, alertname string) []amAlert {
	t.Helper()
	code, body, err := deploytest.HTTPGet(base+"/api/v2/alerts?filter="+url.QueryEscape(`alertname="`+alertname+`"`), "")
	if err != nil || code != 200 {
		t.Fatalf("Alertmanager /api/v2/alerts: %d %v %s", code, err, body)
	}
	var as []amAlert
	if err := json.Unmarshal(body, &as); err != nil {
		t.Fatal(err)
	}
	return as
}

// promQuery evaluates an instant query on Prometheus and returns its vector.
func promQuery(t *testing.T, base, q string) ([]struct {
	Metric map[string]string `json:"metric"`
	Value  [2]any            `json:"value"`
}, error) {
	t.Helper()
	code, body, err := deploytest.HTTPGet(base+"/api/v1/query?query="+url.QueryEscape(q), "")
	if err != nil {
		return nil, err
	}
	var r struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			ResultType string `json:"resultType"`
			Result     []struct {
				Metric map[string]string `json:"metric"`
				Value  [2]any            `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, fmt.Errorf("%d %s", code, body)
	}
	if r.Status != "success" {
		return nil, fmt.Errorf("%s: %s", r.Status, r.Error)
	}
	if r.Data.ResultType != "vector" {
		return nil, fmt.Errorf("result type %s, want vector", r.Data.ResultType)
	}
	return r.Data.Result, nil
}

// promValue is the single value of q, or false when q has no or several series.
func promValue(t *testing.T, base, q string) (string, bool) {
	res, err := promQuery(t, base, q)
	if err != nil || len(res) != 1 {
		return "", false
	}
	s, _ := res[0].Value[1].(string)
	return s, true
}

// promRuleFiring returns the labels of the first alert named alertname that Prometheus's
// /api/v1/alerts reports as firing.
func promRuleFiring(t *testing.T, base, alertname string) (map[string]string, bool) {
	code, body, err := deploytest.HTTPGet(base+"/api/v1/alerts", "")
	if err != nil || code != 200 {
		return nil, false
	}
	var r struct {
		Data struct {
			Alerts []struct {
				Labels map[string]string `json:"labels"`
				State  string            `json:"state"`
			} `json:"alerts"`
		} `json:"data"`
	}
	json.Unmarshal(body, &r)
	for _, a := range r.Data.Alerts {
		if a.Labels["alertname"] == alertname && a.State == "firing" {
			return a.Labels, true
		}
	}
	return nil, false
}

const (
	alertInvalidated = "CfguardCounterfactualsInvalidated"
	alertQuality     = "CfguardModelQualityDegraded"
)

// TestAlertReachesAlertmanager runs the shipped Prometheus and Alertmanager configurations
// (addresses, intervals and the webhook's host changed for the test, the metrics-token option
// uncommented) against a daemon on loopback, registers counterfactuals, drives drift that
// invalidates them, and waits for CfguardCounterfactualsInvalidated at Alertmanager's API and
// at the paging webhook. It logs how long that took from the first drift record, then runs
// every query of the Grafana dashboard on the same Prometheus.
//
// The rules file is alerts/rules.yml itself (by absolute path, since the configuration moves to a
// temporary directory); CfguardCounterfactualsInvalidated has no `for:`, so no rule is changed.
// Only addresses, the token file and timings are rewritten: scrape and evaluation intervals of
// 1 s (15 s shipped) and group_wait of 1 s (10 s for pages) keep the test near 10 s, so it also
// runs under -short.
func TestAlertReachesAlertmanager(t *testing.T) {
	root := tooltest.RepoRoot(t)
	const token, metricsToken = "t0ken", "m3trics"

	// The rule fires on the first evaluation that sees an invalidated counterfactual; with a
	// `for:` the waits below would be too short, and the rule would have to be copied.
	rules := readYAMLMap(t, filepath.Join(root, "alerts", "rules.yml"))
	found := false
	for _, g := range rules["groups"].([]any) {
		for _, r := range g.(map[string]any)["rules"].([]any) {
			if r.(map[string]any)["alert"] == alertInvalidated {
				found = true
				if f, ok := r.(map[string]any)["for"]; ok {
					t.Fatalf("alerts/rules.yml: %s has for: %v; this test waits 45 s and assumes none", alertInvalidated, f)
				}
			}
		}
	}
	if !found {
		t.Fatalf("alerts/rules.yml has no alert %s", alertInvalidated)
	}

	// The daemon, learning at its default settings: flipped labels invalidate counterfactuals by
	// the evidence they bring.
	cfg := config.Default()
	cfg.Kafka.MaxRecords, cfg.Kafka.MaxRecordsBacklog = 32, 32
	cfg.Kafka.MaxWait = 300 * time.Millisecond
	cfg.Certify.Samples = 400
	cfg.Audit.Schedule = ""
	cfg.HTTP.Token, cfg.HTTP.MetricsToken = token, metricsToken
	d := deploytest.StartDaemon(t, cfg)
	mon := startMonitoring(t, root, d.HTTPAddr(), metricsToken)
	promBase, amBase, hook := mon.prom, mon.am, mon.hook

	// Counterfactuals, certified and seen so by Prometheus before any drift.
	data, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	const n = 6
	deploytest.RegisterCounterfactuals(t, d, token, data.X, n)
	waitfor.Cond(t, 20*time.Second, "Prometheus to see the certified counterfactuals", func() bool {
		c, ok1 := promValue(t, promBase, `cfguard_counterfactuals{job="cfguard",status="certified"}`)
		i, ok2 := promValue(t, promBase, `cfguard_counterfactuals{job="cfguard",status="invalidated"}`)
		return ok1 && ok2 && c == fmt.Sprint(n) && i == "0"
	})
	if as := alertmanagerAlerts(t, amBase, alertInvalidated); len(as) != 0 {
		t.Fatalf("%s at Alertmanager before any drift: %+v", alertInvalidated, as)
	}

	// 256 correctly labelled records first, so that the prequential detector has a reference.
	var good []kafka.Message
	for i := 0; i < 256; i++ {
		b, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("good%d", i), "features": data.X[i], "label": data.Y[i]})
		good = append(good, kafka.Message{Value: b})
	}
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(d.BrokerAddrs()...), Topic: cfg.Kafka.Topic, RequiredAcks: kafka.RequireAll, BatchSize: len(data.X)}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, good...); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 30*time.Second, "the 256 correct records applied", func() bool {
		_, body, err := deploytest.HTTPGet("http://"+d.HTTPAddr()+"/metrics", metricsToken)
		return err == nil && bytes.Contains(body, []byte(`cfguard_records_total{result="applied"} 256`))
	})
	if as := alertmanagerAlerts(t, amBase, alertInvalidated); len(as) != 0 {
		t.Fatalf("%s at Alertmanager under correct labels: %+v", alertInvalidated, as)
	}

	// Drift: every row of the data set with the other label (569 records, increments of 32).
	var recs []kafka.Message
	for i := range data.X {
		b, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("flip%d", i), "features": data.X[i], "label": 1 - data.Y[i]})
		recs = append(recs, kafka.Message{Value: b})
	}
	t0 := time.Now()
	if err := w.WriteMessages(ctx, recs...); err != nil {
		t.Fatal(err)
	}
	produced := time.Since(t0)

	var tMetric, tRule, tAM, tHook, tQuality time.Duration
	var amAlerts []amAlert
	var promLabels map[string]string
	appliedAtMetric := ""
	deadline := t0.Add(60 * time.Second)
	for tRule == 0 || tAM == 0 || tHook == 0 || tQuality == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: daemon metric invalidated > 0 at %v, Prometheus rule firing at %v, Alertmanager at %v, paging webhook at %v, %s at Alertmanager at %v (0 = not yet)",
				time.Since(t0).Round(time.Millisecond), tMetric, tRule, tAM, tHook, alertQuality, tQuality)
		}
		now := time.Since(t0)
		if tMetric == 0 {
			_, body, err := deploytest.HTTPGet("http://"+d.HTTPAddr()+"/metrics", metricsToken)
			if err == nil && !bytes.Contains(body, []byte(`cfguard_counterfactuals{status="invalidated"} 0`)) &&
				bytes.Contains(body, []byte(`cfguard_counterfactuals{status="invalidated"} `)) {
				tMetric = now
				for _, line := range strings.Split(string(body), "\n") {
					if strings.HasPrefix(line, `cfguard_records_total{result="applied"} `) {
						appliedAtMetric = strings.TrimPrefix(line, `cfguard_records_total{result="applied"} `)
					}
				}
			}
		}
		if tQuality == 0 {
			if as := alertmanagerAlerts(t, amBase, alertQuality); len(as) > 0 {
				tQuality = now
			}
		}
		if tRule == 0 {
			if l, ok := promRuleFiring(t, promBase, alertInvalidated); ok {
				tRule, promLabels = now, l
			}
		}
		if tAM == 0 {
			if as := alertmanagerAlerts(t, amBase, alertInvalidated); len(as) > 0 {
				tAM, amAlerts = now, as
			}
		}
		if at, ok := hook.firstWith("/page", alertInvalidated); ok && tHook == 0 {
			tHook = at.Sub(t0)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("first drift record to %s: daemon metric %v (after %s flipped records applied), Prometheus rule firing %v, at Alertmanager's API %v, at the paging webhook %v; %s at Alertmanager %v (producing %d records took %v; scrape and evaluation every 1 s, group_wait 1 s)",
		alertInvalidated, tMetric.Round(time.Millisecond), appliedAtMetric, tRule.Round(time.Millisecond), tAM.Round(time.Millisecond), tHook.Round(time.Millisecond),
		alertQuality, tQuality.Round(time.Millisecond), len(recs), produced.Round(time.Millisecond))

	// The labels Prometheus gives the alert (the rule's, the series' and the scrape's) and the
	// ones Alertmanager holds are the rule's and the target's.
	want := map[string]string{"alertname": alertInvalidated, "severity": "critical", "status": "invalidated", "job": "cfguard", "instance": d.HTTPAddr()}
	if len(amAlerts) != 1 {
		t.Errorf("%d %s alerts at Alertmanager, want 1 (one daemon): %+v", len(amAlerts), alertInvalidated, amAlerts)
	}
	a := amAlerts[0]
	if a.Status.State != "active" {
		t.Errorf("alert at Alertmanager is %q, want active", a.Status.State)
	}
	for k, v := range want {
		if promLabels[k] != v {
			t.Errorf("alert in Prometheus: label %s=%q, want %q (labels %v)", k, promLabels[k], v, promLabels)
		}
		if a.Labels[k] != v {
			t.Errorf("alert at Alertmanager: label %s=%q, want %q (labels %v)", k, a.Labels[k], v, a.Labels)
		}
	}
	if _, ok := hook.firstWith("/ticket", alertInvalidated); ok {
		t.Errorf("%s went to the ticket receiver; critical alerts page", alertInvalidated)
	}
	// The daemon agrees that counterfactuals were invalidated.
	code, body := deploytest.APIDo(t, d, token, "GET", "/v1/counterfactuals?status=invalidated", nil)
	if code != 200 || !bytes.Contains(body, []byte(`"id":"ce-`)) {
		t.Errorf("GET /v1/counterfactuals?status=invalidated: %d %s", code, body)
	}

	// Every query of the dashboard evaluates on this Prometheus and returns series; the smallest
	// bound has none while no counterfactual is certified, the replicas' none on a single daemon.
	certified, _ := promValue(t, promBase, `cfguard_counterfactuals{job="cfguard",status="certified"}`)
	for where, q := range deploytest.LoadDashboard(t).Queries(t) {
		q = strings.NewReplacer("$job", ".*", "$instance", ".*", "$__rate_interval", "1m").Replace(q)
		res, err := promQuery(t, promBase, q)
		switch {
		case err != nil:
			t.Errorf("dashboard %s: %s: %v", where, q, err)
		case len(res) == 0 && strings.Contains(q, alerts.NameBoundMin) && certified == "0":
		case len(res) == 0 && (strings.Contains(q, alerts.NameLogStopped) || strings.Contains(q, alerts.NameLogLag) || strings.Contains(q, alerts.NameUnauthenticated) || strings.Contains(q, alerts.NameLogIgnored) ||
			strings.Contains(q, alerts.NameCERebuilding) || strings.Contains(q, alerts.NameCEBlocked) || strings.Contains(q, alerts.NameSettingsDiffer)):
			// A single daemon exports no replica series; those panels say "no replicas".
		case len(res) == 0:
			t.Errorf("dashboard %s: %s returns no series", where, q)
		}
	}
}

// monitoring is a Prometheus on the shipped prometheus.yml and rules and an Alertmanager on the
// shipped alertmanager.yml, its receivers pointed at hook.
type monitoring struct {
	prom, am string // base URLs
	hook     *hookRecorder
}

// startMonitoring starts Alertmanager and Prometheus on loopback, Prometheus scraping target with
// the metrics token. Only addresses, the token file and timings are rewritten: scrape and
// evaluation every 1 s (15 s shipped) and group_wait 1 s (10 s for pages); the rules file is
// alerts/rules.yml itself. It waits until Prometheus scrapes the target.
func startMonitoring(t *testing.T, root, target, metricsToken string) monitoring {
	t.Helper()
	promBin := tooltest.Command(t, "apt-get install prometheus", "prometheus")
	amBin := tooltest.Command(t, "apt-get install prometheus-alertmanager", "prometheus-alertmanager", "alertmanager")
	hook := &hookRecorder{posts: map[string][]hookPost{}}
	hookSrv := httptest.NewServer(hook)
	t.Cleanup(hookSrv.Close)

	// Alertmanager on alertmanager.yml: its receivers at the recorder, group waits of 1 s.
	am := readYAMLMap(t, filepath.Join(root, "deploy", "prometheus", "alertmanager.yml"))
	for _, r := range am["receivers"].([]any) {
		for _, w := range r.(map[string]any)["webhook_configs"].([]any) {
			u, err := url.Parse(w.(map[string]any)["url"].(string))
			if err != nil {
				t.Fatal(err)
			}
			w.(map[string]any)["url"] = hookSrv.URL + u.Path
		}
	}
	// group_interval of 1 s too: a notification that follows a group's first (a resolved one
	// included) waits group_interval, 5 minutes as shipped, longer than any of these tests.
	route := am["route"].(map[string]any)
	route["group_wait"], route["group_interval"] = "1s", "1s"
	for _, sub := range route["routes"].([]any) {
		sub.(map[string]any)["group_wait"], sub.(map[string]any)["group_interval"] = "1s", "1s"
	}
	amDir := t.TempDir()
	writeYAML(t, filepath.Join(amDir, "alertmanager.yml"), am)
	amProc := startProcess(t, "alertmanager", amBin, "--config.file="+filepath.Join(amDir, "alertmanager.yml"),
		"--storage.path="+filepath.Join(amDir, "data"), "--web.listen-address=127.0.0.1:0", "--cluster.listen-address=", "--log.level=info")
	amAddr := amProc.listening(t)
	amBase := "http://" + amAddr
	amProc.waitReady(t, amBase+"/-/ready")

	// Prometheus on prometheus.yml with the metrics token, scraping and evaluating every 1 s.
	promText, err := os.ReadFile(filepath.Join(root, "deploy", "prometheus", "prometheus.yml"))
	if err != nil {
		t.Fatal(err)
	}
	pc := deploytest.LoadPromConfig(t, deploytest.UncommentAuthorization(t, promText))
	promDir := t.TempDir()
	global := pc["global"].(map[string]any)
	global["scrape_interval"], global["evaluation_interval"] = "1s", "1s"
	pc["rule_files"] = []any{filepath.Join(root, "alerts", "rules.yml")}
	pc["alerting"].(map[string]any)["alertmanagers"].([]any)[0].(map[string]any)["static_configs"].([]any)[0].(map[string]any)["targets"] = []any{amAddr}
	job := pc.Job(t, "cfguard")
	job["static_configs"].([]any)[0].(map[string]any)["targets"] = []any{target}
	credentials := filepath.Join(promDir, "cfguard-metrics-token")
	if err := os.WriteFile(credentials, []byte(metricsToken), 0o600); err != nil {
		t.Fatal(err)
	}
	job["authorization"].(map[string]any)["credentials_file"] = credentials
	promProc := startProcess(t, "prometheus", promBin, "--config.file="+pc.Write(t, promDir),
		"--storage.tsdb.path="+filepath.Join(promDir, "data"), "--web.listen-address=127.0.0.1:0", "--log.level=info")
	promBase := "http://" + promProc.listening(t)
	promProc.waitReady(t, promBase+"/-/ready")
	waitfor.Cond(t, 20*time.Second, "Prometheus to scrape cfguard with the metrics token (up == 1)", func() bool {
		v, ok := promValue(t, promBase, `up{job="cfguard"}`)
		return ok && v == "1"
	})

	return monitoring{prom: promBase, am: amBase, hook: hook}
}
