package ledger

// The status rules at their edges: Recertify and Checkpoint refusing an index or a change the
// records contradict, a re-certification made stale by a Confirm, a measurement overtaken by a
// newer verdict that differs only in its version, which measurements written behind are in force,
// and the direction of the KLs a verdict and a renewal written behind are judged at.

import (
	"errors"
	"math"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// scaleSigma returns a copy of m with the next version and the posterior standard deviation of
// class 1's bias multiplied by r. Unlike a move of the mean alone, it makes KL(q || m) and
// KL(m || q) differ, so a test can tell which one was used.
func scaleSigma(m *bnn.Model, r float64) *bnn.Model {
	c := m.Clone()
	c.Version = m.Version + 1
	c.Last().BiasLogSigma[1] += math.Log(r)
	return c
}

// invalidatedCE opens a ledger with one CE ("a-0000000") certified under m0 = testModel(4) and
// invalidated by a Monte-Carlo verdict (decided) under m1, whose last bias is 0; it returns both.
func invalidatedCE(t *testing.T) (*Ledger, *bnn.Model, *bnn.Model) {
	t.Helper()
	l, m0, _ := withCEs(t, 6, "a", 1)
	m1 := toBias(m0, 0)
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Confirm(bg, &fixedPredictor{version: m1.Version, p: 0.3, v: 0.001, samples: 400}, 10); err != nil {
		t.Fatal(err)
	}
	if c, _ := l.Counts(); c[certify.Invalidated] != 1 {
		t.Fatalf("counts %v, want the CE invalidated", c)
	}
	return l, m0, m1
}

// Recertify reads a CE only when its index entry says the move of the anchor's KL changes its
// status, and then holds the record to the entry: an at_risk or invalidated entry whose bound held
// at the anchor's stored KL (Rejudge would have certified it), an entry of the failing class whose
// record is certified, and one whose record is under another anchor are damage (ErrCorrupt),
// never a status change.
func TestRecertifyRefusesAnIndexItsRecordContradicts(t *testing.T) {
	id := []byte("a-0000000")
	for _, tc := range []struct {
		name string
		// damage changes the stored state behind the indexes' back.
		damage func(tx *bolt.Tx, h header, anchor uint64) error
		// back re-certifies against the anchor itself (KL 0: the bound holds) instead of a
		// posterior under which it fails.
		back bool
	}{
		{"the bound held at the anchor's stored KL", func(tx *bolt.Tx, _ header, anchor uint64) error {
			a, _, err := readAnchor(tx, anchor)
			if err != nil {
				return err
			}
			a.kl = 0
			return putAnchor(tx, anchor, a)
		}, false},
		{"the record is certified", func(tx *bolt.Tx, h header, _ uint64) error {
			h.status = certify.Certified
			h.unconfirm()
			return putSealed(tx.Bucket(bHeaders), id, h.encode())
		}, true},
		{"the record is under another anchor", func(tx *bolt.Tx, h header, _ uint64) error {
			h.anchor += 100
			return putSealed(tx.Bucket(bHeaders), id, h.encode())
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, m0, m1 := invalidatedCE(t)
			err := l.update(func(tx *bolt.Tx) error {
				h, ok, err := readHeader(tx, id)
				if err != nil || !ok {
					t.Fatalf("header of %s: %v, %v", id, ok, err)
				}
				return tc.damage(tx, h, m0.Version)
			})
			if err != nil {
				t.Fatal(err)
			}
			next := drift(m1, 0) // as far from m0 as m1: the bound fails
			if tc.back {
				next = m0.Clone()
				next.Version = m1.Version + 1
			}
			if _, changes, err := l.Recertify(bg, next); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("recertify: changes %+v, error %v; want ErrCorrupt", changes, err)
			}
		})
	}
}

