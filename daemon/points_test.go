package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
)

// TestOwnersPublishTheStatusesOfTheLog: two replicas share the CE partitions; a drift of
// flipped labels, in bursts whose last version the log marks as a point, fails the CEs' bounds.
// r1 measures its CEs as the points come; r2 measures its own at the first burst's points, then
// measures nothing (its confirmers held) through two more bursts and stops, so that r1 takes over
// r2's CEs with their measurements at those points still to make. Every status change the
// events topic holds, from either owner, is one that a reference computes from the posterior log
// alone: a ledger that commits the log's posteriors version by version and, at each of its
// confirmation points, measures every CE that waits under that point's posterior with that
// version's draws (Confirm). Each CE's changes (from, to, version) are the same, in the same
// order, none missing and none more (a change published by both owners counts once).
//
// In the second run r2's confirmers measure through the two bursts, but its outbox publishes
// nothing of them (every attempt fails, as a broker that refuses would), and r2 stops with those
// changes unpublished, as an owner that dies between its commit and its publish: r1, restoring
// the states r2 wrote before (a state goes only after its events), makes the same changes at the
// same points and publishes them.
func TestOwnersPublishTheStatusesOfTheLog(t *testing.T) {
	if testing.Short() {
		t.Skip("two replicas through a drift: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	for _, hold := range []string{"confirmer", "events"} {
		t.Run(hold+" held", func(t *testing.T) {
			t.Parallel()
			ownersPublishTheStatusesOfTheLog(t, hold == "events")
		})
	}
}

func ownersPublishTheStatusesOfTheLog(t *testing.T, holdEvents bool) {
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	cfg := func(id string) func(c *config.Config) {
		return func(c *config.Config) {
			daemontest.ReplicaConfig(c, b.Addrs(), id, key)
			daemontest.PaperLearner(c, 5e-4)
			c.Certify.Samples = 400
			c.Audit.Schedule = ""
			c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog = 32, 32
			c.Kafka.MaxWait = 300 * time.Millisecond
		}
	}
	r1 := startDaemonWith(t, cfg("r1"), nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r1.Get(t, "/readyz"); return code == 200 })
	var (
		hold atomic.Bool  // r2's confirmers wait before their next round while set, or its outbox fails
		held atomic.Int32 // r2's confirmer lanes waiting
	)
	r2 := startDaemonWith(t, cfg("r2"), func(o *Options) {
		o.Hooks.OutboxPublish = func(context.Context) error {
			if holdEvents && hold.Load() {
				return errors.New("held by the test")
			}
			return nil
		}
		o.Hooks.ConfirmRound = func(ctx context.Context) {
			if holdEvents {
				return
			}
			if !hold.Load() {
				return
			}
			held.Add(1)
			defer held.Add(-1)
			for hold.Load() && ctx.Err() == nil {
				time.Sleep(10 * time.Millisecond)
			}
		}
	}, nil)
	parts := r1.D.Share().Partitions()
	waitfor.Cond(t, 90*time.Second, "the CE partitions shared by r1 and r2", func() bool {
		n1, n2 := len(r1.D.Share().Member().Owned()), len(r2.D.Share().Member().Owned())
		return daemontest.ShareReady(r1) && daemontest.ShareReady(r2) && n1 > 0 && n2 > 0 && n1+n2 == parts
	})
	reps := []*running{r1, r2}
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r1, data, 40, "")
	start := map[string]*ledger.CE{}
	for _, id := range ids {
		ce := daemontest.Settled(t, b, reps, id)
		if ce == nil {
			t.Fatalf("%s is stored at no owner", id)
		}
		start[id] = ce
	}
	v0 := r1.D.Posterior().Version
	moved := map[string]bool{} // the CEs r2 owns
	for _, id := range ids {
		if ce, err := r2.D.Ledger().Get(id); err == nil && ce != nil {
			moved[id] = true
		}
	}
	if len(moved) == 0 || len(moved) == len(ids) {
		t.Fatalf("r2 owns %d of the %d CEs: the handover would move none or all", len(moved), len(ids))
	}

	// The drift, in bursts of 64 records (two increments), each applied and marked a point
	// before the next.
	drift := daemontest.Flipped(data, 320)
	applied := func(r *running) float64 { return r.Metric(t, "cfguard_records_total", "result", "applied") }
	burst := func(from, to int) {
		t.Helper()
		for lo := from; lo < to; lo += 64 {
			r1.Produce(t, drift[lo:lo+64]...)
			waitfor.Cond(t, 60*time.Second, fmt.Sprintf("records to %d applied and marked a point", lo+64), func() bool {
				h := r1.D.rep.Head()
				return applied(r1) == float64(lo+64) && h.IsPoint(h.Version) && r1.D.Posterior().Version == h.Version
			})
		}
	}
	measured := func(r *running) (n int64) {
		for _, c := range r.D.confirm {
			n += c.measured.Load()
		}
		return n
	}
	nothingDue := func(r *running) bool {
		due, err := r.D.Ledger().DueAtPoints(1<<20, 0, 1, r.D.served.at, r.D.rep.Head())
		return err == nil && len(due.Measure) == 0 && len(due.Again) == 0
	}
	// r has followed the log to r1's head and committed its version: nothing due at r's head is
	// then nothing due at the log's points. r2 follows the log apart from r1, and while it has
	// not yet committed a burst's versions nothing is due in its ledger either.
	followed := func(r *running) bool {
		h := r.D.rep.Head()
		return h.Hash == r1.D.rep.Head().Hash && r.D.Posterior().Version == h.Version
	}
	// The first burst measured and published by both owners; then, for two more bursts, r2's
	// confirmers held, each parked before a round (woken so that none is within one), or its
	// outbox failing.
	burst(0, 64)
	waitfor.Cond(t, 60*time.Second, "r2 at the log's head, its CEs measured at the first points", func() bool {
		return followed(r2) && nothingDue(r2) && r2.Metric(t, "cfguard_events_pending") == 0
	})
	heldFrom := r1.D.Posterior().Version
	hold.Store(true)
	if !holdEvents {
		r2.D.confirm.notify()
		waitfor.Cond(t, 30*time.Second, "r2's confirmers held", func() bool { return held.Load() == int32(len(r2.D.confirm)) })
	}
	before := measured(r2) // r2's confirmers parked, or its outbox failing: what it measures next is held
	burst(64, 192)
	if n := measured(r2) - before; !holdEvents && n != 0 {
		t.Fatalf("r2 measured %d CEs while held", n)
	}
	if holdEvents {
		waitfor.Cond(t, 60*time.Second, "r2 at the log's head, its CEs measured at the points of the held bursts, unpublished", func() bool {
			return followed(r2) && nothingDue(r2) && measured(r2) > before && r2.Metric(t, "cfguard_events_pending") > 0
		})
	}
	stoppedAt := r1.D.Posterior().Version
	r2.Stop(t)
	waitfor.Cond(t, 90*time.Second, "r1 owning every CE partition", func() bool {
		return daemontest.ShareReady(r1) && len(r1.D.Share().Member().Owned()) == parts
	})
	burst(192, 320)
	// Done: the log's head is a point, r1 serves it, and no CE is due at any point.
	waitfor.Cond(t, 120*time.Second, "the drift applied, its last version a point, and nothing due at a point", func() bool {
		if applied(r1) < 320 {
			return false
		}
		head := r1.D.rep.Head()
		if !head.IsPoint(head.Version) || r1.D.Posterior().Version != head.Version {
			return false
		}
		due, err := r1.D.Ledger().DueAtPoints(1<<20, 0, 1, r1.D.served.at, head)
		if err != nil {
			t.Fatal(err)
		}
		return len(due.Measure) == 0 && len(due.Again) == 0 && r1.Metric(t, "cfguard_events_pending") == 0
	})
	head := r1.D.rep.Head()
	points, known := head.PointsIn(v0, head.Version)
	if !known {
		t.Fatalf("r1's head does not know the points after version %d: %+v", v0, head)
	}
	if inexact := r1.D.confirm[0].inexact.Load(); inexact != 0 {
		t.Errorf("r1 measured %d CEs at an inexact point", inexact)
	}

	want := referenceChanges(t, r1, start, v0, head.Version, points)
	got := map[string][]string{}
	by := map[string][]string{} // change (id, from>to@version) -> the replicas that published it
	for _, m := range kafkatest.ReadPartition(t, b.Addrs(), r1.Config.Kafka.EventsTopic, 0) {
		var e Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type != "status_changed" || start[e.ID] == nil {
			continue
		}
		c := fmt.Sprintf("%s>%s@%d", e.From, e.To, e.PosteriorVersion)
		if !slices.Contains(got[e.ID], c) { // published by both owners: once
			got[e.ID] = append(got[e.ID], c)
		}
		by[e.ID+" "+c] = append(by[e.ID+" "+c], kafkatest.Header(m, ReplicaHeader))
	}
	changes, ofMoved, early := 0, 0, 0
	for _, id := range ids {
		if !slices.Equal(got[id], want[id]) {
			t.Errorf("%s: the owners published %v; the log gives %v", id, got[id], want[id])
		}
		changes += len(want[id])
		if moved[id] {
			ofMoved += len(want[id])
			for _, c := range want[id] {
				var v uint64
				if _, err := fmt.Sscanf(c[strings.LastIndexByte(c, '@')+1:], "%d", &v); err == nil && v > heldFrom && v <= stoppedAt {
					early++ // a change at a point r2 held back: r1 made it after the handover
					if pub := by[id+" "+c]; !slices.Equal(pub, []string{"r1"}) {
						t.Errorf("%s %s, held back by r2, published by %v; want r1 alone", id, c, pub)
					}
				}
			}
		}
	}
	t.Logf("versions %d to %d, points %v: %d status changes of %d CEs; %d of the %d CEs r2 owned, %d of them at points r2 held back (%d to %d)",
		v0, head.Version, points, changes, len(ids), ofMoved, len(moved), early, heldFrom+1, stoppedAt)
	if changes == 0 || early == 0 {
		t.Fatalf("%d status changes, %d of CEs that moved at points before the handover: the drift tells nothing", changes, early)
	}
}

