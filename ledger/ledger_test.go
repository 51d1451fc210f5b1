package ledger

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

func TestModelBlobRoundTrip(t *testing.T) {
	m := testModel(4)
	m.Version = 17
	blob, err := encodeModel(m)
	if err != nil {
		t.Fatal(err)
	}
	back, err := decodeModel(blob)
	if err != nil {
		t.Fatal(err)
	}
	if back.Version != 17 || len(back.Layers) != len(m.Layers) || !reflect.DeepEqual(back.Classes, m.Classes) {
		t.Fatalf("round trip changed the model: %+v", back)
	}
	for k := range m.Layers {
		if !bnn.LayersEqual(&m.Layers[k], &back.Layers[k]) {
			t.Errorf("layer %d differs after round trip", k)
		}
	}
	for _, cut := range []int{3, len(modelMagic) + 2, len(blob) - 1} {
		if _, err := decodeModel(blob[:cut]); !errors.Is(err, ErrCorrupt) {
			t.Errorf("blob cut at %d: err %v, want ErrCorrupt", cut, err)
		}
	}
	flip := append([]byte(nil), blob...)
	flip[len(flip)-3] ^= 0x40 // a weight byte: the sidecar's SHA-256 no longer matches
	if _, err := decodeModel(flip); !errors.Is(err, ErrCorrupt) {
		t.Errorf("flipped weight byte: err %v, want ErrCorrupt", err)
	}
	bad := m.Clone()
	bad.Last().WeightMu[0] = math.NaN()
	if _, err := encodeModel(bad); !errors.Is(err, ErrInvalid) {
		t.Errorf("NaN model: err %v, want ErrInvalid", err)
	}
}

func TestRecordRoundTrip(t *testing.T) {
	p2 := 0.42
	at := time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)
	h := header{status: certify.AtRisk, target: 3, anchor: 1 << 40, p1: 0.97, var1: 0.003, delta: 0.05, epsilon: 0.01, samples: 1000, updated: at.UnixNano()}
	got, err := decodeHeader(h.encode())
	if err != nil || got != h {
		t.Fatalf("header round trip: %+v, %v; want %+v", got, err, h)
	}
	b := body{created: at.UnixNano(), x: []float64{1, -2.5, math.MaxFloat64}, xcf: []float64{0, math.SmallestNonzeroFloat64, 3},
		history: []StatusChange{
			{At: at, From: certify.Certified, To: certify.AtRisk, PosteriorVersion: 9, KL: 1e-4, Bound: 0.93, VarBound: 0.07, P2: &p2},
			{At: at.Add(time.Second), From: certify.AtRisk, To: certify.Certified, PosteriorVersion: 10, KL: 2e-5, Bound: 0.96, VarBound: 0.03},
		}}
	gb, err := decodeBody(b.encode(), true)
	if err != nil || !reflect.DeepEqual(gb, b) {
		t.Fatalf("body round trip:\n got %+v, %v\nwant %+v", gb, err, b)
	}
	enc := b.encode()
	for _, cut := range []int{0, 5, 12, len(enc) - 1} {
		if _, err := decodeBody(enc[:cut], true); !errors.Is(err, ErrCorrupt) {
			t.Errorf("body cut at %d: err %v, want ErrCorrupt", cut, err)
		}
	}
	if _, err := decodeHeader(h.encode()[:63]); !errors.Is(err, ErrCorrupt) {
		t.Errorf("short header: err %v", err)
	}
	var hist []StatusChange
	for i := 0; i < MaxHistory+5; i++ {
		hist = appendHistory(hist, StatusChange{ID: "x", PosteriorVersion: uint64(i)})
	}
	if len(hist) != MaxHistory || hist[0].PosteriorVersion != 5 || hist[0].ID != "" {
		t.Errorf("history keeps %d entries from version %d", len(hist), hist[0].PosteriorVersion)
	}
}

