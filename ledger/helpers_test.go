package ledger

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// testModel is a small posterior (3 -> 6 -> 2) whose class "yes" (1) has logit bias `bias`
// above class 0, so p(yes | x) is near sigmoid(bias) for inputs in [-1, 1]^3.
func testModel(bias float64) *bnn.Model {
	m := bnn.New(3, []int{6}, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(7, 8)))
	last := m.Last()
	last.BiasMu[0], last.BiasMu[1] = 0, bias
	return m
}

// drift returns a copy of m with the next version and class 1's bias mean moved by d. With
// sigma = 0.1 its KL from m is d^2 / (2 * 0.01) = 50 d^2; from an anchor n such steps back it is
// 50 (n d)^2, not n * 50 d^2.
func drift(m *bnn.Model, d float64) *bnn.Model {
	c := m.Clone()
	c.Version = m.Version + 1
	c.Last().BiasMu[1] += d
	return c
}

// measure estimates p(target | xcf) and its variance under m, as a CE generator would.
func measure(t testing.TB, m *bnn.Model, xcf []float64, target, samples int, seed uint64) (p, v float64) {
	t.Helper()
	pred, err := m.Predict([][]float64{xcf}, samples, seed)
	if err != nil {
		t.Fatal(err)
	}
	return pred.P(0, target), pred.V(0, target)
}

// newCE measures a CE for a random x' under m (anchor m.Version), target "yes".
func newCE(t testing.TB, m *bnn.Model, rng *rand.Rand) *CE {
	x := []float64{rng.Float64()*2 - 1, rng.Float64()*2 - 1, rng.Float64()*2 - 1}
	xcf := []float64{rng.Float64()*2 - 1, rng.Float64()*2 - 1, rng.Float64()*2 - 1}
	p, v := measure(t, m, xcf, 1, 400, rng.Uint64())
	return &CE{X: x, XCF: xcf, Target: 1, AnchorVersion: m.Version, P1: p, Var1: v, Samples: 400, Delta: 0.05, Epsilon: 0.01}
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// openTest opens a ledger in a fresh temp dir, closed at cleanup.
func openTest(t testing.TB, opts Options) (*Ledger, string) {
	t.Helper()
	dir := t.TempDir()
	if opts.Logger == nil {
		opts.Logger = quietLogger()
	}
	l, err := Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l, dir
}

// reopen closes l and opens the ledger in dir again, as a restart would; the ledger it returns
// is closed at cleanup.
func reopen(t testing.TB, l *Ledger, dir string) *Ledger {
	t.Helper()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l, err := Open(dir, Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// install checkpoints m as the first posterior.
func install(t testing.TB, l *Ledger, m *bnn.Model) {
	t.Helper()
	if err := l.Checkpoint(&Checkpoint{Model: m}); err != nil {
		t.Fatal(err)
	}
}

// bg is the context of calls that are not about cancellation.
var bg = context.Background()

// commit promotes m through Commit, then confirms every CE whose bound fails with 300 draws and
// seed (what Commit did itself before Confirm existed). The changes are merged per CE and the
// report's counts are those after confirmation.
func commit(t testing.TB, l *Ledger, m *bnn.Model, seed uint64) (Report, []StatusChange) {
	t.Helper()
	rep, ch, err := l.Commit(bg, &Checkpoint{Model: m})
	if err != nil {
		t.Fatal(err)
	}
	conf := confirmAll(t, l, m, 300, seed)
	if rep.Counts, err = l.Counts(); err != nil {
		t.Fatal(err)
	}
	return rep, mergeChanges(ch, conf)
}

// confirmAll calls Confirm, 16 CEs at a time, until no CE lacks a verdict at m's version.
func confirmAll(t testing.TB, l *Ledger, m *bnn.Model, samples int, seed uint64) []StatusChange {
	t.Helper()
	return confirmBatches(t, l, m, samples, seed, 16)
}

// confirmBatches is confirmAll with batches of n CEs. The verdicts do not depend on n
// (ModelPredictor draws the same networks for every batch); each batch draws them again and
// writes one transaction.
func confirmBatches(t testing.TB, l *Ledger, m *bnn.Model, samples int, seed uint64, n int) []StatusChange {
	t.Helper()
	p := NewModelPredictor(m, samples, seed)
	var all []StatusChange
	for {
		rep, ch, err := l.Confirm(bg, p, n)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, ch...)
		if rep.Discarded {
			t.Fatalf("confirm discarded: %+v", rep)
		}
		if !rep.More {
			return all
		}
	}
}

// mergeChanges folds each change of b into a's change of the same CE (From of a, the rest of b).
func mergeChanges(a, b []StatusChange) []StatusChange {
	at := map[string]int{}
	for i, ch := range a {
		at[ch.ID] = i
	}
	out := append([]StatusChange(nil), a...)
	for _, ch := range b {
		if i, ok := at[ch.ID]; ok {
			ch.From = out[i].From
			out[i] = ch
		} else {
			out = append(out, ch)
		}
	}
	return out
}

// countByScan counts statuses by listing every CE.
func countByScan(t testing.TB, l *Ledger) map[certify.Status]int {
	t.Helper()
	out := map[certify.Status]int{}
	for _, s := range certify.Statuses() {
		out[s] = 0
	}
	after := ""
	for {
		page, err := l.List(0, 1000, after)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 {
			return out
		}
		for _, ce := range page {
			out[ce.Status]++
		}
		after = page[len(page)-1].ID
	}
}

// copyTestdata decodes testdata/<name>.json into want and copies testdata/<name>.db into a fresh
// state directory. It returns the directory, the copy's path and the file's bytes, which the test
// checks are unchanged at its end.
func copyTestdata(t *testing.T, name string, want any) (dir, path string, data []byte) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", name+".json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, want); err != nil {
		t.Fatal(err)
	}
	if data, err = os.ReadFile(filepath.Join("testdata", name+".db")); err != nil {
		t.Fatal(err)
	}
	dir = t.TempDir()
	path = filepath.Join(dir, FileName)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return dir, path, data
}
