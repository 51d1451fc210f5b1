package daemon

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
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
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	dir := t.TempDir()
	cfg := func(c *config.Config) { c.StateDir = dir }
	held := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(held) }) }
	t.Cleanup(release)
	hold := func(o *Options) {
		o.Hooks.ConfirmRound = func(ctx context.Context) {
			select {
			case <-held:
			case <-ctx.Done():
			}
		}
	}
	// The default learner; the confirmer is held, so
	// that the certificates wait across the restart.
	r := startReadyReplica(t, b, "r1", key, cfg, hold)
	data := daemontest.Bundled(t)
	ids := daemontest.RegisterCEs(t, r, data, 20, "")
	// 32 benign rows labelled malignant lapse certificates; then malignant rows labelled so,
	// which the drifted posterior agrees with, move it little: the newest posterior stays near
	// the version the certificates lapsed at.
	var agree [][]byte
	for i := range data.X {
		if data.Y[i] == 0 && len(agree) < 64 {
			agree = append(agree, daemontest.Record(fmt.Sprintf("agree%d", i), data.X[i], 0))
		}
	}
	for _, part := range [][][]byte{daemontest.Flipped(data, 32), agree[:4]} {
		want := r.Metric(t, "cfguard_records_total", "result", "applied") + float64(len(part))
		r.Produce(t, part...)
		waitfor.Cond(t, 60*time.Second, "the records applied", func() bool {
			return r.Metric(t, "cfguard_records_total", "result", "applied") == want
		})
	}
	before := map[uint64]*bnn.Model{}
	last := r.D.current().Version
	for v := range last + 1 {
		if m := r.D.served.at(v); m != nil {
			before[v] = m
		}
	}
	since := map[string]uint64{}
	for _, id := range ids {
		ce, err := r.D.ledger.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		if ce.RenewalPendingSince != nil {
			since[id] = *ce.RenewalPendingSince
		}
	}
	r.Stop(t)

	r = startReadyReplica(t, b, "r1", key, cfg, nil)
	if r.D.current().Version != last {
		t.Fatalf("restarted at version %d, stopped at %d: the test needs no increment between", r.D.current().Version, last)
	}
	waitfor.Cond(t, 60*time.Second, "the posteriors served before the start recalled", func() bool {
		select {
		case <-r.D.recalled:
			return true
		default:
			return false
		}
	})
	for v, m := range before {
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
	waitfor.Cond(t, 60*time.Second, "every lapsed certificate measured", func() bool {
		return r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 && r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0
	})
	pol := r.D.ledger.Policy()
	atLapse := 0
	for id, u := range since {
		kl, _, err := certify.KL(before[last], before[u])
		if err != nil {
			t.Fatal(err)
		}
		want := last
		if pol.Slack(kl).Mean <= confirmPoolSlack {
			want = u
		}
		ce, err := r.D.ledger.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		// Its first measurement since it lapsed: a renewal (certified to certified) or a verdict.
		var at uint64
		found := false
		for _, h := range ce.History {
			if h.From == certify.Certified && h.PosteriorVersion >= u {
				at, found = h.PosteriorVersion, true
				break
			}
		}
		if !found || at != want {
			t.Errorf("%s lapsed at %d (KL from it to the newest %.3g): measured at %d (found %v), want %d", id, u, kl, at, found, want)
		}
		if want == u && u < last {
			atLapse++
		}
	}
	t.Logf("%d certificates lapsed before the restart at versions up to %d; %d measured at their lapse version after it", len(since), last, atLapse)
	if atLapse == 0 {
		t.Fatal("no lapsed certificate was within the pool slack of its lapse version: the test shows nothing")
	}
}