func TestPutValidation(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	if err := l.Put(bg, &CE{XCF: []float64{1, 2, 3}}); !errors.Is(err, ErrNoPosterior) {
		t.Fatalf("put without posterior: %v", err)
	}
	install(t, l, m)
	rng := rand.New(rand.NewPCG(1, 1))
	good := func() *CE { return newCE(t, m, rng) }
	tests := []struct {
		name string
		edit func(*CE)
		want error
	}{
		{"short x_cf", func(c *CE) { c.XCF = c.XCF[:2] }, ErrInvalid},
		{"NaN in x", func(c *CE) { c.X[1] = math.NaN() }, ErrInvalid},
		{"target out of range", func(c *CE) { c.Target = 2 }, ErrInvalid},
		{"p1 above 1", func(c *CE) { c.P1 = 1.5 }, ErrInvalid},
		{"no samples", func(c *CE) { c.Samples = 0 }, ErrInvalid},
		{"bad id", func(c *CE) { c.ID = "a b" }, ErrInvalid},
		{"unknown anchor", func(c *CE) { c.AnchorVersion = 99 }, ErrUnknownAnchor},
	}
	for _, tt := range tests {
		c := good()
		tt.edit(c)
		if err := l.Put(bg, c); !errors.Is(err, tt.want) {
			t.Errorf("%s: err %v, want %v", tt.name, err, tt.want)
		}
	}
	a, b := good(), good()
	a.ID, b.ID = "dup", "dup"
	if err := l.Put(bg, a, b); !errors.Is(err, ErrExists) {
		t.Errorf("duplicate in batch: %v", err)
	}
	if err := l.Put(bg, a); err != nil {
		t.Fatal(err)
	}
	c := good()
	c.ID = "dup"
	if err := l.Put(bg, c); !errors.Is(err, ErrExists) {
		t.Errorf("duplicate of stored: %v", err)
	}
	// A rejected batch stores nothing: one CE is stored ("dup").
	if n, err := l.Counts(); err != nil || sum(n) != 1 {
		t.Errorf("counts after rejected puts: %v, %v", n, err)
	}
}

// An id the ledger chooses is never one it refuses as existing: the CEs of one call share its
// time, and the random bits of two of them (or of one and a CE stored at the same time) may
// agree; a drawn id that is taken is drawn again. Here the clock stands still and the bits repeat.
func TestPutDrawsATakenIDAgain(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, _ := openTest(t, Options{Policy: testPolicy(), Now: func() time.Time { return now }})
	m := testModel(4)
	install(t, l, m)
	draws := []uint32{7, 7, 8, 7, 8, 9}
	l.idBits = func() uint32 { d := draws[0]; draws = draws[1:]; return d }
	rng := rand.New(rand.NewPCG(3, 3))
	a, b := newCE(t, m, rng), newCE(t, m, rng)
	if err := l.Put(bg, a, b); err != nil {
		t.Fatalf("two CEs whose first draws agree: %v", err)
	}
	c := newCE(t, m, rng)
	if err := l.Put(bg, c); err != nil {
		t.Fatalf("a CE whose first two draws are the ids stored at the same time: %v", err)
	}
	prefix := fmt.Sprintf("%016x", uint64(now.UnixNano()))
	if got := []string{a.ID, b.ID, c.ID}; !slices.Equal(got, []string{prefix + "00000007", prefix + "00000008", prefix + "00000009"}) {
		t.Fatalf("ids %q, want the time %s with the bits 7, 8 and 9", got, prefix)
	}
	if n, err := l.Counts(); err != nil || sum(n) != 3 {
		t.Fatalf("counts %v, %v; want 3 CEs stored", n, err)
	}
}

func sum(m map[certify.Status]int) int {
	s := 0
	for _, n := range m {
		s += n
	}
	return s
}

