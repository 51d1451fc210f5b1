package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// followingPredictor predicts with whichever posterior it was last given, like a shared pool of
// draws that follows the current posterior.
type followingPredictor struct {
	mu      sync.Mutex
	p       *ModelPredictor
	before  func(call int) // runs before each Predict
	calls   int
	samples int
}

func (f *followingPredictor) set(m *bnn.Model) {
	f.mu.Lock()
	f.p = NewModelPredictor(m, f.samples, 5)
	f.mu.Unlock()
}

func (f *followingPredictor) get() *ModelPredictor {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.p
}

func (f *followingPredictor) Version() uint64 { return f.get().Version() }

func (f *followingPredictor) Predict(ctx context.Context, X [][]float64) (*bnn.Predictive, error) {
	p := f.get()
	f.calls++
	if f.before != nil {
		f.before(f.calls)
	}
	return p.Predict(ctx, X)
}

// auditFixture stores 60 CEs under m0 and promotes m1 past their variance ceiling (all at_risk).
func auditFixture(t *testing.T, batch int) (*Ledger, []*CE, *bnn.Model) {
	l, _ := openTest(t, Options{Policy: testPolicy(), MCBatch: batch, EncodeChange: encodeChangeJSON})
	m0 := testModel(4)
	install(t, l, m0)
	rng := rand.New(rand.NewPCG(81, 81))
	var ces []*CE
	for i := 0; i < 60; i++ {
		ces = append(ces, newCE(t, m0, rng))
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	m1 := drift(m0, -0.01)
	commit(t, l, m1, 1)
	return l, ces, m1
}

// checkReanchored checks every CE re-anchored to a posterior of models: its certificate is the
// Monte-Carlo estimate under that posterior (200 draws, seed 5), its KL is certify.KL from the
// current posterior, and its status is what the bounds at that KL say.
func checkReanchored(t *testing.T, l *Ledger, ces []*CE, current *bnn.Model, models map[uint64]*bnn.Model) map[uint64]int {
	t.Helper()
	anchors := map[uint64]int{}
	for _, c := range ces {
		ce, err := l.Get(c.ID)
		if err != nil {
			t.Fatal(err)
		}
		anchors[ce.AnchorVersion]++
		q, ok := models[ce.AnchorVersion]
		if !ok {
			continue
		}
		kl, _, _ := certify.KL(current, q)
		b := l.Policy().Bounds(ce.Certificate(), kl)
		if ce.KLFromAnchor != kl || (ce.Status == certify.Certified && !ce.RenewalPending) != b.Certified {
			t.Fatalf("%s re-anchored to %d: KL %v (certify.KL %v), status %v, bounds %+v", ce.ID, ce.AnchorVersion, ce.KLFromAnchor, kl, ce.Status, b)
		}
		if p, v := measure(t, q, ce.XCF, 1, auditSamples, 5); ce.P1 != p || ce.Var1 != v || ce.Samples != auditSamples {
			t.Fatalf("%s re-anchored to %d with p1 %v var1 %v; Monte-Carlo under it gives %v %v", ce.ID, ce.AnchorVersion, ce.P1, ce.Var1, p, v)
		}
	}
	return anchors
}

// checkChangesInOutbox checks that every change is in the outbox.
func checkChangesInOutbox(t *testing.T, l *Ledger, changes []StatusChange) {
	t.Helper()
	out, _ := l.Outbox(0, 1<<20)
	seen := map[string]bool{}
	for _, e := range out {
		var ch StatusChange
		if json.Unmarshal(e.Value, &ch) == nil {
			seen[ch.ID+ch.From.String()+ch.To.String()+ch.At.String()] = true
		}
	}
	for _, ch := range changes {
		if !seen[ch.ID+ch.From.String()+ch.To.String()+ch.At.String()] {
			t.Fatalf("change %+v not in the outbox", ch)
		}
	}
}

// Ingestion promotes a new posterior while an audit with a fixed predictor (posterior m1) runs.
// The audit does not stop: every batch is sampled under m1 and written, m1's snapshot is kept as
// an anchor (stored from the audit's copy: when the first batch is written, m1 is neither current
// nor an anchor), the re-anchored CEs are judged at KL(q_now || m1) computed with certify.KL.
func TestAuditContinuesWhenPosteriorMoves(t *testing.T) {
	l, ces, m1 := auditFixture(t, 10)
	m2 := drift(m1, -0.001)
	calls := 0
	p := &sneakyPredictor{ModelPredictor: NewModelPredictor(m1, auditSamples, 5), during: func() {
		if calls++; calls == 1 {
			if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
				t.Error(err)
			}
		}
	}}
	var progress []int
	rep, changes, err := l.Audit(bg, p, AuditOptions{Progress: func(done, total int) {
		if total != len(ces) {
			t.Errorf("progress total %d, want %d", total, len(ces))
		}
		progress = append(progress, done)
	}})
	if err != nil {
		t.Fatalf("audit while ingesting: %v", err)
	}
	if rep.Evaluated != len(ces) || rep.Batches != 6 || rep.Behind != 6 || rep.Reanchored == 0 || len(progress) != 6 || progress[5] != len(ces) {
		t.Fatalf("report %+v, progress %v", rep, progress)
	}
	if st, _ := l.State(); st.PosteriorVersion != m2.Version {
		t.Fatalf("current posterior %d, want %d", st.PosteriorVersion, m2.Version)
	}
	anchors := checkReanchored(t, l, ces, m2, map[uint64]*bnn.Model{m1.Version: m1})
	if anchors[m1.Version] != rep.Reanchored {
		t.Fatalf("CEs per anchor %v, %d re-anchored", anchors, rep.Reanchored)
	}
	checkChangesInOutbox(t, l, changes)
	checkInvariants(t, l)
}