// A checkpoint applies only changes its records agree with: a change to or from uncertified is
// invalid (no bound moves a CE there), and a change from a status the CE does not have, or of a
// CE not stored, is stale. Nothing is written.
func TestCheckpointRefusesChangesItsRecordsContradict(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change StatusChange
		want   error
	}{
		{"to uncertified", StatusChange{ID: "a-0000000", From: certify.Certified, To: certify.Uncertified}, ErrInvalid},
		{"from a status the CE does not have", StatusChange{ID: "a-0000000", From: certify.AtRisk, To: certify.Certified}, ErrStale},
		{"of a CE not stored", StatusChange{ID: "b", From: certify.AtRisk, To: certify.Certified}, ErrStale},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, m0, _ := withCEs(t, 6, "a", 1)
			next := drift(m0, 0.001)
			rep, _, err := l.Recertify(bg, next)
			if err != nil {
				t.Fatal(err)
			}
			err = l.Checkpoint(&Checkpoint{Model: next, Recertified: &rep, Changes: []StatusChange{tc.change}})
			if !errors.Is(err, tc.want) {
				t.Fatalf("checkpoint: %v, want %v", err, tc.want)
			}
			if st, _ := l.State(); st.PosteriorVersion != m0.Version || st.Counts[certify.Certified] != 1 {
				t.Fatalf("state %+v after a refused checkpoint; want posterior %d, the CE certified", st, m0.Version)
			}
		})
	}
}

// A Confirm that writes makes a re-certification made before it stale: here it invalidates the
// lapsed certificates that the report restores, and checkpointing the report would leave
// invalidated CEs whose bound holds and a negative backlog of lapses.
func TestStaleAfterConfirm(t *testing.T) {
	l, m0, _ := withCEs(t, 5, "p", 5)
	m1 := lapse(t, l, m0)
	back := m0.Clone()
	back.Version = m1.Version + 1
	rep, changes, err := l.Recertify(bg, back)
	if err != nil || rep.Restored != 5 {
		t.Fatalf("recertify: %+v, %v; want the 5 lapsed certificates restored", rep, err)
	}
	if _, _, err := l.Confirm(bg, &fixedPredictor{version: m1.Version, p: 0.3, v: 0.001, samples: 400}, 100); err != nil {
		t.Fatal(err)
	}
	if err := l.Checkpoint(&Checkpoint{Model: back, Recertified: &rep, Changes: changes}); !errors.Is(err, ErrStale) {
		t.Fatalf("checkpoint after a confirm: %v, want ErrStale", err)
	}
}

// A measurement of a CE that got a newer verdict while it was sampled is not written, even when
// the two verdicts differ only in the version they were measured under (both kept invalidated by
// hysteresis, neither with a carry bound): written, the older one would take the verdict back to
// its version, and the CE would wait for a measurement under the current posterior again.
func TestConfirmDoesNotOverrideANewerUndecidedVerdict(t *testing.T) {
	l, _, m1 := invalidatedCE(t)
	m2 := toBias(m1, -4) // far from m1 (the verdict does not carry) and from m0
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
		t.Fatal(err)
	}
	undecided := func(v uint64) *fixedPredictor {
		return &fixedPredictor{version: v, p: 0.5, v: 0.001, samples: 400}
	}
	if _, _, err := l.Confirm(bg, undecided(m2.Version), 10); err != nil {
		t.Fatal(err)
	}
	m3, m4 := drift(m2, 0.001), drift(m2, 0.002)
	m4.Version = m3.Version + 1
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m3}); err != nil {
		t.Fatal(err)
	}
	outer := undecided(m3.Version)
	outer.during = func() {
		if _, _, err := l.Commit(bg, &Checkpoint{Model: m4}); err != nil {
			t.Error(err)
		}
		if _, _, err := l.Confirm(bg, undecided(m4.Version), 10); err != nil {
			t.Error(err)
		}
	}
	rep, _, err := l.Confirm(bg, outer, 10)
	if err != nil {
		t.Fatal(err)
	}
	ce, err := l.Get("a-0000000")
	if err != nil {
		t.Fatal(err)
	}
	if rep.Skipped != 1 || ce.Status != certify.Invalidated || ce.ConfirmedVersion == nil || *ce.ConfirmedVersion != m4.Version {
		t.Fatalf("outer confirm %+v, CE %+v; want it skipped, the verdict of version %d kept", rep, ce, m4.Version)
	}
}