// A measured V1 may exceed 1/4, the largest variance of f in [0, 1], by the unbiased estimate's
// factor S/(S - 1) (draws of f near 0 or 1 and p1 near 1/2): such a CE is outside its set and is
// stored as uncertified, not refused as invalid (which would fail the whole batch).
func TestPutStoresAVarianceAboveAQuarterAsUncertified(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(3, 3))
	in, wide := newCE(t, m, rng), newCE(t, m, rng)
	wide.P1, wide.Var1 = 0.502, 0.2502 // newCE measures with 400 draws: at most 400/1596 = 0.25063
	if err := l.Put(bg, in, wide); err != nil {
		t.Fatalf("Put of a CE with V1 = %v from %d draws: %v", wide.Var1, wide.Samples, err)
	}
	got, err := l.Get(wide.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.Status != certify.Uncertified || got.Var1 != wide.Var1 || in.Status != certify.Certified {
		t.Errorf("stored %v with V1 %v beside a %v CE; want uncertified with V1 %v beside a certified one", got.Status, got.Var1, in.Status, wide.Var1)
	}
	over := newCE(t, m, rng)
	over.Var1 = math.Nextafter(certify.MaxSampleVar(over.Samples), 1)
	if err := l.Put(bg, over); !errors.Is(err, ErrInvalid) {
		t.Errorf("Put of a CE with V1 = %v from %d draws, above any unbiased variance: %v, want ErrInvalid", over.Var1, over.Samples, err)
	}
}

// Registering under the current posterior: certified (in set, KL = 0) or uncertified (outside),
// the current posterior stored as an anchor, the derived bound equal to p1 at KL = 0.
func TestPutStatuses(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(2, 2))
	in := newCE(t, m, rng)
	out := newCE(t, m, rng)
	out.P1 = 0.9 // below 1 - delta
	if err := l.Put(bg, in, out); err != nil {
		t.Fatal(err)
	}
	if in.Status != certify.Certified || out.Status != certify.Uncertified {
		t.Fatalf("statuses %v, %v; want certified, uncertified (p1 %v var1 %v)", in.Status, out.Status, in.P1, in.Var1)
	}
	got, err := l.Get(in.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.Bound != in.P1 || got.KLFromAnchor != 0 || got.Status != certify.Certified || !reflect.DeepEqual(got.XCF, in.XCF) {
		t.Errorf("stored CE %+v", got)
	}
	anchors, err := l.Anchors()
	if err != nil || len(anchors) != 1 || anchors[0].Version != m.Version || anchors[0].Refs != 1 {
		t.Errorf("anchors %+v, %v; want version %d with 1 reference (uncertified CEs hold none)", anchors, err, m.Version)
	}
	if _, err := l.Get("nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("get unknown: %v", err)
	}
}

// A CE registered against an older, still-live anchor is judged at KL(q_now || q_anchor), with
// a Monte-Carlo check when the bound fails.
func TestPutOlderAnchor(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(3, 3))
	keep := newCE(t, m0, rng) // keeps anchor 0 alive
	late := newCE(t, m0, rng) // measured under m0, registered after m1
	if err := l.Put(bg, keep); err != nil {
		t.Fatal(err)
	}
	m1 := drift(m0, -0.05) // KL = 50 * 0.0025 = 0.125: beyond every budget
	commit(t, l, m1, 1)
	if err := l.Put(bg, late); err != nil {
		t.Fatal(err)
	}
	kl, _, _ := certify.KL(m1, m0)
	if math.Abs(late.KLFromAnchor-kl) > 1e-15 || math.Abs(kl-0.125) > 1e-12 {
		t.Errorf("KL from anchor %v, want KL(m1||m0) = %v = 0.125", late.KLFromAnchor, kl)
	}
	if late.Status != certify.AtRisk {
		t.Errorf("late CE status %v, want at_risk (bound fails, p under m1 still > 1/2)", late.Status)
	}
}

