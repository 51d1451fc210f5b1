package ledger

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// TestHeaderCarryBound checks the carry bound's place in the header: it survives encoding, is
// rounded to float32 away from the side its verdict proves (so the stored bound carries no
// further than the exact one), and a header whose flag and bytes disagree is refused. For each
// verdict one bound's nearest float32 lies on its wrong side and one's on its right side, so both
// the rounding and its absence are checked.
func TestHeaderCarryBound(t *testing.T) {
	const alpha = 0.01
	base := header{target: 1, anchor: 3, p1: 0.97, var1: 0.01, delta: 0.05, epsilon: 0.05, samples: 1000, updated: 5}
	for _, c := range []struct {
		status certify.Status
		p      float64
	}{{certify.AtRisk, 0.7123456789}, {certify.AtRisk, 0.8}, {certify.Invalidated, 0.2123456789}, {certify.Invalidated, 0.2}} {
		e := certify.Evidence{P: c.p, Var: 0.01, Samples: 1000}
		exact, ok := certify.VerdictBound(c.status, e, alpha)
		if !ok {
			t.Fatalf("%v: no verdict bound for p %v", c.status, c.p)
		}
		h := base
		h.status = c.status
		h.confirm(9, &e, alpha)
		if !h.carry {
			t.Fatalf("%v: no carry bound recorded", c.status)
		}
		if c.status == certify.AtRisk && float64(h.cbound) > exact || c.status == certify.Invalidated && float64(h.cbound) < exact {
			t.Errorf("%v: stored bound %v is on the wrong side of the exact %v", c.status, h.cbound, exact)
		}
		if math.Abs(float64(h.cbound)-exact) > 1e-7 {
			t.Errorf("%v: stored bound %v is far from %v", c.status, h.cbound, exact)
		}
		got, err := decodeHeader(h.encode())
		if err != nil || got != h {
			t.Fatalf("%v: decode(encode(h)) = %+v, %v; want %+v", c.status, got, err, h)
		}
		// A verdict without a decision (kept by hysteresis) has no bound, and clears an older one.
		undecided := certify.Evidence{P: 0.5, Var: 0.01, Samples: 1000}
		h.confirm(10, &undecided, alpha)
		if h.carry || h.cbound != 0 || h.cv != 10 {
			t.Errorf("%v: an undecided verdict kept a carry bound (%v, %v)", c.status, h.carry, h.cbound)
		}
		if got, err := decodeHeader(h.encode()); err != nil || got != h {
			t.Errorf("%v: undecided: decode(encode(h)) = %+v, %v", c.status, got, err)
		}
	}
	bad := base
	bad.status = certify.AtRisk
	bad.confirm(4, &certify.Evidence{P: 0.9, Var: 0.01, Samples: 1000}, alpha)
	v := bad.encode()
	v[hFlags] &^= flagCarry // bytes without the flag
	if _, err := decodeHeader(v); err == nil {
		t.Error("a carry bound without its flag was accepted")
	}
	bad.cbound = 0.4 // an at_risk verdict whose bound is below 1/2 proves nothing
	if _, err := decodeHeader(bad.encode()); err == nil {
		t.Error("an at_risk carry bound below 1/2 was accepted")
	}
}

