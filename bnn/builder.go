package bnn

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

// GraphBuilder builds a gorgonia expression graph in named phases and keeps the first error.
// Every autodiff graph of cfguard is built with it: this package's Bayes-by-backprop objective
// (Graph), explain's counterfactual objective and the training losses of explain's VAE and AE.
// A build reads as a sequence of phases:
//
//	b := NewGraphBuilder("graph")
//	b.Phase("inputs")     // Input, Scalar, Const: the values bound once or rebound per run
//	b.Phase("forward")    // Reparam, Activation, LogSoftMax and the ops: the sampled networks
//	b.Phase("loss")       // the loss terms, added up with Accum
//	b.Phase("gradient")   // Grad, and Read for every value the caller wants after a run
//	vm, err := b.Compile()
//
// After the first failure every method does nothing and returns nil (no gorgonia call is made on
// a nil node), so a phase needs no error checks of its own: Compile returns the failure as
//
//	<name>: <phase>: <op>(<operands>): <cause>
//
// naming the operands by their node names (inputs by the name given to Input, Scalar or Const,
// intermediate nodes by gorgonia's op(%id, ...)). gorgonia's construction panics (a value that
// does not fit its shape, a failed compilation) are recorded the same way. A GraphBuilder is not
// safe for concurrent use; it is used for one graph.
type GraphBuilder struct {
	g      *G.ExprGraph
	name   string
	phase  string
	err    error
	reads  []reading
	inputs Inputs
	// box gives the place read i's node writes its value to (Compile): new(G.Value) unless a
	// test sets another.
	box func(i int) *G.Value
}

// NewGraphBuilder starts an empty graph; name prefixes every error.
func NewGraphBuilder(name string) *GraphBuilder {
	return &GraphBuilder{g: G.NewGraph(), name: name, phase: "inputs", box: func(int) *G.Value { return new(G.Value) }}
}

// Phase names the nodes added from now on in errors ("inputs" until the first call).
func (b *GraphBuilder) Phase(name string) { b.phase = name }

// Err is the first error recorded, nil if none.
func (b *GraphBuilder) Err() error { return b.err }

// fail records err as the first error, attributed to the current phase and what.
func (b *GraphBuilder) fail(what string, err error) {
	if b.err == nil {
		b.err = fmt.Errorf("%s: %s: %s: %w", b.name, b.phase, what, err)
	}
}

// node runs one gorgonia construction, unless an error is already recorded or an operand is
// nil, and records its error or panic under op(operands).
func (b *GraphBuilder) node(op string, f func() (*G.Node, error), operands ...*G.Node) (n *G.Node) {
	if b.err != nil {
		return nil
	}
	for _, o := range operands {
		if o == nil {
			b.fail(describe(op, operands), fmt.Errorf("nil operand"))
			return nil
		}
	}
	defer func() {
		if r := recover(); r != nil {
			b.fail(describe(op, operands), fmt.Errorf("gorgonia panicked: %v", r))
			n = nil
		}
	}()
	n, err := f()
	if err != nil {
		b.fail(describe(op, operands), err)
		return nil
	}
	return n
}

func describe(op string, operands []*G.Node) string {
	if len(operands) == 0 {
		return op
	}
	names := make([]string, len(operands))
	for i, o := range operands {
		names[i] = "<nil>"
		if o != nil {
			names[i] = o.Name()
		}
	}
	return op + "(" + strings.Join(names, ", ") + ")"
}

// Input adds a float64 variable named name of the given shape whose value aliases data (zeros of
// the shape's size when data is nil), and returns it with its tensor: writing into the tensor's
// data and calling gorgonia.Let(node, tensor) rebinds it before a run.
func (b *GraphBuilder) Input(name string, data []float64, shape ...int) (*G.Node, *tensor.Dense) {
	var t *tensor.Dense
	n := b.node(name, func() (*G.Node, error) {
		if data == nil {
			data = make([]float64, tensor.Shape(shape).TotalSize())
		}
		t = tensor.New(tensor.WithBacking(data), tensor.WithShape(shape...))
		return G.NewTensor(b.g, tensor.Float64, len(shape), G.WithShape(shape...), G.WithName(name), G.WithValue(t)), nil
	})
	if n == nil {
		return nil, nil
	}
	b.inputs = append(b.inputs, boundInput{name: name, t: t, data: data, shape: slices.Clone(shape), strides: slices.Clone(t.Strides())})
	return n, t
}

