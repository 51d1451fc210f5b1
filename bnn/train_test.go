package bnn_test

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/dataset"
)

// testAccuracy is the fraction of rows whose posterior-predictive argmax (S = 200 draws) is the
// label.
func testAccuracy(t *testing.T, m *bnn.Model, X [][]float64, y []int) float64 {
	t.Helper()
	p, err := m.Predict(X, 200, 1)
	if err != nil {
		t.Fatal(err)
	}
	c := 0
	for i := range y {
		if p.Argmax(i) == y[i] {
			c++
		}
	}
	return float64(c) / float64(len(y))
}

// TestFitBreastCancer trains with the defaults on a seeded 80/20 split of the bundled breast
// cancer data. The paper's BNN reaches 95.6%; we require >= 93% on the held-out 20%.
func TestFitBreastCancer(t *testing.T) {
	set, d, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	train, test := set.Split(0.8, 1)
	var epochs []bnn.EpochStats
	m, st, err := bnn.Fit(context.Background(), train, d.Classes, bnn.TrainConfig{Seed: 1, Progress: func(e bnn.EpochStats) { epochs = append(epochs, e) }})
	if err != nil {
		t.Fatal(err)
	}
	acc := testAccuracy(t, m, test.X, test.Y)
	t.Logf("test accuracy %.4f (n=%d), train stats %+v", acc, len(test.Y), st)
	if acc < 0.93 {
		t.Errorf("test accuracy %.4f < 0.93", acc)
	}
	if len(epochs) != bnn.DefaultEpochs || st.Epochs != bnn.DefaultEpochs {
		t.Errorf("progress called %d times, stats say %d epochs, want %d", len(epochs), st.Epochs, bnn.DefaultEpochs)
	}
	if first, last := epochs[0], epochs[len(epochs)-1]; !(last.NLL < first.NLL) {
		t.Errorf("NLL did not fall: epoch 1 %.4f, last %.4f", first.NLL, last.NLL)
	}
	if err := m.Validate(); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(m.Features, set.Features) || !reflect.DeepEqual(m.Classes, d.Classes) || m.Version != 0 {
		t.Errorf("features/classes/version not set: %v %v %d", m.Features, m.Classes, m.Version)
	}
	// The reported KL is the closed form to the prior over every parameter.
	if want := klToPrior(m); math.Abs(st.KL-want) > 1e-9*want {
		t.Errorf("reported KL %.12g, closed form of the result %.12g", st.KL, want)
	}
}

// TestFitTanh trains a tanh network: the result is a tanh model (its predictions differ from the
// same weights under ReLU) that classifies the held-out breast-cancer rows well. The training
// defaults were tuned for ReLU (which reaches >= 93%); tanh with the same defaults reaches 93.0%
// (106/114), so the bar here is 90%: this test is about honouring the activation.
func TestFitTanh(t *testing.T) {
	set, d, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	train, test := set.Split(0.8, 1)
	m, _, err := bnn.Fit(context.Background(), train, d.Classes, bnn.TrainConfig{Seed: 1, Activation: bnn.Tanh})
	if err != nil {
		t.Fatal(err)
	}
	if m.Activation != bnn.Tanh {
		t.Fatalf("Fit returned a %v model", m.Activation)
	}
	acc := testAccuracy(t, m, test.X, test.Y)
	t.Logf("tanh test accuracy %.4f", acc)
	if acc < 0.90 {
		t.Errorf("tanh test accuracy %.4f < 0.90", acc)
	}
	relu := m.Clone()
	relu.Activation = bnn.ReLU
	a, _ := m.Predict(test.X[:5], 50, 1)
	b, _ := relu.Predict(test.X[:5], 50, 1)
	same := true
	for i := range a.Mean {
		same = same && math.Abs(a.Mean[i]-b.Mean[i]) < 1e-6
	}
	if same {
		t.Error("the tanh model predicts like the same weights under relu")
	}
	if _, _, err := bnn.Fit(context.Background(), train, d.Classes, bnn.TrainConfig{Seed: 1, Epochs: 1, Activation: 9}); err == nil || !strings.Contains(err.Error(), "activation") {
		t.Errorf("unknown activation: %v", err)
	}
}

