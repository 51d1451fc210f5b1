package explain

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/gradcheck"
)

// randomVAE is an untrained VAE of the given shape (as TrainVAE initialises one) with its biases
// spread so that some ReLU inputs are negative and the log variances are not near 0.
func randomVAE(d, hidden, latent int, seed uint64) *VAE {
	rng := rand.New(rand.NewPCG(seed, 9))
	v := &VAE{Inputs: d, Hidden: hidden, Latent: latent, ObsVar: 0.7}
	v.enc, v.mu, v.logvar = newDense(d, hidden, rng), newDense(hidden, latent, rng), newDense(hidden, latent, rng)
	v.dec, v.out = newDense(latent, hidden, rng), newDense(hidden, d, rng)
	for _, l := range []*dense{&v.enc, &v.mu, &v.logvar, &v.dec, &v.out} {
		for i := range l.B {
			l.B[i] += rng.NormFloat64()
		}
	}
	return v
}

// paramsOf are v's parameters in vaeLoss's order, with gradient buffers.
func paramsOf(v *VAE) []bnn.Param {
	f := &vaeLoss{v: v}
	var ps []bnn.Param
	for i, l := range f.layers() {
		ps = append(ps, bnn.Param{Name: vaeParamNames[2*i], Value: l.W, Grad: make([]float64, len(l.W))},
			bnn.Param{Name: vaeParamNames[2*i+1], Value: l.B, Grad: make([]float64, len(l.B))})
	}
	return ps
}

// fillBatch writes rows and wide noise (the latent's variance then counts) into the buffers.
func fillBatch(xb, eb []float64, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 5))
	for i := range xb {
		xb[i] = 1.5 * rng.NormFloat64()
	}
	for i := range eb {
		eb[i] = 2 * rng.NormFloat64()
	}
}

// The plain-Go loss and every component of its gradient equal those of lossGraph's gorgonia
// graph (autodiff) on the same minibatch and noise, to 1e-10 of each parameter block's largest
// gradient, for shapes from one row to a batch wider than the layers.
func TestVAEGradientMatchesTheGraph(t *testing.T) {
	for _, c := range []struct{ batch, d, hidden, latent int }{
		{1, 3, 4, 2}, {5, 4, 16, 2}, {64, 30, 40, 8}, {64, 57, 40, 8},
	} {
		t.Run(fmt.Sprintf("B%d D%d H%d L%d", c.batch, c.d, c.hidden, c.latent), func(t *testing.T) {
			v := randomVAE(c.d, c.hidden, c.latent, uint64(c.batch*c.d))
			ref := newTrainer(c.batch, c.d, c.latent)
			if err := ref.compile(v.lossGraph(ref)); err != nil {
				t.Fatal(err)
			}
			defer ref.vm.Close()
			f := newVAELoss(v, c.batch)
			fillBatch(f.xb, f.eb, uint64(c.latent))
			xb, eb := ref.buffers()
			copy(xb, f.xb)
			copy(eb, f.eb)

			got, want := paramsOf(v), paramsOf(v)
			lg, err := f.eval(got)
			if err != nil {
				t.Fatal(err)
			}
			lw, err := ref.eval(want)
			if err != nil {
				t.Fatal(err)
			}
			if math.Abs(lg-lw) > 1e-12*math.Max(1, math.Abs(lw)) {
				t.Errorf("loss %.15g, graph's %.15g", lg, lw)
			}
			for i := range got {
				scale := 0.0
				for _, g := range want[i].Grad {
					scale = math.Max(scale, math.Abs(g))
				}
				if scale == 0 {
					t.Fatalf("%s: the graph's gradient is 0 everywhere; the case checks nothing", got[i].Name)
				}
				for j, g := range got[i].Grad {
					if e := math.Abs(g - want[i].Grad[j]); e > 1e-10*scale {
						t.Fatalf("%s[%d]: %.15g, graph's %.15g (largest %.3g)", got[i].Name, j, g, want[i].Grad[j], scale)
					}
				}
			}
		})
	}
}

