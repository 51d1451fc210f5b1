package bnn

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/cfguard/cfguard/dataset"
)

// Training defaults, applied by Train and Fit to zero fields of TrainConfig. They were chosen to
// reach the paper's ~95% test accuracy on the bundled breast_cancer data (80/20 split) within a
// couple of seconds on two cores; see the package tests for the measured figures.
const (
	DefaultEpochs    = 30
	DefaultBatchSize = 64
	DefaultLR        = 0.01
	// DefaultKLWeight multiplies KL / N in the loss (see Train).
	DefaultKLWeight = 0.1
)

// TrainConfig configures Bayes-by-backprop training. Zero fields take the defaults above.
type TrainConfig struct {
	Epochs    int     // passes over the data. Default DefaultEpochs.
	BatchSize int     // rows per minibatch (the last one may be shorter). Default DefaultBatchSize.
	LR        float64 // Adam learning rate. Default DefaultLR.
	KLWeight  float64 // weight of KL / N in the loss. Default DefaultKLWeight.
	Seed      uint64  // seeds shuffling and the weight noise; equal seeds give bit-identical models.
	// Hidden is the hidden layer widths for Fit (Train keeps the model's). Default DefaultHidden.
	Hidden []int
	// Activation is the hidden layers' non-linearity for Fit (Train keeps the model's). Default
	// ReLU (the zero value).
	Activation Activation
	// PriorSigma is the prior N(0, PriorSigma^2) of the KL term. Default: the model's
	// PriorSigma in Train, DefaultPriorSigma in Fit. Train records it in the model on success.
	PriorSigma float64
	// Progress, when set, is called after every epoch from Train's goroutine.
	Progress func(EpochStats)
}

// EpochStats summarises one epoch. Loss and NLL are means over the epoch's rows of the
// minibatch values; KL is KL(q || prior) after the epoch; Accuracy is the fraction of rows whose
// sampled network (the draw used for the gradient) put the label first.
type EpochStats struct {
	Epoch    int // 1-based
	Loss     float64
	NLL      float64
	KL       float64
	Accuracy float64
}

// TrainStats summarises a training run: the last epoch's figures plus totals.
type TrainStats struct {
	Epochs     int
	Iterations int // Adam iterations taken
	Loss       float64
	NLL        float64
	KL         float64
	Accuracy   float64
	Duration   time.Duration
}

// withDefaults returns cfg with zero fields replaced by the defaults.
func (cfg TrainConfig) withDefaults() TrainConfig {
	cfg.Epochs = cmp.Or(cfg.Epochs, DefaultEpochs)
	cfg.BatchSize = cmp.Or(cfg.BatchSize, DefaultBatchSize)
	cfg.LR = cmp.Or(cfg.LR, DefaultLR)
	cfg.KLWeight = cmp.Or(cfg.KLWeight, DefaultKLWeight)
	if len(cfg.Hidden) == 0 {
		cfg.Hidden = DefaultHidden
	}
	return cfg
}

func (cfg TrainConfig) validate() error {
	switch {
	case cfg.Epochs < 1:
		return fmt.Errorf("train: epochs %d, want >= 1", cfg.Epochs)
	case cfg.BatchSize < 1:
		return fmt.Errorf("train: batch size %d, want >= 1", cfg.BatchSize)
	case !(cfg.LR > 0) || math.IsInf(cfg.LR, 0):
		return fmt.Errorf("train: learning rate %v, want finite and > 0", cfg.LR)
	case !(cfg.KLWeight >= 0) || math.IsInf(cfg.KLWeight, 0):
		return fmt.Errorf("train: KL weight %v, want finite and >= 0", cfg.KLWeight)
	case cfg.PriorSigma < 0 || math.IsNaN(cfg.PriorSigma) || math.IsInf(cfg.PriorSigma, 0):
		return fmt.Errorf("train: prior sigma %v, want finite and > 0 (or 0 for the default)", cfg.PriorSigma)
	}
	if !cfg.Activation.valid() {
		return fmt.Errorf("train: unknown activation %d", uint8(cfg.Activation))
	}
	for i, h := range cfg.Hidden {
		if h < 1 {
			return fmt.Errorf("train: hidden layer %d has width %d, want >= 1", i, h)
		}
	}
	return nil
}