func klToPrior(m *bnn.Model) float64 {
	lp := math.Log(m.PriorSigma)
	s := 0.0
	for _, l := range m.Layers {
		for _, p := range [][2][]float64{{l.WeightMu, l.WeightLogSigma}, {l.BiasMu, l.BiasLogSigma}} {
			for i, mu := range p[0] {
				ls := p[1][i]
				s += lp - ls + (math.Exp(2*ls)+mu*mu)/(2*m.PriorSigma*m.PriorSigma) - 0.5
			}
		}
	}
	return s
}

// TestTrainDeterministic checks that equal seeds give bit-identical models and different seeds
// different ones.
func TestTrainDeterministic(t *testing.T) {
	set, d, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	fit := func(seed uint64) *bnn.Model {
		m, _, err := bnn.Fit(context.Background(), set, d.Classes, bnn.TrainConfig{Epochs: 3, Seed: seed})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	a, b, c := fit(7), fit(7), fit(8)
	for k := range a.Layers {
		if !bnn.LayersEqual(&a.Layers[k], &b.Layers[k]) {
			t.Errorf("layer %d differs between two runs with seed 7", k)
		}
	}
	if bnn.LayersEqual(a.Last(), c.Last()) {
		t.Error("seeds 7 and 8 gave identical last layers")
	}
}

func tinySet() *dataset.Set {
	rng := rand.New(rand.NewPCG(3, 3))
	s := &dataset.Set{Features: []string{"a", "b"}, NumClasses: 2}
	for i := 0; i < 20; i++ {
		x := []float64{rng.NormFloat64(), rng.NormFloat64()}
		s.X = append(s.X, x)
		s.Y = append(s.Y, map[bool]int{true: 1, false: 0}[x[0]+x[1] > 0])
	}
	return s
}

// TestTrainRejects checks that bad inputs, a cancelled context and a diverging run are refused
// with a clear error and leave the model as it was.
func TestTrainRejects(t *testing.T) {
	s := tinySet()
	m, _, err := bnn.Fit(context.Background(), s, []string{"n", "p"}, bnn.TrainConfig{Epochs: 2, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	nan := [][]float64{{1, 2}, {math.NaN(), 0}}
	short := [][]float64{{1, 2}, {3}}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		X    [][]float64
		y    []int
		cfg  bnn.TrainConfig
		want string
		is   error
	}{
		{"NaN feature", context.Background(), nan, []int{0, 1}, bnn.TrainConfig{}, "NaN", nil},
		{"wrong dimension", context.Background(), short, []int{0, 1}, bnn.TrainConfig{}, "features", nil},
		{"label out of range", context.Background(), s.X[:2], []int{0, 2}, bnn.TrainConfig{}, "label 2", nil},
		{"negative label", context.Background(), s.X[:2], []int{-1, 0}, bnn.TrainConfig{}, "label -1", nil},
		{"label count", context.Background(), s.X[:2], []int{0}, bnn.TrainConfig{}, "1 labels for 2 rows", nil},
		{"no rows", context.Background(), nil, nil, bnn.TrainConfig{}, "no inputs", nil},
		{"negative lr", context.Background(), s.X, s.Y, bnn.TrainConfig{LR: -1}, "learning rate", nil},
		{"negative epochs", context.Background(), s.X, s.Y, bnn.TrainConfig{Epochs: -1}, "epochs", nil},
		{"negative batch size", context.Background(), s.X, s.Y, bnn.TrainConfig{BatchSize: -1}, "batch size -1", nil},
		{"negative KL weight", context.Background(), s.X, s.Y, bnn.TrainConfig{KLWeight: -1}, "KL weight -1", nil},
		{"NaN KL weight", context.Background(), s.X, s.Y, bnn.TrainConfig{KLWeight: math.NaN()}, "KL weight NaN", nil},
		{"negative prior sigma", context.Background(), s.X, s.Y, bnn.TrainConfig{PriorSigma: -0.1}, "prior sigma -0.1", nil},
		{"a hidden layer of no units", context.Background(), s.X, s.Y, bnn.TrainConfig{Hidden: []int{4, 0}}, "hidden layer 1 has width 0", nil},
		{"cancelled", cancelled, s.X, s.Y, bnn.TrainConfig{}, "", context.Canceled},
		{"diverging", context.Background(), s.X, s.Y, bnn.TrainConfig{Epochs: 5, LR: 1e300}, "", bnn.ErrNonFinite},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := m.Clone()
			_, err := bnn.Train(tc.ctx, m, tc.X, tc.y, tc.cfg)
			if err == nil {
				t.Fatal("no error")
			}
			if tc.want != "" && !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not mention %q", err, tc.want)
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Errorf("error %q is not %v", err, tc.is)
			}
			if !reflect.DeepEqual(before, m) {
				t.Error("model changed by a failed Train")
			}
		})
	}
	for _, tc := range []struct {
		name    string
		set     *dataset.Set
		classes []string
		want    string
	}{
		{"label beyond class names", s, []string{"only"}, "class names"},
		{"label beyond class names (3 classes)", &dataset.Set{X: [][]float64{{1}, {2}}, Y: []int{0, 3}}, []string{"a", "b", "c"}, "label 3"},
		{"ragged rows", &dataset.Set{X: [][]float64{{1, 2}, {2}}, Y: []int{0, 1}}, []string{"a", "b"}, "row 1 has 1 features"},
		{"feature names", &dataset.Set{Features: []string{"a"}, X: [][]float64{{1, 2}, {2, 3}}, Y: []int{0, 1}}, []string{"a", "b"}, "feature names"},
		{"infinite feature", &dataset.Set{X: [][]float64{{1, math.Inf(1)}, {2, 3}}, Y: []int{0, 1}}, []string{"a", "b"}, "+Inf"},
		{"empty", &dataset.Set{}, []string{"a", "b"}, "empty"},
	} {
		if _, _, err := bnn.Fit(context.Background(), tc.set, tc.classes, bnn.TrainConfig{Epochs: 1}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Fit %s: error %v, want one mentioning %q", tc.name, err, tc.want)
		}
	}
}

