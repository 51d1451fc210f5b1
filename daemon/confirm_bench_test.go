package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/update"
)

// BenchmarkConfirmUnderDrift runs the daemon's confirmer (newConfirmer) against a ledger while
// posteriors are promoted every 25 ms, as under continuous learning, and reports what became of
// its Monte-Carlo measurements (ledger.Measurements, cfguard_counterfactuals_measured_total) and
// what it cost. Each iteration runs the same drift three times, interleaved:
//
//	new       the daemon's confirmer: verdicts carried (certify.Carries), batches of
//	          confirmBatch, a new pool before a batch once the newest posterior is past
//	          confirmPoolSlack from the pool's, a CE due at a known version measured under it
//	          while that is within confirmPoolSlack of the newest
//	old       the confirmer before verdicts carried: every verdict measured again under each newer
//	          posterior (ledger.Options.RemeasureVerdicts), batches of 1024, a pool kept until its
//	          pass is done
//	commits   the promotions alone, no confirmer: the CPU the other two are measured against
//
// The drift: N CEs (default 2000, CFGUARD_CONFIRM_CES) registered under the bundled model, then
// an update on 96 benign rows labelled malignant (learning rate 3e-3) fails every certificate,
// then K = 200 updates of 32 correctly labelled rows each at the default learning rate (1e-5),
// all computed with update.LastLayer before the timing starts. Once the last posterior is
// promoted the confirmer finishes its work under it; the run ends when no CE waits.
//
//	kept            kept / (kept + superseded + discarded)
//	measured/CE     measurements per CE over the run
//	at-due/CE       of those, the measurements under the version a CE became due at (a
//	                certificate's lapse version, a verdict's version of no longer carrying)
//	due-reads/batch the due pass's reads of the waiting CEs (ledger.DueLane) per batch of the
//	                pass under the pool's posterior (ledger.ConfirmLaneLeaving)
//	catchup-s       from the last promotion until no CE waits for a measurement
//	confirm-cpu-s   the process's CPU time over the run less that of the commits-only run
//	cpu-ratio       old's confirm-cpu-s over new's
//
// Run:
//
//	go test ./daemon -run '^$' -bench ConfirmUnderDrift -benchtime 1x
func BenchmarkConfirmUnderDrift(b *testing.B) {
	n := 2000
	if s := os.Getenv("CFGUARD_CONFIRM_CES"); s != "" {
		var err error
		if n, err = strconv.Atoi(s); err != nil || n < 1 {
			b.Fatalf("CFGUARD_CONFIRM_CES=%q: want a positive integer", s)
		}
	}
	const versions, every = 200, 25 * time.Millisecond
	set, ds, err := assets.Load("breast_cancer")
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	m0, _, err := bnn.Fit(ctx, set, ds.Classes, bnn.TrainConfig{Seed: 1, Epochs: 5})
	if err != nil {
		b.Fatal(err)
	}
	models, kls := driftPosteriors(b, set, m0, versions)
	klFirst, _, _ := certify.KL(models[len(models)-1], models[1])
	b.Logf("%d CEs; drift KL %.4g, then %d updates: step KL median %.3g, 90th percentile %.3g, max %.3g; KL from the first after the drift to the last %.4g",
		n, kls[0], versions, quantile(kls[1:], 0.5), quantile(kls[1:], 0.9), quantile(kls[1:], 1), klFirst)
	cfg := config.Default()
	modes := []string{"commits", "new", "old"}
	var res [3]driftRun
	for i := 0; i < b.N; i++ {
		for k, mode := range modes {
			r := confirmDrift(b, set, models, n, cfg, mode, every)
			res[k].cpu += r.cpu
			res[k].catchup += r.catchup
			res[k].ms.Kept += r.ms.Kept
			res[k].ms.Superseded += r.ms.Superseded
			res[k].ms.Discarded += r.ms.Discarded
			res[k].atDue += r.atDue
			res[k].dueReads += r.dueReads
			res[k].dueRead += r.dueRead
			res[k].batches += r.batches
		}
	}
	var cpu [3]float64
	for k, mode := range modes[1:] {
		r := res[k+1]
		total := r.ms.Kept + r.ms.Superseded + r.ms.Discarded
		cpu[k+1] = (r.cpu - res[0].cpu).Seconds() / float64(b.N)
		b.Logf("%s: %+v, catch-up %v, process CPU %v (commits alone %v)", mode, r.ms, r.catchup.Round(time.Millisecond),
			r.cpu.Round(time.Millisecond), res[0].cpu.Round(time.Millisecond))
		b.ReportMetric(float64(r.ms.Kept)/float64(max(total, 1)), mode+"-kept")
		b.ReportMetric(float64(total)/float64(n*b.N), mode+"-measured/CE")
		b.ReportMetric(r.catchup.Seconds()/float64(b.N), mode+"-catchup-s")
		b.ReportMetric(cpu[k+1], mode+"-confirm-cpu-s")
		if mode == "new" {
			b.ReportMetric(float64(r.atDue)/float64(n*b.N), mode+"-at-due/CE")
			b.ReportMetric(float64(r.dueReads)/float64(max(r.batches, 1)), mode+"-due-reads/batch")
			b.Logf("%s: %d reads of the due CEs took %v; %d batches", mode, r.dueReads, r.dueRead.Round(time.Millisecond), r.batches)
		}
	}
	b.ReportMetric(cpu[2]/cpu[1], "cpu-ratio")
}

// driftRun is what one run of the drift measured.
type driftRun struct {
	cpu, catchup time.Duration
	ms           ledger.Measurements
	atDue        int64 // measurements under the version a CE became due at
	dueReads     int64 // the due pass's reads of the waiting CEs
	dueRead      time.Duration
	batches      int64 // batches of the pass under the pool's posterior
}