// A predictor that follows the current posterior (as a shared pool of draws would) moves to the
// new one in the middle of a batch: that batch is read and sampled again under it, and the
// audit ends with CEs re-anchored to both posteriors.
func TestAuditFollowsThePredictor(t *testing.T) {
	l, ces, m1 := auditFixture(t, 10)
	m2 := drift(m1, -0.0005)
	f := &followingPredictor{samples: auditSamples}
	f.set(m1)
	f.before = func(call int) {
		if call == 3 { // during the third batch: promote m2, the pool follows at once
			if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
				t.Error(err)
			}
			f.set(m2)
		}
	}
	rep, changes, err := l.Audit(bg, f, AuditOptions{})
	if err != nil {
		t.Fatalf("audit: %v", err)
	}
	if rep.Evaluated != len(ces) || rep.Batches != 6 || f.calls != 7 || rep.Behind != 0 {
		t.Fatalf("report %+v after %d Predict calls: want 6 batches, one sampled twice, none behind", rep, f.calls)
	}
	anchors := checkReanchored(t, l, ces, m2, map[uint64]*bnn.Model{m1.Version: m1, m2.Version: m2})
	if anchors[m1.Version] == 0 || anchors[m2.Version] == 0 {
		t.Fatalf("CEs per anchor %v: want some under %d and some under %d", anchors, m1.Version, m2.Version)
	}
	checkChangesInOutbox(t, l, changes)
	checkInvariants(t, l)
}

// auditSamples is the draws per CE of the audit tests: enough for the confidence bound of a
// renewal (certify.Renewable) to clear 1 - delta for the fixtures' p ~ 0.98.
const auditSamples = 4000

// Ingestion promotes a new posterior after the audit's draws were made and before it starts: an
// audit whose predictor gives its posterior measures under it all the same (every batch behind,
// renewed CEs anchored to m1 at KL(m2 || m1)); one whose predictor does not is refused as stale
// before anything is evaluated, naming both versions.
func TestAuditStartsUnderAPosteriorIngestionReplaced(t *testing.T) {
	l, ces, m1 := auditFixture(t, 10)
	m2 := drift(m1, -0.001)
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
		t.Fatal(err)
	}
	_, _, err := l.Audit(bg, NewModelPredictor(m1, auditSamples, 5), AuditOptions{})
	if !errors.Is(err, ErrStale) || !strings.Contains(err.Error(), fmt.Sprintf("version %d is not current (current is %d)", m1.Version, m2.Version)) {
		t.Fatalf("audit with a predictor for a replaced posterior that does not give it: %v, want ErrStale naming %d and %d", err, m1.Version, m2.Version)
	}
	rep, changes, err := l.Audit(bg, posteriorPredictor{NewModelPredictor(m1, auditSamples, 5)}, AuditOptions{})
	if err != nil {
		t.Fatalf("audit under a replaced posterior: %v", err)
	}
	if rep.PosteriorVersion != m1.Version || rep.Evaluated != len(ces) || rep.Batches != 6 || rep.Behind != 6 || rep.Reanchored == 0 {
		t.Fatalf("report %+v: want all %d CEs evaluated under %d in 6 batches, all behind, some re-anchored", rep, len(ces), m1.Version)
	}
	anchors := checkReanchored(t, l, ces, m2, map[uint64]*bnn.Model{m1.Version: m1})
	if anchors[m1.Version] != rep.Reanchored {
		t.Fatalf("CEs per anchor %v, %d re-anchored", anchors, rep.Reanchored)
	}
	checkChangesInOutbox(t, l, changes)
	checkInvariants(t, l)
}
