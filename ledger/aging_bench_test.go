package ledger

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger/store"
)

// BenchmarkAging compares the cost of one steady-state commit (Recertify plus the fsynced
// checkpoint, as BenchmarkCommit) on a fresh ledger and on a lived-in one holding the same number
// of CEs, each opened as the ledger opens bbolt (freelist not synced) and as it did before
// (freelist written by every commit): four ledgers, one commit on each in every iteration. The
// fresh ledger got its CEs in a few large Puts; the lived-in one went through registrations in
// small batches, deletions, drifts that failed every certificate followed by Confirm verdicts,
// and audits that re-anchored every CE, until a large part of its file was free pages. It reports
// the time per commit of each, the ratios fresh/lived (the goal: near 1) and synced/unsynced, the
// pages each commit writes, and each file's size and free pages.
//
//	go test ./ledger -run '^$' -bench Aging -benchtime 200x
//	CFGUARD_BENCH_1M=1 go test ./ledger -run '^$' -bench Aging -benchtime 200x -timeout 3h
func BenchmarkAging(b *testing.B) {
	for _, n := range agingSizes() {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			fx := agingLedgers(b, n)
			names := []string{"fresh-synced", "lived-synced", "fresh", "lived"}
			ls := []*Ledger{fx.fresh[0], fx.lived[0], fx.fresh[1], fx.lived[1]}
			curs := make([]*bnn.Model, len(ls))
			written := make([]int64, len(ls))
			for i, l := range ls {
				var err error
				if curs[i], err = l.Current(); err != nil {
					b.Fatal(err)
				}
				steadyCommit(b, l, drift(curs[i], 0)) // the first commit drops a synced freelist
				curs[i] = drift(curs[i], 0)
			}
			took := make([]time.Duration, len(ls))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				for j, l := range ls {
					curs[j] = drift(curs[j], 1e-7*float64(1-2*(i%2)))
					w0, t0 := bytesWritten(), time.Now()
					steadyCommit(b, l, curs[j])
					took[j] += time.Since(t0)
					written[j] += bytesWritten() - w0
				}
			}
			b.StopTimer()
			per := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / float64(b.N) }
			for j, name := range names {
				st := ls[j].freelistStats()
				b.ReportMetric(per(took[j]), name+"-ns/commit")
				b.ReportMetric(float64(written[j])/float64(b.N)/1024, name+"-KB/commit")
				b.ReportMetric(float64(st.size)/1e6, name+"-MB")
				b.ReportMetric(float64(st.free), name+"-free-pages")
			}
			b.ReportMetric(float64(took[0])/float64(took[1]), "fresh/lived-synced")
			b.ReportMetric(float64(took[2])/float64(took[3]), "fresh/lived")
			b.ReportMetric(float64(took[1])/float64(took[3]), "synced/unsynced-lived")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// steadyCommit is one increment that changes no status.
func steadyCommit(b *testing.B, l *Ledger, m *bnn.Model) {
	rep, changes, err := l.Commit(bg, &Checkpoint{Model: m, Offsets: map[int]int64{0: int64(m.Version)}, Applied: 1,
		Update: &UpdateRecord{Version: m.Version, KL: 1e-12, Outcome: certify.OutcomePromoted}})
	if err != nil {
		b.Fatal(err)
	}
	if len(changes) != 0 || rep.Changed != 0 {
		b.Fatalf("report %+v: want a steady-state update", rep)
	}
}

// freelistStats is the file size and bbolt's count of free pages.
type fileStats struct {
	size int64
	free int
}

func (l *Ledger) freelistStats() fileStats {
	var st fileStats
	if fi, err := os.Stat(l.path); err == nil {
		st.size = fi.Size()
	}
	l.view(func(tx *bolt.Tx) error { st.free = tx.DB().Stats().FreePageN; return nil })
	return st
}

// bytesWritten is what this process has passed to write system calls (wchar in /proc/self/io;
// 0 where there is none).
func bytesWritten() int64 {
	b, err := os.ReadFile("/proc/self/io")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "wchar: "); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	return 0
}

// agingSizes: 10^4 and 10^5 by default, 10^6 with CFGUARD_BENCH_1M=1.
func agingSizes() []int {
	if os.Getenv("CFGUARD_BENCH_1M") == "1" || os.Getenv("CFGUARD_BENCH_10M") == "1" {
		return []int{1_000_000}
	}
	return []int{10_000, 100_000}
}

// agingFixture is a fresh and a lived-in ledger of n CEs each, built once per test binary.
type agingFixture struct {
	once         sync.Once
	dir          string
	fresh, lived [2]*Ledger // [0] syncs bbolt's freelist, [1] does not
	err          error
}

var (
	agingMu       sync.Mutex
	agingFixtures = map[int]*agingFixture{}
)

