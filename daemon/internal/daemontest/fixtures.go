package daemontest

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/update"
)

// Config is the configuration of a test's daemon: ephemeral loopback ports, state in a
// temporary directory, fixed increments, the shared model; then mutate's changes.
func Config(t testing.TB, mutate func(c *config.Config)) config.Config {
	t.Helper()
	c := config.Default()
	c.StateDir = t.TempDir()
	c.HTTP.Listen = "127.0.0.1:0"
	c.Kafka.EmbeddedListen = "127.0.0.1:0"
	c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog = 32, 32 // increments of a fixed size: tests count them
	c.Kafka.MaxWait = 300 * time.Millisecond
	c.Certify.Samples = 400
	c.Audit.Schedule = ""
	if mutate != nil {
		mutate(&c)
	}
	if TrainsDefaultModel(&c) && !c.Replication.Enabled {
		c.Model.Path = SharedModelDir(t) // the network the first start would train
	}
	return c
}

// Bundled is the bundled breast-cancer data set, the default model's.
func Bundled(t testing.TB) *dataset.Set {
	s, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Record is a labelled record as the input topic carries it.
func Record(id string, x []float64, label any) []byte {
	b, _ := json.Marshal(map[string]any{"id": id, "features": x, "label": label})
	return b
}

// CandidatePairs splits the rows of data that the posterior m (S draws, seed) classifies as
// malignant with p > 0.9 (candidates for x) from those it puts in the <delta, epsilon>-set for
// benign with a margin (Var < 0.002 and Admitted: candidates for x_cf), with the predictive that
// decided. The predictive is a function of m's file, the rows, S and seed: it is computed once
// per test binary for each (most tests ask it of the same shared model) and must not be modified.
func CandidatePairs(t testing.TB, m *bnn.Model, data *dataset.Set, S int, seed uint64) (p *bnn.Predictive, xs, cfs []int) {
	t.Helper()
	sc, w, err := bnn.Encode(m)
	if err != nil {
		t.Fatal(err)
	}
	h := sha256.New()
	h.Write(sc)
	h.Write(w)
	for _, x := range data.X {
		for _, v := range x {
			h.Write(binary.LittleEndian.AppendUint64(nil, math.Float64bits(v)))
		}
	}
	fmt.Fprintf(h, "/%d/%d/%d", len(data.X), S, seed)
	key := [sha256.Size]byte(h.Sum(nil))
	predictives.Lock()
	p, ok := predictives.of[key]
	predictives.Unlock()
	if !ok {
		if p, err = m.Predict(data.X, S, seed); err != nil {
			t.Fatal(err)
		}
		predictives.Lock()
		predictives.of[key] = p
		predictives.Unlock()
	}
	for i := range data.X {
		switch {
		case p.Argmax(i) == 0 && p.P(i, 0) > 0.9:
			xs = append(xs, i)
		case p.V(i, 1) < 0.002 && Admitted(p.P(i, 1), p.V(i, 1), S):
			cfs = append(cfs, i)
		}
	}
	return p, xs, cfs
}

// predictives holds CandidatePairs' predictives by the SHA-256 of what decides them.
var predictives = struct {
	sync.Mutex
	of map[[sha256.Size]byte]*bnn.Predictive
}{of: map[[sha256.Size]byte]*bnn.Predictive{}}

// PaperLearner sets the paper's update protocol (the prior objective, lr Adam steps of 50
// iterations, no memory): its steps are capped by the learning rate, so a test that needs a drift
// of a chosen strength (a mild one, many small steps) gets it from lr, whatever the records.
// The default learner's steps follow the evidence instead (docs/MATHS.md).
func PaperLearner(c *config.Config, lr float64) {
	c.Update.Solver, c.Update.Objective, c.Update.KLWeight, c.Update.MemoryRecords = update.SolverAdam, update.ObjectivePrior, 0, 0
	c.Update.LearningRate = lr
}

// Admitted says whether a CE measured at (p, v) from S draws is admitted as certified, with a
// margin of 0.01 for the daemon's own draws: registration takes the rule that renews a
// certificate, lower(p) >= 1 - delta at confidence 1 - certify.verdict_alpha (the defaults).
func Admitted(p, v float64, S int) bool {
	lo, _ := certify.Evidence{P: p, Var: v, Samples: S}.Interval(certify.DefaultVerdictAlpha)
	return lo >= 0.96
}

// RegisterCEs picks malignant rows x and benign rows x_cf that r's current posterior puts in the
// <delta, eps>-set for "benign", and registers n pairs through the API, with ids
// prefix + "ce-<k>".
func RegisterCEs[S Server](t testing.TB, r *Running[S], data *dataset.Set, n int, prefix string) []string {
	t.Helper()
	_, xs, cfs := CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	if len(xs) < n || len(cfs) < n {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	var ids []string
	for k := 0; k < n; k++ {
		id := fmt.Sprintf("%sce-%d", prefix, k)
		code, body := r.Do(t, "POST", "/v1/counterfactuals", "", map[string]any{"id": id, "x": data.X[xs[k]], "x_cf": data.X[cfs[k]], "target": "benign"})
		if code != http.StatusCreated {
			t.Fatalf("register %s: %d %s", id, code, body)
		}
		ids = append(ids, id)
	}
	return ids
}

// Flipped returns n benign rows of data labelled malignant: a drift that moves the decision
// boundary.
func Flipped(data *dataset.Set, n int) [][]byte {
	var vals [][]byte
	for i := range data.X {
		if data.Y[i] == 1 && len(vals) < n {
			vals = append(vals, Record(fmt.Sprintf("flip%d", i), data.X[i], 0))
		}
	}
	return vals
}

// FlippedThenClean is Flipped(data, n), a drift, then the first clean rows of data correctly
// labelled.
func FlippedThenClean(data *dataset.Set, n, clean int) [][]byte {
	vals := Flipped(data, n)
	for i := range clean {
		vals = append(vals, Record(fmt.Sprintf("clean%d", i), data.X[i], data.Y[i]))
	}
	return vals
}

// StoreCEs stores n CEs anchored to r's current posterior directly in its ledger (the API would
// measure each one separately; this measures candidate rows once): x a malignant row, x_cf a row
// the posterior puts in the <delta, epsilon>-set for "benign", cycling over the candidates.
func StoreCEs[S Server](t testing.TB, r *Running[S], data *dataset.Set, n int) {
	t.Helper()
	m := r.D.Posterior()
	c := r.Config.Certify
	p, xs, cfs := CandidatePairs(t, m, data, c.Samples, 7)
	if len(xs) == 0 || len(cfs) == 0 {
		t.Fatalf("no candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	ctx := context.Background()
	batch := make([]*ledger.CE, 0, 2000)
	for k := 0; k < n; k++ {
		x, cf := xs[k%len(xs)], cfs[k%len(cfs)]
		batch = append(batch, &ledger.CE{ID: fmt.Sprintf("ce-%07d", k), X: data.X[x], XCF: data.X[cf], Target: 1, AnchorVersion: m.Version,
			P1: p.P(cf, 1), Var1: p.V(cf, 1), Samples: c.Samples, Delta: c.Delta, Epsilon: c.Epsilon})
		if len(batch) == cap(batch) || k == n-1 {
			if err := r.D.Ledger().Put(ctx, batch...); err != nil {
				t.Fatal(err)
			}
			batch = batch[:0]
		}
	}
}

// EachCE calls fn with every CE the ledger l stores, a page at a time.
func EachCE(t testing.TB, l *ledger.Ledger, fn func(*ledger.CE)) {
	t.Helper()
	for after := ""; ; {
		page, err := l.List(0, 5000, after)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 {
			return
		}
		for _, ce := range page {
			fn(ce)
		}
		after = page[len(page)-1].ID
	}
}

// AnySlice is x as a JSON array's elements.
func AnySlice(x []float64) []any {
	out := make([]any, len(x))
	for i, v := range x {
		out[i] = v
	}
	return out
}

// OverflowingModel saves, in a directory it returns, a model fitted to the bundled data whose
// last-layer means are so large that the logits overflow: every update's loss is non-finite.
func OverflowingModel(t testing.TB) string {
	t.Helper()
	m, _, err := bnn.Fit(context.Background(), Bundled(t), []string{"malignant", "benign"}, bnn.TrainConfig{Seed: 1, Epochs: 2})
	if err != nil {
		t.Fatal(err)
	}
	last := m.Last()
	for i := range last.WeightMu {
		last.WeightMu[i] = 1e306 * float64(1-2*(i%2))
	}
	dir := filepath.Join(t.TempDir(), "model")
	if err := bnn.Save(dir, m); err != nil {
		t.Fatal(err)
	}
	return dir
}

// RowRecords encodes the first n rows of data as records named prefix0, prefix1, ...
func RowRecords(data *dataset.Set, prefix string, n int) [][]byte {
	var out [][]byte
	for i := range n {
		out = append(out, Record(fmt.Sprintf("%s%d", prefix, i), data.X[i], data.Y[i]))
	}
	return out
}
