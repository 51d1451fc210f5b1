package bnn

import (
	"math"
	"strings"
	"testing"

	G "gorgonia.org/gorgonia"
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
