package bnn

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/cfguard/cfguard/dataset"
)

// DefaultDropout is the paper's dropout probability for its MC Dropout networks (Table
// "Architecture of the MC Dropout": p = 0.5 after each hidden layer).
const DefaultDropout = 0.5

// FitDropout trains the paper's MC Dropout network on a data set: a deterministic MLP
// set.Features -> cfg.Hidden -> len(classes), ReLU between layers, dropout with probability p
// after every hidden layer, fitted by minibatch Adam (cfg.LR, cfg.BatchSize, cfg.Epochs, seeded
// by cfg.Seed) on the mean negative log-likelihood of the log-softmax outputs:
//
//	loss = (1/|B|) sum_{i in B} -log softmax(f(x_i; W, mask))[y_i],
//
// a fresh dropout mask per row and minibatch (inverted dropout: kept units scaled by
// 1 / (1 - p)). The initialisation is New's (PyTorch's U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for
// the weights); cfg.KLWeight, cfg.PriorSigma and cfg.Activation other than ReLU do not apply.
// The result is a Model with Dropout = p: its draws are dropout masks, so that Predict, Pool and
// the counterfactual generators average T stochastic forward passes (see Model.Dropout). The
// result is a deterministic function of (set, classes, p, cfg).
func FitDropout(ctx context.Context, set *dataset.Set, classes []string, p float64, cfg TrainConfig) (*Model, TrainStats, error) {
	start := time.Now()
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, TrainStats{}, err
	}
	switch {
	case !(p > 0 && p < 1):
		return nil, TrainStats{}, fmt.Errorf("fit dropout: dropout probability %v, want in (0, 1)", p)
	case cfg.Activation != ReLU:
		return nil, TrainStats{}, fmt.Errorf("fit dropout: activation %v, the MC Dropout network is ReLU only", cfg.Activation)
	case set == nil || len(set.X) == 0:
		return nil, TrainStats{}, errors.New("fit dropout: empty data set")
	case len(classes) < 2:
		return nil, TrainStats{}, fmt.Errorf("fit dropout: %d class names, need at least 2", len(classes))
	}
	d := len(set.X[0])
	if err := CheckLabels(set.Y, len(set.X), len(classes)); err != nil {
		return nil, TrainStats{}, fmt.Errorf("fit dropout: %w", err)
	}
	m := New(d, cfg.Hidden, classes, DefaultPriorSigma, rand.New(rand.NewPCG(cfg.Seed, 0xd409)))
	m.Dropout = p
	m.Scaler = FitScaler(set.X)
	if len(set.Features) == d {
		m.Features = append([]string(nil), set.Features...)
	}
	z, err := m.Standardize(set.X)
	if err != nil {
		return nil, TrainStats{}, fmt.Errorf("fit dropout: %w", err)
	}
	var params []Param
	for k := range m.Layers {
		l := &m.Layers[k]
		params = append(params, Param{Name: l.Name + ".weight", Value: l.WeightMu, Grad: make([]float64, len(l.WeightMu))},
			Param{Name: l.Name + ".bias", Value: l.BiasMu, Grad: make([]float64, len(l.BiasMu))})
	}
	opt := NewAdam(params, cfg.LR)
	rng := rand.New(rand.NewPCG(cfg.Seed, 0xd40f))
	n := len(set.X)
	tr := newDropoutPass(m)
	var st TrainStats
	for epoch := 1; epoch <= cfg.Epochs; epoch++ {
		perm := rng.Perm(n)
		loss, correct := 0.0, 0
		for lo := 0; lo < n; lo += cfg.BatchSize {
			if err := ctx.Err(); err != nil {
				return nil, st, fmt.Errorf("fit dropout: epoch %d: %w", epoch, err)
			}
			batch := perm[lo:min(lo+cfg.BatchSize, n)]
			for _, p := range params {
				clear(p.Grad)
			}
			for _, i := range batch {
				nll, ok := tr.step(z.RawRowView(i), set.Y[i], rng, params, 1/float64(len(batch)))
				loss += nll / float64(n)
				if ok {
					correct++
				}
			}
			opt.Step(params)
			st.Iterations++
		}
		if err := checkParams(params); err != nil {
			return nil, st, fmt.Errorf("fit dropout: epoch %d: %w", epoch, err)
		}
		st.Epochs, st.Loss, st.NLL, st.Accuracy = epoch, loss, loss, float64(correct)/float64(n)
		if cfg.Progress != nil {
			cfg.Progress(EpochStats{Epoch: epoch, Loss: loss, NLL: loss, Accuracy: st.Accuracy})
		}
	}
	if err := m.Validate(); err != nil {
		return nil, st, fmt.Errorf("fit dropout: result: %w", err)
	}
	st.Duration = time.Since(start)
	return m, st, nil
}

