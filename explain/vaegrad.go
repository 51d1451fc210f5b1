package explain

import (
	"math"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"

	"github.com/cfguard/cfguard/bnn"
)

// vaeLoss is the VAE's training loss (lossGraph's, the minibatch mean of -ELBO without its
// constant) and its gradient in plain Go: the forward pass and its reverse, written out, in
// matrix products over the whole minibatch. It computes what lossGraph's gorgonia graph
// computes, to rounding (TestVAEGradientMatchesTheGraph), without building and walking a tape
// on every iteration, which cost about half of the training's time.
//
// With rows X (B x D) and noise E (B x L), row-major, and layers y = W x + b:
//
//	A1 = X W1^T + b1,  H = ReLU(A1),  M = H Wmu^T + bmu,  V = H Wlv^T + blv,
//	S = exp(V / 2),    U = M + S * E,  A2 = U Wd^T + bd,  G = ReLU(A2),  Zh = G Wo^T + bo,
//	loss = sum (X - Zh)^2 / (2 ObsVar B) + sum (M^2 + exp(V) - V - 1) / (2 B),
//
// and, in reverse, with ⊙ the element-wise product and 1[.] the ReLU's derivative:
//
//	dZh = (Zh - X) / (ObsVar B),           dWo = dZh^T G,   dbo = colsum dZh,
//	dA2 = (dZh Wo) ⊙ 1[A2 > 0],            dWd = dA2^T U,   dbd = colsum dA2,   dU = dA2 Wd,
//	dM = dU + M / B,                       dV = dU ⊙ E ⊙ S / 2 + (exp(V) - 1) / (2 B),
//	dWmu = dM^T H, dbmu = colsum dM,       dWlv = dV^T H,   dblv = colsum dV,
//	dA1 = (dM Wmu + dV Wlv) ⊙ 1[A1 > 0],   dW1 = dA1^T X,   db1 = colsum dA1.
type vaeLoss struct {
	v        *VAE
	batch    int
	xb, eb   []float64 // X and E, filled by fit
	h, m, lv []float64 // H (B x Hidden), M and V (B x Latent)
	s, u, g  []float64 // S and U (B x Latent), G (B x Hidden)
	zh       []float64 // Zh (B x D), then dZh
	dg, du   []float64 // dG then dA2 (B x Hidden), dU (B x Latent)
	dm, dlv  []float64 // dM and dV (B x Latent)
	dh       []float64 // dH then dA1 (B x Hidden)
}

// newVAELoss allocates the buffers for minibatches of batch rows.
func newVAELoss(v *VAE, batch int) *vaeLoss {
	B, D, H, L := batch, v.Inputs, v.Hidden, v.Latent
	f := func(n int) []float64 { return make([]float64, n) }
	return &vaeLoss{v: v, batch: B, xb: f(B * D), eb: f(B * L),
		h: f(B * H), m: f(B * L), lv: f(B * L), s: f(B * L), u: f(B * L), g: f(B * H),
		zh: f(B * D), dg: f(B * H), du: f(B * L), dm: f(B * L), dlv: f(B * L), dh: f(B * H)}
}

// layers are the VAE's layers in the order of eval's params: encoder, mean, log-variance,
// decoder, output.
func (f *vaeLoss) layers() []*dense {
	v := f.v
	return []*dense{&v.enc, &v.mu, &v.logvar, &v.dec, &v.out}
}

// vaeParamNames are the layers' parameter names (PyTorch's, as lossGraph names them).
var vaeParamNames = []string{
	"encoder.fc1.weight", "encoder.fc1.bias", "encoder.mu.weight", "encoder.mu.bias",
	"encoder.logvar.weight", "encoder.logvar.bias", "decoder.fc1.weight", "decoder.fc1.bias",
	"decoder.out.weight", "decoder.out.bias",
}

func (f *vaeLoss) buffers() (xb, eb []float64) { return f.xb, f.eb }