// driftPosteriors computes the drift's posteriors: m0, one update on flipped labels, then
// `versions` updates on clean rows; kls are the updates' KL(q_new || q_prev).
func driftPosteriors(b *testing.B, set *dataset.Set, m0 *bnn.Model, versions int) ([]*bnn.Model, []float64) {
	var flipX [][]float64
	var flipY []int
	for i := range set.X {
		if set.Y[i] == 1 && len(flipX) < 96 {
			flipX, flipY = append(flipX, set.X[i]), append(flipY, 0)
		}
	}
	ctx := context.Background()
	m, st, err := update.LastLayer(ctx, m0, flipX, flipY, update.Config{LR: 3e-3, Seed: 1})
	if err != nil {
		b.Fatal(err)
	}
	models, kls := []*bnn.Model{m0, m}, []float64{st.KL}
	for k := 0; k < versions; k++ {
		var X [][]float64
		var y []int
		for j := 0; j < 32; j++ {
			r := (32*k + j) % set.Len()
			X, y = append(X, set.X[r]), append(y, set.Y[r])
		}
		if m, st, err = update.LastLayer(ctx, m, X, y, update.Config{Seed: uint64(k + 2)}); err != nil {
			b.Fatal(err)
		}
		models, kls = append(models, m), append(kls, st.KL)
	}
	return models, kls
}

// confirmDrift stores n CEs under models[0], then promotes models[1:] one every `every` while
// the confirmer of the mode runs (none for "commits"), until no CE waits.
func confirmDrift(b *testing.B, set *dataset.Set, models []*bnn.Model, n int, cfg config.Config, mode string, every time.Duration) driftRun {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	l, err := ledger.Open(b.TempDir(), ledger.Options{Policy: certify.DefaultPolicy(), MCBatch: backgroundBatch,
		RemeasureVerdicts: mode == "old", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	m0 := models[0]
	if _, _, err := l.Commit(ctx, &ledger.Checkpoint{Model: m0}); err != nil {
		b.Fatal(err)
	}
	p, xs, cfs := daemontest.CandidatePairs(b, m0, set, cfg.Certify.Samples, 7)
	var ces []*ledger.CE
	for k := 0; k < n; k++ {
		x, cf := xs[k%len(xs)], cfs[k%len(cfs)]
		ces = append(ces, &ledger.CE{ID: fmt.Sprintf("ce-%07d", k), X: set.X[x], XCF: set.X[cf], Target: 1, AnchorVersion: m0.Version,
			P1: p.P(cf, 1), Var1: p.V(cf, 1), Samples: cfg.Certify.Samples, Delta: cfg.Certify.Delta, Epsilon: cfg.Certify.Epsilon})
	}
	if err := l.Put(ctx, ces...); err != nil {
		b.Fatal(err)
	}
	var cur atomic.Pointer[bnn.Model]
	cur.Store(m0)
	reg := prometheus.NewRegistry()
	c := newConfirmer(l, cur.Load, &pools{samples: cfg.Certify.Samples, prec: cfg.Certify.Precision}, alerts.NewMetrics(reg),
		func([]ledger.StatusChange) {}, slog.New(slog.DiscardHandler))
	if mode == "old" {
		c.batch, c.poolSlack = backgroundBatch, math.Inf(1)
	} else {
		// The daemon's confirmer has the posteriors it served (Daemon.served).
		c.past = func(v uint64) *bnn.Model {
			if v <= cur.Load().Version && v < uint64(len(models)) && models[v].Version == v {
				return models[v]
			}
			return nil
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if mode != "commits" {
			c.run(ctx)
		}
	}()
	var r driftRun
	b.ResetTimer()
	start, cpu0 := time.Now(), cpuTime()
	tick := time.NewTicker(every)
	for _, m := range models[1:] {
		<-tick.C
		if _, _, err := l.Commit(ctx, &ledger.Checkpoint{Model: m}); err != nil {
			b.Fatal(err)
		}
		cur.Store(m)
		c.notify()
	}
	tick.Stop()
	last := time.Now()
	for mode != "commits" {
		waiting, err := l.Waiting()
		if err != nil {
			b.Fatal(err)
		}
		if !waiting {
			break
		}
		time.Sleep(10 * time.Millisecond) // polls a condition; the work it waits for takes seconds
	}
	r.catchup = time.Since(last)
	cancel()
	<-done
	r.cpu = cpuTime() - cpu0
	b.StopTimer()
	if mode == "commits" {
		return r
	}
	r.ms = ledger.Measurements{Kept: measuredCount(b, reg, "kept"), Superseded: measuredCount(b, reg, "superseded"),
		Discarded: measuredCount(b, reg, "discarded")}
	r.atDue = c.dueMeasured.Load()
	r.dueReads, r.dueRead, r.batches = c.dueReads.Load(), time.Duration(c.dueReadTime.Load()), c.batches.Load()
	if cnt, err := l.Counts(); err == nil {
		b.Logf("%s: drift and catch-up %v; statuses at the end %v", mode, time.Since(start).Round(time.Millisecond), cnt)
	}
	return r
}

// measuredCount reads cfguard_counterfactuals_measured_total{result} from reg.
func measuredCount(b *testing.B, reg *prometheus.Registry, result string) int {
	fams, err := reg.Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != alerts.NameMeasured {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "result" && lp.GetValue() == result {
					return int(m.GetCounter().GetValue())
				}
			}
		}
	}
	b.Fatalf("no %s{result=%q}", alerts.NameMeasured, result)
	return 0
}

// quantile is the q-quantile of xs (nearest rank).
func quantile(xs []float64, q float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}
