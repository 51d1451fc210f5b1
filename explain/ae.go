package explain

import (
	"context"
	"fmt"
	"math/rand/v2"

	G "gorgonia.org/gorgonia"
)

// AE is the paper's autoencoder for the IM1 metric (Table "Architecture of the Autoencoder"):
//
//	encoder: D -> Hidden (ReLU) -> Latent (ReLU);   decoder: Latent -> Hidden (ReLU) -> D (linear)
//
// trained to minimise the squared reconstruction error ||z - AE(z)||^2. It works in whatever space
// it is trained in; package evaluate trains one per class on standardised training rows.
type AE struct {
	Inputs, Hidden, Latent int
	enc1, enc2, dec1, out  dense
}

// TrainAE fits an autoencoder to the rows Z by minibatch Adam (bnn.Adam on gorgonia's gradients)
// on the mean squared reconstruction error per row. The result is a deterministic function of
// (Z, cfg).
func TrainAE(ctx context.Context, Z [][]float64, cfg TrainConfig) (*AE, float64, error) {
	if len(Z) == 0 {
		return nil, 0, fmt.Errorf("train ae: no rows")
	}
	d := len(Z[0])
	if err := checkRows(Z, d); err != nil {
		return nil, 0, fmt.Errorf("train ae: %w", err)
	}
	cfg = cfg.withDefaults(len(Z))
	if err := cfg.validate(); err != nil {
		return nil, 0, fmt.Errorf("train ae: %w", err)
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0xae))
	a := &AE{Inputs: d, Hidden: cfg.Hidden, Latent: cfg.Latent}
	a.enc1 = newDense(d, cfg.Hidden, rng)
	a.enc2 = newDense(cfg.Hidden, cfg.Latent, rng)
	a.dec1 = newDense(cfg.Latent, cfg.Hidden, rng)
	a.out = newDense(cfg.Hidden, d, rng)
	t := newTrainer(cfg.BatchSize, d, 0)
	if err := t.compile(a.lossGraph(t)); err != nil {
		return nil, 0, fmt.Errorf("train ae: %w", err)
	}
	last, err := t.run(ctx, Z, cfg.Epochs, cfg.LR, rng)
	if err != nil {
		return nil, 0, fmt.Errorf("train ae: %w", err)
	}
	return a, last, nil
}

// lossGraph builds the minibatch mean squared reconstruction error on t's rows x_i:
//
//	loss = (1/B) sum_i ||x_i - AE(x_i)||^2.
func (a *AE) lossGraph(t *gtrainer) *G.Node {
	b := t.b
	b.Phase("forward")
	h := b.Rectify(t.affine(t.x, &a.enc1, "encoder.fc1"))
	u := b.Rectify(t.affine(h, &a.enc2, "encoder.fc2"))
	zh := t.affine(b.Rectify(t.affine(u, &a.dec1, "decoder.fc1")), &a.out, "decoder.out")
	b.Phase("loss")
	return b.Mul(b.Sum(b.Square(b.Sub(t.x, zh))), G.NewConstant(1/float64(t.batch)))
}

// Reconstruct returns AE(z).
func (a *AE) Reconstruct(z []float64) []float64 {
	h := make([]float64, a.Hidden)
	u := make([]float64, a.Latent)
	a.enc1.forward(h, z, true)
	a.enc2.forward(u, h, true)
	a.dec1.forward(h, u, true)
	out := make([]float64, a.Inputs)
	a.out.forward(out, h, false)
	return out
}

// Error is the squared reconstruction error ||z - AE(z)||^2.
func (a *AE) Error(z []float64) float64 {
	r := a.Reconstruct(z)
	s := 0.0
	for j := range z {
		d := z[j] - r[j]
		s += d * d
	}
	return s
}