// The training loss is the mean NLL of the rows plus KLWeight / n times KL(q || prior): each
// row counts 1 / KLWeight times as much as the prior (ten times at the default 0.1). One epoch
// of one batch with a learning rate too small to move the parameters, so that the KL Train
// reports after the step is the one the loss was computed with.
func TestTrainWeighsTheKLByKLWeightOverRows(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 9))
	X := make([][]float64, 30)
	y := make([]int, len(X))
	for i := range X {
		X[i] = []float64{rng.NormFloat64(), rng.NormFloat64(), rng.NormFloat64()}
		y[i] = i % 2
	}
	for _, w := range []float64{bnn.DefaultKLWeight, 1, 3} {
		m := bnn.New(3, []int{4}, []string{"a", "b"}, 1, rand.New(rand.NewPCG(1, 2)))
		m.Scaler = bnn.FitScaler(X)
		st, err := bnn.Train(context.Background(), m, X, y, bnn.TrainConfig{Epochs: 1, BatchSize: len(X), LR: 1e-15, KLWeight: w, Seed: 4})
		if err != nil {
			t.Fatal(err)
		}
		got, want := (st.Loss-st.NLL)/st.KL, w/float64(len(X))
		if math.Abs(got-want) > 1e-6*want {
			t.Errorf("KLWeight %g: (loss - NLL) / KL = %.9g, want KLWeight / n = %.9g", w, got, want)
		}
	}
}
