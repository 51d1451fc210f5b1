package explain

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/cfguard/cfguard/bnn"
	G "gorgonia.org/gorgonia"
)

// VAE is the paper's tabular variational autoencoder over the model's standardised features z:
//
//	encoder:  h = ReLU(W1 z + b1) (Hidden),  mu = Wmu h + bmu,  logvar = Wlv h + blv   (Latent each)
//	decoder:  u ~ q(u|z) = N(mu, diag(exp(logvar))),  zhat = W4 ReLU(W3 u + b3) + b4   (linear out)
//
// with a Gaussian likelihood of fixed variance ObsVar and a standard normal prior:
//
//	ELBO(z) = E_q(u|z)[ log N(z; zhat(u), ObsVar I) ] - KL(q(u|z) || N(0, I))
//	        = E_q[ -||z - zhat(u)||^2 / (2 ObsVar) ] - (D/2) log(2 pi ObsVar)
//	          - (1/2) sum_k (mu_k^2 + exp(logvar_k) - 1 - logvar_k).
//
// Variance choice: ObsVar = 1 by default. The data are standardised, so 1 is each feature's
// marginal variance; a fixed (not learned) variance keeps the ELBO's scale, and hence the paper's
// lambda_ELBO, independent of how well the decoder happens to fit, and with it the ELBO is a true
// lower bound on log p(z) in standardised units (it includes the normalising constant).
//
// Scaler records the standardisation the VAE was trained in; Compatible checks it against a model.
type VAE struct {
	Inputs, Hidden, Latent int
	ObsVar                 float64
	Scaler                 bnn.Scaler
	enc, mu, logvar        dense
	dec, out               dense
}

// DefaultObsVar is the VAE's default likelihood variance (standardised units).
const DefaultObsVar = 1.0

// VAEStats summarises a VAE training run.
type VAEStats struct {
	Epochs int
	// Loss is the last epoch's mean of -ELBO per row (one reparameterised draw per row).
	Loss     float64
	Duration time.Duration
}

// Encode returns the mean and log-variance of q(u | z) for a standardised input z.
func (v *VAE) Encode(z []float64) (mu, logvar []float64) {
	h := make([]float64, v.Hidden)
	v.enc.forward(h, z, true)
	mu = make([]float64, v.Latent)
	logvar = make([]float64, v.Latent)
	v.mu.forward(mu, h, false)
	v.logvar.forward(logvar, h, false)
	return mu, logvar
}

// Decode returns the decoder's mean zhat(u) for a latent u.
func (v *VAE) Decode(u []float64) []float64 {
	h := make([]float64, v.Hidden)
	v.dec.forward(h, u, true)
	out := make([]float64, v.Inputs)
	v.out.forward(out, h, false)
	return out
}

// ELBOWith evaluates the ELBO at z with the reparameterised latent u = mu + exp(logvar/2) * e for
// the given standard normal draw e (len Latent): the single-sample estimator PSCE differentiates.
func (v *VAE) ELBOWith(z, e []float64) float64 {
	mu, lv := v.Encode(z)
	u := make([]float64, v.Latent)
	kl := 0.0
	for k := range u {
		u[k] = mu[k] + math.Exp(lv[k]/2)*e[k]
		kl += 0.5 * (mu[k]*mu[k] + math.Exp(lv[k]) - 1 - lv[k])
	}
	zh := v.Decode(u)
	se := 0.0
	for j := range z {
		d := z[j] - zh[j]
		se += d * d
	}
	return -se/(2*v.ObsVar) - float64(v.Inputs)/2*math.Log(2*math.Pi*v.ObsVar) - kl
}

// ELBO is the Monte-Carlo ELBO at z averaged over draws reparameterised samples from rng.
func (v *VAE) ELBO(z []float64, draws int, rng *rand.Rand) float64 {
	e := make([]float64, v.Latent)
	s := 0.0
	for d := 0; d < draws; d++ {
		for k := range e {
			e[k] = rng.NormFloat64()
		}
		s += v.ELBOWith(z, e)
	}
	return s / float64(draws)
}

// ErrIncompatible is wrapped when a VAE does not belong to a model's feature space.
var ErrIncompatible = errors.New("vae does not match the model")

// Compatible reports whether v works in m's standardised space: same input dimension and a
// bit-identical scaler (last-layer updates never change the scaler, so a VAE trained beside a
// model stays valid for all its updates).
func (v *VAE) Compatible(m *bnn.Model) error {
	if v.Inputs != m.Inputs() {
		return fmt.Errorf("%w: vae has %d inputs, model %d", ErrIncompatible, v.Inputs, m.Inputs())
	}
	for j := 0; j < v.Inputs; j++ {
		if math.Float64bits(v.Scaler.Mean[j]) != math.Float64bits(m.Scaler.Mean[j]) ||
			math.Float64bits(v.Scaler.Std[j]) != math.Float64bits(m.Scaler.Std[j]) {
			return fmt.Errorf("%w: scaler differs at feature %d (vae mean %v std %v, model mean %v std %v)",
				ErrIncompatible, j, v.Scaler.Mean[j], v.Scaler.Std[j], m.Scaler.Mean[j], m.Scaler.Std[j])
		}
	}
	return nil
}