// referenceChanges is every CE's status changes (from>to@version) that a ledger computes from the
// posterior log alone: it stores the CEs as they were registered under version v0, commits the
// posteriors of versions v0+1 to last (as r serves them), and at each point measures every CE
// that waits under it with the version's draws (r's pools) until none does.
func referenceChanges(t *testing.T, r *running, start map[string]*ledger.CE, v0, last uint64, points []uint64) map[string][]string {
	t.Helper()
	ctx := context.Background()
	d := r.D
	l, err := ledger.Open(t.TempDir(), ledger.Options{Policy: d.policy, Logger: slog.New(slog.DiscardHandler), MCBatch: backgroundBatch,
		VerdictAlpha: d.cfg.Certify.VerdictAlpha, AdmitByEvidence: true, Past: d.served.at})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	at := func(v uint64) *bnn.Model {
		m := d.served.at(v)
		if m == nil {
			t.Fatalf("r1 no longer holds the posterior of version %d", v)
		}
		return m
	}
	out := map[string][]string{}
	record := func(changes []ledger.StatusChange) {
		for _, c := range changes {
			if c.From != c.To {
				out[c.ID] = append(out[c.ID], fmt.Sprintf("%s>%s@%d", c.From, c.To, c.PosteriorVersion))
			}
		}
	}
	if _, _, err := l.Commit(ctx, &ledger.Checkpoint{Model: at(v0)}); err != nil {
		t.Fatal(err)
	}
	var ces []*ledger.CE
	for _, ce := range start {
		if ce.AnchorVersion != v0 || ce.Status != certify.Certified {
			t.Fatalf("%s registered %v under version %d, not certified under %d", ce.ID, ce.Status, ce.AnchorVersion, v0)
		}
		ces = append(ces, &ledger.CE{ID: ce.ID, X: ce.X, XCF: ce.XCF, Target: ce.Target, AnchorVersion: v0, P1: ce.P1, Var1: ce.Var1,
			Samples: ce.Samples, Delta: ce.Delta, Epsilon: ce.Epsilon, CreatedAt: ce.CreatedAt})
	}
	if err := l.Put(ctx, ces...); err != nil {
		t.Fatal(err)
	}
	for v := v0 + 1; v <= last; v++ {
		q := at(v)
		_, changes, err := l.Commit(ctx, &ledger.Checkpoint{Model: q})
		if err != nil {
			t.Fatal(err)
		}
		record(changes)
		if !slices.Contains(points, v) {
			continue
		}
		pool, err := d.pools.get(q)
		if err != nil {
			t.Fatal(err)
		}
		for range 100 {
			rep, changes, err := l.Confirm(ctx, backgroundPredictor{pool, q}, 1000)
			if err != nil {
				t.Fatal(err)
			}
			record(changes)
			if rep.Confirmed == 0 || !rep.More {
				break
			}
		}
	}
	return out
}

