package daemon

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// A replica restarted from its ledger recalls, from the posterior log, the posteriors it served
// before its start, layer for layer the same, and its confirmer waits for them: a certificate
// whose bound lapsed before the restart is measured under its lapse version, as it would have
// been without the restart, whenever that version is within the pool slack of the newest
// posterior, and under the newest otherwise.
func TestRestartedReplicaMeasuresAtVersionsServedBeforeItsStart(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica, a drift and a restart: not with -short")
	}
	t.Parallel()
	s := lapsedAcrossAStop(t)
	r := startReadyReplica(t, s.b, "r1", s.key, s.cfg, nil)
	if r.D.current().Version != s.last {
		t.Fatalf("restarted at version %d, stopped at %d: the test needs no increment between", r.D.current().Version, s.last)
	}
	waitfor.Cond(t, 60*time.Second, "the posteriors served before the start recalled", func() bool { return recalled(r) })
	for v, m := range s.before {
		got := r.D.served.at(v)
		if got == nil {
			t.Fatalf("version %d, served before the restart, is not held after it", v)
		}
		for i := range m.Layers {
			if got.Version != v || !bnn.LayersEqual(&got.Layers[i], &m.Layers[i]) {
				t.Fatalf("version %d recalled: layer %d differs from the one served before the restart", v, i)
			}
		}
	}
	// The confirmer measures every lapsed certificate: under its lapse version when that is near.
	atLapse := s.measuredAt(t, r, func(u uint64, kl float64) uint64 {
		if r.D.ledger.Policy().Slack(kl).Mean <= confirmPoolSlack {
			return u
		}
		return s.last
	})
	t.Logf("%d certificates lapsed before the restart at versions up to %d; %d measured at their lapse version after it", len(s.since), s.last, atLapse)
	if atLapse == 0 {
		t.Fatal("no lapsed certificate was within the pool slack of its lapse version: the test shows nothing")
	}
}

// The confirmers of a restarted replica wait for its recall of the posteriors served before its
// start for recallWait at most: with the recall held (a long log, a broker that does not answer),
// they measure the lapsed certificates under the newest posterior once the wait is over, and the
// recall, once it goes on, still keeps those posteriors.
func TestRestartedReplicaConfirmsWhenItsRecallIsLate(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica, a drift and a restart: not with -short")
	}
	t.Parallel()
	s := lapsedAcrossAStop(t)
	held := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(held) }) }
	t.Cleanup(release)
	r := startReadyReplica(t, s.b, "r1", s.key, s.cfg, func(o *Options) {
		o.Hooks.RecallWait = 2 * time.Second
		o.Hooks.Recall = func(ctx context.Context) {
			select {
			case <-held:
			case <-ctx.Done():
			}
		}
	})
	s.measuredAt(t, r, func(uint64, float64) uint64 { return s.last })
	if recalled(r) {
		t.Fatal("the recall was done while it was held")
	}
	release()
	waitfor.Cond(t, 60*time.Second, "the posteriors served before the start recalled", func() bool { return recalled(r) })
	for v := range s.before {
		if r.D.served.at(v) == nil {
			t.Fatalf("version %d, served before the restart, is not held after the late recall", v)
		}
	}
}

// stoppedReplica is a replica stopped with lapsed certificates waiting (lapsedAcrossAStop).
type stoppedReplica struct {
	b      *broker.Broker
	key    string
	cfg    func(c *config.Config)
	before map[uint64]*bnn.Model // the posteriors it served, by version
	last   uint64                // the version it stopped at
	since  map[string]uint64     // the lapse version of each lapsed certificate
}

// lapsedAcrossAStop runs replica r1 of a new cluster, with its confirmer held, while a drift
// lapses the certificates of 20 CEs at one version and a few records the drifted posterior agrees
// with move it a little further (so that the newest posterior stays near that version), and
// stops it: a restart on its state directory finds the certificates waiting.
func lapsedAcrossAStop(t *testing.T) *stoppedReplica {
	t.Helper()
	s := &stoppedReplica{b: daemontest.StartCluster(t, 1), key: daemontest.WriteKeyFile(t, daemontest.ClusterKey)}
	dir := t.TempDir()
	s.cfg = func(c *config.Config) { c.StateDir = dir }
	held := make(chan struct{})
	defer close(held)
	r := startReadyReplica(t, s.b, "r1", s.key, s.cfg, func(o *Options) {
		o.Hooks.ConfirmRound = func(ctx context.Context) {
			select {
			case <-held:
			case <-ctx.Done():
			}
		}
	})
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 20, "")
	var agree [][]byte
	for i := range data.X {
		if data.Y[i] == 0 && len(agree) < 4 {
			agree = append(agree, daemontest.Record(fmt.Sprintf("agree%d", i), data.X[i], 0))
		}
	}
	for _, part := range [][][]byte{daemontest.Flipped(data, 32), agree} {
		want := r.Metric(t, "cfguard_records_total", "result", "applied") + float64(len(part))
		r.Produce(t, part...)
		waitfor.Cond(t, 60*time.Second, "the records applied", func() bool {
			return r.Metric(t, "cfguard_records_total", "result", "applied") == want
		})
	}
	s.before, s.last, s.since = map[uint64]*bnn.Model{}, r.D.current().Version, map[string]uint64{}
	for v := range s.last + 1 {
		if m := r.D.served.at(v); m != nil {
			s.before[v] = m
		}
	}
	for _, id := range ids {
		ce, err := r.D.ledger.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		if ce.RenewalPendingSince != nil {
			s.since[id] = *ce.RenewalPendingSince
		}
	}
	if len(s.since) == 0 {
		t.Fatal("the drift lapsed no certificate: the test shows nothing")
	}
	r.Stop(t)
	return s
}

// measuredAt waits until r's confirmer has measured every lapsed certificate of s, and checks
// that each was first measured since it lapsed (a renewal or a verdict) at want(its lapse
// version, the KL from it to the newest posterior); it returns how many were measured at a
// lapse version older than the newest.
func (s *stoppedReplica) measuredAt(t *testing.T, r *running, want func(u uint64, kl float64) uint64) (atLapse int) {
	t.Helper()
	waitfor.Cond(t, 60*time.Second, "every lapsed certificate measured", func() bool {
		return r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 && r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0
	})
	for id, u := range s.since {
		kl, _, err := certify.KL(s.before[s.last], s.before[u])
		if err != nil {
			t.Fatal(err)
		}
		w := want(u, kl)
		ce, err := r.D.ledger.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		at, found := uint64(0), false
		for _, h := range ce.History {
			if h.From == certify.Certified && h.PosteriorVersion >= u {
				at, found = h.PosteriorVersion, true
				break
			}
		}
		if !found || at != w {
			t.Errorf("%s lapsed at %d (KL from it to the newest %.3g): measured at %d (found %v), want %d", id, u, kl, at, found, w)
		}
		if w == u && u < s.last {
			atLapse++
		}
	}
	return atLapse
}

// recalled says whether r's recall of the posteriors it served before its start is done.
func recalled(r *running) bool {
	select {
	case <-r.D.recalled:
		return true
	default:
		return false
	}
}