func TestReopenIdenticalState(t *testing.T) {
	l, dir := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(4, 4))
	var ces []*CE
	for i := 0; i < 50; i++ {
		ces = append(ces, newCE(t, m, rng))
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		m = drift(m, -0.004)
		if _, _, err := l.Commit(context.Background(), &Checkpoint{Model: m, Offsets: map[int]int64{0: int64(10 * (i + 1)), 3: 7},
			Applied: 10, Counters: map[string]int64{"updates_promoted": 1}, Update: &UpdateRecord{Version: m.Version, KL: 8e-4, Outcome: certify.OutcomePromoted}}); err != nil {
			t.Fatal(err)
		}
	}
	snap := func(l *Ledger) string {
		t.Helper()
		st, err := l.State()
		if err != nil {
			t.Fatal(err)
		}
		all, err := l.List(0, 10000, "")
		if err != nil {
			t.Fatal(err)
		}
		an, _ := l.Anchors()
		hist, _ := l.KLHistory(0)
		cur, err := l.Current()
		if err != nil {
			t.Fatal(err)
		}
		blob, _ := encodeModel(cur)
		b, err := json.Marshal([]any{st, all, an, hist, blob})
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	before := snap(l)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l2, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if after := snap(l2); after != before {
		t.Errorf("state differs after reopen:\nbefore %.400s\nafter  %.400s", before, after)
	}
	st, _ := l2.State()
	if st.Applied != 30 || st.Offsets[0] != 30 || st.Offsets[3] != 7 || st.Counters["updates_promoted"] != 3 || st.PosteriorVersion != 3 {
		t.Errorf("state %+v", st)
	}
	// A second Open of the same directory fails at once, naming the holder.
	if _, err := Open(dir, Options{Policy: testPolicy()}); !errors.Is(err, ErrLocked) {
		t.Errorf("second Open of a locked ledger: %v, want ErrLocked", err)
	}
}

func TestFailedCheckpointWritesNothing(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(5, 5))
	if err := l.Put(bg, newCE(t, m, rng), newCE(t, m, rng)); err != nil {
		t.Fatal(err)
	}
	if err := l.Checkpoint(&Checkpoint{Offsets: map[int]int64{0: 5}, Applied: 5}); err != nil {
		t.Fatal(err)
	}
	state := func() string {
		st, err := l.State()
		if err != nil {
			t.Fatal(err)
		}
		all, _ := l.List(0, 100, "")
		an, _ := l.Anchors()
		hist, _ := l.KLHistory(0)
		b, _ := json.Marshal([]any{st, all, an, hist})
		return string(b)
	}
	before := state()
	next := drift(m, -0.001)
	rep, changes, err := l.Recertify(context.Background(), next)
	if err != nil {
		t.Fatal(err)
	}
	nan := drift(m, 0)
	nan.Last().BiasMu[0] = math.Inf(1)
	stale := func() (*Report, []StatusChange) {
		r, ch, err := l.Recertify(context.Background(), next)
		if err != nil {
			t.Fatal(err)
		}
		r.Generation-- // as if CEs had been registered since
		return &r, ch
	}
	sr, sch := stale()
	old := m.Clone()
	tests := []struct {
		name string
		c    *Checkpoint
		want error
	}{
		{"invalid model", &Checkpoint{Model: nan, Offsets: map[int]int64{0: 9}, Applied: 4}, ErrInvalid},
		{"version does not advance", &Checkpoint{Model: func() *bnn.Model { o := drift(old, 0.1); o.Version = 0; return o }(), Offsets: map[int]int64{0: 9}}, ErrVersion},
		{"posterior change without re-certification", &Checkpoint{Model: next, Offsets: map[int]int64{0: 9}}, ErrNotRecertified},
		{"report for another posterior", &Checkpoint{Model: drift(m, -0.002), Recertified: &rep, Changes: changes}, ErrNotRecertified},
		{"stale report", &Checkpoint{Model: next, Recertified: sr, Changes: sch, Offsets: map[int]int64{0: 9}}, ErrStale},
		{"negative offset", &Checkpoint{Offsets: map[int]int64{0: -1}}, ErrInvalid},
		{"negative counter delta", &Checkpoint{Counters: map[string]int64{"x": -1}}, ErrInvalid},
		{"changes without report", &Checkpoint{Changes: []StatusChange{{ID: "a", From: certify.Certified, To: certify.AtRisk}}}, ErrInvalid},
		{"infinite update KL", &Checkpoint{Update: &UpdateRecord{KL: math.Inf(1), Outcome: certify.OutcomePromoted}}, ErrInvalid},
		{"unknown outcome", &Checkpoint{Update: &UpdateRecord{KL: 0.1, Outcome: "accepted"}}, ErrInvalid},
	}
	for _, tt := range tests {
		if err := l.Checkpoint(tt.c); !errors.Is(err, tt.want) {
			t.Errorf("%s: err %v, want %v", tt.name, err, tt.want)
		}
		if after := state(); after != before {
			t.Fatalf("%s: failed checkpoint changed the state:\nbefore %.300s\nafter  %.300s", tt.name, before, after)
		}
	}
	// The good report still applies.
	if err := l.Checkpoint(&Checkpoint{Model: next, Recertified: &rep, Changes: changes, Offsets: map[int]int64{0: 9}}); err != nil {
		t.Fatal(err)
	}
	if st, _ := l.State(); st.PosteriorVersion != next.Version || st.Offsets[0] != 9 {
		t.Errorf("state after good checkpoint %+v", st)
	}
}