// Every component of the plain-Go gradient agrees with a central finite difference of the plain-Go
// loss, (L(w + h) - L(w - h)) / 2h, to 1e-5 relative: the loss and its gradient are one function.
func TestVAEGradientMatchesFiniteDifferences(t *testing.T) {
	v := randomVAE(6, 7, 3, 11)
	f := newVAELoss(v, 9)
	fillBatch(f.xb, f.eb, 3)
	ps := paramsOf(v)
	if _, err := f.eval(ps); err != nil {
		t.Fatal(err)
	}
	scratch := paramsOf(v)
	loss := func() float64 {
		l, err := f.eval(scratch)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	values := make([][]float64, len(ps))
	for i, p := range ps {
		values[i] = p.Value
	}
	gradcheck.Central(values, 1e-6, loss, func(i, j int, fd float64) {
		if g := ps[i].Grad[j]; math.Abs(fd-g) > 1e-5*math.Max(1e-3, math.Abs(fd)) {
			t.Errorf("%s[%d]: gradient %.10g, finite difference %.10g", ps[i].Name, j, g, fd)
		}
	})
}

// Training on the plain-Go gradient and on the graph's, from one seed, gives the same VAE to
// 1e-9 after 3 epochs of 5 minibatches: the same rows, noise and Adam steps, with only rounding
// between them.
func TestTrainVAEFollowsTheGraph(t *testing.T) {
	m, _, set := blobFixture(t)
	Z, err := standardize(m, set.X)
	if err != nil {
		t.Fatal(err)
	}
	cfg := TrainConfig{Seed: 4, Epochs: 3, Hidden: 16, Latent: 2, BatchSize: 60}.withDefaults(len(Z))
	got, _, err := TrainVAE(context.Background(), m, set.X, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The reference: TrainVAE's initialisation, then the graph's training loop.
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x7ae))
	d := m.Inputs()
	want := &VAE{Inputs: d, Hidden: cfg.Hidden, Latent: cfg.Latent, ObsVar: DefaultObsVar}
	want.enc, want.mu, want.logvar = newDense(d, cfg.Hidden, rng), newDense(cfg.Hidden, cfg.Latent, rng), newDense(cfg.Hidden, cfg.Latent, rng)
	want.dec, want.out = newDense(cfg.Latent, cfg.Hidden, rng), newDense(cfg.Hidden, d, rng)
	tr := newTrainer(cfg.BatchSize, d, cfg.Latent)
	if err := tr.compile(want.lossGraph(tr)); err != nil {
		t.Fatal(err)
	}
	if _, err := tr.run(context.Background(), Z, cfg.Epochs, cfg.LR, rng); err != nil {
		t.Fatal(err)
	}
	gl, wl := (&vaeLoss{v: got}).layers(), (&vaeLoss{v: want}).layers()
	for i := range gl {
		for j, w := range wl[i].W {
			if e := math.Abs(gl[i].W[j] - w); e > 1e-9 {
				t.Fatalf("%s[%d]: %.15g, trained on the graph %.15g", vaeParamNames[2*i], j, gl[i].W[j], w)
			}
		}
		for j, b := range wl[i].B {
			if e := math.Abs(gl[i].B[j] - b); e > 1e-9 {
				t.Fatalf("%s[%d]: %.15g, trained on the graph %.15g", vaeParamNames[2*i+1], j, gl[i].B[j], b)
			}
		}
	}
	// The comparison means something only if training moved the weights from their start.
	if w0 := newDense(d, cfg.Hidden, rand.New(rand.NewPCG(cfg.Seed, 0x7ae))); math.Abs(w0.W[0]-gl[0].W[0]) < 1e-6 {
		t.Fatalf("training did not move encoder.fc1.weight[0] from %v", w0.W[0])
	}
}

