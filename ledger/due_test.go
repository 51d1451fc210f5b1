package ledger

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// A batch measured under a past version v renews certificates to a new anchor v, whose history
// comes from the posteriors past gives: when past no longer holds v itself (the daemon keeps the
// last 256 it served) but holds the versions after it, the renewal is written all the same, with
// the sampled posterior as the anchor's (the history needs KL(q_x || q_v)).
func TestRenewalUnderAPastVersionPastNoLongerHolds(t *testing.T) {
	l, dir, m0, _ := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return spreadCEs(t, m0, rand.New(rand.NewPCG(16, 16)), 40) })
	past := map[uint64]*bnn.Model{m0.Version: m0}
	cur := m0
	for _, d := range []float64{-0.005, -0.004, -0.007, -0.01} {
		cur = driftBy(t, l, cur, d)
		past[cur.Version] = cur
	}
	v := m0.Version + 2
	given := maps.Clone(past)
	delete(given, v) // forgotten: the versions after it are kept
	rep, _, err := l.ConfirmLaneLeaving(bg, posteriorPredictor{NewModelPredictor(past[v], 300, v)}, 1000, 0, 1, pastOf(given), nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Renewed == 0 {
		t.Fatalf("%+v: no renewal under version %d, the test cannot tell anything", rep, v)
	}
	anchors, err := l.Anchors()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(anchors, func(a Anchor) bool { return a.Version == v && a.Refs > 0 }) {
		t.Fatalf("anchors %+v: none at version %d", anchors, v)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := Verify(filepath.Join(dir, FileName)); err != nil {
		t.Fatalf("Verify: %v", err)
	}
}

// A certificate renewed under a past version gets its new anchor's history from the posteriors
// since (pastAnchorKL over every version): Verify accepts the file, Open keeps every history (it
// logs no damaged one and no stray record), and the commits after go on from it, so that every
// certified CE's renewal_pending_since is, at each later version, the one its bound at every
// version's KL from its anchor gives, or none, never another.
func TestRenewalUnderAPastVersionKeepsAVerifiedHistory(t *testing.T) {
	l, dir, m0, ces := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return spreadCEs(t, m0, rand.New(rand.NewPCG(16, 16)), 40) })
	pol := l.Policy()
	past := map[uint64]*bnn.Model{m0.Version: m0}
	cur := m0
	for _, d := range []float64{-0.005, -0.004, -0.007, -0.01, -0.03, -0.02, -0.03, -0.04, -0.05} {
		cur = driftBy(t, l, cur, d)
		past[cur.Version] = cur
	}
	// The CEs due at the first version, measured after the last commit: renewals under a past
	// version, whose new certificates lapse at the versions since.
	byVersion, _, err := l.DueLane(1000, 0, 1, pastOf(past), func(u uint64) bool { return past[u] != nil })
	if err != nil {
		t.Fatal(err)
	}
	first := slices.Min(slices.Collect(maps.Keys(byVersion)))
	if _, _, err := l.ConfirmDue(bg, posteriorPredictor{NewModelPredictor(past[first], 300, first)}, byVersion[first], pastOf(past)); err != nil {
		t.Fatal(err)
	}
	anchors, err := l.Anchors()
	if err != nil {
		t.Fatal(err)
	}
	renewedPast, pastAnchor := 0, map[uint64]bool{}
	for _, a := range anchors {
		if a.Version != m0.Version && a.Version < cur.Version && a.Refs > 0 {
			renewedPast += a.Refs
			pastAnchor[a.Version] = true
		}
	}
	if renewedPast == 0 {
		t.Fatal("no certificate was renewed under a past version: the test cannot tell anything")
	}
	exact, unknown, exactPast := 0, 0, 0 // exactPast: of a certificate under an anchor renewals under a past version made
	check := func(l *Ledger) {
		t.Helper()
		for _, ce := range ces {
			got, err := l.Get(ce.ID)
			if err != nil {
				t.Fatal(err)
			}
			if got.Status != certify.Certified {
				continue
			}
			a := got.AnchorVersion
			var kls []float64 // KL(q_x || q_a) for x = a, a+1, ..., cur
			for x := a; x <= cur.Version; x++ {
				kl, _, err := certify.KL(past[x], past[a])
				if err != nil {
					t.Fatal(err)
				}
				kls = append(kls, kl)
			}
			threshold := -1.0
			for _, k := range kls {
				if pol.Bounds(got.Certificate(), k).Certified {
					threshold = max(threshold, k)
				}
			}
			want, lapsed, known := bruteSince(kls, threshold)
			switch {
			case got.RenewalPending != lapsed:
				t.Fatalf("version %d: %s (anchor %d) renewal_pending %v, its bound at every version says %v", cur.Version, ce.ID, a, got.RenewalPending, lapsed)
			case !lapsed:
			case got.RenewalPendingSince == nil:
				unknown++
			case !known || *got.RenewalPendingSince != a+want:
				t.Fatalf("version %d: %s (anchor %d) renewal_pending_since %d, its bound at every version says %d (known %v)", cur.Version, ce.ID, a, *got.RenewalPendingSince, a+want, known)
			default:
				exact++
				if pastAnchor[a] {
					exactPast++
				}
			}
		}
	}
	check(l)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := Verify(filepath.Join(dir, FileName)); err != nil {
		t.Fatalf("Verify after renewals under past versions: %v", err)
	}
	var logs bytes.Buffer
	l, err = Open(dir, Options{Policy: testPolicy(), Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if logs.Len() > 0 {
		t.Fatalf("Open after renewals under past versions logged:\n%s", logs.String())
	}
	check(l)
	for _, d := range []float64{-0.004, 0.003, -0.006, -0.01, -0.02} {
		cur = driftBy(t, l, cur, d)
		past[cur.Version] = cur
		check(l)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := Verify(filepath.Join(dir, FileName)); err != nil {
		t.Fatalf("Verify after commits over histories written by renewals: %v", err)
	}
	t.Logf("%d certificates renewed under past versions; %d lapse versions read exact (%d under an anchor renewals under a past version made), %d unknown",
		renewedPast, exact, exactPast, unknown)
	if exactPast == 0 {
		t.Fatal("no lapse version was read from a history a renewal under a past version wrote: the test cannot tell anything")
	}
}

// A certificate whose bound fails, holds again and fails again became due at the first version
// its bound failed at: a ledger measured after every commit measures it there. For the
// measurements to be a function of the log, a ledger measured once after the last commit must
// measure it there too, not at its lapse version (the version after the last one its bound held
// at, renewal_pending_since). The drift moves away from the anchor, comes back and moves away
// again; past holds every version (all near), and both ledgers must reach the same outcomes.
func TestDueVersionOfACertificateWhoseBoundCameBack(t *testing.T) {
	d := driveTwo(t, -0.03, 0.025, -0.03)
	timely, late, m0, cur, ces, past := d.timely, d.late, d.m0, d.cur, d.ces, d.past
	// The CEs whose bound failed first before their lapse version: it held again between.
	came := 0
	for _, ce := range ces {
		b := getCE(t, late, ce.ID)
		for v := m0.Version + 1; v <= cur.Version; v++ {
			kl, _, err := certify.KL(past[v], m0)
			if err != nil {
				t.Fatal(err)
			}
			if !late.Policy().Bounds(ce.Certificate(), kl).Certified {
				if b.RenewalPendingSince != nil && v < *b.RenewalPendingSince {
					came++
				}
				break
			}
		}
	}
	measureDue(t, late, past)
	differ := 0
	for _, ce := range ces {
		a, b := getCE(t, timely, ce.ID), getCE(t, late, ce.ID)
		if a.AnchorVersion != b.AnchorVersion || ptrU64(a.ConfirmedVersion) != ptrU64(b.ConfirmedVersion) || a.Status != b.Status {
			differ++
			t.Errorf("%s: measured after every commit: %v, anchor %d, verdict version %s; once after the last: %v, anchor %d, verdict version %s",
				ce.ID, a.Status, a.AnchorVersion, ptrU64(a.ConfirmedVersion), b.Status, b.AnchorVersion, ptrU64(b.ConfirmedVersion))
		}
	}
	t.Logf("%d of %d outcomes differ; the bounds of %d CEs failed, held again and failed again", differ, len(ces), came)
	if came < 5 {
		t.Fatal("the drift must bring five bounds or more back before they fail again for the test to mean anything")
	}
}

// A verdict that no longer carries says since which version (verdict_pending_since): the first
// version after its own at which certify.Carries fails at KL(q_x || q_cv), computed here directly
// at every version of a drift that goes, comes back and goes on, read by Get and by List. It is
// absent for a verdict that decided nothing, and when Options.Past does not hold a posterior since
// the verdict's version.
func TestVerdictPendingSinceIsTheVersionTheVerdictStoppedCarrying(t *testing.T) {
	past := map[uint64]*bnn.Model{}
	var forgotten uint64 // a version Past does not give, 0 for none
	l, _ := openTest(t, Options{Policy: testPolicy(), Past: func(v uint64) *bnn.Model {
		if v == forgotten {
			return nil
		}
		return past[v]
	}})
	pol := l.Policy()
	m0 := testModel(4)
	install(t, l, m0)
	past[m0.Version] = m0
	if err := l.Put(bg, spreadCEs(t, m0, rand.New(rand.NewPCG(17, 17)), 40)...); err != nil {
		t.Fatal(err)
	}
	// stopped is the first version after ce's verdict's at which it does not carry, 0 for none.
	stopped := func(ce *CE, now uint64) uint64 {
		cv := *ce.ConfirmedVersion
		for x := cv + 1; x <= now; x++ {
			kl, _, err := certify.KL(past[x], past[cv])
			if err != nil {
				t.Fatal(err)
			}
			if !certify.Carries(ce.Status, *ce.VerdictBound, pol.Slack(kl)) {
				return x
			}
		}
		return 0
	}
	var since, undecided, unknown int
	check := func(now uint64) {
		t.Helper()
		listed, err := l.List(0, 1000, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, ce := range listed {
			for _, got := range []*CE{ce, getCE(t, l, ce.ID)} {
				want := uint64(0)
				if got.VerdictPending && got.VerdictBound != nil {
					want = stopped(got, now)
					if want == 0 {
						t.Fatalf("%s at version %d: verdict pending, but its verdict carries to every version since %d", got.ID, now, *got.ConfirmedVersion)
					}
					if forgotten >= *got.ConfirmedVersion && forgotten <= want {
						want = 0 // a posterior on the way is not at hand
					}
				}
				switch {
				case want == 0 && got.VerdictPendingSince != nil:
					t.Errorf("%s at version %d (%v, verdict pending %v, bound %v): verdict pending since %d, want none",
						got.ID, now, got.Status, got.VerdictPending, got.VerdictBound, *got.VerdictPendingSince)
				case want != 0 && (got.VerdictPendingSince == nil || *got.VerdictPendingSince != want):
					t.Errorf("%s at version %d: verdict pending since %s, want %d", got.ID, now, ptrU64(got.VerdictPendingSince), want)
				}
			}
			switch {
			case ce.VerdictPendingSince != nil:
				since++
			case ce.VerdictPending && ce.VerdictBound == nil:
				undecided++
			case ce.VerdictPending:
				unknown++
			}
		}
	}
	cur := m0
	for i, d := range []float64{-0.3, -0.1, 0.2, -0.3, -0.2, -0.4, 0.3, -0.5, -0.5} {
		cur = driftBy(t, l, cur, d)
		past[cur.Version] = cur
		if i == 7 {
			forgotten = cur.Version - 1
		}
		check(cur.Version)
		if i%3 == 0 { // verdicts wait for a few versions between measurements
			measureDue(t, l, past)
		}
	}
	t.Logf("CE-versions: %d verdicts pending with their version, %d whose posteriors were not all at hand, %d undecided", since, unknown, undecided)
	if since < 10 || unknown == 0 {
		t.Fatal("the drift must leave ten verdicts pending with a version, and one whose version is not known, for the test to mean anything")
	}
}

// committingPredictor is a PosteriorPredictor that commits the posteriors next to l before it
// draws: ingestion that promotes versions between a measurement's read and its write.
type committingPredictor struct {
	posteriorPredictor
	l    *Ledger
	next []*bnn.Model
}

func (p committingPredictor) Predict(ctx context.Context, X [][]float64) (*bnn.Predictive, error) {
	for _, m := range p.next {
		if _, _, err := p.l.Commit(ctx, &Checkpoint{Model: m}); err != nil {
			return nil, err
		}
	}
	return p.posteriorPredictor.Predict(ctx, X)
}

// A certificate due at its lapse version read from its anchor's history (past does not hold the
// anchor's posterior) is written as measured there only if that is still its lapse version when
// the measurement is written. The drift lapses certificates at version 1; while ConfirmDue draws
// under it, version 2 brings some bounds back and version 3 fails them again: those lapsed at 3,
// not 1, and are left for a measurement under 3 (skipped, unchanged, due at 3 after); those
// whose bound failed at every version are measured under 1.
func TestConfirmDueLeavesACertificateWhoseLapseVersionMoved(t *testing.T) {
	l, _, m0, ces := ledgerHolding(t, func(m0 *bnn.Model) []*CE { return spreadCEs(t, m0, rand.New(rand.NewPCG(16, 16)), 40) })
	m1 := driftBy(t, l, m0, -0.03)
	m2 := drift(m1, 0.012)
	m3 := drift(m2, -0.03)
	byVersion, _, err := l.DueLane(1000, 0, 1, nil, func(uint64) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	ids := byVersion[m1.Version]
	if len(byVersion) != 1 || len(ids) == 0 {
		t.Fatalf("due versions %v: want the certificates that lapsed at %d only", slices.Sorted(maps.Keys(byVersion)), m1.Version)
	}
	kl2, _, err := certify.KL(m2, m0)
	if err != nil {
		t.Fatal(err)
	}
	kl3, _, err := certify.KL(m3, m0)
	if err != nil {
		t.Fatal(err)
	}
	pol := l.Policy()
	moved := map[string]bool{} // lapsed at 1, held at 2, failed at 3
	for _, id := range ids {
		cert := getCE(t, l, string(id)).Certificate()
		if pol.Bounds(cert, kl2).Certified && !pol.Bounds(cert, kl3).Certified {
			moved[string(id)] = true
		}
	}
	if len(moved) < 5 || len(ids)-len(moved) < 5 {
		t.Fatalf("of %d certificates due at %d, %d lapse again at %d: the drift must give five or more of both for the test to mean anything",
			len(ids), m1.Version, len(moved), m3.Version)
	}
	t.Logf("%d certificates due at %d, %d of them lapse again at %d", len(ids), m1.Version, len(moved), m3.Version)
	p := committingPredictor{posteriorPredictor{NewModelPredictor(m1, 300, m1.Version)}, l, []*bnn.Model{m2, m3}}
	rep, _, err := l.ConfirmDue(bg, p, ids, nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Picked != len(ids) || rep.Skipped != len(moved) || rep.Confirmed != len(ids)-len(moved) || !rep.Behind {
		t.Fatalf("%+v: want %d picked, the %d whose lapse version moved to %d skipped, the others confirmed under %d",
			rep, len(ids), len(moved), m3.Version, m1.Version)
	}
	for _, ce := range ces {
		got := getCE(t, l, ce.ID)
		measured := got.AnchorVersion != m0.Version || got.ConfirmedVersion != nil
		switch {
		case moved[ce.ID] && (measured || got.Status != certify.Certified || ptrU64(got.RenewalPendingSince) != fmt.Sprint(m3.Version)):
			t.Errorf("%s lapsed again at %d: %v, anchor %d, verdict version %s, renewal_pending_since %s; want it left certified under %d, lapsed since %d",
				ce.ID, m3.Version, got.Status, got.AnchorVersion, ptrU64(got.ConfirmedVersion), ptrU64(got.RenewalPendingSince), m0.Version, m3.Version)
		case !moved[ce.ID] && slices.ContainsFunc(ids, func(id []byte) bool { return string(id) == ce.ID }) &&
			got.AnchorVersion != m1.Version && ptrU64(got.ConfirmedVersion) != fmt.Sprint(m1.Version):
			t.Errorf("%s lapsed at %d for good: anchor %d, verdict version %s; want it measured under %d",
				ce.ID, m1.Version, got.AnchorVersion, ptrU64(got.ConfirmedVersion), m1.Version)
		}
	}
	byVersion, _, err = l.DueLane(1000, 0, 1, nil, func(uint64) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range byVersion[m3.Version] {
		delete(moved, string(id))
	}
	if len(moved) > 0 {
		t.Fatalf("due at %d: %d CEs; %d of those whose lapse version moved there are not", m3.Version, len(byVersion[m3.Version]), len(moved))
	}
}