// Puts between Recertify and Checkpoint make the report stale; Commit never is.
func TestStaleAfterPut(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(6, 6))
	if err := l.Put(bg, newCE(t, m, rng)); err != nil {
		t.Fatal(err)
	}
	next := drift(m, -0.001)
	rep, ch, err := l.Recertify(context.Background(), next)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Put(bg, newCE(t, m, rng)); err != nil {
		t.Fatal(err)
	}
	if err := l.Checkpoint(&Checkpoint{Model: next, Recertified: &rep, Changes: ch}); !errors.Is(err, ErrStale) {
		t.Fatalf("checkpoint after put: %v, want ErrStale", err)
	}
	rep, _ = commit(t, l, next, 1)
	if rep.Checked != 2 {
		t.Errorf("commit checked %d CEs, want 2", rep.Checked)
	}
}

func TestKLHistoryRing(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), KLHistory: 5})
	m := testModel(4)
	install(t, l, m)
	for i := 1; i <= 8; i++ {
		if err := l.Checkpoint(&Checkpoint{Update: &UpdateRecord{Version: uint64(i), KL: float64(i) * 1e-4, Outcome: certify.OutcomeRejected}}); err != nil {
			t.Fatal(err)
		}
	}
	h, err := l.KLHistory(0)
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 5 || h[0].Seq != 4 || h[4].Seq != 8 || h[4].KL != 8e-4 || h[4].Outcome != "rejected" {
		t.Errorf("history %+v, want seq 4..8", h)
	}
	if h2, _ := l.KLHistory(2); len(h2) != 2 || h2[1].Seq != 8 {
		t.Errorf("last 2: %+v", h2)
	}
}

