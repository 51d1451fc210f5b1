package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// BenchmarkRegisterConcurrent measures registrations per second through a running daemon's
// POST /v1/counterfactuals (HTTP, JSON, Monte-Carlo measurement with certify.samples = 1000 on
// the version's pool, a bbolt transaction fsynced to a real file in a temporary directory) with
// 1 client and with 16 concurrent clients, in one run, each client sending its next
// registration when the last is answered. Concurrent registrations share one measurement and
// one ledger write (group commit); ratio = registrations/s with 16 clients over 1 client. Run:
//
//	go test -run '^$' -bench RegisterConcurrent -benchtime 2000x ./daemon
//
// b.N is the number of registrations of each sub-benchmark (each with fresh ids); per-write is
// the mean number of CEs one ledger write stored (cfguard_counterfactuals_registration_batch_size); cpu-ms/reg
// is the CPU time of the whole process (daemon and clients) per registration, so that
// registrations/s can be read against what the cores allow (cores x 1000 / cpu-ms/reg).
func BenchmarkRegisterConcurrent(b *testing.B) {
	_, set, m, modelDir := benchStream(b, 1)
	c := config.Default()
	c.StateDir, c.HTTP.Listen, c.Model.Path = b.TempDir(), "127.0.0.1:0", modelDir
	c.Kafka.EmbeddedListen = "127.0.0.1:0"
	c.Audit.Schedule = ""
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan *Daemon, 1)
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Options{Config: &c, Logger: slog.New(slog.DiscardHandler), Registry: prometheus.NewRegistry(), Ready: ready})
	}()
	d := <-ready
	defer func() {
		cancel()
		if err := <-done; err != nil {
			b.Error(err)
		}
	}()
	p, err := m.Predict(set.X, 1000, 1)
	if err != nil {
		b.Fatal(err)
	}
	var xs, cfs []int
	for i := range set.X {
		switch {
		case p.Argmax(i) == 0 && p.P(i, 0) > 0.9:
			xs = append(xs, i)
		case p.P(i, 1) > 0.985 && p.V(i, 1) < 0.002:
			cfs = append(cfs, i)
		}
	}
	if len(xs) == 0 || len(cfs) == 0 {
		b.Fatalf("no candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	url := "http://" + d.HTTPAddr() + "/v1/counterfactuals"
	var seq atomic.Int64
	register := func() error {
		k := int(seq.Add(1))
		body, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("ce-%d", k), "x": set.X[xs[k%len(xs)]], "x_cf": set.X[cfs[k%len(cfs)]], "target": "benign"})
		resp, err := client.Post(url, "application/json", bytes.NewReader(body))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		msg, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusCreated {
			return fmt.Errorf("%d %s", resp.StatusCode, msg)
		}
		return nil
	}
	if err := register(); err != nil { // the version's pool is drawn by the first registration
		b.Fatal(err)
	}
	rates := map[int]float64{}
	for _, clients := range []int{1, 16} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
			writes0, stored0 := histogramOf(b, d)
			cpu0 := processCPU(b)
			var next atomic.Int64
			var wg sync.WaitGroup
			errs := make(chan error, clients)
			t0 := time.Now()
			for w := 0; w < clients; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for next.Add(1) <= int64(b.N) {
						if err := register(); err != nil {
							errs <- err
							return
						}
					}
				}()
			}
			wg.Wait()
			elapsed := time.Since(t0)
			cpu := processCPU(b) - cpu0
			close(errs)
			for err := range errs {
				b.Fatal(err)
			}
			writes, stored := histogramOf(b, d)
			rates[clients] = float64(b.N) / elapsed.Seconds()
			b.ReportMetric(rates[clients], "registrations/s")
			b.ReportMetric((stored-stored0)/float64(writes-writes0), "per-write")
			b.ReportMetric(float64(cpu)/1e6/float64(b.N), "cpu-ms/reg")
			if clients > 1 && rates[1] > 0 {
				b.ReportMetric(rates[clients]/rates[1], "ratio")
			}
		})
	}
}

// histogramOf reads cfguard_counterfactuals_registration_batch_size of a daemon: writes and CEs stored.
func histogramOf(b *testing.B, d *Daemon) (writes uint64, stored float64) {
	mfs, err := d.reg.Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "cfguard_counterfactuals_registration_batch_size" {
			h := mf.GetMetric()[0].GetHistogram()
			return h.GetSampleCount(), h.GetSampleSum()
		}
	}
	b.Fatal("cfguard_counterfactuals_registration_batch_size not found")
	return 0, 0
}

// processCPU is the CPU time (user and system) this process has used (tooltest.SelfCPU).
func processCPU(b *testing.B) time.Duration {
	d, ok := tooltest.SelfCPU()
	if !ok {
		b.Fatal("getrusage gave no CPU time")
	}
	return d
}