// CheckLabels verifies that y has one label per row and every label is a class index in
// [0, classes).
func CheckLabels(y []int, rows, classes int) error {
	if len(y) != rows {
		return fmt.Errorf("%d labels for %d rows", len(y), rows)
	}
	for i, c := range y {
		if c < 0 || c >= classes {
			return fmt.Errorf("label %d of row %d out of range [0, %d)", c, i, classes)
		}
	}
	return nil
}

// Train fits every layer of m to (X, y) in place by Bayes-by-backprop (Blundell et al. 2015)
// with Adam. X holds raw features; they are standardised with m.Scaler. Each minibatch B of a
// seeded shuffle takes one Adam iteration on
//
//	loss = (1/|B|) sum_{i in B} -log p(y_i | x_i, w) + KLWeight * KL(q || N(0, PriorSigma^2)) / N,
//	w = mu + exp(log_sigma) * eps,   eps ~ N(0, 1) drawn afresh for every minibatch,
//
// where N = len(X) and the KL is the closed form summed over every weight and bias. The result is
// a deterministic function of (m, X, y, cfg).
//
// m changes only when training succeeds: on a cancelled ctx (checked before every minibatch), a
// bad input, or a loss, gradient or parameter that becomes NaN or infinite (ErrNonFinite), Train
// returns an error and leaves m as it was.
func Train(ctx context.Context, m *Model, X [][]float64, y []int, cfg TrainConfig) (TrainStats, error) {
	start := time.Now()
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return TrainStats{}, err
	}
	if err := m.Validate(); err != nil {
		return TrainStats{}, fmt.Errorf("train: %w", err)
	}
	z, err := m.Standardize(X)
	if err != nil {
		return TrainStats{}, fmt.Errorf("train: %w", err)
	}
	if err := CheckLabels(y, len(X), m.NumClasses()); err != nil {
		return TrainStats{}, fmt.Errorf("train: %w", err)
	}
	work := m.Clone()
	if cfg.PriorSigma > 0 {
		work.PriorSigma = cfg.PriorSigma
	}
	n := len(X)
	gr, err := NewGraph(work, GraphConfig{Batch: min(cfg.BatchSize, n), KLScale: cfg.KLWeight / float64(n)})
	if err != nil {
		return TrainStats{}, fmt.Errorf("train: %w", err)
	}
	defer gr.Close()

	rng := rand.New(rand.NewPCG(cfg.Seed, 0x7a41))
	opt := NewAdam(gr.Params(), cfg.LR)
	rows := make([][]float64, 0, gr.Batch())
	labels := make([]int, 0, gr.Batch())
	var st TrainStats
	for epoch := 1; epoch <= cfg.Epochs; epoch++ {
		perm := rng.Perm(n)
		var es EpochStats
		correct := 0
		for lo := 0; lo < n; lo += gr.Batch() {
			if err := ctx.Err(); err != nil {
				return st, fmt.Errorf("train: epoch %d: %w", epoch, err)
			}
			rows, labels = rows[:0], labels[:0]
			for _, i := range perm[lo:min(lo+gr.Batch(), n)] {
				rows, labels = append(rows, z.RawRowView(i)), append(labels, y[i])
			}
			if err := gr.SetBatch(rows, labels); err != nil {
				return st, fmt.Errorf("train: %w", err)
			}
			gr.DrawEps(rng)
			ev, err := gr.Run()
			if err != nil {
				return st, fmt.Errorf("train: epoch %d iteration %d: %w", epoch, st.Iterations+1, err)
			}
			opt.Step(gr.Params())
			st.Iterations++
			w := float64(ev.Rows) / float64(n)
			es.Loss += w * ev.Loss
			es.NLL += w * ev.NLL
			correct += ev.Correct
		}
		if err := checkParams(gr.Params()); err != nil {
			return st, fmt.Errorf("train: epoch %d: %w", epoch, err)
		}
		es.Epoch, es.KL, es.Accuracy = epoch, gr.KL(), float64(correct)/float64(n)
		st.Epochs, st.Loss, st.NLL, st.KL, st.Accuracy = epoch, es.Loss, es.NLL, es.KL, es.Accuracy
		if cfg.Progress != nil {
			cfg.Progress(es)
		}
	}
	if err := gr.WriteTo(work); err != nil {
		return st, fmt.Errorf("train: %w", err)
	}
	if err := work.Validate(); err != nil {
		return st, fmt.Errorf("train: result: %w", err)
	}
	// Train fits every layer to (X, y) from the model's initial parameters: the posterior stands
	// for these rows.
	m.Layers, m.PriorSigma, m.Records = work.Layers, work.PriorSigma, float64(n)
	st.Duration = time.Since(start)
	return st, nil
}

