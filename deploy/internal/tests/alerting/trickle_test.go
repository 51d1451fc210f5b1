package alerting

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/deploy/internal/deploytest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestMeasureTrickle is a measurement, run on demand: CFGUARD_MEASURE_TRICKLE=30m go test
// ./deploy/internal/tests/alerting -run TestMeasureTrickle -v -timeout 45m. The daemon at its
// default settings (every update.*, certify.* and kafka.* setting; only addresses and tokens
// differ) beside the shipped Prometheus rules and Alertmanager, 24 certified counterfactuals, and
// correctly labelled breast-cancer records at 2 per second for the given duration. It counts
// firing alert episodes (none is expected), and compares the counterfactuals' p(target) at the
// end with the start.
func TestMeasureTrickle(t *testing.T) {
	d0 := os.Getenv("CFGUARD_MEASURE_TRICKLE")
	if d0 == "" {
		t.Skip("a measurement: set CFGUARD_MEASURE_TRICKLE to a duration (e.g. 30m)")
	}
	dur, err := time.ParseDuration(d0)
	if err != nil {
		t.Fatalf("CFGUARD_MEASURE_TRICKLE=%q: %v", d0, err)
	}
	tooltest.Command(t, "apt-get install prometheus", "prometheus")
	tooltest.Command(t, "apt-get install prometheus-alertmanager", "prometheus-alertmanager", "alertmanager")
	root := tooltest.RepoRoot(t)
	const token, metricsToken, nCEs = "t0ken", "m3trics", 24

	proc, d := startDefault(t, token, metricsToken, nil)
	cfg := proc.cfg
	mon := startMonitoring(t, root, cfg.HTTP.Listen, metricsToken)
	data, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	deploytest.RegisterCounterfactuals(t, d, token, data.X, nCEs)
	ids := make([]string, nCEs)
	for k := range ids {
		ids[k] = fmt.Sprintf("ce-%d", k)
	}
	// p(target) of each counterfactual's x_cf under the current posterior (POST /v1/predict).
	pNow := func() []float64 {
		var xcf [][]float64
		for _, id := range ids {
			code, body := deploytest.APIDo(t, d, token, "GET", "/v1/counterfactuals/"+id, nil)
			var ce struct {
				XCF []float64 `json:"x_cf"`
			}
			if code != 200 || json.Unmarshal(body, &ce) != nil {
				t.Fatalf("GET %s: %d %s", id, code, body)
			}
			xcf = append(xcf, ce.XCF)
		}
		code, body := deploytest.APIDo(t, d, token, "POST", "/v1/predict", map[string]any{"xs": xcf})
		var resp struct {
			Predictions []struct {
				P []float64 `json:"p"`
			} `json:"predictions"`
		}
		if code != 200 || json.Unmarshal(body, &resp) != nil {
			t.Fatalf("predict: %d %s", code, body)
		}
		out := make([]float64, len(ids))
		for i, p := range resp.Predictions {
			out[i] = p.P[1]
		}
		return out
	}
	p0 := pNow()

	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(d.BrokerAddrs()...), Topic: cfg.Kafka.Topic, RequiredAcks: kafka.RequireAll, BatchSize: 1}
	defer w.Close()
	start := time.Now()
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	sent := 0
	for time.Since(start) < dur {
		<-tick.C
		i := sent % len(data.X)
		b, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("t%d", sent), "features": data.X[i], "label": data.Y[i]})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := w.WriteMessages(ctx, kafka.Message{Value: b}); err != nil {
			cancel()
			t.Fatal(err)
		}
		cancel()
		sent++
		if sent%600 == 0 {
			v, _ := metricsSample(t, cfg.HTTP.Listen, metricsToken, "cfguard_posterior_version")
			t.Logf("%v: %d records sent, posterior version %v", time.Since(start).Round(time.Second), sent, v)
		}
	}
	waitfor.Cond(t, 2*time.Minute, "every record applied and no renewal pending", func() bool {
		a, _ := metricsSample(t, cfg.HTTP.Listen, metricsToken, `cfguard_records_total{result="applied"}`)
		p, _ := metricsSample(t, cfg.HTTP.Listen, metricsToken, "cfguard_counterfactuals_renewal_pending")
		return a == float64(sent) && p == 0
	})
	time.Sleep(3 * time.Second) // a few more rule evaluations on the final state
	p1 := pNow()
	var m0, m1, dmin, dsd float64
	dmin = math.Inf(1)
	for i := range p0 {
		m0 += p0[i] / float64(len(p0))
		m1 += p1[i] / float64(len(p1))
		dmin = min(dmin, p1[i]-p0[i])
	}
	for i := range p0 {
		d := p1[i] - p0[i] - (m1 - m0)
		dsd += d * d / float64(len(p0)-1)
	}
	code, body := deploytest.APIDo(t, d, token, "GET", "/v1/model", nil)
	var model struct {
		KLHistory []struct {
			KL float64 `json:"kl"`
		} `json:"kl_history"`
		Counterfactuals map[string]int `json:"counterfactuals"`
		Prequential     map[string]any `json:"prequential"`
	}
	if code != 200 || json.Unmarshal(body, &model) != nil {
		t.Fatalf("GET /v1/model: %d %s", code, body)
	}
	version, _ := metricsSample(t, cfg.HTTP.Listen, metricsToken, "cfguard_posterior_version")
	renewed, _ := metricsSample(t, cfg.HTTP.Listen, metricsToken, "cfguard_counterfactuals_renewed_total")
	maxKL := 0.0
	for _, h := range model.KLHistory {
		maxKL = max(maxKL, h.KL)
	}
	firing := promRange(t, mon.prom, `ALERTS{alertstate="firing"}`, start, time.Now())
	pending := promRange(t, mon.prom, `ALERTS{alertstate="pending"}`, start, time.Now())
	t.Logf("%v at 2 records/s: %d records, %v posterior versions, largest of the last %d update KLs %.3g; statuses %v; %v renewals; "+
		"p(target) of the %d counterfactuals: mean %.4f -> %.4f (change %+.4f, sd of the changes %.4f, smallest %+.4f); prequential %v; "+
		"firing alerts %v, pending %v",
		dur, sent, version, len(model.KLHistory), maxKL, model.Counterfactuals, renewed, len(p0), m0, m1, m1-m0, math.Sqrt(dsd), dmin,
		model.Prequential, firing, pending)
	if len(firing) != 0 {
		t.Errorf("alerts fired under correct labels: %v", firing)
	}
	if model.Counterfactuals["certified"] != nCEs {
		t.Errorf("statuses %v, want all %d certified", model.Counterfactuals, nCEs)
	}
	// The pool behind /v1/predict has 1,000 draws: a p near 0.98 with variance ~1e-3 is known to
	// about 0.001; the mean over 24 CEs to less.
	if m1 < m0-0.003 {
		t.Errorf("mean p(target) fell from %.4f to %.4f", m0, m1)
	}
}
