package ledger

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

// BenchmarkDueRead measures one read of the CEs due for a measurement, as a confirmer makes it
// each round, on one ledger: DueLane (the single daemon: each CE at the version its bound failed
// at) and DueAtPoints (a replica: each at the first confirmation point at which it waits) with a
// point every 2 and every 4 versions. The ledger holds dueBenchN CEs under four anchors, whose
// bounds fail at KLs spread from 1e-3 to 0.1, and has committed dueBenchSteps versions of a
// drift that lapses over half of them; past holds every posterior, and the current version is a
// point, so that both reads find the same CEs due. It reports ns per stored CE and how many
// were found due.
//
//	go test ./ledger -run '^$' -bench DueRead -count 6 > due.txt
//	go run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da -col /read due.txt
func BenchmarkDueRead(b *testing.B) {
	f := dueBenchLedger(b)
	past := pastOf(f.past)
	every2, every4 := f.points(2), f.points(4)
	for _, r := range []struct {
		name string
		read func() (int, error)
	}{
		{"DueLane", func() (int, error) {
			byVersion, _, err := f.l.DueLane(dueBenchN, 0, 1, past, func(u uint64) bool { return f.past[u] != nil })
			return countIDs(byVersion), err
		}},
		{"DueAtPoints-every2", func() (int, error) {
			due, err := f.l.DueAtPoints(dueBenchN, 0, 1, past, every2)
			return countIDs(due.Measure) + len(due.Again), err
		}},
		{"DueAtPoints-every4", func() (int, error) {
			due, err := f.l.DueAtPoints(dueBenchN, 0, 1, past, every4)
			return countIDs(due.Measure) + len(due.Again), err
		}},
	} {
		b.Run("read="+r.name, func(b *testing.B) {
			found := 0
			for b.Loop() {
				n, err := r.read()
				if err != nil {
					b.Fatal(err)
				}
				found = n
			}
			if found != f.lapsed {
				b.Fatalf("%s found %d CEs due; %d certificates lapsed", r.name, found, f.lapsed)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/dueBenchN, "ns/CE")
			b.ReportMetric(float64(found), "due")
		})
	}
}

const (
	dueBenchN     = 10_000
	dueBenchSteps = 16
)

// dueFixture is BenchmarkDueRead's ledger, built once per test binary.
type dueFixture struct {
	once   sync.Once
	dir    string
	l      *Ledger
	past   map[uint64]*bnn.Model // every posterior the ledger committed
	now    uint64
	lapsed int // certificates the drift lapsed
	err    error
}

var dueBench dueFixture

func dueBenchLedger(b *testing.B) *dueFixture {
	f := &dueBench
	f.once.Do(func() { f.err = f.build() })
	if f.err != nil {
		b.Fatal(f.err)
	}
	return f
}

func closeDueBench() {
	if dueBench.l != nil {
		dueBench.l.Close()
	}
	if dueBench.dir != "" {
		os.RemoveAll(dueBench.dir)
	}
}

// build puts dueBenchN/4 CEs under each of four anchors a version apart (spreadCEs' certificates,
// with random P1), then commits dueBenchSteps drift steps of class 1's bias by 0.002: KL 0.05 from
// the anchors at the end.
func (f *dueFixture) build() (err error) {
	if f.dir, err = os.MkdirTemp("", "cfguard-due-bench-"); err != nil {
		return err
	}
	if f.l, err = Open(f.dir, Options{Policy: testPolicy(), Logger: quietLogger()}); err != nil {
		return err
	}
	m := testModel(4)
	if err := f.l.Checkpoint(&Checkpoint{Model: m}); err != nil {
		return err
	}
	f.past = map[uint64]*bnn.Model{m.Version: m}
	commit := func(d float64) error {
		m = drift(m, d)
		rep, _, err := f.l.Commit(bg, &Checkpoint{Model: m})
		f.past[m.Version] = m
		f.lapsed += rep.Lapsed
		return err
	}
	rng := rand.New(rand.NewPCG(21, 21))
	for a := range 4 {
		if a > 0 {
			if err := commit(1e-4); err != nil {
				return err
			}
		}
		ces := cheapCEs(m, rng, fmt.Sprint("a", a), dueBenchN/4)
		for _, c := range ces {
			c.P1 = 0.62 + 0.37*rng.Float64()
			c.Delta, c.Epsilon = 1-c.P1+0.001, 0.25
		}
		if err := f.l.Put(bg, ces...); err != nil {
			return err
		}
	}
	for range dueBenchSteps {
		if err := commit(0.002); err != nil {
			return err
		}
	}
	f.now = m.Version
	return nil
}

// points is a point every k versions, ending at the current one, ascending.
func (f *dueFixture) points(k uint64) pointSet {
	var ps pointSet
	for v := range f.past {
		if (f.now-v)%k == 0 {
			ps = append(ps, v)
		}
	}
	slices.Sort(ps)
	return ps
}

func countIDs(byVersion map[uint64][][]byte) (n int) {
	for _, ids := range byVersion {
		n += len(ids)
	}
	return n
}
