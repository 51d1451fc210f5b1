package bnn

import (
	"errors"
	"math"
	"strings"
	"testing"

	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

// TestGraphBuilderComputes builds y = sum((mu + sigma*eps)^2) with sigma = exp(log_sigma) and
// checks y and its gradients against the closed forms
//
//	dy/dmu_j = 2 w_j,   dy/dlog_sigma_j = 2 w_j sigma_j eps_j,   w = mu + sigma*eps.
func TestGraphBuilderComputes(t *testing.T) {
	mu, ls, eps := []float64{0.5, -1, 2}, []float64{-1, 0, 0.3}, []float64{1.5, -0.2, 0.7}
	b := NewGraphBuilder("test")
	muN, _ := b.Input("mu", mu, 3)
	lsN, _ := b.Input("log_sigma", ls, 3)
	epsN, _ := b.Input("eps", eps, 3)
	b.Phase("forward")
	y := b.Sum(b.Square(b.Reparam(muN, b.Exp(lsN), epsN)))
	b.Phase("gradient")
	grads := b.Grad(y, muN, lsN)
	var yv, gmu, gls G.Value
	b.Read(y, &yv)
	b.Read(grads[0], &gmu)
	b.Read(grads[1], &gls)
	vm, err := b.Compile()
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	if err := vm.RunAll(); err != nil {
		t.Fatal(err)
	}
	want := 0.0
	for j := range mu {
		s := math.Exp(ls[j])
		w := mu[j] + s*eps[j]
		want += w * w
		if got := gmu.Data().([]float64)[j]; math.Abs(got-2*w) > 1e-12 {
			t.Errorf("dy/dmu[%d] = %v, want %v", j, got, 2*w)
		}
		if got := gls.Data().([]float64)[j]; math.Abs(got-2*w*s*eps[j]) > 1e-12 {
			t.Errorf("dy/dlog_sigma[%d] = %v, want %v", j, got, 2*w*s*eps[j])
		}
	}
	if got := yv.Data().(float64); math.Abs(got-want) > 1e-12 {
		t.Errorf("y = %v, want %v", got, want)
	}
}

// TestGraphBuilderFirstError checks that the first failure is kept, named by the builder, its
// phase, the op and its operands, and that nothing after it is built.
func TestGraphBuilderFirstError(t *testing.T) {
	b := NewGraphBuilder("test")
	x, _ := b.Input("x", nil, 2, 3)
	v, _ := b.Input("v", nil, 4)
	b.Phase("forward")
	bad := b.Mul(x, v) // (2x3) x (4): shapes do not fit
	if bad != nil {
		t.Fatal("Mul of a 2x3 matrix and a 4-vector built a node")
	}
	if n := b.Exp(x); n != nil {
		t.Error("an op after the first error built a node")
	}
	b.Phase("later")
	b.Activation(Activation(9), x)
	b.Read(x, new(G.Value))
	_, err := b.Compile()
	if err == nil {
		t.Fatal("Compile after a failure: no error")
	}
	if !strings.HasPrefix(err.Error(), "test: forward: Mul(x, v): ") {
		t.Errorf("error %q does not name the builder, the phase and the op", err)
	}
	if b.Err() != err {
		t.Errorf("Err() = %v, Compile %v", b.Err(), err)
	}
}

func TestGraphBuilderRejects(t *testing.T) {
	for _, tc := range []struct {
		name, want string
		build      func(b *GraphBuilder)
	}{
		{"data of the wrong length", "test: inputs: x: gorgonia panicked", func(b *GraphBuilder) {
			b.Input("x", []float64{1, 2, 3}, 2, 2)
		}},
		{"unknown activation", "test: inputs: Activation(9)(x): unknown activation 9", func(b *GraphBuilder) {
			x, _ := b.Input("x", nil, 2)
			b.Read(b.Activation(Activation(9), x), new(G.Value))
		}},
		{"nil operand", "test: inputs: Add(x, <nil>): nil operand", func(b *GraphBuilder) {
			x, _ := b.Input("x", nil, 2)
			b.Add(x, nil)
		}},
		{"nothing read", "test: compile: nothing is read", func(b *GraphBuilder) {
			b.Input("x", nil, 2)
		}},
	} {
		b := NewGraphBuilder("test")
		tc.build(b)
		if _, err := b.Compile(); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want it to start with %q", tc.name, err, tc.want)
		}
	}
}