// eval computes the loss and writes its gradient into params (the layers' weights and biases in
// the order of layers).
func (f *vaeLoss) eval(params []bnn.Param) (float64, error) {
	v, B := f.v, f.batch
	invB := 1 / float64(B)

	// Forward.
	affine(B, &v.enc, f.xb, f.h)
	relu(f.h)
	affine(B, &v.mu, f.h, f.m)
	affine(B, &v.logvar, f.h, f.lv)
	kl := 0.0
	for i, lv := range f.lv {
		s := math.Exp(lv / 2)
		f.s[i], f.u[i] = s, f.m[i]+s*f.eb[i]
		kl += f.m[i]*f.m[i] + s*s - lv - 1
	}
	affine(B, &v.dec, f.u, f.g)
	relu(f.g)
	affine(B, &v.out, f.g, f.zh)
	se := 0.0
	scale := invB / v.ObsVar
	for i, z := range f.zh {
		r := z - f.xb[i]
		se += r * r
		f.zh[i] = r * scale // dZh
	}
	loss := se*scale/2 + kl*invB/2

	// Reverse, layer by layer from the output.
	dz := f.zh
	backAffine(B, &v.out, dz, f.g, params[8].Grad, params[9].Grad, f.dg, 0)
	reluBack(f.dg, f.g)
	backAffine(B, &v.dec, f.dg, f.u, params[6].Grad, params[7].Grad, f.du, 0)
	for i, du := range f.du {
		f.dm[i] = du + f.m[i]*invB
		f.dlv[i] = du*f.eb[i]*f.s[i]/2 + (f.s[i]*f.s[i]-1)*invB/2
	}
	backAffine(B, &v.mu, f.dm, f.h, params[2].Grad, params[3].Grad, f.dh, 0)
	backAffine(B, &v.logvar, f.dlv, f.h, params[4].Grad, params[5].Grad, f.dh, 1)
	reluBack(f.dh, f.h)
	backAffine(B, &v.enc, f.dh, f.xb, params[0].Grad, params[1].Grad, nil, 0)
	return loss, nil
}

// affine sets y = x W^T + 1 b^T for the rows x (rows x l.In) into y (rows x l.Out).
func affine(rows int, l *dense, x, y []float64) {
	for r := 0; r < rows; r++ {
		copy(y[r*l.Out:(r+1)*l.Out], l.B)
	}
	gonum.Implementation{}.Dgemm(blas.NoTrans, blas.Trans, rows, l.Out, l.In, 1, x, l.In, l.W, l.In, 1, y, l.Out)
}

// backAffine is affine's reverse: given dy = d loss / d y (rows x l.Out) and its input x, it
// sets dW = dy^T x, db = colsum dy and, unless dx is nil, dx = dy W + beta dx (beta 1 adds to
// dx the gradient of a second layer reading the same input).
func backAffine(rows int, l *dense, dy, x, dW, db, dx []float64, beta float64) {
	gonum.Implementation{}.Dgemm(blas.Trans, blas.NoTrans, l.Out, l.In, rows, 1, dy, l.Out, x, l.In, 0, dW, l.In)
	clear(db)
	for r := 0; r < rows; r++ {
		for o, d := range dy[r*l.Out : (r+1)*l.Out] {
			db[o] += d
		}
	}
	if dx != nil {
		gonum.Implementation{}.Dgemm(blas.NoTrans, blas.NoTrans, rows, l.In, l.Out, 1, dy, l.Out, l.W, l.In, beta, dx, l.In)
	}
}

// relu sets every negative element of x to 0.
func relu(x []float64) {
	for i, v := range x {
		if v < 0 {
			x[i] = 0
		}
	}
}

// reluBack zeroes the gradient d where the ReLU's output y is not positive (its derivative there
// is 0; y > 0 exactly where the ReLU's input was).
func reluBack(d, y []float64) {
	for i, v := range y {
		if !(v > 0) {
			d[i] = 0
		}
	}
}
