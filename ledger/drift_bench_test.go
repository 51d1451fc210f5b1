package ledger

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// BenchmarkDrift measures what a drift over every stored CE costs the increments that carry it.
// A ledger of n CEs (fresh, anchored to one posterior) takes driftSteps steady commits (the
// posterior moves by 1e-7, no bound fails), then driftSteps commits of a drift that moves class
// 1's bias from 4 to -0.5 in equal steps: after a few steps every certificate's bound fails, and
// later most CEs cross 1/2. Meanwhile a confirmer runs beside the commits as the daemon's does
// (Confirm in batches of 1024 under the newest posterior, 100 draws, outside the writer lock).
// It reports the mean time of a steady and of a drifting commit, their ratio (the goal: <= 2),
// the slowest drifting commit (the one that lapses every certificate at once), the growth over
// the drift of the file (which bbolt grows in steps of up to 16 MiB) and of the pages in use (its
// high-water mark, tx.Size: what the data needs), and how many Confirm batches ran.
//
//	go test ./ledger -run '^$' -bench Drift -benchtime 1x
//	CFGUARD_BENCH_1M=1 go test ./ledger -run '^$' -bench Drift -benchtime 1x -timeout 1h
func BenchmarkDrift(b *testing.B) {
	for _, n := range agingSizes() {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			var steady, drifting, worst time.Duration
			var grew, grewData int64
			var batches int
			for i := 0; i < b.N; i++ {
				r := driftRun(b, n)
				steady += r.steady
				drifting += r.drifting
				grew += r.grew
				grewData += r.grewData
				batches += r.batches
				worst = max(worst, r.worst)
			}
			per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(b.N*driftSteps) }
			b.ReportMetric(per(steady)/1e6, "steady-ms/commit")
			b.ReportMetric(per(drifting)/1e6, "drift-ms/commit")
			b.ReportMetric(float64(drifting)/float64(steady), "drift/steady")
			b.ReportMetric(float64(worst.Nanoseconds())/1e6, "worst-drift-ms")
			b.ReportMetric(float64(grew)/float64(b.N)/1e6, "file-growth-MB")
			b.ReportMetric(float64(grewData)/float64(b.N)/1e6, "data-growth-MB")
			b.ReportMetric(float64(grewData)/float64(b.N)/float64(n), "data-growth-bytes/CE")
			b.ReportMetric(float64(batches)/float64(b.N), "confirm-batches")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// driftSteps is the number of commits in each phase of BenchmarkDrift.
const driftSteps = 100

type driftResult struct {
	steady, drifting time.Duration
	worst            time.Duration // the slowest drifting commit
	grew, grewData   int64
	batches          int
}

func driftRun(b *testing.B, n int) driftResult {
	b.StopTimer()
	defer b.StartTimer()
	dir := b.TempDir()
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	m := testModel(4)
	if err := l.Checkpoint(&Checkpoint{Model: m}); err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(5, 5))
	for lo := 0; lo < n; lo += 50_000 {
		if err := l.Put(bg, cheapCEs(m, rng, fmt.Sprint(lo), min(50_000, n-lo))...); err != nil {
			b.Fatal(err)
		}
	}
	commit := func(next *bnn.Model) time.Duration {
		start := time.Now()
		_, _, err := l.Commit(bg, &Checkpoint{Model: next, Offsets: map[int]int64{0: int64(next.Version)}, Applied: 1,
			Update: &UpdateRecord{Version: next.Version, KL: 1e-12, Outcome: certify.OutcomePromoted}})
		if err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	var r driftResult
	for i := range driftSteps {
		m = drift(m, 1e-7*float64(1-2*(i%2)))
		r.steady += commit(m)
	}
	size0, data0 := fileSize(b, dir), dataSize(b, l)

	// The confirmer: Confirm under the newest posterior until the drift's commits are done
	// and nothing waits any more.
	var (
		mu      sync.Mutex
		current = m
		done    = make(chan struct{})
		wg      sync.WaitGroup
		cerr    error
	)
	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			mu.Lock()
			q := current
			mu.Unlock()
			rep, _, err := l.Confirm(ctx, NewModelPredictor(q, 100, q.Version), 1024)
			if err != nil {
				if ctx.Err() == nil {
					cerr = err
				}
				return
			}
			r.batches++
			if !rep.More && !rep.Discarded {
				select {
				case <-done:
					return
				case <-time.After(time.Millisecond):
				}
			}
		}
	}()
	const from, to = 4.0, -0.5
	for i := range driftSteps {
		next := toBias(m, from+(to-from)*float64(i+1)/driftSteps)
		took := commit(next)
		r.drifting += took
		r.worst = max(r.worst, took)
		mu.Lock()
		current, m = next, next
		mu.Unlock()
	}
	close(done)
	wg.Wait()
	if cerr != nil {
		b.Fatal(cerr)
	}
	r.grew, r.grewData = fileSize(b, dir)-size0, dataSize(b, l)-data0
	return r
}

// dataSize is the ledger file's high-water mark: the pages bbolt has used, free or not.
func dataSize(b *testing.B, l *Ledger) (n int64) {
	if err := l.view(func(tx *bolt.Tx) error { n = tx.Size(); return nil }); err != nil {
		b.Fatal(err)
	}
	return n
}

func fileSize(b *testing.B, dir string) int64 {
	fi, err := os.Stat(filepath.Join(dir, FileName))
	if err != nil {
		b.Fatal(err)
	}
	return fi.Size()
}