// checkParams fails with ErrNonFinite if any parameter is NaN or infinite.
func checkParams(ps []Param) error {
	for _, p := range ps {
		for j, v := range p.Value {
			if !finite(v) {
				return fmt.Errorf("%s[%d] = %v: %w", p.Name, j, v, ErrNonFinite)
			}
		}
	}
	return nil
}

// Fit trains a new model on a data set: it fits the scaler on set.X, initialises a network
// set.Features -> cfg.Hidden -> len(classes) with cfg.Activation between layers and torchbnn's
// initialisation (seeded by cfg.Seed)
// and prior sigma cfg.PriorSigma (default DefaultPriorSigma), and runs Train. classes names the
// labels; every label must be below len(classes), and there must be at least two classes.
func Fit(ctx context.Context, set *dataset.Set, classes []string, cfg TrainConfig) (*Model, TrainStats, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, TrainStats{}, err
	}
	if set == nil || len(set.X) == 0 {
		return nil, TrainStats{}, errors.New("fit: empty data set")
	}
	if len(classes) < 2 {
		return nil, TrainStats{}, fmt.Errorf("fit: %d class names, need at least 2", len(classes))
	}
	d := len(set.X[0])
	if d == 0 {
		return nil, TrainStats{}, errors.New("fit: rows have no features")
	}
	if len(set.Features) != 0 && len(set.Features) != d {
		return nil, TrainStats{}, fmt.Errorf("fit: %d feature names for %d features", len(set.Features), d)
	}
	for i, x := range set.X {
		if len(x) != d {
			return nil, TrainStats{}, fmt.Errorf("fit: row %d has %d features, row 0 has %d", i, len(x), d)
		}
		for j, v := range x {
			if !finite(v) {
				return nil, TrainStats{}, fmt.Errorf("fit: row %d feature %d is %v", i, j, v)
			}
		}
	}
	if err := CheckLabels(set.Y, len(set.X), len(classes)); err != nil {
		return nil, TrainStats{}, fmt.Errorf("fit: %w", err)
	}
	ps := cfg.PriorSigma
	ps = cmp.Or(ps, DefaultPriorSigma)
	m := New(d, cfg.Hidden, classes, ps, rand.New(rand.NewPCG(cfg.Seed, 0x1417)))
	m.Activation = cfg.Activation
	m.Scaler = FitScaler(set.X)
	m.Features = append([]string(nil), set.Features...)
	if len(m.Features) == 0 {
		m.Features = nil
	}
	st, err := Train(ctx, m, set.X, set.Y, cfg)
	if err != nil {
		return nil, st, fmt.Errorf("fit: %w", err)
	}
	return m, st, nil
}

// Adam is the Adam optimiser (Kingma and Ba 2015) with PyTorch's defaults
// (beta1 = 0.9, beta2 = 0.999, epsilon = 1e-8) and no weight decay. For each parameter p with
// gradient g, at iteration t:
//
//	m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2,
//	p -= LR * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + epsilon).
//
// Each iteration moves a parameter by at most about LR, whatever the gradient's scale.
type Adam struct {
	LR, Beta1, Beta2, Epsilon float64
	t                         int
	m, v                      [][]float64
}

// NewAdam returns an optimiser for params with zeroed moments.
func NewAdam(params []Param, lr float64) *Adam {
	a := &Adam{LR: lr, Beta1: 0.9, Beta2: 0.999, Epsilon: 1e-8}
	for _, p := range params {
		a.m = append(a.m, make([]float64, len(p.Value)))
		a.v = append(a.v, make([]float64, len(p.Value)))
	}
	return a
}

// Step updates every params[i].Value in place from params[i].Grad. params must be the slice the
// optimiser was created with.
func (a *Adam) Step(params []Param) {
	a.t++
	c1 := 1 - math.Pow(a.Beta1, float64(a.t))
	c2 := 1 - math.Pow(a.Beta2, float64(a.t))
	for i, p := range params {
		m, v := a.m[i], a.v[i]
		for j, g := range p.Grad {
			m[j] = a.Beta1*m[j] + (1-a.Beta1)*g
			v[j] = a.Beta2*v[j] + (1-a.Beta2)*g*g
			p.Value[j] -= a.LR * (m[j] / c1) / (math.Sqrt(v[j]/c2) + a.Epsilon)
		}
	}
}