// TestUpdaterMarksAQuietHeadAPoint: an updater whose increments close while its consumer seems
// behind (a test says so, as a transaction marker fetched only after the increment closed would
// make it) leaves a version that is not a point; once no record came for kafka.max_wait, it
// appends an increment of no records that marks that version, and the CEs due there are measured.
func TestUpdaterMarksAQuietHeadAPoint(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica through a drift: not with -short")
	}
	t.Parallel() // mostly waits for the group and kafka.max_wait
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r := startDaemonWith(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", key)
		daemontest.PaperLearner(c, 1e-3)
		c.Certify.Samples = 400
		c.Audit.Schedule = ""
		c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog = 32, 32
		c.Kafka.MaxWait = 300 * time.Millisecond
	}, func(o *Options) {
		o.Hooks.UpdaterCaughtUp = func(stream.Stats) bool { return false }
	}, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 10, "")
	r.Produce(t, daemontest.Flipped(data, 64)...) // two full increments: versions 1 and 2, neither marked
	waitfor.Cond(t, 60*time.Second, "the head's version marked a point after the input went quiet", func() bool {
		h := r.D.rep.Head()
		return h.Version == 2 && h.IsPoint(2) && r.D.Posterior().Version == 2
	})
	h := r.D.rep.Head()
	if h.IsPoint(1) {
		t.Errorf("version 1 is a point: %v; the hook says no increment closed caught up", h.Points)
	}
	waitfor.Cond(t, 60*time.Second, "the CEs due at point 2 measured", func() bool {
		due, err := r.D.Ledger().DueAtPoints(1<<20, 0, 1, r.D.served.at, r.D.rep.Head())
		return err == nil && len(due.Measure) == 0 && len(due.Again) == 0
	})
	measuredAt2 := 0
	for _, id := range ids {
		ce, err := r.D.Ledger().Get(id)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range ce.History {
			if c.PosteriorVersion == 2 {
				measuredAt2++
			}
		}
	}
	if measuredAt2 == 0 {
		t.Fatalf("no CE's history has a change at point 2: the drift tells nothing")
	}
}