// LastKLOver finds the newest update over the budget, not the newest update: a breach followed by
// updates within budget is still when the budget was last breached; none is found before a
// breach, and one the ring has dropped is still found, from the checkpoint that marked it
// breached (UpdateRecord.Breached, as the daemon sets it).
func TestLastKLOver(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), KLHistory: 4})
	install(t, l, testModel(4))
	const budget = 0.1
	put := func(v uint64, kl float64) {
		t.Helper()
		u := &UpdateRecord{Version: v, KL: kl, Outcome: certify.OutcomeRejected, Breached: kl > budget}
		if err := l.Checkpoint(&Checkpoint{Update: u}); err != nil {
			t.Fatal(err)
		}
	}
	check := func(wantOK bool, wantVersion uint64) {
		t.Helper()
		e, ok, err := l.LastKLOver(budget)
		if err != nil || ok != wantOK || ok && (e.PosteriorVersion != wantVersion || e.KL <= budget || e.At.IsZero()) {
			t.Fatalf("LastKLOver(%v) = %+v, %v, %v; want found %v at version %d", budget, e, ok, err, wantOK, wantVersion)
		}
	}
	check(false, 0)
	put(1, 0.01)
	check(false, 0)
	put(2, 0.2)
	put(3, 0.3)
	put(4, budget) // at the budget is not over it
	put(5, 0.02)
	check(true, 3)
	h, _ := l.KLHistory(0)
	if e, _, _ := l.LastKLOver(budget); !e.At.Equal(h[1].At) || e.Seq != h[1].Seq {
		t.Fatalf("LastKLOver gives %+v; the history's entry for version 3 is %+v", e, h[1])
	}
	put(6, 0.01)
	put(7, 0.01)
	put(8, 0.01) // the ring of 4 keeps versions 5..8: the breaches are not in it
	check(true, 3)
	if e, _, _ := l.LastKLOver(budget); !e.At.Equal(h[1].At) || e.Seq != h[1].Seq {
		t.Fatalf("LastKLOver after the ring dropped it gives %+v; the breach was %+v", e, h[1])
	}
	put(9, 0.5)
	check(true, 9)
}

// The newest failed update is found as the newest breach is: in the history while it is there,
// then from the checkpoint that recorded it, and a newer failure replaces it. A breach and a
// failure are dated apart: the one does not stand for the other.
func TestLastFailureOutlivesTheHistory(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), KLHistory: 3})
	install(t, l, testModel(4))
	const budget = 0.1
	put := func(v uint64, outcome certify.Outcome, kl float64) KLEntry {
		t.Helper()
		u := &UpdateRecord{Version: v, KL: kl, Outcome: outcome, Breached: kl > budget}
		if err := l.Checkpoint(&Checkpoint{Update: u}); err != nil {
			t.Fatal(err)
		}
		h, err := l.KLHistory(1)
		if err != nil || len(h) != 1 {
			t.Fatalf("KLHistory(1) = %+v, %v", h, err)
		}
		return h[0]
	}
	check := func(stage string, want *KLEntry) {
		t.Helper()
		ev, err := l.LastKLEvents(budget)
		if err != nil {
			t.Fatalf("%s: LastKLEvents: %v", stage, err)
		}
		switch {
		case want == nil && ev.Failed != nil:
			t.Fatalf("%s: a failure %+v, want none", stage, *ev.Failed)
		case want != nil && (ev.Failed == nil || ev.Failed.Seq != want.Seq || !ev.Failed.At.Equal(want.At) || ev.Failed.Outcome != certify.OutcomeFailed):
			t.Fatalf("%s: the last failure is %+v, want %+v", stage, ev.Failed, *want)
		}
	}
	put(1, certify.OutcomePromoted, 0.01)
	check("no failure", nil)
	first := put(2, certify.OutcomeFailed, 0)
	check("in the history", &first)
	put(3, certify.OutcomePromoted, 0.5) // a breach, not a failure
	check("after a breach", &first)
	for v := uint64(4); v <= 7; v++ {
		put(v, certify.OutcomePromoted, 0.01)
	}
	if h, _ := l.KLHistory(0); h[0].Seq <= first.Seq {
		t.Fatalf("the history %+v still holds the failure: the test needs it dropped", h)
	}
	check("dropped from the history", &first)
	second := put(8, certify.OutcomeFailed, 0)
	put(9, certify.OutcomeRejected, 0.5)
	check("a newer failure", &second)
	if ev, _ := l.LastKLEvents(budget); ev.Breach == nil || ev.Breach.PosteriorVersion != 9 {
		t.Fatalf("the last breach is %+v, want version 9's", ev.Breach)
	}
}