// BenchmarkVAEMinibatch times one evaluation of the VAE's loss and gradient on a minibatch of 64
// rows of spambase's shape (57 features, the default 40 hidden and 8 latent units), by the graph
// and in plain Go, interleaved in every iteration, and reports graph-time / go-time, which a
// shared, loaded machine disturbs far less than two benchmarks run at different moments.
func BenchmarkVAEMinibatch(b *testing.B) {
	const batch, d = 64, 57
	v := randomVAE(d, DefaultHidden, DefaultLatent, 1)
	ref := newTrainer(batch, d, DefaultLatent)
	if err := ref.compile(v.lossGraph(ref)); err != nil {
		b.Fatal(err)
	}
	defer ref.vm.Close()
	f := newVAELoss(v, batch)
	fillBatch(f.xb, f.eb, 1)
	xb, eb := ref.buffers()
	copy(xb, f.xb)
	copy(eb, f.eb)
	pg, pr := paramsOf(v), paramsOf(v)
	var tGo, tGr time.Duration
	for b.Loop() {
		t0 := time.Now()
		if _, err := f.eval(pg); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if _, err := ref.eval(pr); err != nil {
			b.Fatal(err)
		}
		tGo, tGr = tGo+t1.Sub(t0), tGr+time.Since(t1)
	}
	b.ReportMetric(float64(tGr)/float64(tGo), "graph/go")
	b.ReportMetric(float64(tGo.Nanoseconds())/float64(b.N), "go-ns/minibatch")
}

// recordingLoss is a minibatchLoss that keeps a copy of every minibatch fit hands it.
type recordingLoss struct {
	xb, eb    []float64
	rows, ebs [][]float64
}

func (r *recordingLoss) buffers() (xb, eb []float64) { return r.xb, r.eb }

func (r *recordingLoss) eval(params []bnn.Param) (float64, error) {
	r.rows = append(r.rows, append([]float64(nil), r.xb...))
	r.ebs = append(r.ebs, append([]float64(nil), r.eb...))
	return 0, nil
}

// fit draws from its rng as its documentation says, which is what makes a trained VAE the same
// function of its seed whatever evaluates the loss: each minibatch's rows are the next ones of a
// running permutation (rng.Perm, a fresh one when it is used up, across epochs), then its noise is
// standard normal draws, in that order. 7 rows in minibatches of 3 over 2 epochs: 6 minibatches,
// the permutation renewed twice.
func TestFitDrawsRowsThenNoise(t *testing.T) {
	Z := make([][]float64, 7)
	for i := range Z {
		Z[i] = []float64{float64(i), -float64(i)}
	}
	const batch, d, noise, epochs = 3, 2, 2, 2
	rec := &recordingLoss{xb: make([]float64, batch*d), eb: make([]float64, batch*noise)}
	layer := newDense(1, 1, rand.New(rand.NewPCG(1, 1)))
	if _, err := fit(context.Background(), rec, []*dense{&layer}, []string{"w", "b"}, Z, batch, d, epochs, 1e-3, rand.New(rand.NewPCG(5, 6))); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(5, 6))
	perm, pos := rng.Perm(len(Z)), 0
	iters := epochs * ((len(Z) + batch - 1) / batch)
	if len(rec.rows) != iters {
		t.Fatalf("%d minibatches, want %d", len(rec.rows), iters)
	}
	for it := 0; it < iters; it++ {
		for r := 0; r < batch; r++ {
			if pos == len(Z) {
				perm, pos = rng.Perm(len(Z)), 0
			}
			if got, want := rec.rows[it][r*d:(r+1)*d], Z[perm[pos]]; got[0] != want[0] || got[1] != want[1] {
				t.Fatalf("minibatch %d row %d: %v, want row %v", it, r, got, want)
			}
			pos++
		}
		for i, e := range rec.ebs[it] {
			if want := rng.NormFloat64(); e != want {
				t.Fatalf("minibatch %d noise %d: %v, want %v", it, i, e, want)
			}
		}
	}
}
