package ledger

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger/store"
)

// The benchmarks share ledgers of n CEs, built once per test binary in temp dirs removed by
// TestMain. Sizes: 10^4 and 10^5 by default (what CI can afford), 10^5 and 10^6 with
// CFGUARD_BENCH_1M=1 (10^6 CEs: about 700 MB), and also 10^7 with CFGUARD_BENCH_10M=1 (about
// 7 GB and many minutes to build).
//
//	CFGUARD_BENCH_1M=1 go test ./ledger -run '^$' -bench 'Recertify|Scan|Commit|Growth' -benchtime 20x
//	CFGUARD_BENCH_1M=1 go test ./ledger -run '^$' -bench 'Open|Check|Walk|Verify' -benchtime 3x
//
// What to report: BenchmarkGrowth's exponents (time per update ~ n^exponent, measured
// interleaved in one run) for the indexed re-certification and for the full scan it replaced,
// and ns/update at each size beside BenchmarkScanHeaders, the cost of merely reading every header.
type benchFixture struct {
	once sync.Once
	dir  string
	l    *Ledger
	next *bnn.Model // a posterior within budget of both anchors: the steady state
	n    int
	err  error
}

var (
	fixtureMu sync.Mutex
	fixtures  = map[int]*benchFixture{}
)

func TestMain(m *testing.M) {
	code := m.Run()
	closeAuditBench()
	closeAgingBench()
	closeDueBench()
	for _, f := range fixtures {
		if f.l != nil {
			f.l.Close()
		}
		if f.dir != "" {
			os.RemoveAll(f.dir)
		}
	}
	os.Exit(code)
}

const benchFeatures = 20

// benchSizes are the fixture sizes of this run.
func benchSizes() []int {
	switch {
	case os.Getenv("CFGUARD_BENCH_10M") == "1":
		return []int{100_000, 1_000_000, 10_000_000}
	case os.Getenv("CFGUARD_BENCH_1M") == "1":
		return []int{100_000, 1_000_000}
	}
	return []int{10_000, 100_000}
}

func benchLedger(b *testing.B, n int) *benchFixture {
	fixtureMu.Lock()
	f := fixtures[n]
	if f == nil {
		f = &benchFixture{n: n}
		fixtures[n] = f
	}
	fixtureMu.Unlock()
	f.once.Do(func() { f.err = buildFixture(f) })
	if f.err != nil {
		b.Fatal(f.err)
	}
	return f
}

// buildFixture stores n CEs over two anchors (versions 0 and 1) with a 20-feature model of the
// paper's architecture, and prepares a posterior version 2 within every CE's budget.
func buildFixture(f *benchFixture) error {
	var err error
	if f.dir, err = os.MkdirTemp("", "cfguard-ledger-bench-"); err != nil {
		return err
	}
	if f.l, err = Open(f.dir, Options{Policy: testPolicy(), Logger: quietLogger()}); err != nil {
		return err
	}
	rng := rand.New(rand.NewPCG(99, 1))
	m0 := bnn.New(benchFeatures, bnn.DefaultHidden, []string{"no", "yes"}, 0.1, rng)
	if err := f.l.Checkpoint(&Checkpoint{Model: m0}); err != nil {
		return err
	}
	start := time.Now()
	put := func(m *bnn.Model, from, to int) error {
		const batch = 50_000
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
	if _, _, err := f.l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
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

// recertifyIndexed is one steady-state re-certification (no status change).
func recertifyIndexed(b *testing.B, f *benchFixture) {
	rep, changes, err := f.l.Recertify(bg, f.next)
	if err != nil {
		b.Fatal(err)
	}
	if rep.Checked != f.n || len(changes) != 0 || len(rep.AnchorKL) != 2 {
		b.Fatalf("report %+v, %d changes: want every CE certified by bound", rep, len(changes))
	}
}

// recertifyScan is the re-certification this package did before the indexes (the baseline):
// KL per anchor, then every header judged with the anchor's gate in one cursor pass.
func recertifyScan(b *testing.B, f *benchFixture) {
	pol := f.l.Policy()
	certified := 0
	err := f.l.view(func(tx *bolt.Tx) error {
		gates := map[uint64]*certify.Gate{}
		if err := forEachAnchor(tx, func(v uint64, a anchorMeta) error {
			m, err := f.l.model(tx, v)
			if err != nil {
				return err
			}
			kl, _, err := certify.KL(f.next, m)
			g := pol.Gate(pol.Slack(kl))
			gates[v] = &g
			return err
		}); err != nil {
			return err
		}
		c := tx.Bucket(bHeaders).Cursor()
		for k, v := c.First(); k != nil; k, v = c.Next() {
			p := v[:len(v)-store.CRCSize]
			g := gates[binary.LittleEndian.Uint64(p[hAnchor:])]
			if _, ok := g.Check(f64(p, hP1), f64(p, hVar1), f64(p, hEps), int(binary.LittleEndian.Uint32(p[hSamples:]))); ok {
				certified++
			}
		}
		return nil
	})
	if err != nil || certified != f.n {
		b.Fatal(err, certified)
	}
}

// scanHeaders walks the header bucket with a cursor, decoding nothing.
func scanHeaders(b *testing.B, f *benchFixture) {
	total := 0
	err := f.l.view(func(tx *bolt.Tx) error {
		c := tx.Bucket(bHeaders).Cursor()
		for k, v := c.First(); k != nil; k, v = c.Next() {
			total += len(v)
		}
		return nil
	})
	if err != nil || total < headerSize*f.n {
		b.Fatal(err, total)
	}
}

func perSize(b *testing.B, run func(b *testing.B, f *benchFixture)) {
	for _, n := range benchSizes() {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			f := benchLedger(b, n)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				run(b, f)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/update")
		})
	}
}

