package ledger

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"gonum.org/v1/gonum/blas"

	"github.com/cfguard/cfguard/bnn"
)

// BenchmarkAudit is a full Monte-Carlo audit of 10^5 stored CEs (20 features, the paper's
// architecture 20 -> 64 -> 32 -> 2, DefaultMCBatch) against two references measured in the same
// iterations:
//
//	mc     the audit's Monte-Carlo alone: the same ModelPredictor (same draws) over every x'
//	pool   the audit as the daemon runs it: the networks drawn once (bnn.Pool, drawing included)
//	       and shared by every batch, instead of redrawn for each chunk of inputs; pool32 the same
//	       with float32 forward passes (certify.precision: float32), still against the dgemm floor
//	floor  the GEMM floor: the products of those forward passes, 2 (20*64 + 64*32 + 32*2) flops
//	       per input and draw, at this build's dgemm peak (best of three n = 1024 products,
//	       gonum by default, OpenBLAS with -tags openblas)
//
// and reports floor/audit and floor/pool-audit (the target: >= 0.5) and mc/audit (the share of the audit that
// is sampling rather than reading and writing the ledger). The audit draws auditBenchSamples
// networks per posterior, fewer than the daemon's 1000 to keep one iteration short: the ledger's
// per-CE cost is the same at any S, so the ratios at S = 1000 are at least these.
//
//	go test ./ledger -run '^$' -bench Audit -benchtime 3x
//	go test -tags openblas ./ledger -run '^$' -bench Audit -benchtime 3x
func BenchmarkAudit(b *testing.B) {
	f := auditBenchLedger(b)
	flops := float64(auditBenchN) * auditBenchSamples * float64(2*(benchFeatures*64+64*32+32*2))
	var ta, tm, tp, tf time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		seed := uint64(i)
		t0 := time.Now()
		rep, _, err := f.l.Audit(bg, NewModelPredictor(f.m, auditBenchSamples, seed), AuditOptions{})
		if err != nil {
			b.Fatal(err)
		}
		if rep.Evaluated != auditBenchN {
			b.Fatalf("audit evaluated %d CEs, want %d", rep.Evaluated, auditBenchN)
		}
		t1 := time.Now()
		pred, err := NewModelPredictor(f.m, auditBenchSamples, seed).Predict(bg, f.xcf)
		if err != nil || pred.N != auditBenchN {
			b.Fatal(err, pred)
		}
		t2 := time.Now()
		pool, err := bnn.NewPool(f.m, auditBenchSamples, seed, bnn.Float64)
		if err != nil {
			b.Fatal(err)
		}
		if rep, _, err = f.l.Audit(bg, pool, AuditOptions{}); err != nil || rep.Evaluated != auditBenchN {
			b.Fatal(err, rep.Evaluated)
		}
		t3 := time.Now()
		pool32, err := bnn.NewPool(f.m, auditBenchSamples, seed, bnn.Float32)
		if err != nil {
			b.Fatal(err)
		}
		if rep, _, err = f.l.Audit(bg, pool32, AuditOptions{}); err != nil || rep.Evaluated != auditBenchN {
			b.Fatal(err, rep.Evaluated)
		}
		ta, tm, tp, tf = ta+t1.Sub(t0), tm+t2.Sub(t1), tp+t3.Sub(t2), tf+time.Since(t3)
	}
	b.StopTimer()
	peak := dgemmPeak() // after the predictor ran: OpenBLAS is then set to one thread by bnn
	floor := flops / peak / 1e9
	audit, mc, pooled := ta.Seconds()/float64(b.N), tm.Seconds()/float64(b.N), tp.Seconds()/float64(b.N)
	b.ReportMetric(audit, "audit-s")
	b.ReportMetric(mc, "mc-s")
	b.ReportMetric(floor, "floor-s")
	b.ReportMetric(floor/audit, "floor/audit")
	b.ReportMetric(pooled, "pool-audit-s")
	b.ReportMetric(floor/pooled, "floor/pool-audit")
	pooled32 := tf.Seconds() / float64(b.N)
	b.ReportMetric(pooled32, "pool32-audit-s")
	b.ReportMetric(floor/pooled32, "floor/pool32-audit") // against the dgemm floor; sgemm's is about half
	b.ReportMetric(mc/audit, "mc/audit")
	b.ReportMetric(flops/audit/1e9, "GFLOP/s")
	b.ReportMetric(peak, "peak-GFLOP/s")
}

const (
	auditBenchN       = 100_000
	auditBenchSamples = 100
)

// auditBench is BenchmarkAudit's ledger, its posterior and every stored x'.
type auditBench struct {
	l   *Ledger
	m   *bnn.Model
	xcf [][]float64
	dir string
	err error
}

var (
	auditOnce     sync.Once
	auditBenchFix auditBench
)

