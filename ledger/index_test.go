package ledger

import (
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

func TestFloatKeyOrder(t *testing.T) {
	vals := []float64{math.Inf(-1), -math.MaxFloat64, -1, -math.SmallestNonzeroFloat64, 0, math.SmallestNonzeroFloat64,
		1e-300, 0.5, 0.5000000000000001, 1, math.MaxFloat64, math.Inf(1)}
	var prev []byte
	for _, v := range vals {
		k := make([]byte, 8)
		floatKey(k, v)
		if back := keyFloat(k); back != v {
			t.Fatalf("keyFloat(floatKey(%v)) = %v", v, back)
		}
		if prev != nil && string(prev) >= string(k) {
			t.Fatalf("key of %v not above the previous", v)
		}
		prev = k
	}
	rng := rand.New(rand.NewPCG(1, 1))
	for i := 0; i < 10000; i++ {
		a, b := rng.NormFloat64()*math.Pow(10, rng.Float64()*20-10), rng.NormFloat64()*math.Pow(10, rng.Float64()*20-10)
		ka, kb := make([]byte, 8), make([]byte, 8)
		floatKey(ka, a)
		floatKey(kb, b)
		if (a < b) != (string(ka) < string(kb)) {
			t.Fatalf("order of %v, %v not kept", a, b)
		}
	}
}

// bruteForce judges every stored CE against next from scratch (List, certify.KL per CE's
// anchor, Policy.Bounds) and returns the changes Recertify must make, the counts after them and
// the smallest Theorem 1 bound over certified CEs.
func bruteForce(t *testing.T, l *Ledger, next *bnn.Model, models map[uint64]*bnn.Model) (map[string]string, map[certify.Status]int, float64) {
	t.Helper()
	pol := l.Policy()
	changes := map[string]string{}
	cnt := map[certify.Status]int{}
	minBound := 1.0
	all, err := l.List(0, 10000, "")
	if err != nil {
		t.Fatal(err)
	}
	// A certified CE whose bound fails lapses (stays certified, pending renewal); one whose
	// bound holds again is restored; neither is a status change. The names "lapsed" and
	// "certified" in the transitions are the pending flag's.
	name := func(s certify.Status, pending bool) string {
		if pending {
			return "lapsed"
		}
		return s.String()
	}
	for _, ce := range all {
		s, pending := ce.Status, ce.RenewalPending
		if s != certify.Uncertified {
			kl, _, err := certify.KL(next, models[ce.AnchorVersion])
			if err != nil {
				t.Fatal(err)
			}
			b := pol.Bounds(ce.Certificate(), kl)
			switch {
			case b.Certified:
				s, pending = certify.Certified, false
			case s == certify.Certified:
				pending = true
			}
			if s == certify.Certified && b.ProbLower >= 0.5 {
				minBound = math.Min(minBound, b.ProbLower) // Theorem 1's bound, where it holds
			}
		}
		if s != ce.Status || pending != ce.RenewalPending {
			changes[ce.ID] = fmt.Sprintf("%v->%v", name(ce.Status, ce.RenewalPending), name(s, pending))
		}
		cnt[s]++
	}
	return changes, cnt, minBound
}

// lapsedByIndex is the set of lapsed certificates Confirm finds (eachLapsed).
func lapsedByIndex(t *testing.T, l *Ledger) map[string]bool {
	t.Helper()
	got := map[string]bool{}
	if err := l.view(func(tx *bolt.Tx) error {
		return eachLapsed(tx, l.opts.Policy, func(id []byte) error { got[string(id)] = true; return nil })
	}); err != nil {
		t.Fatal(err)
	}
	return got
}

// lapsedByBounds is the set of certified CEs whose bound fails at KL(now || anchor), computed
// from the models for every CE.
func lapsedByBounds(t *testing.T, l *Ledger, now *bnn.Model, models map[uint64]*bnn.Model) map[string]bool {
	t.Helper()
	all, err := l.List(0, 10000, "")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{}
	for _, ce := range all {
		if ce.Status != certify.Certified {
			continue
		}
		kl, _, err := certify.KL(now, models[ce.AnchorVersion])
		if err != nil {
			t.Fatal(err)
		}
		if !l.Policy().Bounds(ce.Certificate(), kl).Certified {
			want[ce.ID] = true
		}
	}
	return want
}

// splitLapses removes the lapses and restorations from a brute-force transition map (they are
// not status changes: Recertify counts them) and returns how many there were of each.
func splitLapses(want map[string]string) (lapsed, restored int) {
	for id, tr := range want {
		switch tr {
		case "certified->lapsed":
			lapsed++
			delete(want, id)
		case "lapsed->certified":
			restored++
			delete(want, id)
		}
	}
	return lapsed, restored
}

// Indexed re-certification against a full brute-force evaluation, over random policies, random
// certificates near every threshold, several anchors, and random sequences of posteriors whose
// KL from each anchor goes up and down, with registrations, deletions and Monte-Carlo verdicts
// in between. Changes, counts, MinBound and anchor KLs must agree exactly, and the stored
// records and indexes must pass the full check after every commit.
func TestIndexedRecertifyMatchesBruteForce(t *testing.T) {
	policies := []certify.Policy{
		certify.DefaultPolicy(),
		{Mode: certify.Tight, EpsilonMax: 0.05, Alpha: 0.01},
		{Mode: certify.Paper, EpsilonMax: 0, Hoeffding: true, Alpha: 0.05},
		{Mode: certify.Tight, EpsilonMax: 0.25, Hoeffding: true, Alpha: 0.01},
		{Mode: certify.Paper, EpsilonMax: 0.02, Alpha: 0.01},
	}
	steps := 30
	if testing.Short() {
		steps = 10
	}
	for pi, pol := range policies {
		t.Run(fmt.Sprintf("%s-eps%v-hoeffding%v", pol.Mode, pol.EpsilonMax, pol.Hoeffding), func(t *testing.T) {
			seed := uint64(100 + pi)
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(seed, 7))
			l, _ := openTest(t, Options{Policy: pol, EncodeChange: encodeChangeJSON})
			m := testModel(4)
			install(t, l, m)
			models := map[uint64]*bnn.Model{m.Version: m}
			ids := 0
			randomCE := func(m *bnn.Model) *CE {
				ce := newCE(t, m, rng)
				// Ids from the run, not the ledger's (time and random bits): the CEs deleted
				// below are picked from List's order, which must be the same in every run.
				ids++
				ce.ID = fmt.Sprintf("ce-%06d", ids)
				// Certificates spread over the thresholds: p1 in [0.55, 1), V1 in [0, 0.05].
				ce.P1 = 0.55 + 0.45*rng.Float64()
				ce.Var1 = 0.05 * rng.Float64() * rng.Float64()
				ce.Delta = 0.02 + 0.4*rng.Float64()
				ce.Epsilon = 0.001 + 0.06*rng.Float64()
				ce.Samples = []int{10, 100, 1000, 20000}[rng.IntN(4)]
				return ce
			}
			put := func(n int) {
				var ces []*CE
				for i := 0; i < n; i++ {
					ces = append(ces, randomCE(m))
				}
				if err := l.Put(bg, ces...); err != nil {
					t.Fatal(err)
				}
			}
			put(150)
			changed, candidates, checked := 0, 0, 0
			for step := 0; step < steps; step++ {
				// Drift the bias by a random amount on a log scale, either way, sometimes back
				// exactly to an anchor.
				next := drift(m, math.Copysign(math.Pow(10, -4+2.8*rng.Float64()), rng.Float64()-0.5))
				if rng.IntN(6) == 0 {
					vs := slices.Sorted(mapKeys(models)) // sorted: map order would make the run differ each time
					back := models[vs[rng.IntN(len(vs))]].Clone()
					back.Version = m.Version + 1
					next = back
				}
				want, wantCnt, wantMin := bruteForce(t, l, next, models)
				rep, changes, err := l.Recertify(bg, next)
				if err != nil {
					t.Fatal(err)
				}
				got := map[string]string{}
				for _, ch := range changes {
					got[ch.ID] = fmt.Sprintf("%v->%v", ch.From, ch.To)
					if ch.P2 != nil {
						t.Fatalf("step %d: Recertify sampled: %+v", step, ch)
					}
				}
				lapsed, restored := splitLapses(want)
				if fmt.Sprint(got) != fmt.Sprint(want) {
					t.Fatalf("step %d: indexed changes differ from brute force:\n got %v\nwant %v", step, got, want)
				}
				if rep.Lapsed != lapsed || rep.Restored != restored {
					t.Fatalf("step %d: %d certificates lapsed and %d restored, brute force %d and %d", step, rep.Lapsed, rep.Restored, lapsed, restored)
				}
				if !equalCounts(rep.Counts, wantCnt) || rep.MinBound != wantMin {
					t.Fatalf("step %d: report counts %v min bound %v; brute force %v, %v", step, rep.Counts, rep.MinBound, wantCnt, wantMin)
				}
				for v, kl := range rep.AnchorKL {
					if want, _, _ := certify.KL(next, models[v]); kl != want {
						t.Fatalf("step %d: anchor %d KL %v, certify.KL %v", step, v, kl, want)
					}
				}
				if _, _, err := l.Commit(bg, &Checkpoint{Model: next}); err != nil {
					t.Fatal(err)
				}
				if got, want := lapsedByIndex(t, l), lapsedByBounds(t, l, next, models); !reflect.DeepEqual(got, want) {
					t.Fatalf("step %d: lapsed certificates by the indexes %v, by their bounds %v", step, got, want)
				}
				m = next
				changed += len(changes) + rep.Lapsed + rep.Restored
				candidates += rep.Candidates
				checked += rep.Checked
				// Something else happens between updates.
				switch rng.IntN(4) {
				case 0:
					put(20)
					models[m.Version] = m
				case 1:
					confirmAll(t, l, m, 50, uint64(step))
					models[m.Version] = m // renewals re-anchor to m
				case 2:
					all, _ := l.List(0, 10000, "")
					for i := 0; i < 10 && len(all) > 0; i++ {
						j := rng.IntN(len(all))
						if err := l.Delete(all[j].ID); err != nil {
							t.Fatal(err)
						}
						all = slices.Delete(all, j, j+1)
					}
				}
				checkInvariants(t, l)
				an, _ := l.Anchors()
				live := map[uint64]bool{}
				for _, a := range an {
					live[a.Version] = true
				}
				for v := range models {
					if !live[v] && v != m.Version {
						delete(models, v)
					}
				}
			}
			t.Logf("%d steps: %d status changes and lapses; %d candidates read for %d CE judgements", steps, changed, candidates, checked)
			if changed == 0 {
				t.Fatal("no status changed: the drifts miss every threshold")
			}
		})
	}
}