// BenchmarkRecertify: the indexed re-certification at steady state (KL per anchor, index range
// scans that find nothing, MinBound from idx_cert).
func BenchmarkRecertify(b *testing.B) { perSize(b, recertifyIndexed) }

// BenchmarkRecertifyScan: the same judgement by walking every header (the old Recertify).
func BenchmarkRecertifyScan(b *testing.B) { perSize(b, recertifyScan) }

// BenchmarkScanHeaders: a cursor over every header, nothing else (a floor for any full scan).
func BenchmarkScanHeaders(b *testing.B) { perSize(b, scanHeaders) }

// BenchmarkCommit is one daemon increment at steady state: Recertify plus the fsynced
// checkpoint (new current posterior, anchors' KL, offsets, KL history; no status change). The
// posterior alternates by +-1e-7 so the fixture stays within budget.
func BenchmarkCommit(b *testing.B) {
	for _, n := range benchSizes() {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			f := benchLedger(b, n)
			cur, err := f.l.Current()
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				cur = drift(cur, 1e-7*float64(1-2*(i%2)))
				rep, changes, err := f.l.Commit(bg, &Checkpoint{Model: cur, Offsets: map[int]int64{0: int64(cur.Version)}, Applied: 1,
					Update: &UpdateRecord{Version: cur.Version, KL: 1e-12, Outcome: certify.OutcomePromoted}})
				if err != nil {
					b.Fatal(err)
				}
				if len(changes) != 0 || rep.Changed != 0 {
					b.Fatalf("report %+v: want a steady-state update", rep)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/update")
		})
	}
}

// BenchmarkGrowth interleaves, in every iteration, the indexed re-certification and the full
// scan at the smallest and the largest fixture, and reports each one's time per update and its
// growth exponent log(t_large / t_small) / log(n_large / n_small): 0 means independent of the
// number stored, 1 linear. Interleaving makes the ratios robust on a shared machine.
func BenchmarkGrowth(b *testing.B) {
	sizes := benchSizes()
	small, large := benchLedger(b, sizes[0]), benchLedger(b, sizes[len(sizes)-1])
	var ti, ts [2]time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j, f := range []*benchFixture{small, large} {
			t0 := time.Now()
			recertifyIndexed(b, f)
			t1 := time.Now()
			recertifyScan(b, f)
			ti[j] += t1.Sub(t0)
			ts[j] += time.Since(t1)
		}
	}
	ratio := math.Log(float64(large.n) / float64(small.n))
	b.ReportMetric(float64(ti[0].Nanoseconds())/float64(b.N), fmt.Sprintf("indexed-ns/update@%d", small.n))
	b.ReportMetric(float64(ti[1].Nanoseconds())/float64(b.N), fmt.Sprintf("indexed-ns/update@%d", large.n))
	b.ReportMetric(float64(ts[0].Nanoseconds())/float64(b.N), fmt.Sprintf("scan-ns/update@%d", small.n))
	b.ReportMetric(float64(ts[1].Nanoseconds())/float64(b.N), fmt.Sprintf("scan-ns/update@%d", large.n))
	b.ReportMetric(math.Log(float64(ti[1])/float64(ti[0]))/ratio, "indexed-exponent")
	b.ReportMetric(math.Log(float64(ts[1])/float64(ts[0]))/ratio, "scan-exponent")
	b.ReportMetric(float64(ts[1])/float64(ti[1]), "scan/indexed@large")
}

