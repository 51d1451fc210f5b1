package daemon

import (
	"slices"
	"sync"

	"github.com/cfguard/cfguard/bnn"
)

// recentPosteriors is how many of the last posteriors the daemon served it keeps in memory, for
// the confirmer to measure a lapsed certificate under the version its bound lapsed at.
const recentPosteriors = 256

// recent keeps the last posteriors the daemon served, by version. A posterior is never changed
// once served, and the learner changes only the last layer, so a kept posterior's layers that
// equal those of the one kept before it share that one's arrays: the memory per version is about
// one last layer, not one network. It is memory only: after a restart it holds the posteriors
// served since. A nil recent keeps none.
type recent struct {
	mu   sync.Mutex
	keep int
	byV  map[uint64]*bnn.Model
	last *bnn.Model // the last one kept
}

func newRecent(keep int) *recent { return &recent{keep: keep, byV: map[uint64]*bnn.Model{}} }

// add keeps m, and forgets the versions keep or more below it.
func (r *recent) add(m *bnn.Model) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	m = sharing(m, r.last)
	r.byV[m.Version], r.last = m, m
	for v := range r.byV {
		if v+uint64(r.keep) <= m.Version {
			delete(r.byV, v)
		}
	}
}

// recall keeps m, a posterior served before the daemon started (found again in the posterior
// log), unless it holds that version already or m is keep or more versions below the newest
// it holds. Its layers that equal those of the kept version after it share that version's
// arrays, as add's do with the one before.
func (r *recent) recall(m *bnn.Model) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.byV[m.Version]; ok || r.last == nil || m.Version+uint64(r.keep) <= r.last.Version {
		return
	}
	r.byV[m.Version] = sharing(m, r.byV[m.Version+1])
}

// sharing is m with each layer equal, bit for bit, to the same layer of kept (nil: none) replaced
// by kept's, so that the two share its arrays.
func sharing(m, kept *bnn.Model) *bnn.Model {
	if kept == nil || len(kept.Layers) != len(m.Layers) {
		return m
	}
	c := *m
	c.Layers = slices.Clone(m.Layers)
	for i, l := range c.Layers {
		if k := kept.Layers[i]; l.Name == k.Name && bnn.LayersEqual(&l, &k) {
			c.Layers[i] = k
		}
	}
	return &c
}

// at is the posterior of version v, nil when it is not kept.
func (r *recent) at(v uint64) *bnn.Model {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.byV[v]
}