// waitingByScan is the set of CEs that wait for a measurement under the current posterior now,
// judged CE by CE from every header with certify.Carries at KL(q_now || q_cv) computed from
// models: what the index-driven eachWaiting must find.
func waitingByScan(t *testing.T, l *Ledger, now *bnn.Model, models map[uint64]*bnn.Model) map[string]bool {
	t.Helper()
	want := map[string]bool{}
	err := l.view(func(tx *bolt.Tx) error {
		return tx.Bucket(bHeaders).ForEach(func(k, v []byte) error {
			p, _ := unseal(k, v)
			h, err := decodeHeader(p)
			if err != nil {
				return err
			}
			lapsed, err := l.lapsed(tx, &h)
			if err != nil || !lapsed && !h.failing() {
				return err
			}
			wait := lapsed || !h.confirmed
			if !wait && h.cv < now.Version {
				kl, _, err := certify.KL(now, models[h.cv])
				if err != nil {
					return err
				}
				wait = l.opts.RemeasureVerdicts || !h.carry || !certify.Carries(h.status, float64(h.cbound), l.opts.Policy.Slack(kl))
			}
			if wait {
				want[string(k)] = true
			}
			return nil
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	return want
}

// waitingByIndex is the set eachWaiting finds under the current posterior.
func waitingByIndex(t *testing.T, l *Ledger) map[string]bool {
	t.Helper()
	got := map[string]bool{}
	err := l.view(func(tx *bolt.Tx) error {
		c, err := readCur(tx)
		if err != nil {
			return err
		}
		return l.eachWaiting(tx, c, c.version, func(id []byte) (bool, error) {
			if got[string(id)] {
				t.Errorf("%s found twice", id)
			}
			got[string(id)] = true
			return false, nil
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// Under a drift of small steps, the CEs Confirm measures again are exactly those whose verdict
// the KL from its posterior no longer carries (certify.Carries, judged CE by CE from every
// header), found through idx_fail; most verdicts carry for a while and some stop carrying, so
// carrying saves measurements without skipping one that is due. With RemeasureVerdicts every
// verdict older than the posterior is measured again and none carries (five steps show it).
func TestConfirmCarriesVerdicts(t *testing.T) {
	n, steps := 1500, 16
	if testing.Short() {
		n, steps = 800, 10
	}
	for _, remeasure := range []bool{false, true} {
		t.Run(fmt.Sprintf("remeasure=%v", remeasure), func(t *testing.T) {
			steps := steps
			if remeasure {
				steps = min(steps, 5)
			}
			l, _ := openTest(t, Options{Policy: testPolicy(), RemeasureVerdicts: remeasure})
			m := testModel(4)
			install(t, l, m)
			rng := rand.New(rand.NewPCG(81, 81))
			if err := l.Put(bg, cheapCEs(m, rng, "carry", n)...); err != nil {
				t.Fatal(err)
			}
			m = toBias(m, -0.5) // every certificate lapses; p(yes) straddles 1/2
			if _, _, err := l.Commit(bg, &Checkpoint{Model: m}); err != nil {
				t.Fatal(err)
			}
			models := map[uint64]*bnn.Model{m.Version: m}
			confirmBatches(t, l, m, 1000, 1, 128) // the daemon's batch (daemon.confirmBatch)
			bounds := 0
			all, err := l.List(0, n, "")
			if err != nil {
				t.Fatal(err)
			}
			for _, ce := range all {
				if b := ce.VerdictBound; b != nil {
					bounds++
					if ce.ConfirmedVersion == nil || ce.Status == certify.AtRisk && *b < 0.5 || ce.Status == certify.Invalidated && *b >= 0.5 {
						t.Fatalf("%s: %v with verdict bound %v (confirmed at %v)", ce.ID, ce.Status, *b, ce.ConfirmedVersion)
					}
				}
			}
			if bounds == 0 {
				t.Fatal("no verdict has a bound: the evidence decided none")
			}
			var measured, failing, carried int
			for step := range steps {
				m = drift(m, math.Copysign(0.001+0.003*rng.Float64(), rng.Float64()-0.7)) // mostly down: p(yes) crosses 1/2 for some
				if _, _, err := l.Commit(bg, &Checkpoint{Model: m}); err != nil {
					t.Fatal(err)
				}
				models[m.Version] = m
				want, got := waitingByScan(t, l, m, models), waitingByIndex(t, l)
				for id := range want {
					if !got[id] {
						t.Fatalf("step %d: %s waits (judging every header) but eachWaiting skips it (%d found, %d want)", step, id, len(got), len(want))
					}
				}
				for id := range got {
					if !want[id] {
						t.Fatalf("step %d: eachWaiting finds %s, whose verdict carries (%d found, %d want)", step, id, len(got), len(want))
					}
				}
				// What Get says of each CE agrees: a decided status waits for nothing, an undecided one
				// waits for the confirmer (or, kept by hysteresis under this very posterior, for the next).
				all, err := l.List(0, n, "")
				if err != nil {
					t.Fatal(err)
				}
				for _, ce := range all {
					switch ce.Status {
					case certify.Certified:
						if ce.Decided == ce.RenewalPending || ce.RenewalPending != want[ce.ID] || ce.VerdictPending {
							t.Fatalf("step %d: certified %s decided %v, renewal pending %v, waiting %v", step, ce.ID, ce.Decided, ce.RenewalPending, want[ce.ID])
						}
					case certify.AtRisk, certify.Invalidated:
						hysteresis := ce.ConfirmedVersion != nil && *ce.ConfirmedVersion == m.Version && ce.VerdictBound == nil
						if ce.Decided == ce.VerdictPending || ce.Decided && want[ce.ID] || !ce.Decided && !want[ce.ID] && !hysteresis {
							t.Fatalf("step %d: %v %s decided %v, verdict pending %v, waiting %v (confirmed %v at %v, bound %v)", step, ce.Status, ce.ID,
								ce.Decided, ce.VerdictPending, want[ce.ID], ce.ConfirmedVersion != nil, *cmp.Or(ce.ConfirmedVersion, new(uint64)), ce.VerdictBound != nil)
						}
						if ce.Decided && ce.VerdictBound == nil {
							t.Fatalf("step %d: %s decided without a verdict bound", step, ce.ID)
						}
					}
				}
				st, err := l.State()
				if err != nil || st.Unconfirmed != len(want) {
					t.Fatalf("step %d: State.Unconfirmed %d, %v; want %d", step, st.Unconfirmed, err, len(want))
				}
				if w, err := l.Waiting(); err != nil || w != (len(want) > 0) {
					t.Fatalf("step %d: Waiting %v, %v with %d waiting", step, w, err, len(want))
				}
				if !remeasure && step%3 == 2 {
					checkCarriedTrue(t, l, m, want)
				}
				fail := st.Counts[certify.AtRisk] + st.Counts[certify.Invalidated] + st.Pending
				failing += fail
				measured += len(want)
				if remeasure && len(want) != fail {
					t.Fatalf("step %d: with RemeasureVerdicts %d of %d failing CEs wait", step, len(want), fail)
				}
				p := NewModelPredictor(m, 1000, uint64(step+2))
				for {
					rep, _, err := l.Confirm(bg, p, 256)
					if err != nil || rep.Discarded || rep.Measurements.Kept != rep.Picked {
						t.Fatalf("step %d: confirm %+v, %v; want every measurement kept (no posterior change)", step, rep, err)
					}
					if !rep.More {
						break
					}
				}
				if left := waitingByIndex(t, l); len(left) != 0 {
					t.Fatalf("step %d: %d CEs still wait after Confirm", step, len(left))
				}
				carried += fail - len(want)
				checkInvariants(t, l)
			}
			t.Logf("%d steps: %d of %d failing CE-versions measured again, %d carried", steps, measured, failing, carried)
			switch {
			case remeasure && carried != 0:
				t.Fatalf("RemeasureVerdicts carried %d verdicts", carried)
			case !remeasure && (carried < failing/2 || measured == 0):
				t.Fatalf("carried %d of %d, measured %d: want most carried and some measured again", carried, failing, measured)
			}
		})
	}
}

// What becomes of each measurement: a batch sampled under m1 while ingestion promotes m2 is
// written as of m1; a verdict that carries to m2 is kept, the others are superseded (exactly the
// CEs that then wait under m2); with RemeasureVerdicts none carries. A CE that changes while it is
// sampled is not written: discarded.
func TestConfirmMeasurementOutcomes(t *testing.T) {
	for _, remeasure := range []bool{false, true} {
		t.Run(fmt.Sprintf("remeasure=%v", remeasure), func(t *testing.T) {
			l, _ := openTest(t, Options{Policy: testPolicy(), RemeasureVerdicts: remeasure})
			m0 := testModel(4)
			install(t, l, m0)
			rng := rand.New(rand.NewPCG(82, 82))
			ces := cheapCEs(m0, rng, "outcome", 300)
			if err := l.Put(bg, ces...); err != nil {
				t.Fatal(err)
			}
			m1 := toBias(m0, -0.5)
			if _, _, err := l.Commit(bg, &Checkpoint{Model: m1}); err != nil {
				t.Fatal(err)
			}
			m2 := drift(m1, -0.006) // slack 0.06: some verdicts carry, those nearer 1/2 do not
			p := &sneakyPredictor{ModelPredictor: NewModelPredictor(m1, 1000, 3), during: func() {
				if _, _, err := l.Commit(bg, &Checkpoint{Model: m2}); err != nil {
					t.Error(err)
				}
			}}
			rep, _, err := l.Confirm(bg, p, 1000)
			if err != nil || !rep.Behind || rep.Confirmed != len(ces) {
				t.Fatalf("confirm behind: %+v, %v", rep, err)
			}
			waiting := waitingByScan(t, l, m2, map[uint64]*bnn.Model{m1.Version: m1, m2.Version: m2})
			ms := rep.Measurements
			if ms.Superseded != len(waiting) || ms.Kept != rep.Confirmed-len(waiting) || ms.Discarded != 0 {
				t.Fatalf("measurements %+v; want %d superseded (the CEs waiting under m2), %d kept", ms, len(waiting), rep.Confirmed-len(waiting))
			}
			if remeasure && ms.Kept != 0 || !remeasure && ms.Kept == 0 {
				t.Fatalf("measurements %+v with RemeasureVerdicts %v", ms, remeasure)
			}
			if len(waiting) == 0 {
				t.Fatal("no CE waits under m2: nothing to measure next")
			}
			var gone string
			for id := range waiting {
				gone = id
				break
			}
			p = &sneakyPredictor{ModelPredictor: NewModelPredictor(m2, 1000, 4), during: func() {
				if err := l.Delete(gone); err != nil {
					t.Error(err)
				}
			}}
			rep, _, err = l.Confirm(bg, p, 1000)
			if err != nil || rep.Picked != len(waiting) || rep.Measurements != (Measurements{Kept: len(waiting) - 1, Discarded: 1}) {
				t.Fatalf("confirm under m2 with a delete meanwhile: %+v, %v; want %d kept, 1 discarded", rep, err, len(waiting)-1)
			}
			checkInvariants(t, l)
		})
	}
}

// trueDraws and trueTol are how the tests that check a carried verdict against the posterior
// estimate p: with this many seeded draws, to within trueTol.
const (
	trueDraws = 1000
	trueTol   = 0.01
)

// checkSE fails the test unless trueTol is four or more standard errors of the estimate of
// p(c | x_i): sqrt(V / draws), with V the variance of f_c(x_i; w) over the draws.
func checkSE(t *testing.T, id string, pred *bnn.Predictive, i, c int) {
	t.Helper()
	if se := math.Sqrt(pred.V(i, c) / float64(pred.S)); 4*se > trueTol {
		t.Fatalf("%s: the estimate of p has standard error %.4f: %d draws do not decide it to within %v", id, se, pred.S, trueTol)
	}
}

// checkCarriedTrue estimates p under m, with trueDraws draws, for every CE whose verdict is older
// than m and carried to it (not in waiting), and checks that the verdict is true there: p >= 1/2
// for at_risk, p < 1/2 for invalidated, up to the estimate's own error (trueTol, which must be
// four of its standard errors or more: checkSE). The draws are seeded, so the check is
// deterministic.
func checkCarriedTrue(t *testing.T, l *Ledger, m *bnn.Model, waiting map[string]bool) {
	t.Helper()
	all, err := l.List(0, 100000, "")
	if err != nil {
		t.Fatal(err)
	}
	var carried []*CE
	var xs [][]float64
	for _, ce := range all {
		if waiting[ce.ID] || ce.ConfirmedVersion == nil || *ce.ConfirmedVersion >= m.Version {
			continue
		}
		carried, xs = append(carried, ce), append(xs, ce.XCF)
	}
	if len(carried) == 0 {
		return
	}
	pred, err := m.Predict(xs, trueDraws, 99)
	if err != nil {
		t.Fatal(err)
	}
	for i, ce := range carried {
		p := pred.P(i, ce.Target)
		checkSE(t, ce.ID, pred, i, ce.Target)
		if ce.Status == certify.AtRisk && p < 0.5-trueTol || ce.Status == certify.Invalidated && p >= 0.5+trueTol {
			t.Fatalf("%s: %v carried from version %d (bound %v) to %d, where p = %.4f", ce.ID, ce.Status, *ce.ConfirmedVersion,
				boundOf(ce), m.Version, p)
		}
	}
	t.Logf("version %d: %d carried verdicts true under it", m.Version, len(carried))
}

// Verdicts measured once and then carried while the posterior moves away, with no measurement in
// between: at every step each carried verdict is true under the current posterior (p estimated
// as checkCarriedTrue does), and the verdicts that became false were all among the ones the ledger
// stopped carrying, so the check can fail: without the rule they would be shown as they were.
func TestCarriedVerdictsAreTrue(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(83, 83))
	if err := l.Put(bg, cheapCEs(m, rng, "true", 200)...); err != nil {
		t.Fatal(err)
	}
	m = toBias(m, -0.5)
	if _, _, err := l.Commit(bg, &Checkpoint{Model: m}); err != nil {
		t.Fatal(err)
	}
	confirmBatches(t, l, m, 1000, 5, 128)
	var carriedSteps, carried, falseUncarried, steps int
	for step := 0; step < 300; step++ {
		steps = step + 1
		// p(yes) rises from 0.40-0.44 past 1/2: every invalidated verdict turns false, first those
		// nearest 1/2. Each step's KL is 2e-4 (a mean slack of 0.02 per step, growing with the steps).
		// Once no verdict carries, none can carry again (the KL from each verdict's version only
		// grows and nothing is measured): the steps only look for a verdict turned false, ten at a
		// time.
		d := 0.002
		if carriedSteps > 0 && carried == 0 {
			d = 0.02
		}
		m = drift(m, d)
		if _, _, err := l.Commit(bg, &Checkpoint{Model: m}); err != nil {
			t.Fatal(err)
		}
		waiting := waitingByIndex(t, l)
		all, err := l.List(0, 1000, "")
		if err != nil {
			t.Fatal(err)
		}
		var xs [][]float64
		for _, ce := range all {
			xs = append(xs, ce.XCF)
		}
		pred, err := m.Predict(xs, trueDraws, 99)
		if err != nil {
			t.Fatal(err)
		}
		carried = 0
		for i, ce := range all {
			if ce.ConfirmedVersion == nil || ce.Status != certify.AtRisk && ce.Status != certify.Invalidated {
				continue
			}
			p := pred.P(i, ce.Target)
			checkSE(t, ce.ID, pred, i, ce.Target)
			wrong := ce.Status == certify.AtRisk && p < 0.5-trueTol || ce.Status == certify.Invalidated && p >= 0.5+trueTol
			switch {
			case !waiting[ce.ID] && wrong:
				t.Fatalf("step %d: %s: %v carried from version %d (bound %v) to %d, where p = %.4f", step, ce.ID, ce.Status,
					*ce.ConfirmedVersion, boundOf(ce), m.Version, p)
			case !waiting[ce.ID]:
				carried++
			case wrong && ce.VerdictBound != nil: // a decided verdict that turned false
				falseUncarried++
			}
		}
		if carried > 0 {
			carriedSteps++
		} else if falseUncarried > 0 {
			// No verdict carries and one has turned false: the drift only moves further from every
			// verdict's version (the KL from it grows) and nothing is measured, so no verdict can
			// carry again; the steps after this one would check nothing.
			break
		}
	}
	t.Logf("verdicts carried at %d of %d steps; %d decided verdict-steps false under the current posterior, none of them carried", carriedSteps, steps, falseUncarried)
	if carriedSteps == 0 || falseUncarried == 0 {
		t.Fatalf("carried at %d steps, %d false verdicts: the drift shows nothing", carriedSteps, falseUncarried)
	}
}

// boundOf is the CE's verdict bound, NaN without one.
func boundOf(ce *CE) float64 {
	if ce.VerdictBound == nil {
		return math.NaN()
	}
	return *ce.VerdictBound
}