func agingLedgers(b *testing.B, n int) *agingFixture {
	agingMu.Lock()
	f := agingFixtures[n]
	if f == nil {
		f = &agingFixture{}
		agingFixtures[n] = f
	}
	agingMu.Unlock()
	f.once.Do(func() { f.err = f.build(n) })
	if f.err != nil {
		b.Fatal(f.err)
	}
	return f
}

func closeAgingBench() {
	for _, f := range agingFixtures {
		for _, l := range append(f.fresh[:], f.lived[:]...) {
			if l != nil {
				l.Close()
			}
		}
		if f.dir != "" {
			os.RemoveAll(f.dir)
		}
	}
}

// build makes the two ledgers with a synced freelist, then copies each file to a second
// directory opened without.
func (f *agingFixture) build(n int) (err error) {
	if f.dir, err = os.MkdirTemp("", "cfguard-aging-bench-"); err != nil {
		return err
	}
	opts := func(sync bool) Options {
		return Options{Policy: testPolicy(), Logger: quietLogger(), syncFreelist: sync}
	}
	start := time.Now()
	fresh, err := Open(filepath.Join(f.dir, "fresh-synced"), opts(true))
	if err != nil {
		return err
	}
	f.fresh[0] = fresh
	m0 := testModel(4)
	if err := fresh.Checkpoint(&Checkpoint{Model: m0}); err != nil {
		return err
	}
	rng := rand.New(rand.NewPCG(18, 1))
	for lo := 0; lo < n; lo += 50_000 {
		if err := fresh.Put(bg, agingCEs(m0, rng, min(50_000, n-lo))...); err != nil {
			return err
		}
	}
	logFixture("fresh", fresh, n, start)
	start = time.Now()
	lived, err := Open(filepath.Join(f.dir, "lived-synced"), opts(true))
	if err != nil {
		return err
	}
	f.lived[0] = lived
	if err := liveIn(lived, n, rng); err != nil {
		return err
	}
	logFixture("lived-in", lived, n, start)
	for _, p := range []struct {
		l   **Ledger
		dst string
	}{{&f.fresh[0], "fresh"}, {&f.lived[0], "lived"}} {
		dir := filepath.Dir((*p.l).Path())
		if err := (*p.l).Close(); err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Join(f.dir, p.dst), 0o755); err != nil {
			return err
		}
		if err := store.CopyFile(filepath.Join(dir, FileName), filepath.Join(f.dir, p.dst, FileName)); err != nil {
			return err
		}
		if *p.l, err = Open(dir, opts(true)); err != nil {
			return err
		}
	}
	if f.fresh[1], err = Open(filepath.Join(f.dir, "fresh"), opts(false)); err != nil {
		return err
	}
	f.lived[1], err = Open(filepath.Join(f.dir, "lived"), opts(false))
	return err
}

func logFixture(what string, l *Ledger, n int, start time.Time) {
	st := l.freelistStats()
	fmt.Fprintf(os.Stderr, "aging bench fixture: %s, %d CEs, %.0f MB, %d free pages, built in %v\n",
		what, n, float64(st.size)/1e6, st.free, time.Since(start).Round(time.Second))
}

// agingCEs are n CEs certified under m with random ids, so that registrations land all over
// the key space as user-chosen ids do.
func agingCEs(m *bnn.Model, rng *rand.Rand, n int) []*CE {
	ces := cheapCEs(m, rng, "", n)
	for _, c := range ces {
		c.ID = fmt.Sprintf("ce-%016x", rng.Uint64())
	}
	return ces
}

// liveIn takes an empty ledger to n CEs the way a daemon's ledger grows: registrations in
// batches of 500, and three rounds of: every certificate failing at once under a drift, Confirm
// verdicts for each, the posterior back, a full audit that renews and re-anchors every CE, and
// 5% of the CEs (at most 5000) deleted one by one and replaced by new registrations.
func liveIn(l *Ledger, n int, rng *rand.Rand) error {
	m := testModel(4)
	if err := l.Checkpoint(&Checkpoint{Model: m}); err != nil {
		return err
	}
	var ids []string
	register := func(k int) error {
		for lo := 0; lo < k; lo += 500 {
			ces := agingCEs(m, rng, min(500, k-lo))
			if err := l.Put(bg, ces...); err != nil {
				return err
			}
			for _, c := range ces {
				ids = append(ids, c.ID)
			}
		}
		return nil
	}
	if err := register(n); err != nil {
		return err
	}
	const samples = 64
	for round := 0; round < 3; round++ {
		m = toBias(m, -0.19) // every certificate fails
		if _, _, err := l.Commit(bg, &Checkpoint{Model: m}); err != nil {
			return err
		}
		p := NewModelPredictor(m, samples, uint64(round))
		for {
			rep, _, err := l.Confirm(bg, p, 4096)
			if err != nil {
				return err
			}
			if !rep.More {
				break
			}
		}
		m = toBias(m, 4)
		if _, _, err := l.Commit(bg, &Checkpoint{Model: m}); err != nil {
			return err
		}
		if _, _, err := l.Audit(bg, NewModelPredictor(m, samples, uint64(round)), AuditOptions{}); err != nil {
			return err
		}
		rng.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
		k := min(n/20, 5000)
		for _, id := range ids[len(ids)-k:] {
			if err := l.Delete(id); err != nil {
				return err
			}
		}
		ids = ids[:len(ids)-k]
		if err := register(k); err != nil {
			return err
		}
	}
	return nil
}

