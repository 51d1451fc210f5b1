package alerting

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

const alertLost = "CfguardRecordsLost"

// TestRecordsLostPagesAcrossRestarts runs the daemon at the default settings on a broker of the
// test's own whose topics keep records 30 minutes, beside a real Prometheus and Alertmanager
// with the shipped rules. The daemon applies 64 records and stops; 32 records stamped an hour
// ago and 16 new ones are produced and the broker applies its retention, deleting the 32 unread.
// Started again, the daemon reads on from the 16 and counts the 32 lost: CfguardRecordsLost
// reaches the paging webhook with the input topic's name, and through one more restart it keeps
// firing (one episode, the same startsAt at Alertmanager, no resolved notification), since the
// ledger keeps the loss's time.
func TestRecordsLostPagesAcrossRestarts(t *testing.T) {
	if testing.Short() {
		t.Skip("real Prometheus and Alertmanager through two restarts")
	}
	root := tooltest.RepoRoot(t)
	const token, metricsToken = "t0ken", "m3trics"
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"cfguard.records", "cfguard.records.dlq", "cfguard.events"},
		Partitions: 1, Retention: 30 * time.Minute, RetentionCheckInterval: time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	proc, _ := startDefault(t, token, metricsToken, func(c *config.Config) { c.Kafka.Brokers = b.Addrs() })
	cfg := proc.cfg
	mon := startMonitoring(t, root, cfg.HTTP.Listen, metricsToken)
	data, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	produce := func(prefix string, n int, at time.Time) {
		t.Helper()
		msgs := make([]kafka.Message, n)
		for i := range msgs {
			v, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("%s%d", prefix, i), "features": data.X[i], "label": data.Y[i]})
			msgs[i] = kafka.Message{Value: v, Time: at}
		}
		w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()...), Topic: cfg.Kafka.Topic, RequiredAcks: kafka.RequireAll, BatchSize: n}
		defer w.Close()
		wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
		defer wcancel()
		if err := w.WriteMessages(wctx, msgs...); err != nil {
			t.Fatal(err)
		}
	}
	sample := func(series string) float64 {
		v, _ := metricsSample(t, cfg.HTTP.Listen, metricsToken, series)
		return v
	}
	lost := `cfguard_records_lost_total{topic="cfguard.records"}`

	produce("applied", 64, time.Time{})
	waitfor.Cond(t, 60*time.Second, "64 records applied, and Prometheus holding a count of 0 lost", func() bool {
		v, ok := promValue(t, mon.prom, `cfguard_records_lost_total{job="cfguard",topic="cfguard.records"}`)
		return sample(`cfguard_records_total{result="applied"}`) == 64 && ok && v == "0"
	})
	proc.stop()
	produce("deleted", 32, time.Now().Add(-time.Hour))
	produce("after", 16, time.Time{})
	b.ApplyRetention()
	proc.start()
	t0 := time.Now()
	waitfor.Cond(t, 60*time.Second, alertLost+" at the paging webhook", func() bool {
		_, ok := mon.hook.firstWith("/page", alertLost)
		return ok
	})
	t.Logf("restart to %s at the paging webhook: %v; lost %v, applied since the start %v", alertLost, time.Since(t0).Round(time.Millisecond),
		sample(lost), sample(`cfguard_records_total{result="applied"}`))
	if v := sample(lost); v != 32 {
		t.Errorf("%s = %v, want 32", lost, v)
	}
	as := alertmanagerAlerts(t, mon.am, alertLost)
	if len(as) != 1 || as[0].Labels["topic"] != "cfguard.records" {
		t.Fatalf("Alertmanager holds %+v, want one %s alert for topic cfguard.records", as, alertLost)
	}
	startsAt, firing := as[0].StartsAt, time.Now()

	proc.stop()
	stopped := time.Now()
	proc.start()
	scrapedSince(t, mon, stopped)
	if v := sample(lost); v != 32 {
		t.Errorf("after a restart %s = %v, want 32 (kept in the ledger, not counted again)", lost, v)
	}
	evaluatedAfter(t, mon, time.Now().Add(3*time.Second))
	oneEpisode(t, mon, alertLost, firing, startsAt)
	noResolved(t, mon)
}