func mapKeys[K comparable, V any](m map[K]V) func(func(K) bool) {
	return func(yield func(K) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// A policy change at Open rebuilds the indexes and re-judges every CE, recording the changes and,
// on a replica (Options.EncodeState), the state of each CE it re-judged to another status.
func TestPolicyChangeRebuilds(t *testing.T) {
	dir := t.TempDir()
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), EncodeChange: encodeChangeJSON})
	if err != nil {
		t.Fatal(err)
	}
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(61, 61))
	var ces []*CE
	for i := 0; i < 60; i++ {
		ces = append(ces, newCE(t, m, rng))
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	commit(t, l, drift(m, -0.002), 1) // KL 2e-4: variance slack 0.06 in paper mode (past 0.05), 0.03 in tight mode
	before, _ := l.Counts()
	outBefore, _ := l.OutboxLen()
	l.Close()
	// Tight mode has half the constants: some at_risk CEs are certified again.
	tight := certify.Policy{Mode: certify.Tight, EpsilonMax: certify.DefaultEpsilonMax, Alpha: certify.DefaultAlpha}
	l, err = Open(dir, Options{Logger: quietLogger(), Policy: tight, EncodeChange: encodeChangeJSON, EncodeState: encodeStateJSON})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	after, _ := l.Counts()
	outAfter, _ := l.OutboxLen()
	if before[certify.AtRisk]+before[certify.Invalidated] == 0 || after[certify.Certified] <= before[certify.Certified] {
		t.Fatalf("counts under paper %v, under tight %v: want more certified", before, after)
	}
	if outAfter-outBefore != 2*(after[certify.Certified]-before[certify.Certified]) {
		t.Fatalf("%d outbox entries for %d re-certified CEs, want a status change and a state each", outAfter-outBefore, after[certify.Certified]-before[certify.Certified])
	}
	states := latestStates(t, l)
	if len(states) != after[certify.Certified]-before[certify.Certified] {
		t.Fatalf("%d states in the outbox for %d re-certified CEs", len(states), after[certify.Certified]-before[certify.Certified])
	}
	for id, s := range states {
		if got, err := l.Get(id); err != nil || got.Status != certify.Certified || s.Status != certify.Certified || !reflect.DeepEqual(s.History, got.History) {
			t.Fatalf("%s: state %+v, stored %+v (%v)", id, s, got, err)
		}
	}
	checkInvariants(t, l)
}