// BenchmarkOpenRSS opens the lived-in ledger of BenchmarkAging in a child process and reports
// how long Open took and the child's memory (/proc/self/status) when it returned: the peak resident set (VmHWM), the
// resident set then, split into anonymous memory (the Go heap and stacks: a real cost) and pages
// of the mapped file (page cache, clean: the kernel reclaims them under pressure), and the
// memory the Go runtime holds from the system (GoSys: at least the heap's peak), and, in a
// second child, the same for the page-tree walk alone. It does so for the file with a synced
// freelist (bbolt reads its freelist page), and for the same file without one, as the ledger's
// commits leave it (bbolt then rebuilds the freelist by walking the tree).
//
//	go test ./ledger -run '^$' -bench OpenRSS -benchtime 1x
//	CFGUARD_BENCH_1M=1 go test ./ledger -run '^$' -bench OpenRSS -benchtime 1x -timeout 3h
func BenchmarkOpenRSS(b *testing.B) {
	for _, n := range agingSizes() {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			fx := agingLedgers(b, n)
			dirs := map[string]string{}
			for _, mode := range []string{"synced", "unsynced"} {
				dir := b.TempDir()
				if err := store.CopyFile(fx.lived[0].Path(), filepath.Join(dir, FileName)); err != nil {
					b.Fatal(err)
				}
				if mode == "unsynced" { // one commit drops the freelist page
					l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
					if err != nil {
						b.Fatal(err)
					}
					if err := l.Checkpoint(&Checkpoint{Counters: map[string]int64{"rss": 1}}); err != nil {
						b.Fatal(err)
					}
					l.Close()
				}
				dirs[mode] = dir
			}
			fi, err := os.Stat(filepath.Join(dirs["synced"], FileName))
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(fi.Size())/1e6, "file-MB")
			for i := 0; i < b.N; i++ {
				for _, c := range []struct{ name, mode, dir string }{
					{"walk", "walk", dirs["unsynced"]},
					{"open-synced", "open-synced", dirs["synced"]},
					{"open", "open", dirs["unsynced"]},
				} {
					m := openRSSChild(b, c.mode, c.dir)
					for _, k := range []string{"VmHWM", "VmRSS", "RssAnon", "RssFile", "GoSys"} {
						b.ReportMetric(m[k]/1024, c.name+"-"+k+"-MB")
					}
					b.ReportMetric(m["seconds"], c.name+"-s")
				}
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}

const openRSSEnv = "CFGUARD_LEDGER_RSS_CHILD"

// openRSSChild runs TestOpenRSSChild in a child process and returns its /proc/self/status
// figures in kB.
func openRSSChild(b *testing.B, mode, dir string) map[string]float64 {
	cmd := exec.Command(os.Args[0], "-test.run", "^TestOpenRSSChild$", "-test.v")
	cmd.Env = append(os.Environ(), openRSSEnv+"="+mode+":"+dir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		b.Fatalf("child: %v\n%s", err, out)
	}
	m := map[string]float64{}
	for _, line := range strings.Split(string(out), "\n") {
		var k string
		var v float64
		if _, err := fmt.Sscanf(strings.TrimSpace(line), "rss %s %f", &k, &v); err == nil {
			m[k] = v
		}
	}
	if len(m) != 6 {
		b.Fatalf("child printed %v\n%s", m, out)
	}
	return m
}

// TestOpenRSSChild is the child of BenchmarkOpenRSS: it opens (or walks) the ledger named by
// CFGUARD_LEDGER_RSS_CHILD and prints its memory figures.
func TestOpenRSSChild(t *testing.T) {
	mode, dir, ok := strings.Cut(os.Getenv(openRSSEnv), ":")
	if !ok {
		t.Skip("child process of BenchmarkOpenRSS")
	}
	start := time.Now()
	switch mode {
	case "walk":
		f, err := os.Open(filepath.Join(dir, FileName))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := store.Inspect(f); err != nil {
			t.Fatal(err)
		}
	default:
		l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), syncFreelist: mode == "open-synced"})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
	}
	fmt.Printf("rss seconds %f\n", time.Since(start).Seconds())
	sample := []metrics.Sample{{Name: "/memory/classes/total:bytes"}}
	metrics.Read(sample)
	fmt.Printf("rss GoSys %d\n", sample[0].Value.Uint64()/1024)
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		k, v, _ := strings.Cut(line, ":")
		switch k {
		case "VmHWM", "VmRSS", "RssAnon", "RssFile":
			fmt.Printf("rss %s %s\n", k, strings.TrimSuffix(strings.TrimSpace(v), " kB"))
		}
	}
}
