package ledger

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// fixedPredictor answers every input with the same p(target) and variance (class 1 the
// target), from S draws, under one posterior version: a measurement the test dictates, as a
// stale or unlucky one would be.
type fixedPredictor struct {
	version uint64
	p, v    float64
	samples int
	during  func()
}

func (f *fixedPredictor) Version() uint64 { return f.version }

func (f *fixedPredictor) Predict(_ context.Context, X [][]float64) (*bnn.Predictive, error) {
	if f.during != nil {
		f.during()
		f.during = nil
	}
	out := &bnn.Predictive{N: len(X), C: 2, S: f.samples}
	for range X {
		out.Mean = append(out.Mean, 1-f.p, f.p)
		out.Var = append(out.Var, f.v, f.v)
	}
	return out, nil
}

// A certified CE whose bound holds (its certificate says p1 = 0.99) but which the audit measures,
// under the current posterior, at p = 0.2 with confidence is not left certified: measured
// evidence that p < 1/2 wins over a bound resting on an older measurement.
func TestAuditNeverLeavesMeasuredFailureCertified(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m := testModel(4)
	install(t, l, m)
	ce := newCE(t, m, rand.New(rand.NewPCG(91, 91)))
	ce.P1, ce.Var1 = 0.99, 0.001 // the certificate as given; the bound holds at KL 0
	if err := l.Put(bg, ce); err != nil {
		t.Fatal(err)
	}
	if got, _ := l.Get(ce.ID); got.Status != certify.Certified {
		t.Fatalf("registered as %v, want certified", got.Status)
	}
	rep, changes, err := l.Audit(bg, &fixedPredictor{version: m.Version, p: 0.2, v: 0.01, samples: 1000}, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got, _ := l.Get(ce.ID)
	if got.Status != certify.Invalidated || len(changes) != 1 || changes[0].From != certify.Certified || changes[0].P2 == nil {
		t.Fatalf("after an audit measuring p = 0.2: %v, changes %+v (report %+v); want invalidated by the measurement", got.Status, changes, rep)
	}
	checkInvariants(t, l)
}

// The audit reads a batch, samples it without any lock, then writes: a verdict given meanwhile
// (here Confirm's invalidated, at the same posterior version) is newer than the audit's reading
// and is not overwritten by the audit's own (a stale at_risk).
func TestAuditDoesNotOverrideANewerVerdict(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy(), EncodeChange: encodeChangeJSON})
	m0 := testModel(4)
	install(t, l, m0)
	ce := newCE(t, m0, rand.New(rand.NewPCG(92, 92)))
	if err := l.Put(bg, ce); err != nil {
		t.Fatal(err)
	}
	m1 := toBias(m0, -0.5) // the certificate lapses
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
		t.Fatal(err)
	}
	if got, _ := l.Get(ce.ID); !got.RenewalPending {
		t.Fatalf("after the drift %+v, want a lapsed certificate", got)
	}
	audit := &fixedPredictor{version: m1.Version, p: 0.7, v: 0.001, samples: 1000, during: func() {
		// Confirm measures the CE under m1 meanwhile: p = 0.1, invalidated.
		if _, _, err := l.Confirm(bg, &fixedPredictor{version: m1.Version, p: 0.1, v: 0.001, samples: 1000}, 10); err != nil {
			t.Error(err)
		}
	}}
	rep, changes, err := l.Audit(bg, audit, AuditOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got, _ := l.Get(ce.ID)
	if got.Status != certify.Invalidated || len(changes) != 0 {
		t.Fatalf("after the audit: %v, audit changes %+v (report %+v); want Confirm's newer invalidated kept", got.Status, changes, rep)
	}
	checkInvariants(t, l)
}