// Rounding at the threshold: the variance index holds the headroom h = ceiling - V1, rounded,
// and the scan compares it with the slack s, while the verdict computes V1 + s <= ceiling,
// rounded differently. For some V1 within a few ulps of ceiling - s, V1 + s <= ceiling (the CE
// is certified at slack s) while h < s. When an anchor's KL falls back to that s from above,
// the scan from s up stops short of such a CE and it would stay at_risk. CEs on every float
// from 8 ulps below to 8 ulps above ceiling - s, at least one of them such a case, must be
// judged by Recertify exactly as by a full scan; without scanMargin the scan misses them. The
// margin is absolute below 1 (1e-9, not 1e-9 times the slack): the rounding is of the order of
// the ceiling's ulp whatever the slack, so it is checked at a slack of ~3e-3 (a move of a mean)
// and at one of ~3e-12 (a move of a log standard deviation, whose KL is not quantised by the
// mean's ulp), as right after registration, where a margin relative to the slack would be far
// below an ulp.
func TestRecertifyAtTheRoundedThreshold(t *testing.T) {
	for _, tc := range []struct {
		name string
		d0   float64
		move func(m *bnn.Model, d float64) *bnn.Model
	}{
		{"mean", 1e-4, drift},
		{"log sigma", 7e-13, func(m *bnn.Model, d float64) *bnn.Model {
			c := drift(m, 0)
			c.Last().BiasLogSigma[1] += d
			return c
		}},
	} {
		t.Run(tc.name, func(t *testing.T) { recertifyAtTheRoundedThreshold(t, tc.d0, tc.move) })
	}
}

