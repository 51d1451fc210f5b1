package explain

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/cfguard/cfguard/bnn"
	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

// dense is a fully connected layer in PyTorch's layout: W is Out x In, row-major, and
//
//	y = W x + b.
type dense struct {
	In, Out int
	W, B    []float64
}

// newDense initialises a layer as torch.nn.Linear does: W, b ~ U(-1/sqrt(In), 1/sqrt(In)).
func newDense(in, out int, rng *rand.Rand) dense {
	l := dense{In: in, Out: out, W: make([]float64, in*out), B: make([]float64, out)}
	bound := 1 / math.Sqrt(float64(in))
	for i := range l.W {
		l.W[i] = (2*rng.Float64() - 1) * bound
	}
	for i := range l.B {
		l.B[i] = (2*rng.Float64() - 1) * bound
	}
	return l
}

// forward writes W x + b into dst (len Out), applying ReLU when relu is set.
func (l *dense) forward(dst, x []float64, relu bool) {
	for o := 0; o < l.Out; o++ {
		row := l.W[o*l.In : (o+1)*l.In]
		s := l.B[o]
		for i, v := range x {
			s += row[i] * v
		}
		if relu && s < 0 {
			s = 0
		}
		dst[o] = s
	}
}

func (l *dense) finite() error {
	for i, v := range l.W {
		if !finite(v) {
			return fmt.Errorf("weight[%d] = %v", i, v)
		}
	}
	for i, v := range l.B {
		if !finite(v) {
			return fmt.Errorf("bias[%d] = %v", i, v)
		}
	}
	return nil
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// TrainConfig configures the minibatch training of the VAE and the autoencoders. Zero fields
// take the defaults in brackets.
type TrainConfig struct {
	Hidden    int     // width of the hidden layers [40, the paper's tabular architecture]
	Latent    int     // latent dimension D_z [8; the paper does not state it for tabular data]
	Epochs    int     // passes over the data [200]
	BatchSize int     // rows per Adam iteration [64; smaller data sets use all rows]
	LR        float64 // Adam learning rate [1e-3]
	Seed      uint64  // seeds initialisation, shuffling and the VAE's noise
}

// Defaults of TrainConfig.
const (
	DefaultHidden    = 40
	DefaultLatent    = 8
	DefaultEpochs    = 200
	DefaultBatchSize = 64
	DefaultTrainLR   = 1e-3
)

func (c TrainConfig) withDefaults(rows int) TrainConfig {
	c.Hidden = cmp.Or(c.Hidden, DefaultHidden)
	c.Latent = cmp.Or(c.Latent, DefaultLatent)
	c.Epochs = cmp.Or(c.Epochs, DefaultEpochs)
	c.BatchSize = cmp.Or(c.BatchSize, DefaultBatchSize)
	if c.BatchSize > rows {
		c.BatchSize = rows
	}
	c.LR = cmp.Or(c.LR, DefaultTrainLR)
	return c
}

func (c TrainConfig) validate() error {
	switch {
	case c.Hidden < 1:
		return fmt.Errorf("hidden width %d, want >= 1", c.Hidden)
	case c.Latent < 1:
		return fmt.Errorf("latent dimension %d, want >= 1", c.Latent)
	case c.Epochs < 1:
		return fmt.Errorf("epochs %d, want >= 1", c.Epochs)
	case c.BatchSize < 1:
		return fmt.Errorf("batch size %d, want >= 1", c.BatchSize)
	case !(c.LR > 0) || math.IsInf(c.LR, 0):
		return fmt.Errorf("learning rate %v, want finite and > 0", c.LR)
	}
	return nil
}

// checkRows verifies that Z is a non-empty matrix of finite values with d columns.
func checkRows(Z [][]float64, d int) error {
	if len(Z) == 0 {
		return errors.New("no rows")
	}
	for i, z := range Z {
		if len(z) != d {
			return fmt.Errorf("row %d has %d features, want %d", i, len(z), d)
		}
		for j, v := range z {
			if !finite(v) {
				return fmt.Errorf("row %d feature %d is %v", i, j, v)
			}
		}
	}
	return nil
}

// gtrainer runs minibatch Adam on a loss built as a gorgonia graph over dense layers, with
// bnn.GraphBuilder. The graph has a (Batch x D) input X and optionally a (Batch x Noise) input E
// of standard normal noise; both are refilled in place and rebound with gorgonia.Let before every
// iteration. The layers' weights and biases are the graph's parameters, bound to their storage.
type gtrainer struct {
	b        *bnn.GraphBuilder
	vm       G.VM
	bound    bnn.Inputs // every input tensor, checked when a run fails
	x, e     *G.Node
	xv, ev   *tensor.Dense
	params   G.Nodes
	layers   []*dense
	lossVal  G.Value
	grads    []G.Value // d loss / d params[i], read after every run
	batch, d int
}

// newTrainer starts the graph with its inputs X and, if noise > 0, E.
func newTrainer(batch, d, noise int) *gtrainer {
	t := &gtrainer{b: bnn.NewGraphBuilder("graph"), batch: batch, d: d}
	t.x, t.xv = t.b.Input("X", nil, batch, d)
	if noise > 0 {
		t.e, t.ev = t.b.Input("E", nil, batch, noise)
	}
	return t
}

// affine returns h W^T + b for a (B x In) node h, with W and b bound to l's storage.
func (t *gtrainer) affine(h *G.Node, l *dense, name string) *G.Node {
	b := t.b
	w, _ := b.Input(name+".weight", l.W, l.Out, l.In)
	bias, _ := b.Input(name+".bias", l.B, 1, l.Out)
	t.params = append(t.params, w, bias)
	t.layers = append(t.layers, l)
	return b.BroadcastAdd(b.Mul(h, b.Transpose(w)), bias, 0)
}

// compile differentiates loss with respect to every parameter and builds the tape machine; it
// returns the first error of the whole build.
func (t *gtrainer) compile(loss *G.Node) error {
	b := t.b
	b.Phase("gradient")
	b.Read(loss, &t.lossVal)
	grads := b.Grad(loss, t.params...)
	t.grads = make([]G.Value, len(grads))
	for i, g := range grads {
		b.Read(g, &t.grads[i])
	}
	vm, err := b.Compile()
	if err != nil {
		return err
	}
	t.vm, t.bound, t.b = vm, b.Inputs(), nil
	return nil
}

// minibatchLoss is a loss over minibatches of batch rows of d features and, for a VAE, batch x
// noise standard normal draws, with its gradient with respect to the parameters of layers.
type minibatchLoss interface {
	// buffers are the minibatch's rows (batch x d, row-major) and noise (batch x noise, nil
	// without noise), which fit fills before every eval.
	buffers() (xb, eb []float64)
	// eval returns the loss of the rows and noise in the buffers and writes d loss / d
	// params[i] into params[i].Grad; params are the layers' weights and biases in order.
	eval(params []bnn.Param) (float64, error)
}

// run trains t's layers for epochs passes over Z (fit) on gorgonia's gradients.
func (t *gtrainer) run(ctx context.Context, Z [][]float64, epochs int, lr float64, rng *rand.Rand) (float64, error) {
	defer t.vm.Close()
	names := make([]string, len(t.params))
	for i, n := range t.params {
		names[i] = n.Name()
	}
	return fit(ctx, t, t.layers, names, Z, t.batch, t.d, epochs, lr, rng)
}

// buffers are the values bound to the graph's inputs X and E.
func (t *gtrainer) buffers() (xb, eb []float64) {
	xb = t.xv.Data().([]float64)
	if t.ev != nil {
		eb = t.ev.Data().([]float64)
	}
	return xb, eb
}

// eval runs the graph on its inputs and copies the gradients out.
func (t *gtrainer) eval(params []bnn.Param) (float64, error) {
	if err := G.Let(t.x, t.xv); err != nil {
		return 0, err
	}
	if t.e != nil {
		if err := G.Let(t.e, t.ev); err != nil {
			return 0, err
		}
	}
	defer t.vm.Reset()
	if err := t.bound.Run(t.vm); err != nil {
		return 0, fmt.Errorf("training iteration: %w", err)
	}
	return t.lossVal.Data().(float64), t.readGrads(params)
}

// fit trains layers by minibatch Adam on loss for epochs passes over Z with seeded shuffling, and
// returns the mean loss of the last epoch. Each iteration fills the batch with the next rows of a
// running permutation (wrapping into a fresh one), so every iteration has a full batch and every
// row is seen once per epoch up to the wrap, then the noise with standard normal draws, both
// from rng in that order.
//
// The optimiser is bnn.Adam, the project's one Adam, and it updates the layers' own slices
// (names[2i] is layer i's weight, names[2i+1] its bias), which the next eval reads.
func fit(ctx context.Context, loss minibatchLoss, layers []*dense, names []string, Z [][]float64, batch, d, epochs int, lr float64, rng *rand.Rand) (float64, error) {
	params := make([]bnn.Param, 2*len(layers))
	for i := range params {
		v := layers[i/2].W
		if i%2 == 1 {
			v = layers[i/2].B
		}
		params[i] = bnn.Param{Name: names[i], Value: v, Grad: make([]float64, len(v))}
	}
	opt := bnn.NewAdam(params, lr)
	n := len(Z)
	itersPerEpoch := (n + batch - 1) / batch
	perm := rng.Perm(n)
	pos := 0
	xb, eb := loss.buffers()
	last := math.NaN()
	for ep := 0; ep < epochs; ep++ {
		sum := 0.0
		for it := 0; it < itersPerEpoch; it++ {
			if err := ctx.Err(); err != nil {
				return 0, err
			}
			for r := 0; r < batch; r++ {
				if pos == n {
					perm, pos = rng.Perm(n), 0
				}
				copy(xb[r*d:(r+1)*d], Z[perm[pos]])
				pos++
			}
			for i := range eb {
				eb[i] = rng.NormFloat64()
			}
			l, err := loss.eval(params)
			if err != nil {
				return 0, err
			}
			if !finite(l) {
				return 0, fmt.Errorf("training loss became %v at epoch %d", l, ep+1)
			}
			sum += l
			opt.Step(params)
		}
		last = sum / float64(itersPerEpoch)
	}
	for _, l := range layers {
		if err := l.finite(); err != nil {
			return 0, fmt.Errorf("training produced a non-finite parameter: %v", err)
		}
	}
	return last, nil
}

// readGrads copies every parameter's gradient of the last run into params[i].Grad. The
// parameters' values must be the layers' slices.
func (t *gtrainer) readGrads(params []bnn.Param) error {
	for i, n := range t.params {
		d, ok := t.grads[i].Data().([]float64)
		if !ok || len(d) != len(params[i].Grad) {
			return fmt.Errorf("gradient of %s has %T of %d values, want %d float64s", n.Name(), t.grads[i].Data(), len(d), len(params[i].Grad))
		}
		copy(params[i].Grad, d)
		if v := n.Value().Data().([]float64); &v[0] != &params[i].Value[0] {
			return fmt.Errorf("parameter %s is no longer bound to its layer's storage (internal error)", n.Name())
		}
	}
	return nil
}