// Inputs are the tensors a graph's Input nodes hold, each with the storage and shape it was made
// with. The graph's code writes into their storage and never reshapes them; gorgonia's ops
// transpose some in place for the length of one op.
type Inputs []boundInput

type boundInput struct {
	name    string
	t       *tensor.Dense
	data    []float64
	shape   []int
	strides []int
}

// Inputs returns the inputs added so far.
func (b *GraphBuilder) Inputs() Inputs { return slices.Clone(b.inputs) }

// Run runs vm once. When the run fails, the error also names every input whose tensor no longer
// has the shape or the storage it was made with: a run that fails with its inputs as made is the
// graph's error; one that fails with an input changed points at whatever changed it (a program
// that writes another node's value into the input's place, as one compiled from two nodes taken
// for one would: Compile; gorgonia's machine and its package-level pools of tensors and shapes,
// which every graph shares).
func (in Inputs) Run(vm G.VM) error {
	err := vm.RunAll()
	if err == nil {
		return nil
	}
	if changed := in.changed(); changed != "" {
		return fmt.Errorf("%w (inputs changed during the run: %s)", err, changed)
	}
	return err
}

// changed describes the inputs whose tensor's shape or storage differs from what it was made
// with, "" when none. An input changed both ways is described both ways: a shape changed alone
// is a reshape of the input's own tensor, a shape and storage changed together say the tensor was
// rebuilt (another *Dense's data and shape written into it). A changed shape comes with the
// tensor's strides, which tell two shape changes apart: a reshape of the tensor sets both, while
// a new shape beside the strides it was made with was written into the tensor's shape slice by
// another holder of that slice (gorgonia.org/tensor hands the slices it is given back, through a
// package-level pool, to whatever asks next).
func (in Inputs) changed() string {
	var out []string
	for _, x := range in {
		var what []string
		if shape := []int(x.t.Shape()); !slices.Equal(shape, x.shape) {
			what = append(what, fmt.Sprintf("has shape %v and strides %v, made %v and %v", shape, x.t.Strides(), x.shape, x.strides))
		}
		if data, _ := x.t.Data().([]float64); len(data) != len(x.data) || len(data) > 0 && &data[0] != &x.data[0] {
			what = append(what, fmt.Sprintf("holds other storage (%d float64 values, made with %d)", len(data), len(x.data)))
		}
		if len(what) > 0 {
			out = append(out, x.name+" "+strings.Join(what, ", and "))
		}
	}
	return strings.Join(out, "; ")
}

// Scalar adds a float64 scalar variable named name with value v, rebound with gorgonia.Let.
func (b *GraphBuilder) Scalar(name string, v float64) *G.Node {
	return b.node(name, func() (*G.Node, error) {
		return G.NewScalar(b.g, tensor.Float64, G.WithName(name), G.WithValue(v)), nil
	})
}

// Const adds a constant named name of the given shape holding a copy of data.
func (b *GraphBuilder) Const(name string, data []float64, shape ...int) *G.Node {
	return b.node(name, func() (*G.Node, error) {
		t := tensor.New(tensor.WithBacking(append([]float64(nil), data...)), tensor.WithShape(shape...))
		return G.NewConstant(t, G.WithName(name)), nil
	})
}

// Reparam is the reparameterised draw of a diagonal Gaussian N(mu, sigma^2) at the standard
// normal noise eps, element-wise:
//
//	mu + sigma * eps.
func (b *GraphBuilder) Reparam(mu, sigma, eps *G.Node) *G.Node {
	return b.Add(mu, b.HadamardProd(sigma, eps))
}

// Activation applies a element-wise: Rectify (ReLU), Tanh or Sigmoid.
func (b *GraphBuilder) Activation(a Activation, x *G.Node) *G.Node {
	return b.node(a.String(), func() (*G.Node, error) { return ActivationNode(a, x) }, x)
}

// Accum is acc + x, or x when acc is nil: a sum of terms started from nothing.
func (b *GraphBuilder) Accum(acc, x *G.Node) *G.Node {
	if acc == nil {
		return x
	}
	return b.Add(acc, x)
}

// Add is x + y (element-wise, or a matrix plus a vector of its shape).
func (b *GraphBuilder) Add(x, y *G.Node) *G.Node {
	return b.node("Add", func() (*G.Node, error) { return G.Add(x, y) }, x, y)
}

// Sub is x - y.
func (b *GraphBuilder) Sub(x, y *G.Node) *G.Node {
	return b.node("Sub", func() (*G.Node, error) { return G.Sub(x, y) }, x, y)
}