// TestInputsRunNamesAChangedInput: a run that fails because an input's tensor was changed behind
// the graph's back says which input and how; a run with its inputs as made says nothing more.
func TestInputsRunNamesAChangedInput(t *testing.T) {
	b := NewGraphBuilder("test")
	x, xv := b.Input("x", []float64{1, 2, 3, 4, 5, 6}, 2, 3)
	w, _ := b.Input("w", []float64{1, 0, 0, 1, 1, 1}, 3, 2)
	var yv G.Value
	b.Read(b.Sum(b.Mul(x, w)), &yv)
	vm, err := b.Compile()
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	in := b.Inputs()
	if err := in.Run(vm); err != nil {
		t.Fatalf("a run with its inputs as made: %v", err)
	}
	if got := yv.Data().(float64); got != 30 { // x w = (1+3, 2+3; 4+6, 5+6), summed
		t.Fatalf("y = %v, want 30", got)
	}
	vm.Reset()
	if err := xv.Reshape(3, 2); err != nil {
		t.Fatal(err)
	}
	err = in.Run(vm)
	if err == nil || errors.Unwrap(err) == nil {
		t.Fatalf("a run with x reshaped: err = %v, want gorgonia's error wrapped", err)
	}
	if want := "(inputs changed during the run: x has shape [3 2] and strides [2 1], made [2 3] and [3 1])"; !strings.HasSuffix(err.Error(), want) {
		t.Fatalf("a run with x reshaped: %v, want it to end %q", err, want)
	}
}

// TestInputsChanged: an input is named when its tensor has another shape, or holds storage other
// than the slice it was made with (another array, or another length), and only then; an input
// changed both ways says both (its tensor's shape alone changes on a reshape, its shape and
// storage together when the tensor was rebuilt). A changed shape comes with the strides: a
// reshape changes them too, a shape written into the tensor's own shape slice leaves them.
func TestInputsChanged(t *testing.T) {
	data := []float64{1, 2}
	overwritten := tensor.New(tensor.WithBacking([]float64{1, 2, 3, 4}), tensor.WithShape(2, 2))
	s := overwritten.Shape()
	s[0], s[1] = 1, 4 // what another owner of the shape's slice writes
	for _, tc := range []struct {
		name string
		in   boundInput
		want string
	}{
		{"as made", boundInput{name: "a", t: tensor.New(tensor.WithBacking(data), tensor.WithShape(2)), data: data, shape: []int{2}, strides: []int{1}}, ""},
		{"another shape", boundInput{name: "a", t: tensor.New(tensor.WithBacking(data), tensor.WithShape(1, 2)), data: data, shape: []int{2}, strides: []int{1}},
			"a has shape [1 2] and strides [2 1], made [2] and [1]"},
		{"its shape slice written over", boundInput{name: "a", t: overwritten, data: overwritten.Data().([]float64), shape: []int{2, 2}, strides: []int{2, 1}},
			"a has shape [1 4] and strides [2 1], made [2 2] and [2 1]"},
		{"another array, the same values", boundInput{name: "a", t: tensor.New(tensor.WithBacking([]float64{1, 2})), data: data, shape: []int{2}, strides: []int{1}},
			"a holds other storage (2 float64 values, made with 2)"},
		{"another type", boundInput{name: "a", t: tensor.New(tensor.WithBacking([]float32{1, 2})), data: data, shape: []int{2}, strides: []int{1}},
			"a holds other storage (0 float64 values, made with 2)"},
		{"another shape and another array", boundInput{name: "a", t: tensor.New(tensor.WithBacking([]float64{1, 2, 3}), tensor.WithShape(1, 3)), data: data, shape: []int{2}, strides: []int{1}},
			"a has shape [1 3] and strides [3 1], made [2] and [1], and holds other storage (3 float64 values, made with 2)"},
	} {
		if got := (Inputs{tc.in}).changed(); got != tc.want {
			t.Errorf("%s: changed() = %q, want %q", tc.name, got, tc.want)
		}
	}
	two := Inputs{
		{name: "a", t: tensor.New(tensor.WithBacking(data), tensor.WithShape(1, 2)), data: data, shape: []int{2}, strides: []int{1}},
		{name: "b", t: tensor.New(tensor.WithBacking([]float64{3}), tensor.WithShape(1)), data: []float64{3}, shape: []int{1}, strides: []int{1}},
	}
	if got, want := two.changed(), "a has shape [1 2] and strides [2 1], made [2] and [1]; b holds other storage (1 float64 values, made with 1)"; got != want {
		t.Errorf("two changed: %q, want %q", got, want)
	}
}
