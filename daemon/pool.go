package daemon

import (
	"sync"

	"github.com/cfguard/cfguard/bnn"
)

// poolSeed mixes into a posterior version to seed its shared draws, so that a restart (and a
// replay) measures with the same networks.
const poolSeed = 0x5eed

// pools keeps the Monte-Carlo draws of the current posterior version (bnn.Pool): certify.samples
// networks in certify.precision, drawn once per version and shared by registration, /v1/predict
// and the confirmation of at-risk CEs, instead of fresh draws per call. Sharing draws across CEs
// is common random numbers: each CE's estimate keeps its distribution (and Hoeffding's guarantee
// holds per CE), but the errors of two CEs measured under one version are not independent, so a
// guarantee is per CE, never joint over CEs.
type pools struct {
	samples int
	prec    bnn.Precision

	mu    sync.Mutex
	pool  *bnn.Pool // of the newest version asked for
	older *bnn.Pool // of the last version asked for that was older than pool's
	drawn int       // pools drawn so far (a test reads it)
}

// get returns the pool of m's version, drawing it on first use. Callers asking for the same
// version wait for one draw. The newest version's pool is kept, and so is the last older one's:
// the confirmer's lanes measure the CEs due at a past version at about the same time, and share
// its pool instead of drawing it once each (at most two pools are held).
func (p *pools) get(m *bnn.Model) (*bnn.Pool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, q := range []*bnn.Pool{p.pool, p.older} {
		if q != nil && q.Version() == m.Version {
			return q, nil
		}
	}
	pool, err := bnn.NewPool(m, p.samples, m.Version^poolSeed, p.prec)
	if err != nil {
		return nil, err
	}
	p.drawn++
	if p.pool == nil || m.Version > p.pool.Version() {
		p.pool = pool
	} else {
		p.older = pool
	}
	return pool, nil
}
