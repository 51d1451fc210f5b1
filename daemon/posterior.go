package daemon

import (
	"context"
	"sync"

	sidecarpkg "github.com/cfguard/cfguard/internal/sidecar"

	"github.com/cfguard/cfguard/bnn"
)

// posteriorFiles are the two files of one posterior version in the format model.path reads
// (bnn.Encode): the JSON sidecar and the safetensors weights, with their ETags.
type posteriorFiles struct {
	version                  uint64
	sidecar, weights         []byte
	weightsSHA256            string
	sidecarETag, weightsETag string
}

func encodePosterior(m *bnn.Model) (*posteriorFiles, error) {
	sidecar, weights, err := bnn.Encode(m)
	if err != nil {
		return nil, err
	}
	w := sidecarpkg.Checksum(weights)
	return &posteriorFiles{version: m.Version, sidecar: sidecar, weights: weights, weightsSHA256: w,
		weightsETag: etagOf(w), sidecarETag: etagOf(sidecarpkg.Checksum(sidecar))}, nil
}

// posteriorCache keeps the encoded files of the latest posterior asked for: versions are unique
// per posterior, so a version names its bytes.
type posteriorCache struct {
	mu sync.Mutex
	pf *posteriorFiles
}

func (c *posteriorCache) get(m *bnn.Model) (*posteriorFiles, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pf != nil && c.pf.version == m.Version {
		return c.pf, nil
	}
	pf, err := encodePosterior(m)
	if err != nil {
		return nil, err
	}
	c.pf = pf
	return pf, nil
}

// posteriorFiles returns the current posterior's files.
func (d *Daemon) posteriorFiles() (*posteriorFiles, error) { return d.files.get(d.current()) }

// predict estimates the predictive of xs under m with the version's shared pool of
// certify.samples draws, through the batcher (concurrent requests share one engine call); equal
// requests under one version get equal answers, whatever they were batched with: bit for bit in
// the default build, to rounding (dgemm's order of additions) with -tags openblas.
func (d *Daemon) predict(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
	return d.batch.do(ctx, m, xs)
}

// predictNow is one engine call on the version's pool: what the batcher runs per batch.
func (d *Daemon) predictNow(ctx context.Context, m *bnn.Model, xs [][]float64) (*bnn.Predictive, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	pool, err := d.pools.get(m)
	if err != nil {
		return nil, err
	}
	return pool.Predict(ctx, xs)
}