// A measurement written behind (ingestion promoted q_now while it was sampled under q_s) is kept
// only when it is in force under q_now: a verdict kept by hysteresis has no bound and never
// carries, and a renewal whose new certificate fails at KL(q_now || q_s) lapses at once; both are
// superseded. A renewal that holds there is kept.
func TestMeasurementsBehindAreKeptOnlyWhenInForce(t *testing.T) {
	for _, tc := range []struct {
		name string
		// setup returns a ledger with 5 CEs waiting for a measurement under the current
		// posterior, and that posterior.
		setup func(t *testing.T) (*Ledger, *bnn.Model)
		p     float64 // the measured p(target), with variance 0.0005 from 400 draws
		// next is the posterior ingestion promotes while the batch is sampled.
		next    func(*bnn.Model) *bnn.Model
		want    Measurements
		renewed int
	}{
		{"a verdict kept by hysteresis", func(t *testing.T) (*Ledger, *bnn.Model) {
			l, m0, _ := withCEs(t, 6, "a", 5)
			m1 := toBias(m0, -4)
			if _, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
				t.Fatal(err)
			}
			confirmAll(t, l, m1, 300, 1) // invalidated, decided
			m2 := toBias(m1, 0)          // far from m1: the verdicts do not carry
			if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
				t.Fatal(err)
			}
			return l, m2
		}, 0.5, func(m *bnn.Model) *bnn.Model { return drift(m, 0.001) }, Measurements{Superseded: 5}, 0},
		{"a renewal that lapses at once", func(t *testing.T) (*Ledger, *bnn.Model) {
			l, m0, _ := withCEs(t, 5, "p", 5)
			return l, lapse(t, l, m0)
		}, 0.99, func(m *bnn.Model) *bnn.Model { return toBias(m, 2) }, Measurements{Superseded: 5}, 5},
		{"a renewal that holds", func(t *testing.T) (*Ledger, *bnn.Model) {
			l, m0, _ := withCEs(t, 5, "p", 5)
			return l, lapse(t, l, m0)
		}, 0.99, func(m *bnn.Model) *bnn.Model { return drift(m, -0.0001) }, Measurements{Kept: 5}, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, cur := tc.setup(t)
			p := &fixedPredictor{version: cur.Version, p: tc.p, v: 0.0005, samples: 400, during: func() {
				if _, _, err := l.Commit(bg, &Checkpoint{Model: tc.next(cur)}); err != nil {
					t.Error(err)
				}
			}}
			rep, _, err := l.Confirm(bg, p, 100)
			if err != nil || !rep.Behind || rep.Confirmed != 5 || rep.Renewed != tc.renewed || rep.Measurements != tc.want {
				t.Fatalf("confirm behind: %+v, %v; want 5 confirmed, %d renewed, measurements %+v", rep, err, tc.renewed, tc.want)
			}
			st, err := l.State()
			if err != nil {
				t.Fatal(err)
			}
			undecided := 0
			for _, s := range []certify.Status{certify.Certified, certify.AtRisk, certify.Invalidated} {
				undecided += st.Counts[s] - st.Decided[s]
			}
			if undecided != tc.want.Superseded {
				t.Fatalf("%d CEs undecided under the new posterior (counts %v, decided %v), want the %d superseded",
					undecided, st.Counts, st.Decided, tc.want.Superseded)
			}
		})
	}
}