// A ledger written before meta kl_failed existed keeps its newest failure from the KL history at
// Open, so that the failure still dates CfguardUpdatesFailing after the history drops it.
func TestOlderLedgerKeepsItsLastFailure(t *testing.T) {
	opts := Options{Policy: testPolicy(), KLHistory: 3}
	l, dir := openTest(t, opts)
	install(t, l, testModel(4))
	for v, o := range []certify.Outcome{certify.OutcomeFailed, certify.OutcomePromoted} {
		if err := l.Checkpoint(&Checkpoint{Update: &UpdateRecord{Version: uint64(v + 1), Outcome: o}}); err != nil {
			t.Fatal(err)
		}
	}
	h, err := l.KLHistory(0)
	if err != nil || len(h) != 2 || h[0].Outcome != certify.OutcomeFailed {
		t.Fatalf("KLHistory = %+v, %v; want the failure, then a promotion", h, err)
	}
	failure := h[0]
	// What an older build left: the history without the key.
	if err := l.update(func(tx *bolt.Tx) error { return tx.Bucket(bMeta).Delete(kKLFailed) }); err != nil {
		t.Fatal(err)
	}
	l.Close()
	var logs bytes.Buffer
	opts.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	l, err = Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if !strings.Contains(logs.String(), "kl_failed") {
		t.Errorf("Open logged nothing of the failure it kept:\n%s", logs.String())
	}
	for v := uint64(3); v <= 6; v++ {
		if err := l.Checkpoint(&Checkpoint{Update: &UpdateRecord{Version: v, Outcome: certify.OutcomePromoted}}); err != nil {
			t.Fatal(err)
		}
	}
	if h, _ := l.KLHistory(0); h[0].Seq <= failure.Seq {
		t.Fatalf("the history %+v still holds the failure: the test needs it dropped", h)
	}
	ev, err := l.LastKLEvents(0.1)
	if err != nil || ev.Failed == nil || ev.Failed.Seq != failure.Seq || !ev.Failed.At.Equal(failure.At) {
		t.Fatalf("LastKLEvents().Failed = %+v, %v; want %+v", ev.Failed, err, failure)
	}
}

// testPolicy is the policy the ledger's tests are written for: paper mode with a variance
// ceiling of 0.05, low enough for Theorem 2 to bite under small drifts (the daemon's default,
// certify.DefaultEpsilonMax, is 1/4: no variance constraint).
func testPolicy() certify.Policy {
	p := certify.DefaultPolicy()
	p.EpsilonMax = 0.05
	return p
}

func TestLogHeadIsStoredWithItsPosterior(t *testing.T) {
	l, dir := openTest(t, Options{})
	if h, err := l.LogHead(); err != nil || h != nil {
		t.Fatalf("LogHead of a new ledger = %q, %v, want none", h, err)
	}
	m := testModel(2)
	if err := l.Checkpoint(&Checkpoint{Model: m, LogHead: []byte(`{"seq":0}`)}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Commit(context.Background(), &Checkpoint{Model: drift(m, 0.01), LogHead: []byte(`{"seq":1}`)}); err != nil {
		t.Fatal(err)
	}
	// A checkpoint without a head keeps the stored one.
	if err := l.Checkpoint(&Checkpoint{Counters: map[string]int64{"dead_lettered": 1}}); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	l2, err := Open(dir, Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if h, err := l2.LogHead(); err != nil || string(h) != `{"seq":1}` {
		t.Fatalf("LogHead after reopening = %q, %v, want the last one given", h, err)
	}
}

// A breach is dated when its update was made (Checkpoint.At: a replica replaying an old log
// gives the entries' times), not when a replica wrote it: an old breach replayed does not page.
func TestKLBreachKeepsItsUpdateTime(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), KLHistory: 2})
	install(t, l, testModel(4))
	const budget = 0.1
	long := time.Now().Add(-48 * time.Hour).UTC().Truncate(time.Millisecond)
	for i, kl := range []float64{0.5, 0.01, 0.01, 0.01} {
		at := long.Add(time.Duration(i) * time.Minute)
		u := &UpdateRecord{Version: uint64(i + 1), KL: kl, Outcome: certify.OutcomePromoted, Breached: kl > budget}
		if err := l.Checkpoint(&Checkpoint{Update: u, At: at}); err != nil {
			t.Fatal(err)
		}
	}
	e, ok, err := l.LastKLOver(budget)
	if err != nil || !ok || !e.At.Equal(long) {
		t.Fatalf("LastKLOver = %+v, %v, %v; want the breach at %v, when its update was made", e, ok, err, long)
	}
}

