package ledger

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// The 1M benchmarks share one database, built once per test binary in a temp dir removed by
// TestMain. CFGUARD_BENCH_1M=1 builds 1,000,000 CEs (about 30 s and 450 MB); otherwise 50,000,
// which measures the same ratio at a size CI can afford.
//
//	CFGUARD_BENCH_1M=1 go test ./ledger -run '^$' -bench '1M$' -benchtime 5x
//
// Ratio to report: BenchmarkRecertify1M / BenchmarkScan1M (goal <= 2); BenchmarkScanHeaders1M
// is the stricter baseline (the header bucket alone).
type benchFixture struct {
	once sync.Once
	dir  string
	l    *Ledger
	next *bnn.Model // a posterior within budget of both anchors: the steady state
	n    int
	err  error
}

var fixture benchFixture

func TestMain(m *testing.M) {
	code := m.Run()
	if fixture.l != nil {
		fixture.l.Close()
	}
	if fixture.dir != "" {
		os.RemoveAll(fixture.dir)
	}
	os.Exit(code)
}

const benchFeatures = 20

func benchLedger(b *testing.B) *benchFixture {
	fixture.once.Do(func() {
		fixture.n = 50_000
		if os.Getenv("CFGUARD_BENCH_1M") == "1" {
			fixture.n = 1_000_000
		}
		fixture.err = buildFixture(&fixture)
	})
	if fixture.err != nil {
		b.Fatal(fixture.err)
	}
	return &fixture
}

// buildFixture stores n CEs over two anchors (versions 0 and 1) with a 20-feature model of the
// paper's architecture, and prepares a posterior version 2 within every CE's budget.
func buildFixture(f *benchFixture) error {
	var err error
	if f.dir, err = os.MkdirTemp("", "cfguard-ledger-bench-"); err != nil {
		return err
	}
	if f.l, err = Open(f.dir, Options{Logger: quietLogger()}); err != nil {
		return err
	}
	rng := rand.New(rand.NewPCG(99, 1))
	m0 := bnn.New(benchFeatures, bnn.DefaultHidden, []string{"no", "yes"}, 0.1, rng)
	if err := f.l.Checkpoint(&Checkpoint{Model: m0}); err != nil {
		return err
	}
	start := time.Now()
	put := func(m *bnn.Model, from, to int) error {
		const batch = 20_000
		for lo := from; lo < to; lo += batch {
			ces := make([]*CE, 0, batch)
			for i := lo; i < min(lo+batch, to); i++ {
				x, xcf := make([]float64, benchFeatures), make([]float64, benchFeatures)
				for j := range x {
					x[j], xcf[j] = rng.NormFloat64(), rng.NormFloat64()
				}
				ces = append(ces, &CE{ID: fmt.Sprintf("ce-%08d", i), X: x, XCF: xcf, Target: 1, AnchorVersion: m.Version,
					P1: 0.96 + 0.039*rng.Float64(), Var1: 0.005 * rng.Float64(), Samples: 1000, Delta: 0.05, Epsilon: 0.01})
			}
			if err := f.l.Put(bg, ces...); err != nil {
				return err
			}
		}
		return nil
	}
	if err := put(m0, 0, f.n/2); err != nil {
		return err
	}
	m1 := drift(m0, 1e-4)
	if _, _, err := f.l.Commit(context.Background(), &Checkpoint{Model: m1}); err != nil {
		return err
	}
	if err := put(m1, f.n/2, f.n); err != nil {
		return err
	}
	f.next = drift(m1, 1e-4)
	fi, _ := os.Stat(f.l.Path())
	fmt.Fprintf(os.Stderr, "ledger bench fixture: %d CEs, %.0f MB, built in %v\n", f.n, float64(fi.Size())/1e6, time.Since(start).Round(time.Second))
	return nil
}

// BenchmarkScan1M is the baseline: a bbolt cursor over every CE value (headers and bodies),
// decoding nothing.
func BenchmarkScan1M(b *testing.B) {
	f := benchLedger(b)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		scanValues(b, f, bHeaders, bBodies)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(f.n), "ns/CE")
}

// BenchmarkScanHeaders1M is the stricter baseline: a cursor over the header bucket only.
func BenchmarkScanHeaders1M(b *testing.B) {
	f := benchLedger(b)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		scanValues(b, f, bHeaders)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(f.n), "ns/CE")
}

// BenchmarkRecertify1M re-certifies every CE against a new posterior within budget (the steady
// state: two anchor KLs, a bound per CE, no status change, no Monte-Carlo).
func BenchmarkRecertify1M(b *testing.B) {
	f := benchLedger(b)
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		recertifySteady(ctx, b, f)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(f.n), "ns/CE")
}