// Mul is gorgonia's product: a matrix or matrix-vector product, or scaling by a scalar.
func (b *GraphBuilder) Mul(x, y *G.Node) *G.Node {
	return b.node("Mul", func() (*G.Node, error) { return G.Mul(x, y) }, x, y)
}

// HadamardProd is the element-wise product x * y.
func (b *GraphBuilder) HadamardProd(x, y *G.Node) *G.Node {
	return b.node("HadamardProd", func() (*G.Node, error) { return G.HadamardProd(x, y) }, x, y)
}

// Exp is exp(x), element-wise.
func (b *GraphBuilder) Exp(x *G.Node) *G.Node {
	return b.node("Exp", func() (*G.Node, error) { return G.Exp(x) }, x)
}

// Log is log(x), element-wise.
func (b *GraphBuilder) Log(x *G.Node) *G.Node {
	return b.node("Log", func() (*G.Node, error) { return G.Log(x) }, x)
}

// Neg is -x.
func (b *GraphBuilder) Neg(x *G.Node) *G.Node {
	return b.node("Neg", func() (*G.Node, error) { return G.Neg(x) }, x)
}

// Abs is |x|, element-wise.
func (b *GraphBuilder) Abs(x *G.Node) *G.Node {
	return b.node("Abs", func() (*G.Node, error) { return G.Abs(x) }, x)
}

// Square is x^2, element-wise.
func (b *GraphBuilder) Square(x *G.Node) *G.Node {
	return b.node("Square", func() (*G.Node, error) { return G.Square(x) }, x)
}

// Rectify is max(x, 0), element-wise.
func (b *GraphBuilder) Rectify(x *G.Node) *G.Node {
	return b.node("Rectify", func() (*G.Node, error) { return rectify(x) }, x)
}

// Softplus is log(1 + exp(x)), element-wise.
func (b *GraphBuilder) Softplus(x *G.Node) *G.Node {
	return b.node("Softplus", func() (*G.Node, error) { return G.Softplus(x) }, x)
}

// Sum is the sum of all of x's elements.
func (b *GraphBuilder) Sum(x *G.Node) *G.Node {
	return b.node("Sum", func() (*G.Node, error) { return G.Sum(x) }, x)
}

// Mean is the mean of all of x's elements.
func (b *GraphBuilder) Mean(x *G.Node) *G.Node {
	return b.node("Mean", func() (*G.Node, error) { return G.Mean(x) }, x)
}

// BroadcastAdd is x + y with y repeated along its axes right (gorgonia.BroadcastAdd(x, y, nil, right)).
func (b *GraphBuilder) BroadcastAdd(x, y *G.Node, right ...byte) *G.Node {
	return b.node("BroadcastAdd", func() (*G.Node, error) { return G.BroadcastAdd(x, y, nil, right) }, x, y)
}

// Transpose is the matrix x^T.
func (b *GraphBuilder) Transpose(x *G.Node) *G.Node {
	return b.node("Transpose", func() (*G.Node, error) { return G.Transpose(x) }, x)
}

// BatchedMatMul multiplies the matrices of x and y batch by batch, transposing as asked.
func (b *GraphBuilder) BatchedMatMul(x, y *G.Node, transX, transY bool) *G.Node {
	return b.node("BatchedMatMul", func() (*G.Node, error) { return G.BatchedMatMul(x, y, transX, transY) }, x, y)
}

// Reshape gives x the shape (same number of elements).
func (b *GraphBuilder) Reshape(x *G.Node, shape ...int) *G.Node {
	return b.node("Reshape", func() (*G.Node, error) { return G.Reshape(x, tensor.Shape(shape)) }, x)
}

// LogSoftMax is log softmax(x) along axes (gorgonia's default, the last axis, when none):
//
//	log p_c = x_c - log sum_c' exp(x_c').
func (b *GraphBuilder) LogSoftMax(x *G.Node, axes ...int) *G.Node {
	return b.node("LogSoftMax", func() (*G.Node, error) { return G.LogSoftMax(x, axes...) }, x)
}

// Grad adds the reverse-mode gradient of the scalar y with respect to each of wrt, in order.
func (b *GraphBuilder) Grad(y *G.Node, wrt ...*G.Node) G.Nodes {
	var grads G.Nodes
	b.node("Grad", func() (*G.Node, error) {
		var err error
		grads, err = G.Grad(y, wrt...)
		return y, err
	}, append(G.Nodes{y}, wrt...)...)
	if b.err != nil {
		return nil
	}
	return grads
}