// A damaged record of the last breach or failure only dates an alert: Verify refuses it, and Open
// deletes it (an ERROR line) rather than refuse the ledger; LastKLEvents then answers from the
// history.
func TestDamagedKeptEventIsDropped(t *testing.T) {
	for _, key := range keptEvents() {
		t.Run(string(key), func(t *testing.T) {
			l, dir := openTest(t, Options{Policy: testPolicy(), KLHistory: 2})
			install(t, l, testModel(4))
			for i, u := range []UpdateRecord{{KL: 0.5, Outcome: certify.OutcomePromoted, Breached: true}, {Outcome: certify.OutcomeFailed},
				{KL: 0.01, Outcome: certify.OutcomePromoted}, {KL: 0.01, Outcome: certify.OutcomePromoted}} {
				u.Version = uint64(i + 1)
				if err := l.Checkpoint(&Checkpoint{Update: &u}); err != nil {
					t.Fatal(err)
				}
			}
			damageValue(t, l, bMeta, string(key))
			ev, err := l.LastKLEvents(0.1)
			lost := map[string]*KLEntry{"kl_breach": ev.Breach, "kl_failed": ev.Failed}[string(key)]
			if err != nil || lost != nil {
				t.Fatalf("LastKLEvents on a damaged %s = %+v, %v; want the history's answer (none: the ring dropped the event)", key, ev, err)
			}
			if kept := map[string]*KLEntry{"kl_breach": ev.Failed, "kl_failed": ev.Breach}[string(key)]; kept == nil {
				t.Fatalf("LastKLEvents on a damaged %s = %+v: the other kept event is lost too", key, ev)
			}
			l.Close()
			path := filepath.Join(dir, FileName)
			if _, err := Verify(path); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), string(key)) {
				t.Fatalf("Verify of a damaged %s: %v, want a corrupt error naming it", key, err)
			}
			var logs bytes.Buffer
			l2, err := Open(dir, Options{Policy: testPolicy(), KLHistory: 2, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			if err != nil {
				t.Fatalf("Open with a damaged %s: %v", key, err)
			}
			defer l2.Close()
			if !strings.Contains(logs.String(), string(key)) {
				t.Errorf("no ERROR line names the damaged %s:\n%s", key, logs.String())
			}
			l2.Close()
			if _, err := Verify(path); err != nil {
				t.Errorf("Verify after Open dropped it: %v", err)
			}
		})
	}
}

// Page says whether CEs follow the page, also for a page that ends exactly at the last CE and
// for a limit List reads as its default.
func TestPageSaysWhetherMoreFollow(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(5, 5))
	for i := range 3 {
		c := newCE(t, m, rng)
		c.ID = "page-" + strconv.Itoa(i)
		if err := l.Put(bg, c); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		limit int
		after string
		n     int
		more  bool
	}{{2, "", 2, true}, {3, "", 3, false}, {2, "page-1", 1, false}, {0, "", 3, false}, {-1, "", 3, false}} {
		ces, more, err := l.Page(0, tc.limit, tc.after)
		if err != nil || len(ces) != tc.n || more != tc.more {
			t.Errorf("Page(limit %d, after %q) = %d CEs, more %v, %v; want %d, %v", tc.limit, tc.after, len(ces), more, err, tc.n, tc.more)
		}
	}
}