// scanValues walks every value of the buckets with a cursor, decoding nothing.
func scanValues(b *testing.B, f *benchFixture, buckets ...[]byte) {
	total := 0
	err := f.l.db.View(func(tx *bolt.Tx) error {
		for _, name := range buckets {
			c := tx.Bucket(name).Cursor()
			for k, v := c.First(); k != nil; k, v = c.Next() {
				total += len(v)
			}
		}
		return nil
	})
	if err != nil || total < headerSize*f.n {
		b.Fatal(err, total)
	}
}

func recertifySteady(ctx context.Context, b *testing.B, f *benchFixture) {
	rep, changes, err := f.l.Recertify(ctx, f.next)
	if err != nil {
		b.Fatal(err)
	}
	if rep.Checked != f.n || len(changes) != 0 || rep.Changed != 0 || len(rep.AnchorKL) != 2 {
		b.Fatalf("report %+v, %d changes: want every CE certified by bound", rep, len(changes))
	}
}

// BenchmarkRecertifyRatio1M interleaves the three passes in every iteration and reports
// Recertify's time as a ratio of each scan, which a shared, loaded machine disturbs far less
// than comparing separate benchmarks run at different moments.
func BenchmarkRecertifyRatio1M(b *testing.B) {
	f := benchLedger(b)
	ctx := context.Background()
	var scan, headers, recert time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		scanValues(b, f, bHeaders, bBodies)
		t1 := time.Now()
		scanValues(b, f, bHeaders)
		t2 := time.Now()
		recertifySteady(ctx, b, f)
		t3 := time.Now()
		scan, headers, recert = scan+t1.Sub(t0), headers+t2.Sub(t1), recert+t3.Sub(t2)
	}
	b.ReportMetric(float64(recert)/float64(scan), "recertify/scan")
	b.ReportMetric(float64(recert)/float64(headers), "recertify/scan-headers")
	b.ReportMetric(float64(recert.Nanoseconds())/float64(b.N)/float64(f.n), "recertify-ns/CE")
}

// BenchmarkRecordEncoding compares the binary record (header + body) with JSON of the same CE
// (20 features, 4 history entries): bytes per record and encode+decode time.
func BenchmarkRecordEncoding(b *testing.B) {
	rng := rand.New(rand.NewPCG(3, 4))
	x, xcf := make([]float64, benchFeatures), make([]float64, benchFeatures)
	for j := range x {
		x[j], xcf[j] = rng.NormFloat64(), rng.NormFloat64()
	}
	p2 := 0.61
	now := time.Now().UTC()
	var hist []StatusChange
	for i := 0; i < 4; i++ {
		hist = append(hist, StatusChange{At: now, From: certify.Certified, To: certify.AtRisk, PosteriorVersion: uint64(i), KL: 1e-4, Bound: 0.93, VarBound: 0.06, P2: &p2})
	}
	ce := &CE{ID: "ce-00000001", X: x, XCF: xcf, Target: 1, AnchorVersion: 3, P1: 0.97, Var1: 0.004, Samples: 1000,
		Delta: 0.05, Epsilon: 0.01, Status: certify.Certified, CreatedAt: now, UpdatedAt: now, History: hist}
	h := header{status: ce.Status, target: ce.Target, anchor: ce.AnchorVersion, p1: ce.P1, var1: ce.Var1, delta: ce.Delta,
		epsilon: ce.Epsilon, samples: ce.Samples, updated: now.UnixNano()}
	bd := body{created: now.UnixNano(), x: x, xcf: xcf, history: hist}
	b.Run("binary", func(b *testing.B) {
		n := 0
		for i := 0; i < b.N; i++ {
			hv, bv := h.encode(), bd.encode()
			n = len(hv) + len(bv)
			if _, err := decodeHeader(hv); err != nil {
				b.Fatal(err)
			}
			if _, err := decodeBody(bv, true); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(n), "bytes/record")
	})
	b.Run("json", func(b *testing.B) {
		n := 0
		for i := 0; i < b.N; i++ {
			v, err := json.Marshal(ce)
			if err != nil {
				b.Fatal(err)
			}
			n = len(v)
			var back CE
			if err := json.Unmarshal(v, &back); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(n), "bytes/record")
	})
}

// BenchmarkCommit1M is one daemon increment at steady state: Recertify plus the fsynced
// checkpoint (new current posterior, anchors' KL, offsets, counters, KL history; no status
// change). The posterior alternates by +-1e-7 so the fixture stays within budget.
func BenchmarkCommit1M(b *testing.B) {
	f := benchLedger(b)
	cur, err := f.l.Current()
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		cur = drift(cur, 1e-7*float64(1-2*(i%2)))
		rep, changes, err := f.l.Commit(ctx, &Checkpoint{Model: cur, Offsets: map[int]int64{0: int64(cur.Version)}, Applied: 1,
			Update: &UpdateRecord{Version: cur.Version, KL: 1e-12, Outcome: certify.OutcomePromoted}})
		if err != nil {
			b.Fatal(err)
		}
		if len(changes) != 0 || rep.Changed != 0 {
			b.Fatalf("report %+v: want a steady-state step", rep)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(f.n), "ns/CE")
}
