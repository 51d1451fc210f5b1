package ledger

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
)

// BenchmarkConfirmLanes measures confirmation on 1 and on 2 cores: 10^4 CEs of the paper's
// network shape (20 -> 64 -> 32 -> 2) whose certificates a drift has lapsed are confirmed with one
// pool of 1000 draws, by one lane (Confirm, one goroutine), then by two lanes at once (ConfirmLane,
// one goroutine each, as the daemon's confirmers run with audit.workers 2), each on a fresh copy of
// the ledger, in batches of 128. It reports both times and the speed-up.
//
//	go test ./ledger -run '^$' -bench ConfirmLanes -benchtime 2x
func BenchmarkConfirmLanes(b *testing.B) {
	if runtime.GOMAXPROCS(0) < 2 {
		b.Skip("one core: nothing to scale to")
	}
	const n, batch = 10_000, 128
	var took [2]time.Duration
	for i := 0; i < b.N; i++ {
		for _, lanes := range []int{1, 2} {
			b.StopTimer()
			l, pool := laneBenchLedger(b, n)
			b.StartTimer()
			start := time.Now()
			var wg sync.WaitGroup
			confirmed := make([]int, lanes)
			for lane := range lanes {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						rep, _, err := l.ConfirmLane(bg, workersPredictor{pool, 1}, batch, lane, lanes)
						if err != nil {
							b.Error(err)
							return
						}
						confirmed[lane] += rep.Confirmed
						if !rep.More {
							return
						}
					}
				}()
			}
			wg.Wait()
			took[lanes-1] += time.Since(start)
			b.StopTimer()
			sum := 0
			for _, c := range confirmed {
				sum += c
			}
			if sum != n {
				b.Fatalf("%d lanes confirmed %v of %d CEs", lanes, confirmed, n)
			}
			l.Close()
		}
	}
	b.ReportMetric(took[0].Seconds()/float64(b.N), "1lane-s")
	b.ReportMetric(took[1].Seconds()/float64(b.N), "2lanes-s")
	b.ReportMetric(float64(took[0])/float64(took[1]), "speedup")
	b.ReportMetric(0, "ns/op")
}

// laneBenchLedger is a fresh ledger of n CEs whose certificates a drift has lapsed, and the pool
// of 1000 draws of the posterior now current.
func laneBenchLedger(b *testing.B, n int) (*Ledger, *bnn.Pool) {
	l, err := Open(b.TempDir(), Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	m0 := bnn.New(benchFeatures, bnn.DefaultHidden, []string{"no", "yes"}, 0.1, rng)
	if err := l.Checkpoint(&Checkpoint{Model: m0}); err != nil {
		b.Fatal(err)
	}
	ces := make([]*CE, n)
	for i := range ces {
		x, xcf := make([]float64, benchFeatures), make([]float64, benchFeatures)
		for j := range x {
			x[j], xcf[j] = rng.NormFloat64(), rng.NormFloat64()
		}
		ces[i] = &CE{ID: fmt.Sprintf("ce-%06d", i), X: x, XCF: xcf, Target: 1, AnchorVersion: m0.Version,
			P1: 0.96 + 0.039*rng.Float64(), Var1: 0.005 * rng.Float64(), Samples: 1000, Delta: 0.05, Epsilon: 0.01}
	}
	if err := l.Put(bg, ces...); err != nil {
		b.Fatal(err)
	}
	m1 := drift(m0, -3)
	rep, _, err := l.Commit(bg, &Checkpoint{Model: m1})
	if err != nil || rep.Lapsed != n {
		b.Fatalf("commit: %v; %d of %d certificates lapsed", err, rep.Lapsed, n)
	}
	pool, err := bnn.NewPool(m1, 1000, 1, bnn.Float64)
	if err != nil {
		b.Fatal(err)
	}
	return l, pool
}