// recertifyAtTheRoundedThreshold is TestRecertifyAtTheRoundedThreshold with the anchor's last
// bias moved by move, from d0 up to the first move that puts a rounding case at the threshold.
func recertifyAtTheRoundedThreshold(t *testing.T, d0 float64, move func(m *bnn.Model, d float64) *bnn.Model) {
	pol := certify.Policy{Mode: certify.Paper, EpsilonMax: 0.05, Alpha: certify.DefaultAlpha}
	const eps = 0.05
	ceiling := pol.VarCeiling(eps)
	anchor := testModel(4)
	var (
		next     *bnn.Model
		d, s     float64
		vs       []float64
		rounding int
	)
	for d = d0; rounding == 0; d *= 1.01 {
		next = move(anchor, d)
		kl, _, err := certify.KL(next, anchor)
		if err != nil {
			t.Fatal(err)
		}
		if s = pol.Slack(kl).Var; s >= ceiling {
			t.Fatal("no drift put a rounding case at the threshold")
		}
		vs = vs[:0]
		v := ceiling - s
		for range 8 {
			v = math.Nextafter(v, 0)
		}
		for range 17 {
			vs = append(vs, v)
			if v+s <= ceiling && (terms{v1: v, ceil: pol.VarCeiling(eps)}).headroom() < s {
				rounding++
			}
			v = math.Nextafter(v, 1)
		}
	}
	l, _ := openTest(t, Options{Policy: pol})
	install(t, l, anchor)
	rng := rand.New(rand.NewPCG(3, 3))
	var ces []*CE
	for i, v := range vs {
		ce := newCE(t, anchor, rng)
		ce.ID, ce.P1, ce.Var1, ce.Epsilon, ce.Samples = fmt.Sprintf("edge-%02d", i), 1, v, eps, 1000
		ces = append(ces, ce)
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	// Further first (every CE fails its variance bound, none its mean bound, so that only the
	// variance index finds them), then back to slack s.
	far := move(anchor, 2*d)
	if _, _, err := l.Commit(bg, &Checkpoint{Model: far}); err != nil {
		t.Fatal(err)
	}
	if st, _ := l.State(); st.Pending != len(vs) {
		t.Fatalf("%d of %d certificates lapsed far from their anchor, want all", st.Pending, len(vs))
	}
	if st, _ := l.Get("edge-00"); st.Bound < 0.5 {
		t.Fatalf("the mean bound fails too (%v): the test needs a drift that breaks only the variance bound", st.Bound)
	}
	back := next.Clone()
	back.Version = far.Version + 1
	models := map[uint64]*bnn.Model{anchor.Version: anchor}
	want, _, _ := bruteForce(t, l, back, models)
	rep, changes, err := l.Recertify(bg, back)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, ch := range changes {
		got[ch.ID] = fmt.Sprintf("%v->%v", ch.From, ch.To)
	}
	lapsed, restored := splitLapses(want)
	if rep.Lapsed != lapsed || rep.Restored != restored {
		t.Fatalf("slack %v, %d rounding cases among V1 = %v: %d lapsed and %d restored, full scan %d and %d", s, rounding, vs, rep.Lapsed, rep.Restored, lapsed, restored)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("slack %v, %d rounding cases among V1 = %v:\nindexed changes %v\n    full scan %v", s, rounding, vs, got, want)
	}
	t.Logf("slack %v: %d of %d CEs are rounding cases; %d change", s, rounding, len(vs), len(want))
}

// The Theorem 1 threshold, to the ulp: certified CEs on every float from 8 ulps below to 8 above
// 1/2 + m (m the mean slack of their anchor's KL) are lapsed or not exactly as certify.Bounds
// says, and the smallest Theorem 1 bound reported is that of the first CE above the threshold,
// never one within the scan's margin below it. Confirm finds exactly the lapsed ones.
func TestMinBoundAndLapsesAtTheMeanThreshold(t *testing.T) {
	pol := testPolicy()
	anchor := testModel(4)
	far := drift(anchor, -0.046) // KL ~0.106: mean slack ~0.46, so 1/2 + m is above 1 - delta
	kl, _, err := certify.KL(far, anchor)
	if err != nil {
		t.Fatal(err)
	}
	m := pol.Slack(kl).Mean
	l, _ := openTest(t, Options{Policy: pol})
	install(t, l, anchor)
	rng := rand.New(rand.NewPCG(4, 4))
	p := 0.5 + m
	for range 8 {
		p = math.Nextafter(p, 0)
	}
	var ces []*CE
	for i := range 17 {
		ce := newCE(t, anchor, rng)
		ce.ID, ce.P1, ce.Var1, ce.Epsilon = fmt.Sprintf("p1-%02d", i), p, 0, 0.25
		ces = append(ces, ce)
		p = math.Nextafter(p, 1)
	}
	if err := l.Put(bg, ces...); err != nil {
		t.Fatal(err)
	}
	if _, _, err := l.Commit(bg, &Checkpoint{Model: far}); err != nil {
		t.Fatal(err)
	}
	wantMin, lapsed := 1.0, map[string]bool{}
	for _, c := range ces {
		b := pol.Bounds(c.Certificate(), kl)
		if b.Certified {
			wantMin = min(wantMin, b.ProbLower)
		} else {
			lapsed[c.ID] = true
		}
	}
	if len(lapsed) == 0 || len(lapsed) == len(ces) {
		t.Fatalf("%d of %d lapsed: the test needs the threshold among them", len(lapsed), len(ces))
	}
	st, err := l.State()
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending != len(lapsed) || st.MinBound != wantMin {
		t.Fatalf("pending %d, min bound %v; want %d and %v", st.Pending, st.MinBound, len(lapsed), wantMin)
	}
	found := waitingByIndex(t, l)
	if !reflect.DeepEqual(found, lapsed) {
		t.Fatalf("waiting by the indexes %v, want %v", found, lapsed)
	}
	checkInvariants(t, l)
}
