package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/ledger"
)

// BenchmarkIngestDuringAudit measures sustained ingest (records/s from the first record to the
// last applied) over a ledger of 10^5 stored CEs (CFGUARD_AUDIT_CES to change), without and with
// full audits running back to back for the whole ingest: records/s without,
// records/s_audit with, and ratio = records/s_audit / records/s (goal >= 0.8), both measured in
// every iteration, in alternating order. Both start from a copy of the same ledger (the model,
// the CEs, no offsets), so they consume the same records into the same increments.
// certify.samples is 400. Run:
//
//	go test -run '^$' -bench IngestDuringAudit -benchtime 1x ./daemon
func BenchmarkIngestDuringAudit(b *testing.B) {
	const records = 32000 // 500 increments of kafka.max_records 64
	nCEs := 100_000
	if s := os.Getenv("CFGUARD_AUDIT_CES"); s != "" {
		var err error
		if nCEs, err = strconv.Atoi(s); err != nil || nCEs < 1 {
			b.Fatalf("CFGUARD_AUDIT_CES=%q", s)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	br, set, m, modelDir := benchStream(b, records)
	const samples = 400
	base := benchLedger(b, m, set.X, nCEs, samples)

	// once ingests every record into a fresh copy of the ledger, with or without audits running
	// back to back, and returns the wall time from the daemon's start to the last record applied,
	// the audits completed and the CEs audited meanwhile.
	once := func(b *testing.B, name string, i int, audit bool) (time.Duration, int, int) {
		state := b.TempDir()
		copyFile(b, base, filepath.Join(state, ledger.FileName))
		c := config.Default()
		c.StateDir, c.HTTP.Listen, c.Model.Path = state, "127.0.0.1:0", modelDir
		c.Kafka.Brokers, c.Kafka.GroupID = br.Addrs(), fmt.Sprintf("audit-bench-%s-%d-%d", name, b.N, i)
		c.Certify.Samples = samples
		c.Audit.Schedule = ""
		rctx, stop := context.WithCancel(ctx)
		defer stop()
		ready := make(chan *Daemon, 1)
		done := make(chan error, 1)
		go func() {
			done <- Run(rctx, Options{Config: &c, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Registry: prometheus.NewRegistry(), Ready: ready})
		}()
		d := <-ready
		t0 := time.Now()
		type result struct{ audits, evaluated int }
		auditDone := make(chan result, 1)
		actx, stopAudits := context.WithCancel(rctx)
		if audit {
			go func() {
				var r result
				for actx.Err() == nil {
					rep, err := d.runAudit(actx, "bench")
					r.evaluated += rep.Evaluated // the report counts the batches written before a cancel too
					if err == nil {
						r.audits++
					} else if actx.Err() == nil {
						b.Error(err)
						break
					}
				}
				auditDone <- r
			}()
		} else {
			auditDone <- result{}
		}
		for {
			st, err := d.ledger.State()
			if err != nil {
				b.Fatal(err)
			}
			if st.Applied == records {
				break
			}
			time.Sleep(2 * time.Millisecond)
		}
		wall := time.Since(t0)
		stopAudits()
		r := <-auditDone
		stop()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		return wall, r.audits, r.evaluated
	}
	// Each iteration runs both, in alternating order, so that the ratio compares runs made
	// under the same load of a shared machine.
	var plain, audited time.Duration
	audits, evaluated := 0, 0
	for i := 0; i < b.N; i++ {
		for k := 0; k < 2; k++ {
			withAudit := (i+k)%2 == 1
			wall, n, e := once(b, fmt.Sprint(withAudit), i, withAudit)
			if withAudit {
				audited += wall
				audits += n
				evaluated += e
			} else {
				plain += wall
			}
		}
	}
	plainRate, auditRate := float64(records*b.N)/plain.Seconds(), float64(records*b.N)/audited.Seconds()
	b.ReportMetric(plainRate, "records/s")
	b.ReportMetric(auditRate, "records/s_audit")
	b.ReportMetric(auditRate/plainRate, "ratio")
	b.ReportMetric(float64(evaluated)/audited.Seconds(), "audited_CEs/s")
	b.ReportMetric(float64(audits)/float64(b.N), "audits_completed/op")
}

// benchLedger writes a ledger holding m as its current posterior and n CEs anchored to it (x_cf
// rows in the <delta, epsilon>-set for class 1 under samples draws, cycled), and returns its path.
func benchLedger(b *testing.B, m *bnn.Model, X [][]float64, n, samples int) string {
	dir := b.TempDir()
	c := config.Default() // the daemon's policy, so that its Open does not rebuild the indexes
	policy := certify.Policy{Mode: c.Certify.Mode, EpsilonMax: c.Certify.EpsilonMax, Alpha: certify.DefaultAlpha}
	l, err := ledger.Open(dir, ledger.Options{Policy: policy, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
		b.Fatal(err)
	}
	p, err := m.Predict(X, samples, 7)
	if err != nil {
		b.Fatal(err)
	}
	var xs, cfs []int
	for i := range X {
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
	batch := make([]*ledger.CE, 0, 5000)
	for k := 0; k < n; k++ {
		x, cf := xs[k%len(xs)], cfs[k%len(cfs)]
		batch = append(batch, &ledger.CE{ID: fmt.Sprintf("ce-%07d", k), X: X[x], XCF: X[cf], Target: 1, AnchorVersion: m.Version,
			P1: p.P(cf, 1), Var1: p.V(cf, 1), Samples: samples, Delta: 0.05, Epsilon: 0.01})
		if len(batch) == cap(batch) || k == n-1 {
			if err := l.Put(context.Background(), batch...); err != nil {
				b.Fatal(err)
			}
			batch = batch[:0]
		}
	}
	return l.Path()
}

func copyFile(b *testing.B, from, to string) {
	src, err := os.ReadFile(from)
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(to, src, 0o600); err != nil {
		b.Fatal(err)
	}
}
