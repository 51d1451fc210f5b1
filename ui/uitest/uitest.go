// Package uitest starts a real daemon for the UI's tests: the embedded broker, the bundled
// breast-cancer model, counterfactuals registered through the API and records produced over
// Kafka, so that the pages have CEs in several statuses to show.
package uitest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// Daemon is a running daemon and how to reach it.
type Daemon struct {
	Base  string // http://127.0.0.1:PORT
	Token string
	cfg   config.Config
}

type testLog struct{ t testing.TB }

func (w testLog) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// Start runs a daemon at the default settings (but certify.uncertified: store, so every CE
// registered is kept) until the test ends.
func Start(t testing.TB, token string, edit ...func(*config.Config)) *Daemon {
	t.Helper()
	cfg := config.Default()
	cfg.StateDir = t.TempDir()
	cfg.Model.ExportDir = ""
	cfg.Certify.Uncertified = "store"
	httpPort, brokerPort := testnet.Reserve(t), testnet.Reserve(t)
	cfg.HTTP.Listen, cfg.Kafka.EmbeddedListen = httpPort.Addr(), brokerPort.Addr()
	cfg.HTTP.Token = token
	for _, e := range edit {
		e(&cfg)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan *daemon.Daemon, 1), make(chan error, 1)
	log := slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	opts := daemon.Options{Config: &cfg, Logger: log, Registry: prometheus.NewRegistry(), Ready: ready,
		HTTPListener: httpPort.Listen(t), BrokerListener: brokerPort.Listen(t)}
	go func() { done <- daemon.Run(ctx, opts) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("daemon stopped with %v", err)
		}
	})
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("daemon failed to start: %v", err)
	}
	d := &Daemon{Base: "http://" + cfg.HTTP.Listen, Token: token, cfg: cfg}
	waitfor.Cond(t, 2*time.Minute, "the daemon's /readyz", func() bool {
		resp, err := http.Get(d.Base + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	return d
}

// Do sends a request with the daemon's token and returns the status and body.
func (d *Daemon) Do(t testing.TB, method, path string, body []byte) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, d.Base+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if d.Token != "" {
		req.Header.Set("Authorization", "Bearer "+d.Token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, b
}

// JSON GETs path and decodes its body into v.
func (d *Daemon) JSON(t testing.TB, path string, v any) {
	t.Helper()
	code, b := d.Do(t, "GET", path, nil)
	if code != 200 {
		t.Fatalf("GET %s: %d %s", path, code, b)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
}

// Register stores n CEs through POST /v1/counterfactuals:bulk, named ce-000...: the input is a
// row of one class of the bundled data and the counterfactual a row of the other, so that most
// are certified and some stored uncertified. It returns how many were stored (a pair whose x_cf
// the model does not give the target is refused).
func (d *Daemon) Register(t testing.TB, n int) int {
	t.Helper()
	set, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	var byClass [2][]int
	for i, y := range set.Y {
		byClass[y] = append(byClass[y], i)
	}
	var body bytes.Buffer
	for i := range n {
		from, to := i%2, 1-i%2
		x, xcf := set.X[byClass[from][i%len(byClass[from])]], set.X[byClass[to][(i+50)%len(byClass[to])]]
		line, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("ce-%03d", i), "x": x, "x_cf": xcf, "target": to})
		body.Write(append(line, '\n'))
	}
	code, b := d.Do(t, "POST", "/v1/counterfactuals:bulk", body.Bytes())
	if code != 200 {
		t.Fatalf("bulk registration: %d %s", code, b)
	}
	var res struct {
		Stored int `json:"stored"`
	}
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatalf("bulk registration: %v", err)
	}
	return res.Stored
}

// Stream produces correct records of the bundled data with their labels, then flipped ones with
// their labels flipped (a label-noise drift), in chunks of 64 (kafka.max_records: one increment,
// one posterior version, each), each applied before the next is produced; then it waits until no
// CE waits for the confirmer.
func (d *Daemon) Stream(t testing.TB, correct, flipped int) {
	t.Helper()
	set, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	var m struct {
		Applied int64 `json:"applied"`
	}
	d.JSON(t, "/v1/model", &m)
	w := &kafka.Writer{Addr: kafka.TCP(d.cfg.Kafka.EmbeddedListen), Topic: d.cfg.Kafka.Topic, Balancer: &kafka.RoundRobin{}, BatchSize: 64}
	defer w.Close()
	applied := m.Applied
	for i := 0; i < correct+flipped; {
		var msgs []kafka.Message
		for ; len(msgs) < 64 && i < correct+flipped; i++ {
			r, label := i%set.Len(), set.Y[i%set.Len()]
			if i >= correct {
				label = 1 - label
			}
			v, _ := json.Marshal(map[string]any{"id": "rec" + strconv.Itoa(i), "features": set.X[r], "label": label})
			msgs = append(msgs, kafka.Message{Value: v})
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		err := w.WriteMessages(ctx, msgs...)
		cancel()
		if err != nil {
			t.Fatalf("producing %d records: %v", len(msgs), err)
		}
		applied += int64(len(msgs))
		d.Settle(t, applied)
	}
}

// Settle waits until applied records reach applied and no CE waits for a measurement.
func (d *Daemon) Settle(t testing.TB, applied int64) {
	t.Helper()
	waitfor.Cond(t, 5*time.Minute, fmt.Sprintf("%d records applied and no CE waiting for the confirmer", applied), func() bool {
		var m struct {
			Applied int64 `json:"applied"`
		}
		d.JSON(t, "/v1/model", &m)
		return m.Applied >= applied && d.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0
	})
}

// Metric reads one unlabelled sample from /metrics (-1 when absent).
func (d *Daemon) Metric(t testing.TB, name string) float64 {
	t.Helper()
	_, b := d.Do(t, "GET", "/metrics", nil)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err == nil {
				return f
			}
		}
	}
	return -1
}