// auditBenchLedger builds, once per test binary, a ledger of auditBenchN CEs anchored at the
// current posterior (version 0); TestMain closes it and removes its directory.
func auditBenchLedger(b *testing.B) *auditBench {
	f := &auditBenchFix
	auditOnce.Do(func() {
		start := time.Now()
		if f.dir, f.err = os.MkdirTemp("", "cfguard-audit-bench-"); f.err != nil {
			return
		}
		if f.l, f.err = Open(f.dir, Options{Logger: quietLogger()}); f.err != nil {
			return
		}
		rng := rand.New(rand.NewPCG(5, 6))
		f.m = bnn.New(benchFeatures, bnn.DefaultHidden, []string{"no", "yes"}, 0.1, rng)
		if f.err = f.l.Checkpoint(&Checkpoint{Model: f.m}); f.err != nil {
			return
		}
		const batch = 50_000
		for lo := 0; lo < auditBenchN; lo += batch {
			ces := make([]*CE, 0, batch)
			for i := lo; i < min(lo+batch, auditBenchN); i++ {
				x, xcf := make([]float64, benchFeatures), make([]float64, benchFeatures)
				for j := range x {
					x[j], xcf[j] = rng.NormFloat64(), rng.NormFloat64()
				}
				f.xcf = append(f.xcf, xcf)
				ces = append(ces, &CE{ID: fmt.Sprintf("ce-%08d", i), X: x, XCF: xcf, Target: 1, AnchorVersion: f.m.Version,
					P1: 0.96 + 0.039*rng.Float64(), Var1: 0.005 * rng.Float64(), Samples: 1000, Delta: 0.05, Epsilon: 0.01})
			}
			if f.err = f.l.Put(bg, ces...); f.err != nil {
				return
			}
		}
		fmt.Fprintf(os.Stderr, "audit bench fixture: %d CEs, built in %v\n", auditBenchN, time.Since(start).Round(time.Second))
	})
	if f.err != nil {
		b.Fatal(f.err)
	}
	return f
}

// closeAuditBench closes and removes BenchmarkAudit's ledger, if it was built.
func closeAuditBench() {
	if f := &auditBenchFix; f.l != nil {
		f.l.Close()
	}
	if auditBenchFix.dir != "" {
		os.RemoveAll(auditBenchFix.dir)
	}
}

// dgemmPeak is the best rate, in GFLOP/s, of three n x n x n dgemm calls (2 n^3 flops each, n =
// 1024) with benchDgemm: the peak the GEMM floor is computed from.
func dgemmPeak() float64 {
	const n = 1024
	rng := rand.New(rand.NewPCG(3, 3))
	a, c, d := make([]float64, n*n), make([]float64, n*n), make([]float64, n*n)
	for i := range a {
		a[i], c[i] = rng.NormFloat64(), rng.NormFloat64()
	}
	best := 0.0
	for r := 0; r < 3; r++ {
		start := time.Now()
		benchDgemm().Dgemm(blas.NoTrans, blas.NoTrans, n, n, n, 1, a, n, c, n, 0, d, n)
		best = max(best, 2*n*n*n/time.Since(start).Seconds()/1e9)
	}
	return best
}

// workersPredictor runs a pool's predictive on a fixed number of goroutines.
type workersPredictor struct {
	pool    *bnn.Pool
	workers int
}

func (p workersPredictor) Version() uint64 { return p.pool.Version() }

func (p workersPredictor) Predict(ctx context.Context, X [][]float64) (*bnn.Predictive, error) {
	return p.pool.PredictWorkers(ctx, X, p.workers)
}

// BenchmarkAuditCores is the audit of BenchmarkAudit's 10^5 CEs with one shared pool, its
// Monte-Carlo on 1 and on GOMAXPROCS goroutines in each iteration, and reports the speed-up
// (audit.workers: the daemon's default is every core but one).
//
//	go test ./ledger -run '^$' -bench AuditCores -benchtime 2x
func BenchmarkAuditCores(b *testing.B) {
	f := auditBenchLedger(b)
	n := runtime.GOMAXPROCS(0)
	if n < 2 {
		b.Skip("one core: nothing to scale to")
	}
	pool, err := bnn.NewPool(f.m, auditBenchSamples, 1, bnn.Float64)
	if err != nil {
		b.Fatal(err)
	}
	var t1, tn time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, w := range []int{1, n} {
			t0 := time.Now()
			rep, _, err := f.l.Audit(bg, workersPredictor{pool, w}, AuditOptions{})
			if err != nil || rep.Evaluated != auditBenchN {
				b.Fatal(err, rep.Evaluated)
			}
			if w == 1 {
				t1 += time.Since(t0)
			} else {
				tn += time.Since(t0)
			}
		}
	}
	b.ReportMetric(t1.Seconds()/float64(b.N), "1core-s")
	b.ReportMetric(tn.Seconds()/float64(b.N), fmt.Sprintf("%dcores-s", n))
	b.ReportMetric(t1.Seconds()/tn.Seconds(), "speedup")
}
