package daemon

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/postlog"
)

// TestConfirmerMovedPastThePoolSlack: a confirmer draws a new pool before a batch when the newest
// posterior has moved from the pool's by more than confirmPoolSlack, measured as the mean slack
// (certify.Policy.Slack) of KL(q_newest || q_pool); at or below it the pool is kept. A posterior
// whose KL from the pool's cannot be computed (another architecture) counts as moved.
func TestConfirmerMovedPastThePoolSlack(t *testing.T) {
	l := openLedger(t)
	pool := bnn.New(3, []int{4}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	c := newConfirmer(l, nil, nil, nil, nil, slog.New(slog.DiscardHandler))
	c.model = pool
	// shifted moves every output bias of the pool's posterior by k of its standard deviations.
	shifted := func(k float64) *bnn.Model {
		m := pool.Clone()
		last := &m.Layers[len(m.Layers)-1]
		for i := range last.BiasMu {
			last.BiasMu[i] += k * math.Exp(last.BiasLogSigma[i])
		}
		return m
	}
	cases := []struct {
		name  string
		m     *bnn.Model
		moved bool
	}{
		{"the pool's own posterior", pool, false},
		{"a posterior a thousandth of a deviation away", shifted(1e-3), false},
		{"a posterior one deviation away", shifted(1), true},
		{"a posterior of another architecture", bnn.New(3, []int{5}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 2))), true},
	}
	for _, tc := range cases {
		// The fixture is on the side of the slack it is named for.
		if kl, _, err := certify.KL(tc.m, pool); err == nil {
			if over := l.Policy().Slack(kl).Mean > confirmPoolSlack; over != tc.moved {
				t.Fatalf("%s: mean slack %v against %v: fixture on the wrong side", tc.name, l.Policy().Slack(kl).Mean, confirmPoolSlack)
			}
		} else if !tc.moved {
			t.Fatalf("%s: KL: %v", tc.name, err)
		}
		if got := c.moved(tc.m); got != tc.moved {
			t.Errorf("%s: moved = %v, want %v", tc.name, got, tc.moved)
		}
	}
}

// TestConfirmersNotifyWakesEveryLane: a commit wakes every lane of the confirmer (each measures
// only its own CEs, so a lane left asleep leaves its CEs waiting until the poll), and waking never
// blocks: wake-ups that come while one is pending coalesce into it.
func TestConfirmersNotifyWakesEveryLane(t *testing.T) {
	l := openLedger(t)
	cs := newConfirmers(3, l, nil, nil, nil, nil, slog.New(slog.DiscardHandler))
	for i, c := range cs {
		if c.lane != i || c.lanes != 3 {
			t.Fatalf("confirmer %d measures lane %d of %d, want lane %d of 3", i, c.lane, c.lanes, i)
		}
	}
	for range 3 {
		cs.notify() // would block here if a pending wake-up were not coalesced
	}
	for i, c := range cs {
		if len(c.wake) != 1 {
			t.Fatalf("lane %d has %d wake-ups pending after three commits, want 1", i, len(c.wake))
		}
	}
}