// Read makes n's value available in *into after every run, and makes n a root of the compiled
// graph: Compile keeps only what the read values depend on.
func (b *GraphBuilder) Read(n *G.Node, into *G.Value) {
	if b.node("Read", func() (*G.Node, error) { return n, nil }, n) != nil {
		b.reads = append(b.reads, reading{src: n, into: into})
	}
}

// reading is one value read after each run: gorgonia's read node of src writes it to box, and
// the machine Compile returns copies it to into.
type reading struct {
	src       *G.Node
	into, box *G.Value
	node      *G.Node
}

// maxReadMoves is how many times Compile gives a read node another place before it gives up.
const maxReadMoves = 8

// Compile returns the first error recorded, or a tape machine over the part of the graph the Read
// values depend on. The machine runs the whole computation on every RunAll.
//
// gorgonia's compiler numbers the values of a graph by a 32-bit hash of each node, and its
// common-subexpression elimination takes two nodes with equal hashes for one without comparing
// them, so two different nodes whose hashes are equal compile into a wrong program (a product that
// finds an operand overwritten by another node's value, a panic). The hash of a read node includes
// the address of the place it writes to, which differs from run to run: about once in 10^6
// builds of a graph of a few hundred nodes, a read node's hash equals another node's. Compile
// therefore checks that every node it compiles has a hash of its own, gives a read node whose hash
// is shared another place (maxReadMoves times at most), and refuses a graph in which two other
// nodes share one, naming them.
func (b *GraphBuilder) Compile() (vm G.VM, err error) {
	b.Phase("compile")
	if b.err != nil {
		return nil, b.err
	}
	if len(b.reads) == 0 {
		return nil, fmt.Errorf("%s: compile: nothing is read", b.name)
	}
	defer func() {
		if r := recover(); r != nil {
			vm, err = nil, fmt.Errorf("%s: compile: gorgonia panicked: %v", b.name, r)
		}
	}()
	for i := range b.reads {
		b.place(i)
	}
	for moves := 0; ; moves++ {
		roots := make(G.Nodes, len(b.reads))
		for i, r := range b.reads {
			roots[i] = r.node
		}
		// Exact: a read node Compile replaced stays a parent of its value's node, and the
		// discovering walk would bring it back (the graphs built here have no other statements).
		sub := b.g.ExactSubgraphRoots(roots...)
		clashes := sharedHashes(sub.AllNodes())
		if len(clashes) == 0 {
			return &readingVM{VM: G.NewTapeMachine(sub), reads: b.reads}, nil
		}
		moved := false
		for i, r := range b.reads {
			if clashes[r.node.Hashcode()] != nil && moves < maxReadMoves {
				b.place(i)
				moved = true
			}
		}
		if !moved {
			return nil, fmt.Errorf("%s: compile: gorgonia would take these nodes for one (their hashes are equal): %s", b.name, describeClashes(clashes))
		}
	}
}

// place gives read i a new place to write to, and the read node that writes there. A node it
// replaces stays in the graph, outside what Compile compiles.
func (b *GraphBuilder) place(i int) {
	r := &b.reads[i]
	r.box = b.box(i)
	r.node = G.Read(r.src, r.box)
}

// sharedHashes groups the nodes whose hash another of them has, by hash.
func sharedHashes(nodes G.Nodes) map[uint32]G.Nodes {
	by := map[uint32]G.Nodes{}
	for _, n := range nodes {
		by[n.Hashcode()] = append(by[n.Hashcode()], n)
	}
	for h, ns := range by {
		if len(ns) < 2 {
			delete(by, h)
		}
	}
	return by
}

func describeClashes(clashes map[uint32]G.Nodes) string {
	var out []string
	for _, h := range slices.Sorted(maps.Keys(clashes)) {
		out = append(out, fmt.Sprintf("%v (hash %08x)", clashes[h], h))
	}
	return strings.Join(out, "; ")
}

// readingVM is a tape machine that copies the values its read nodes wrote to the places the
// GraphBuilder's callers gave (Read) after each run.
type readingVM struct {
	G.VM
	reads []reading
}

func (m *readingVM) RunAll() error {
	if err := m.VM.RunAll(); err != nil {
		return err
	}
	for _, r := range m.reads {
		*r.into = *r.box
	}
	return nil
}