// A verdict written behind (sampled under q_s, ingestion promoted q_now meanwhile) is recorded as
// of q_s: its change carries version s and the anchor's KL at it, KL(q_s || q_anchor) in the
// paper's direction (new || old), not the reverse. The posteriors differ in a standard deviation,
// so the two directions differ.
func TestBehindVerdictIsRecordedAtTheSampledPosterior(t *testing.T) {
	l, m0, _ := withCEs(t, 5, "p", 5)
	m1 := scaleSigma(toBias(m0, 3.5), 1.5)
	if rep, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil || rep.Lapsed != 5 {
		t.Fatalf("commit: %+v, %v; want the 5 certificates lapsed", rep, err)
	}
	want, _, err := certify.KL(m1, m0)
	if err != nil {
		t.Fatal(err)
	}
	if rev, _, _ := certify.KL(m0, m1); rev == want {
		t.Fatalf("KL %v both ways: the test cannot tell the directions apart", want)
	}
	p := &fixedPredictor{version: m1.Version, p: 0.3, v: 0.001, samples: 400, during: func() {
		if _, _, err := l.Commit(bg, &Checkpoint{Model: drift(m1, 0.001)}); err != nil {
			t.Error(err)
		}
	}}
	rep, changes, err := l.Confirm(bg, p, 100)
	if err != nil || !rep.Behind || len(changes) != 5 {
		t.Fatalf("confirm behind: %+v, %d changes, %v; want 5 verdicts", rep, len(changes), err)
	}
	for _, ch := range changes {
		if ch.To != certify.Invalidated || ch.PosteriorVersion != m1.Version || ch.KL != want {
			t.Fatalf("change %+v; want invalidated at version %d, KL %v", ch, m1.Version, want)
		}
	}
}

// Whether a verdict carries is judged at KL(q_now || q_v), from the posterior q_v it was measured
// under (Theorem 1 with q1 = q_v, q2 = q_now), not at KL(q_v || q_now). The verdict's margin lies
// between the slacks of the two, so only the right one says it no longer carries: the CE is
// undecided and waits for a measurement.
func TestVerdictCarriesByTheKLFromItsPosterior(t *testing.T) {
	l, m0, _ := withCEs(t, 6, "a", 1)
	m1 := lapse(t, l, m0)
	m2 := scaleSigma(m1, 1.1)
	pol := l.Policy()
	fwd, _, _ := certify.KL(m2, m1)
	rev, _, _ := certify.KL(m1, m2)
	sf, sr := pol.Slack(fwd).Mean, pol.Slack(rev).Mean
	if !(sr < sf && sf < 0.5) {
		t.Fatalf("slacks %v (forward) and %v (reverse): the test needs the reverse one smaller", sf, sr)
	}
	// Evidence whose upper bound b puts the carry margin 1/2 - b midway between the two slacks.
	const v, samples = 0.0005, 1000
	_, hi := certify.Evidence{P: 0.3, Var: v, Samples: samples}.Interval(l.opts.VerdictAlpha)
	p := 0.5 - (sf+sr)/2 - (hi - 0.3)
	if _, _, err := l.Confirm(bg, &fixedPredictor{version: m1.Version, p: p, v: v, samples: samples}, 10); err != nil {
		t.Fatal(err)
	}
	ce, err := l.Get("a-0000000")
	if err != nil || ce.Status != certify.Invalidated || !ce.Decided {
		t.Fatalf("CE %+v, %v; want invalidated, decided", ce, err)
	}
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
		t.Fatal(err)
	}
	if ce, err = l.Get("a-0000000"); err != nil || ce.Decided || !ce.VerdictPending {
		t.Fatalf("CE %+v, %v under m2; want its verdict pending (margin %v < slack %v)", ce, err, 0.5-float64(*ce.VerdictBound), sf)
	}
	if rep, _, err := l.Confirm(bg, &fixedPredictor{version: m2.Version, p: p, v: v, samples: samples}, 10); err != nil || rep.Picked != 1 {
		t.Fatalf("confirm under m2: %+v, %v; want the CE measured again", rep, err)
	}
}

// A CE whose bound holds again is certified, and its Theorem 1 bound enters Report.MinBound: here
// it is the only certified CE, under the only anchor, so MinBound is its bound.
func TestMinBoundCountsACertificateRegained(t *testing.T) {
	l, m0, m1 := invalidatedCE(t)
	back := m0.Clone()
	back.Version = m1.Version + 1
	rep, changes, err := l.Recertify(bg, back)
	if err != nil || len(changes) != 1 || changes[0].To != certify.Certified {
		t.Fatalf("recertify: %+v, changes %+v, %v; want the CE certified again", rep, changes, err)
	}
	if rep.MinBound != changes[0].Bound || rep.MinBound >= 1 {
		t.Fatalf("min bound %v; want the regained certificate's bound %v", rep.MinBound, changes[0].Bound)
	}
}