// TrainVAE fits a VAE to the raw rows X, standardised with m's scaler, by minimising the mean
// -ELBO of minibatches (one reparameterised draw per row) with bnn.Adam on the gradients of
// vaeLoss, which equal those of lossGraph's gorgonia graph to rounding.
// The result is a deterministic function of (m.Scaler, X, cfg).
func TrainVAE(ctx context.Context, m *bnn.Model, X [][]float64, cfg TrainConfig) (*VAE, VAEStats, error) {
	start := time.Now()
	if m == nil {
		return nil, VAEStats{}, errors.New("train vae: nil model")
	}
	Z, err := standardize(m, X)
	if err != nil {
		return nil, VAEStats{}, fmt.Errorf("train vae: %w", err)
	}
	cfg = cfg.withDefaults(len(Z))
	if err := cfg.validate(); err != nil {
		return nil, VAEStats{}, fmt.Errorf("train vae: %w", err)
	}
	d := m.Inputs()
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x7ae))
	v := &VAE{Inputs: d, Hidden: cfg.Hidden, Latent: cfg.Latent, ObsVar: DefaultObsVar,
		Scaler: bnn.Scaler{Mean: append([]float64(nil), m.Scaler.Mean...), Std: append([]float64(nil), m.Scaler.Std...)}}
	v.enc = newDense(d, cfg.Hidden, rng)
	v.mu = newDense(cfg.Hidden, cfg.Latent, rng)
	v.logvar = newDense(cfg.Hidden, cfg.Latent, rng)
	v.dec = newDense(cfg.Latent, cfg.Hidden, rng)
	v.out = newDense(cfg.Hidden, d, rng)

	f := newVAELoss(v, cfg.BatchSize)
	last, err := fit(ctx, f, f.layers(), vaeParamNames, Z, cfg.BatchSize, d, cfg.Epochs, cfg.LR, rng)
	if err != nil {
		return nil, VAEStats{}, fmt.Errorf("train vae: %w", err)
	}
	// The graph's loss omits the constant (D/2) log(2 pi ObsVar); report the full -ELBO.
	last += float64(d) / 2 * math.Log(2*math.Pi*v.ObsVar)
	return v, VAEStats{Epochs: cfg.Epochs, Loss: last, Duration: time.Since(start)}, nil
}

// lossGraph builds, as a gorgonia graph, the minibatch mean of -ELBO without its constant (D/2)
// log(2 pi ObsVar), on t's rows x_i and noise e_i: the reference by autodiff that the tests hold
// vaeLoss, what TrainVAE trains on, to:
//
//	(mu_i, logvar_i) = encoder(x_i),   u_i = mu_i + exp(logvar_i / 2) * e_i,
//	loss = (1/B) sum_i [ ||x_i - decoder(u_i)||^2 / (2 ObsVar)
//	                     + (1/2) sum_k (mu_ik^2 + exp(logvar_ik) - logvar_ik - 1) ].
func (v *VAE) lossGraph(t *gtrainer) *G.Node {
	b := t.b
	b.Phase("forward")
	h := b.Rectify(t.affine(t.x, &v.enc, "encoder.fc1"))
	mu := t.affine(h, &v.mu, "encoder.mu")
	lv := t.affine(h, &v.logvar, "encoder.logvar")
	u := b.Reparam(mu, b.Exp(b.Mul(lv, G.NewConstant(0.5))), t.e)
	zh := t.affine(b.Rectify(t.affine(u, &v.dec, "decoder.fc1")), &v.out, "decoder.out")
	b.Phase("loss")
	inv := 1 / float64(t.batch)
	se := b.Sum(b.Square(b.Sub(t.x, zh)))
	rec := b.Mul(se, G.NewConstant(inv/(2*v.ObsVar)))
	klTerms := b.Sub(b.Add(b.Square(mu), b.Exp(lv)), b.Add(lv, G.NewConstant(1.0)))
	kl := b.Mul(b.Sum(klTerms), G.NewConstant(0.5*inv))
	return b.Add(rec, kl)
}

// standardize returns m's standardised rows of X as a slice of rows.
func standardize(m *bnn.Model, X [][]float64) ([][]float64, error) {
	zm, err := m.Standardize(X)
	if err != nil {
		return nil, err
	}
	Z := make([][]float64, len(X))
	for i := range Z {
		Z[i] = append([]float64(nil), zm.RawRowView(i)...)
	}
	return Z, nil
}