// The checks at Open. BenchmarkOpen is what every Open (and every reopen after a failed
// commit) costs: meta pages, size, the page-tree walk, bbolt's open, the small records.
// BenchmarkWalk is the walk alone; BenchmarkTxCheck bbolt's tx.Check (which Verify runs, not
// Open); BenchmarkVerify the full check of every record (Verify).
func BenchmarkOpen(b *testing.B) {
	perSizeClosed(b, func(b *testing.B, dir string) {
		l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
		if err != nil {
			b.Fatal(err)
		}
		l.Close()
	})
}

func BenchmarkWalk(b *testing.B) {
	perSizeClosed(b, func(b *testing.B, dir string) {
		f, err := os.Open(dir + "/" + FileName)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		if _, err := store.Inspect(f); err != nil {
			b.Fatal(err)
		}
	})
}

func BenchmarkTxCheck(b *testing.B) {
	perSizeClosed(b, func(b *testing.B, dir string) {
		db, err := bolt.Open(dir+"/"+FileName, 0o600, &bolt.Options{ReadOnly: true})
		if err != nil {
			b.Fatal(err)
		}
		defer db.Close()
		db.View(func(tx *bolt.Tx) error {
			for err := range tx.Check() {
				b.Fatal(err)
			}
			return nil
		})
	})
}

func BenchmarkVerify(b *testing.B) {
	perSizeClosed(b, func(b *testing.B, dir string) {
		info, err := Verify(dir + "/" + FileName)
		if err != nil || info.CEs == 0 {
			b.Fatal(err, info)
		}
	})
}

// perSizeClosed runs fn on each fixture's directory with the fixture's ledger closed.
func perSizeClosed(b *testing.B, fn func(b *testing.B, dir string)) {
	for _, n := range benchSizes() {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			f := benchLedger(b, n)
			f.l.Close()
			defer func() {
				var err error
				if f.l, err = Open(f.dir, Options{Policy: testPolicy(), Logger: quietLogger()}); err != nil {
					b.Fatal(err)
				}
			}()
			fi, _ := os.Stat(f.dir + "/" + FileName)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				fn(b, f.dir)
			}
			b.ReportMetric(float64(fi.Size())/1e6, "MB")
		})
	}
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
	key := []byte(ce.ID)
	b.Run("binary", func(b *testing.B) {
		n := 0
		for i := 0; i < b.N; i++ {
			hv, bv := seal(key, h.encode()), seal(key, bd.encode())
			n = len(hv) + len(bv)
			hp, _ := unseal(key, hv)
			if _, err := decodeHeader(hp); err != nil {
				b.Fatal(err)
			}
			bp, _ := unseal(key, bv)
			if _, err := decodeBody(bp, true); err != nil {
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

// BenchmarkCommitAllFailing is the worst update: 10^5 CEs whose bound fails at once. Commit
// lapses their certificates (no status change); it runs no Monte-Carlo and writes nothing per CE
// (a lapse is derived from the anchor's KL), so its time is that of judging the 2 x 10^5 index
// entries between the anchor's old and new thresholds and of the fsynced commit.
func BenchmarkCommitAllFailing(b *testing.B) {
	const n = 100_000
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		dir := b.TempDir()
		l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
		if err != nil {
			b.Fatal(err)
		}
		m0 := testModel(4)
		if err := l.Checkpoint(&Checkpoint{Model: m0}); err != nil {
			b.Fatal(err)
		}
		rng := rand.New(rand.NewPCG(1, 1))
		for lo := 0; lo < n; lo += 50_000 {
			if err := l.Put(bg, cheapCEs(m0, rng, fmt.Sprint(lo), 50_000)...); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
		rep, changes, err := l.Commit(context.Background(), &Checkpoint{Model: toBias(m0, -0.19)})
		if err != nil || len(changes) != 0 || rep.Lapsed != n {
			b.Fatalf("commit: %v; %d status changes and %d lapses, want 0 and %d", err, len(changes), rep.Lapsed, n)
		}
		b.StopTimer()
		l.Close()
	}
}