// TestConfirmerRunsARoundWhenWoken: the confirmer runs a round when it starts and again as soon
// as it is woken (notify, after every commit), not only at its poll; it stops when its context
// ends. The poll is set to an hour here, so a second round can only come from the wake-up.
func TestConfirmerRunsARoundWhenWoken(t *testing.T) {
	l := openLedger(t)
	m := bnn.New(3, []int{4}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	ps := &pools{samples: 8}
	c := newConfirmer(l, func() *bnn.Model { return m }, ps, nil, nil, slog.New(slog.DiscardHandler))
	c.poll = time.Hour
	rounds := make(chan struct{})
	c.beforeRound = func(ctx context.Context) {
		select {
		case rounds <- struct{}{}:
		case <-ctx.Done():
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- c.run(ctx) }()
	defer func() {
		cancel()
		if err := <-stopped; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	round := func(what string) {
		t.Helper()
		select {
		case <-rounds:
		case <-time.After(time.Minute): // the poll is an hour away: only a wake-up brings a round
			t.Fatalf("no round %s", what)
		}
	}
	round("at the start")
	c.notify()
	round("after a wake-up")
	c.notify()
	round("after a second wake-up")
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.drawn != 0 {
		t.Fatalf("%d pools drawn for an empty ledger", ps.drawn)
	}
}

// TestConfirmerRoundEndsWhenItsPoolsPassIsDone: a pool is kept while ingestion promotes
// posteriors within confirmPoolSlack of it, but only until its pass is done. Then the round
// looks again under the newest posterior: with no CE waiting it ends, drawing nothing; it does
// not keep measuring with the old pool, which finds nothing to measure and would loop without
// a pause.
func TestConfirmerRoundEndsWhenItsPoolsPassIsDone(t *testing.T) {
	l := openLedger(t)
	old := smallModel(1)
	newest := old.Clone()
	newest.Version = 2
	last := &newest.Layers[len(newest.Layers)-1]
	last.BiasMu[0] += 1e-3 * math.Exp(last.BiasLogSigma[0])
	for _, m := range []*bnn.Model{old, newest} {
		if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
			t.Fatal(err)
		}
	}
	ps := &pools{samples: 8}
	pool, err := ps.get(old)
	if err != nil {
		t.Fatal(err)
	}
	c := newConfirmer(l, func() *bnn.Model { return newest }, ps, alerts.NewMetrics(prometheus.NewRegistry()), nil, slog.New(slog.DiscardHandler))
	c.pool, c.model = pool, old
	if c.moved(newest) {
		t.Fatal("fixture: the newest posterior is past the pool slack")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := c.round(ctx); err != nil {
		t.Fatal(err)
	}
	if ctx.Err() != nil {
		t.Fatal("the round went on measuring with a pool whose pass was done until its context ended")
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.drawn != 1 {
		t.Fatalf("%d pools drawn, want only the fixture's: nothing waits under the newest posterior", ps.drawn)
	}
}

// TestConfirmerFailsWhenItsLedgerCannotBeRead: a round whose ledger cannot be read fails, whether
// it was looking for CEs that wait (no pool yet) or measuring a batch with its pool; it does not
// end as though nothing waited. The loop logs the failure once per episode, however many rounds
// fail in it, and goes on retrying.
func TestConfirmerFailsWhenItsLedgerCannotBeRead(t *testing.T) {
	l := openLedger(t)
	m := smallModel(1)
	if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
		t.Fatal(err)
	}
	ps := &pools{samples: 8}
	pool, err := ps.get(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	metrics := alerts.NewMetrics(prometheus.NewRegistry())
	for _, withPool := range []bool{false, true} {
		c := newConfirmer(l, func() *bnn.Model { return m }, ps, metrics, nil, slog.New(slog.DiscardHandler))
		if withPool {
			c.pool, c.model = pool, m
		}
		if err := c.round(context.Background()); err == nil {
			t.Errorf("a round with a pool %v and a closed ledger: no error", withPool)
		}
	}

	var logs bytes.Buffer
	c := newConfirmer(l, func() *bnn.Model { return m }, ps, metrics, nil, slog.New(slog.NewTextHandler(&logs, nil)))
	c.poll = time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	rounds := 0
	c.beforeRound = func(context.Context) {
		if rounds++; rounds == 5 {
			cancel()
		}
	}
	if err := c.run(ctx); err != nil {
		t.Fatalf("run: %v", err)
	}
	if n := strings.Count(logs.String(), "level=ERROR"); rounds < 5 || n != 1 {
		t.Fatalf("%d ERROR lines over %d failing rounds, want 1:\n%s", n, rounds, logs.String())
	}
	// It is the line docs/RUNBOOK.md (CfguardRenewalBehind) points at, and it says what becomes
	// of the CEs that wait: a lapsed certificate stays certified, renewal pending (a commit
	// marks none at_risk: the confirmer's verdict alone does).
	if line := logs.String(); !strings.Contains(line, `msg="confirming counterfactuals`) ||
		!strings.Contains(line, "stays certified with renewal_pending") || strings.Contains(line, "stay at_risk") {
		t.Errorf("the ERROR line does not say what becomes of the waiting CEs:\n%s", line)
	}
}

// A confirmer whose gate does not open (a replica whose share has not settled: its ledger may
// hold stale copies of CEs another replica owns) measures nothing: the round ends before it
// reads the posterior or the ledger.
func TestConfirmerWaitsForItsGate(t *testing.T) {
	asked := 0
	c := newConfirmer(nil, func() *bnn.Model { t.Fatal("the round read the posterior past a closed gate"); return nil },
		nil, nil, nil, slog.New(slog.DiscardHandler))
	c.gate = func(ctx context.Context) error { asked++; return context.Canceled }
	if err := c.round(context.Background()); err != nil || asked != 1 {
		t.Fatalf("round = %v after asking the gate %d times; want nil after one", err, asked)
	}
}

// A confirmer measures a lapsed certificate under the version its bound lapsed at when it keeps
// that posterior and the newest has not moved past its pool slack from it, and under the newest
// otherwise. A drift of eight versions lapses certificates at several of them; with every version
// near (an infinite slack), each verdict is recorded at its CE's lapse version
// (renewal_pending_since), the verdicts span several versions, and the verdicts that stop
// carrying and the renewals that lapse again are measured again at the versions they became due
// at; with none near (slack 0), every verdict is recorded at the newest version.
func TestConfirmerMeasuresALapsedCertificateAtItsLapseVersion(t *testing.T) {
	for _, tc := range []struct {
		name  string
		slack float64
		near  bool
	}{
		{"every version near", math.Inf(1), true},
		{"no version near", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, m := lapsingLedger(t)
			past := map[uint64]*bnn.Model{m.Version: m}
			for range 8 {
				m = driftStep(t, l, m)
				past[m.Version] = m
			}
			since := map[string]uint64{}
			for i := range 60 {
				id := fmt.Sprintf("ce-%02d", i)
				got, err := l.Get(id)
				if err != nil {
					t.Fatal(err)
				}
				if got.RenewalPendingSince != nil {
					since[id] = *got.RenewalPendingSince
				}
			}
			var changes []ledger.StatusChange
			c := newConfirmer(l, func() *bnn.Model { return m }, &pools{samples: 200, prec: bnn.Float64}, alerts.NewMetrics(prometheus.NewRegistry()),
				func(chs []ledger.StatusChange) { changes = append(changes, chs...) }, slog.New(slog.DiscardHandler))
			c.past = func(v uint64) *bnn.Model { return past[v] }
			c.poolSlack = tc.slack
			if err := c.round(context.Background()); err != nil {
				t.Fatal(err)
			}
			versions, again := map[uint64]int{}, map[uint64]int{}
			for _, ch := range changes {
				if ch.From != certify.Certified {
					again[ch.PosteriorVersion]++
					continue
				}
				want := m.Version
				if tc.near {
					want = since[ch.ID]
				}
				if ch.PosteriorVersion != want {
					t.Errorf("%s (lapsed at %d): measured at %d, want %d", ch.ID, since[ch.ID], ch.PosteriorVersion, want)
				}
				versions[ch.PosteriorVersion]++
			}
			t.Logf("%d certificates lapsed; verdicts at versions %v; verdicts changed again at versions %v; %d measurements, %d at a due version",
				len(since), versions, again, c.measured.Load(), c.dueMeasured.Load())
			if tc.near && c.dueMeasured.Load() <= int64(len(since)) {
				t.Errorf("%d measurements at a due version for %d lapsed certificates: no verdict or renewal was measured again at the version it became due at",
					c.dueMeasured.Load(), len(since))
			}
			lapsedAt := map[uint64]bool{}
			for _, u := range since {
				lapsedAt[u] = true
			}
			if len(since) < 10 || len(lapsedAt) < 3 {
				t.Fatalf("lapse versions %v: the drift must lapse certificates at three versions or more", since)
			}
		})
	}
}

// lapsingLedger is a ledger holding 60 certificates, ce-00 to ce-59, under m0, spread in p1 so
// that a drift of the second class's bias lapses some of them at each version (driftStep).
func lapsingLedger(t *testing.T) (*ledger.Ledger, *bnn.Model) {
	t.Helper()
	l := openLedger(t)
	rng := rand.New(rand.NewPCG(3, 4))
	m := bnn.New(3, []int{4}, []string{"a", "b"}, 0.1, rng)
	if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
		t.Fatal(err)
	}
	var ces []*ledger.CE
	for i := range 60 {
		p1 := 0.6 + 0.39*float64(i)/59
		ces = append(ces, &ledger.CE{ID: fmt.Sprintf("ce-%02d", i), X: []float64{0, 0, 0}, XCF: []float64{rng.NormFloat64(), rng.NormFloat64(), rng.NormFloat64()},
			Target: 1, AnchorVersion: m.Version, P1: p1, Var1: 0.001, Samples: 1000, Delta: 1 - p1 + 0.001, Epsilon: 0.25})
	}
	if err := l.Put(context.Background(), ces...); err != nil {
		t.Fatal(err)
	}
	return l, m
}

// driftStep commits the version after m, one step of lapsingLedger's drift, and returns it.
func driftStep(t *testing.T, l *ledger.Ledger, m *bnn.Model) *bnn.Model {
	t.Helper()
	next := m.Clone()
	next.Version++
	next.Last().BiasMu[1] -= 0.06 * math.Exp(next.Last().BiasLogSigma[1])
	if _, _, err := l.Commit(context.Background(), &ledger.Checkpoint{Model: next}); err != nil {
		t.Fatal(err)
	}
	return next
}

// lapsedKept counts the lapsed certificates (and verdicts no longer carried) whose due version
// past keeps, by that version.
func lapsedKept(t *testing.T, l *ledger.Ledger, past map[uint64]*bnn.Model) map[uint64]int {
	t.Helper()
	byVersion, _, err := l.DueLane(1000, 0, 1, func(v uint64) *bnn.Model { return past[v] }, func(u uint64) bool { return past[u] != nil })
	if err != nil {
		t.Fatal(err)
	}
	n := map[uint64]int{}
	for u, ids := range byVersion {
		n[u] = len(ids)
	}
	return n
}

// A round ends with no lapsed certificate left that it would measure under its lapse version:
// certificates that lapse at a version promoted while the round measures under an older pool
// are measured under it within the round, as lapsed certificates are measured before the other
// CEs that wait. Here the round's pass measures, one per batch, the certificates that lapsed at
// a version the confirmer no longer keeps, and a version promoted after its first batch lapses
// more.
func TestConfirmerRoundMeasuresCertificatesThatLapseDuringIt(t *testing.T) {
	l, m := lapsingLedger(t)
	for range 3 {
		m = driftStep(t, l, m)
	}
	past := map[uint64]*bnn.Model{m.Version: m} // the earlier versions are not kept (a restart)
	if n := lapsedKept(t, l, map[uint64]*bnn.Model{m.Version - 1: m}); n[m.Version-1] < 2 {
		t.Fatalf("lapse versions %v: the pass under the newest posterior needs two certificates or more", n)
	}
	var mu sync.Mutex
	cur := func() *bnn.Model { mu.Lock(); defer mu.Unlock(); return m }
	c := pastConfirmer(l, cur, func(v uint64) *bnn.Model { mu.Lock(); defer mu.Unlock(); return past[v] })
	c.poolSlack, c.batch = math.Inf(1), 1
	promoted := false
	c.gate = func(context.Context) error {
		if c.pool != nil && !promoted { // after the pass's first batch
			promoted = true
			next := driftStep(t, l, cur())
			mu.Lock()
			m, past[next.Version] = next, next
			mu.Unlock()
		}
		return nil
	}
	roundLeavesNoneDue(t, c, l, past, &promoted)
}

// A round does not end with lapsed certificates its last batches left out because they lapsed
// at a version promoted after measureDue last ran: here the version is promoted once the pass
// has measured its last CE, before the round looks whether a newer posterior is current.
func TestConfirmerRoundMeasuresCertificatesThatLapseAtItsEnd(t *testing.T) {
	l, m := lapsingLedger(t)
	for range 3 {
		m = driftStep(t, l, m)
	}
	past := map[uint64]*bnn.Model{m.Version: m} // the earlier versions are not kept (a restart)
	early := m.Version - 1
	atEarly := func() int {
		byVersion, _, err := l.DueLane(1000, 0, 1, nil, func(u uint64) bool { return u == early })
		if err != nil {
			t.Fatal(err)
		}
		return len(byVersion[early])
	}
	if atEarly() == 0 {
		t.Fatal("no certificate lapsed at the version before the newest: the pass has nothing to measure")
	}
	var c *confirmer
	promoted := false
	cur := func() *bnn.Model {
		if c.pool != nil && !promoted && atEarly() == 0 { // the pass has measured its last CE
			promoted = true
			m = driftStep(t, l, m)
			past[m.Version] = m
		}
		return m
	}
	c = pastConfirmer(l, cur, func(v uint64) *bnn.Model { return past[v] })
	c.poolSlack = math.Inf(1) // one batch a pass: the batch that leaves CEs out is the last
	roundLeavesNoneDue(t, c, l, past, &promoted)
}

// pastConfirmer is a confirmer of l, with S = 200 draws in float64, that keeps the posteriors
// past gives.
func pastConfirmer(l *ledger.Ledger, current func() *bnn.Model, past func(v uint64) *bnn.Model) *confirmer {
	c := newConfirmer(l, current, &pools{samples: 200, prec: bnn.Float64}, alerts.NewMetrics(prometheus.NewRegistry()),
		func([]ledger.StatusChange) {}, slog.New(slog.DiscardHandler))
	c.past = past
	return c
}

// roundLeavesNoneDue runs one round of c and fails the test unless a version was promoted
// during it (promoted, set by the test's hooks) and no CE of l is left due at a version past
// keeps.
func roundLeavesNoneDue(t *testing.T, c *confirmer, l *ledger.Ledger, past map[uint64]*bnn.Model, promoted *bool) {
	t.Helper()
	if err := c.round(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !*promoted {
		t.Fatal("no version was promoted during the round")
	}
	if n := lapsedKept(t, l, past); len(n) > 0 {
		t.Errorf("the round ended with lapsed certificates it keeps the lapse version of, by version: %v", n)
	}
}

// pointConfirmer is a confirmer of l whose current posterior is *m and whose past posteriors are
// past's (a replica's, c.points to be set by the test), drawing 200 networks.
func pointConfirmer(l *ledger.Ledger, m **bnn.Model, past map[uint64]*bnn.Model, log *slog.Logger) *confirmer {
	c := newConfirmer(l, func() *bnn.Model { return *m }, &pools{samples: 200, prec: bnn.Float64}, alerts.NewMetrics(prometheus.NewRegistry()),
		func([]ledger.StatusChange) {}, log)
	c.past = func(v uint64) *bnn.Model { return past[v] }
	return c
}

// TestConfirmerMeasuresWhileTheLogMarksNoPoint: a replica whose posterior log marks no
// confirmation point (its updater is of a build that does not mark them, during a rolling
// upgrade) still measures its lapsed certificates, under the newest posterior as a single node
// does, rather than none until the log marks one.
func TestConfirmerMeasuresWhileTheLogMarksNoPoint(t *testing.T) {
	l, m := lapsingLedger(t)
	past := map[uint64]*bnn.Model{m.Version: m}
	for range 4 {
		m = driftStep(t, l, m)
		past[m.Version] = m
	}
	c := pointConfirmer(l, &m, past, slog.New(slog.DiscardHandler))
	head := &postlog.Head{Version: m.Version, PointsKept: true} // no point marked
	c.points = func() ledger.Points { return head }
	if err := c.round(context.Background()); err != nil {
		t.Fatal(err)
	}
	st, err := l.State()
	if err != nil {
		t.Fatal(err)
	}
	if c.measured.Load() == 0 || st.Pending != 0 {
		t.Errorf("%d measurements, %d certificates still renewal_pending: a log without points stops the confirmer", c.measured.Load(), st.Pending)
	}
}

// TestConfirmerSaysWhenItFellBehindThePointsKept: a confirmer that left nothing due at point 2
// and next reads a head that knows only the points after 5 (it keeps the latest 256) logs that
// it fell behind them, once while it stays behind.
func TestConfirmerSaysWhenItFellBehindThePointsKept(t *testing.T) {
	l, m := lapsingLedger(t)
	past := map[uint64]*bnn.Model{m.Version: m}
	var logs bytes.Buffer
	c := pointConfirmer(l, &m, past, slog.New(slog.NewTextHandler(&logs, nil)))
	for _, step := range []struct {
		head   *postlog.Head
		warned int
	}{
		{&postlog.Head{Version: m.Version + 2, Points: []uint64{m.Version + 2}, PointsKept: true}, 0},
		{&postlog.Head{Version: m.Version + 7, Points: []uint64{m.Version + 6}, PointsAfter: m.Version + 5, PointsKept: true}, 1},
		{&postlog.Head{Version: m.Version + 8, Points: []uint64{m.Version + 6, m.Version + 8}, PointsAfter: m.Version + 5, PointsKept: true}, 1},
	} {
		c.points = func() ledger.Points { return step.head }
		if err := c.round(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := strings.Count(logs.String(), "fell behind"); got != step.warned {
			t.Fatalf("head %+v: %d lines saying the confirmer fell behind, want %d:\n%s", step.head, got, step.warned, logs.String())
		}
	}
}

// TestPointRoundPutsOffAReadWithNoNewPoint: a round that finds no point since the last read that
// left nothing due reads again no sooner than confirmDueReadEvery times that read took, and
// wakes the confirmer then; a new point is read at once.
func TestPointRoundPutsOffAReadWithNoNewPoint(t *testing.T) {
	l, m := lapsingLedger(t)
	past := map[uint64]*bnn.Model{m.Version: m}
	c := pointConfirmer(l, &m, past, slog.New(slog.DiscardHandler))
	head := &postlog.Head{Version: m.Version + 2, Points: []uint64{m.Version + 2}, PointsKept: true}
	c.points = func() ledger.Points { return head }
	round := func() int64 {
		t.Helper()
		before := c.dueReads.Load()
		if err := c.round(context.Background()); err != nil {
			t.Fatal(err)
		}
		return c.dueReads.Load() - before
	}
	if n := round(); n == 0 {
		t.Fatal("the first round read nothing")
	}
	// A last read of a minute puts the next off for ten: the round comes well within that on
	// any schedule (after the first round's last read came a write transaction, an fsync).
	c.lastRead = time.Minute
	if n := round(); n != 0 {
		t.Fatalf("a round with no new point read %d times within confirmDueReadEvery times the last read", n)
	}
	select {
	case <-c.wake:
		t.Fatal("the confirmer was woken at once, not when the read put off comes due")
	default:
	}
	if c.later == nil || !c.later.Stop() {
		t.Fatal("the round put its read off without setting a wake for it")
	}
	c.later.Reset(time.Millisecond) // the read put off comes due
	waitfor.Cond(t, 10*time.Second, "the wake of the read put off", func() bool {
		select {
		case <-c.wake:
			return true
		default:
			return false
		}
	})
	c.later.Stop()
	head = &postlog.Head{Version: m.Version + 3, Points: []uint64{m.Version + 2, m.Version + 3}, PointsKept: true}
	c.lastReadAt = time.Now()
	if n := round(); n == 0 {
		t.Fatal("a round with a new point did not read")
	}
}

// TestConfirmerBusyWithinThePointsKeptSaysNothing: a confirmer whose round measures CEs at every
// read through a drift, each read while the head still keeps the points its CEs are due at (here
// the latest 2), has not fallen behind the points kept and logs nothing of it, though no read of
// the round leaves nothing due.
func TestConfirmerBusyWithinThePointsKeptSaysNothing(t *testing.T) {
	l, m := lapsingLedger(t)
	past := map[uint64]*bnn.Model{m.Version: m}
	var logs bytes.Buffer
	c := pointConfirmer(l, &m, past, slog.New(slog.NewTextHandler(&logs, nil)))
	m = driftStep(t, l, m)
	past[m.Version] = m
	// The head keeps the latest 2 points, one at every version after the first.
	v1 := m.Version
	headAt := func(v uint64) *postlog.Head {
		h := &postlog.Head{Version: v, Points: []uint64{v}, PointsAfter: v1 - 1, PointsKept: true}
		if v > v1 {
			h.Points, h.PointsAfter = []uint64{v - 1, v}, max(v1, v-1)-1
		}
		return h
	}
	head := headAt(v1)
	c.points = func() ledger.Points { return head }
	if err := c.round(context.Background()); err != nil {
		t.Fatal(err)
	}
	const steps = 6
	var reads, rounds int
	c.points = func() ledger.Points {
		// Each read of the round comes after the next version of the drift, a point.
		if reads < steps {
			m = driftStep(t, l, m)
			past[m.Version] = m
			head = headAt(m.Version)
		}
		reads++
		return head
	}
	before := c.dueMeasured.Load()
	for reads < steps {
		if err := c.round(context.Background()); err != nil {
			t.Fatal(err)
		}
		rounds++
	}
	t.Logf("%d measurements in %d rounds, %d reads, %d inexact", c.dueMeasured.Load()-before, rounds, reads, c.inexact.Load())
	if c.inexact.Load() != 0 {
		t.Fatalf("%d inexact measurements: the drift outran the points kept", c.inexact.Load())
	}
	if got := strings.Count(logs.String(), "fell behind"); got != 0 {
		t.Errorf("%d lines saying the confirmer fell behind, though it measured every CE at its point while the head kept it:\n%s", got, logs.String())
	}
}
