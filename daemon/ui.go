package daemon

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/ui"
)

// uiSource is what the web UI reads, through the API's own readers: the pages show what the
// JSON endpoints answer.
type uiSource struct {
	a     *api
	alpha float64 // certify.verdict_alpha
	// metrics is the daemon's registry, whose gauges the overview evaluates the alerts'
	// conditions on; nil: no conditions are shown.
	metrics prometheus.Gatherer
}

// Snapshot reads GET /v1/model's figures at one posterior version.
func (s uiSource) Snapshot(ctx context.Context) (ui.Snapshot, error) {
	var snap ui.Snapshot
	err := s.a.core.snapshot(func(m *bnn.Model) error {
		st, err := s.a.state.State()
		if err != nil {
			return err
		}
		hist, err := s.a.state.KLHistory(100)
		if err != nil {
			return err
		}
		snap = ui.Snapshot{PosteriorVersion: m.Version, Features: m.Features, Classes: m.Classes, Budget: s.a.cfg.budget,
			Delta: s.a.cfg.delta, Epsilon: s.a.cfg.epsilon, EpsilonMax: s.a.cfg.epsilonMax, Alpha: s.alpha, Mode: s.a.cfg.mode, State: st, History: hist}
		return nil
	})
	if err != nil {
		return ui.Snapshot{}, err
	}
	snap.Gauges = s.gauges()
	snap.Replication = s.a.core.replication(ctx)
	snap.Quality = s.a.core.prequential()
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second) // as /readyz waits
	if err := s.a.core.readiness(rctx); err != nil {
		snap.NotReady = err.Error()
	}
	cancel()
	snap.Now = time.Now()
	return snap, nil
}

// List reads a page as GET /v1/counterfactuals does: on a replica, the whole cluster's, which
// the other replicas answer with the API's token.
func (s uiSource) List(ctx context.Context, st certify.Status, limit int, after string) ([]*ledger.CE, string, error) {
	auth := ""
	if s.a.cfg.token != "" {
		auth = "Bearer " + s.a.cfg.token
	}
	ces, next, err := s.a.core.list(ctx, st, limit, after, auth, false, nil)
	return ces, next, notYet(err)
}

// notYet marks the errors of a replica that will answer in a moment (a partition without an
// owner, or still being rebuilt) as ui.ErrNotYet, and those of a blocked partition, which will
// not, as ui.ErrBlocked.
func notYet(err error) error {
	if errors.Is(err, cluster.ErrBlocked) {
		return fmt.Errorf("%w: %w", ui.ErrBlocked, err)
	}
	if errors.Is(err, ceshare.ErrNoOwner) || errors.Is(err, cluster.ErrRebuilding) {
		return fmt.Errorf("%w: %w", ui.ErrNotYet, err)
	}
	return err
}

// Get reads a CE as GET /v1/counterfactuals/{id} does: from its owner on a replica, which the
// request reaches with the API's token.
func (s uiSource) Get(ctx context.Context, id string) (*ledger.CE, error) {
	auth := ""
	if s.a.cfg.token != "" {
		auth = "Bearer " + s.a.cfg.token
	}
	ce, _, err := s.a.core.find(ctx, id, auth, false)
	return ce, notYet(err)
}

func (s uiSource) Events(n int) ([]ledger.OutboxEntry, error) { return s.a.state.OutboxNewest(n) }

func (s uiSource) Publishing() ui.Publishing {
	if s.a.publishing != nil {
		if p := s.a.publishing.Load(); p != nil {
			return *p
		}
	}
	return ui.Publishing{}
}

// gauges reads every gauge and counter of the registry by series (see ui.Snapshot.Gauges); nil
// when there is no registry or it cannot be read (the overview then shows no conditions).
func (s uiSource) gauges() map[string]float64 {
	if s.metrics == nil {
		return nil
	}
	mfs, err := s.metrics.Gather()
	if err != nil {
		return nil
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			key := mf.GetName()
			if len(m.GetLabel()) > 0 {
				var ls []string
				for _, l := range m.GetLabel() {
					ls = append(ls, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
				}
				key += "{" + strings.Join(ls, ",") + "}"
			}
			switch {
			case m.GetGauge() != nil:
				out[key] = m.GetGauge().GetValue()
			case m.GetCounter() != nil:
				out[key] = m.GetCounter().GetValue()
			}
		}
	}
	return out
}