// dropoutPass holds the buffers of one row's forward and backward pass through an MC Dropout
// network.
type dropoutPass struct {
	m     *Model
	in    [][]float64 // in[k]: layer k's input after its dropout mask
	keep  [][]float64 // keep[k]: layer k's input mask (1 for the first layer)
	pre   [][]float64 // pre[k]: layer k's pre-activation
	grad  [][]float64 // grad[k]: d loss / d pre[k]
	probs []float64
}

func newDropoutPass(m *Model) *dropoutPass {
	t := &dropoutPass{m: m}
	for _, l := range m.Layers {
		t.in = append(t.in, make([]float64, l.In))
		t.keep = append(t.keep, make([]float64, l.In))
		t.pre = append(t.pre, make([]float64, l.Out))
		t.grad = append(t.grad, make([]float64, l.Out))
	}
	t.probs = make([]float64, m.NumClasses())
	return t
}

// step runs one row forward with a fresh dropout mask, adds scale x the gradient of its NLL to
// params' Grad (layer k's weight and bias at 2k and 2k+1), and returns the NLL and whether the
// label came first.
func (t *dropoutPass) step(x []float64, y int, rng *rand.Rand, params []Param, scale float64) (float64, bool) {
	m := t.m
	for k := range m.Layers {
		l := &m.Layers[k]
		t.keep[k] = m.dropoutMask(k, rng, t.keep[k])
		for i := range t.in[k] {
			var v float64
			if k == 0 {
				v = x[i]
			} else {
				v = math.Max(t.pre[k-1][i], 0)
			}
			t.in[k][i] = v * t.keep[k][i]
		}
		for o := 0; o < l.Out; o++ {
			s := l.BiasMu[o]
			w := l.WeightMu[o*l.In : (o+1)*l.In]
			for i, v := range t.in[k] {
				s += w[i] * v
			}
			t.pre[k][o] = s
		}
	}
	last := len(m.Layers) - 1
	Softmax(t.probs, t.pre[last])
	nll := -math.Log(math.Max(t.probs[y], 1e-300))
	best := 0
	for c, v := range t.probs {
		t.grad[last][c] = scale * v
		if v > t.probs[best] {
			best = c
		}
	}
	t.grad[last][y] -= scale
	for k := last; k >= 0; k-- {
		l := &m.Layers[k]
		gw, gb := params[2*k].Grad, params[2*k+1].Grad
		for o, g := range t.grad[k] {
			if g == 0 {
				continue
			}
			gb[o] += g
			row := gw[o*l.In : (o+1)*l.In]
			for i, v := range t.in[k] {
				row[i] += g * v
			}
		}
		if k == 0 {
			break
		}
		// d loss / d pre[k-1]_i = sum_o grad[k]_o W[o,i] keep[k]_i relu'(pre[k-1]_i)
		prev := t.grad[k-1]
		clear(prev)
		for o, g := range t.grad[k] {
			if g == 0 {
				continue
			}
			w := l.WeightMu[o*l.In : (o+1)*l.In]
			for i := range prev {
				prev[i] += g * w[i]
			}
		}
		for i := range prev {
			if t.pre[k-1][i] <= 0 {
				prev[i] = 0
			} else {
				prev[i] *= t.keep[k][i]
			}
		}
	}
	return nll, best == y
}
