package bnn

import (
	"context"
	"math"
	"math/rand/v2"
	"sync"
	"unsafe"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// The predictive engine: S sampled networks applied to N inputs, in float64 or float32, with the
// softmax and the running moments in float64.
//
// Layout. A sampled network is held as wnet: per layer, the weight transposed (In x Out,
// row-major, wt[i*Out+o] = W[o][i]) and the bias. Many inputs (N >= chunkMin: 32 with gonum, 4 with OpenBLAS, see the backends) go through in chunks
// of up to chunkRows inputs held transposed (features x inputs), so that a layer is one matrix
// product
//
//	H_k = act(W_k H_{k-1} + b_k)      (Out x rows) = (Out x In)(In x rows)
//
// computed by the build's gemm (gemmTN: in the default build In rank-one updates with gonum's
// pure-Go Dger/Sger, each a pass over the chunk's inputs; OpenBLAS with -tags openblas), followed
// by one fused pass that adds the bias and applies the activation while the block is in cache
// (biasActBlock; with -tags openblas a C loop the compiler vectorizes, and the output layer of a
// few classes is one such loop too, denseOut, where a dgemm call would mostly pack). Few inputs
// go one at a time, each layer one gonum gemv (always pure Go: a cgo call per small product
// would cost more than it saves). With two classes the softmax and the moments are one
// written-out loop (addChunk2).
//
// Both paths add the products of an output in the same order, w_0 h_0 + w_1 h_1 + ..., starting
// from zero and adding the bias last, without fused multiply-adds, so in the default build a
// probability does not depend on which other inputs share the call (bit for bit; see
// TestEngineBatchIndependent); OpenBLAS sums in its own order, so with -tags openblas results
// agree to rounding only.
const (
	chunkRows = 192 // inputs per chunk: one layer's block of 64 x 192 float64s stays in L2
)

// float is the element type of the forward passes.
type float interface{ float32 | float64 }

// wnet is one sampled network in the engine's layout (see above).
type wnet[F float] struct {
	wt, b [][]F
}

// arch is what the engine needs to know about a model besides its weights.
type arch struct {
	sizes []int // sizes[0] inputs, sizes[k+1] outputs of layer k
	act   Activation
}

func (m *Model) arch() arch {
	a := arch{sizes: []int{m.Inputs()}, act: m.Activation}
	for _, l := range m.Layers {
		a.sizes = append(a.sizes, l.Out)
	}
	return a
}

func (a arch) layers() int { return len(a.sizes) - 1 }

func (a arch) classes() int { return a.sizes[len(a.sizes)-1] }

// params is the number of weights and biases of one network.
func (a arch) params() int {
	n := 0
	for k := 0; k < a.layers(); k++ {
		n += (a.sizes[k] + 1) * a.sizes[k+1]
	}
	return n
}

// newWnet allocates a network shaped like a, in one block.
func newWnet[F float](a arch) wnet[F] {
	return wnetIn(a, make([]F, a.params()))
}

// wnetIn lays a network shaped like a over block (len a.params()).
func wnetIn[F float](a arch, block []F) wnet[F] {
	n := wnet[F]{wt: make([][]F, a.layers()), b: make([][]F, a.layers())}
	for k := 0; k < a.layers(); k++ {
		in, out := a.sizes[k], a.sizes[k+1]
		n.wt[k], block = block[:in*out:in*out], block[in*out:]
		n.b[k], block = block[:out:out], block[out:]
	}
	return n
}

// sampleWnet draws w = mu + sigma e (e ~ N(0, 1)) for every parameter of m into dst, rounding to
// F. The draws come in Sample's order (per layer, the weights in Layer order, then the biases), so
// that a seed gives the same networks as Sample.
func sampleWnet[F float](m *Model, sig *Net, rng *rand.Rand, dst wnet[F]) {
	if m.Dropout > 0 {
		var keep []float64
		for k := range m.Layers {
			l := &m.Layers[k]
			keep = m.dropoutMask(k, rng, keep)
			wt := dst.wt[k]
			for o := 0; o < l.Out; o++ {
				for i := 0; i < l.In; i++ {
					wt[i*l.Out+o] = F(l.WeightMu[o*l.In+i] * keep[i])
				}
			}
			for o, mu := range l.BiasMu {
				dst.b[k][o] = F(mu)
			}
		}
		return
	}
	for k := range m.Layers {
		l := &m.Layers[k]
		wt, sw := dst.wt[k], sig.W[k]
		for o := 0; o < l.Out; o++ {
			for i := 0; i < l.In; i++ {
				j := o*l.In + i
				wt[i*l.Out+o] = F(l.WeightMu[j] + sw[j]*rng.NormFloat64())
			}
		}
		for o, mu := range l.BiasMu {
			dst.b[k][o] = F(mu + sig.B[k][o]*rng.NormFloat64())
		}
	}
}

// biasAct sets row[i] = act(row[i] + bias), or row[i] + bias for the output layer (output).
func biasAct[F float](row []F, bias F, act Activation, output bool) {
	switch {
	case output:
		for i, v := range row {
			row[i] = v + bias
		}
	case act == ReLU:
		for i, v := range row {
			row[i] = max(v+bias, 0) // NaN stays NaN
		}
	case act == Tanh:
		for i, v := range row {
			row[i] = F(math.Tanh(float64(v + bias)))
		}
	default:
		for i, v := range row {
			row[i] = F(sigmoid(float64(v + bias)))
		}
	}
}

// biasActVec sets o[j] = act(o[j] + b[j]), or o[j] + b[j] for the output layer: biasAct with a
// bias per element.
func biasActVec[F float](o, b []F, act Activation, output bool) {
	b = b[:len(o)]
	switch {
	case output:
		for j, v := range o {
			o[j] = v + b[j]
		}
	case act == ReLU:
		for j, v := range o {
			o[j] = max(v+b[j], 0)
		}
	case act == Tanh:
		for j, v := range o {
			o[j] = F(math.Tanh(float64(v + b[j])))
		}
	default:
		for j, v := range o {
			o[j] = F(sigmoid(float64(v + b[j])))
		}
	}
}

// forwardChunk computes the logits (C x rows, row-major) of the rows inputs held transposed in x
// (In x rows) under network n. bufs holds one Out x chunkRows block per layer.
func forwardChunk[F float](a arch, n wnet[F], x []F, rows int, bufs [][]F) []F {
	h := x
	last := a.layers() - 1
	for k := 0; k <= last; k++ {
		in, out := a.sizes[k], a.sizes[k+1]
		o := bufs[k][:out*rows]
		if k == last && denseOut(o, n.wt[k], h, n.b[k], in, out, rows) {
			return o
		}
		gemmTN(out, rows, in, n.wt[k], h, o)
		biasActBlock(o, n.b[k], rows, a.act, k == last)
		h = o
	}
	return h
}

// forwardOne computes the logits of one input x under network n; bufs holds one Out-vector per
// layer.
func forwardOne[F float](a arch, n wnet[F], x []F, bufs [][]F) []F {
	h := x
	last := a.layers() - 1
	for k := 0; k <= last; k++ {
		out := a.sizes[k+1]
		o := bufs[k][:out]
		gemvT(a.sizes[k], out, n.wt[k], h, o)
		biasActVec(o, n.b[k], a.act, k == last)
		h = o
	}
	return h
}

// batch is the standardised inputs of one predictive call, rounded to F, in the layout the
// engine runs them in: chunks (In x rows each) or single rows.
type batch[F float] struct {
	n      int
	chunks [][]F
	rows   [][]F
}

func newBatch[F float](z [][]float64, d int) batch[F] {
	b := batch[F]{n: len(z)}
	if len(z) < chunkMin {
		for _, r := range z {
			row := make([]F, d)
			for j, v := range r {
				row[j] = F(v)
			}
			b.rows = append(b.rows, row)
		}
		return b
	}
	for lo := 0; lo < len(z); lo += chunkRows {
		rows := min(chunkRows, len(z)-lo)
		c := make([]F, d*rows)
		for r := 0; r < rows; r++ {
			for j, v := range z[lo+r] {
				c[j*rows+r] = F(v)
			}
		}
		b.chunks = append(b.chunks, c)
	}
	return b
}

// moments accumulates Welford's running mean and sum of squared deviations of the class
// probabilities, per input and class, in float64.
type moments struct {
	p     *Predictive
	probs []float64 // one input's probabilities
}

// addChunk folds the logits (C x rows) of inputs lo..lo+rows-1 under draw number k (1-based).
func addChunk[F float](mo *moments, lo, rows int, logits []F, k int) {
	c, inv := mo.p.C, 1/float64(k)
	if c == 2 {
		addChunk2(mo.p, lo, rows, logits, inv)
		return
	}
	for r := 0; r < rows; r++ {
		for j := 0; j < c; j++ {
			mo.probs[j] = float64(logits[j*rows+r])
		}
		mo.fold(lo+r, inv)
	}
}

// addChunk2 is addChunk for two classes, the commonest case, written out without the per-input
// calls, copies and data-dependent branches, and with the same bits as Softmax and fold: the
// larger logit's exp(0) = 1 is exact, the other's exp(l_other - l_max) = exp(-|l0 - l1|)
// (IEEE subtraction is antisymmetric), the sum 1 + e in either order, and an infinite maximum
// gives NaN as exp(Inf - Inf) does in Softmax.
func addChunk2[F float](p *Predictive, lo, rows int, logits []F, inv float64) {
	l0s, l1s := logits[:rows], logits[rows:2*rows]
	mean, m2 := p.Mean[2*lo:2*(lo+rows)], p.Var[2*lo:2*(lo+rows)]
	for r := range rows {
		l0, l1 := float64(l0s[r]), float64(l1s[r])
		e := math.Exp(-math.Abs(l0 - l1))
		if math.IsInf(l0, 0) || math.IsInf(l1, 0) {
			e = twoInf(l0, l1)
		}
		s := 1 + e
		f0, f1 := 1/s, e/s
		if l1 > l0 {
			f0, f1 = f1, f0
		}
		d0, d1 := f0-mean[2*r], f1-mean[2*r+1]
		mean[2*r] += float64(d0 * inv) // float64(): no fused multiply-add (see fold)
		mean[2*r+1] += float64(d1 * inv)
		m2[2*r] += float64(d0 * (f0 - mean[2*r]))
		m2[2*r+1] += float64(d1 * (f1 - mean[2*r+1]))
	}
}

// twoInf is addChunk2's e when a logit is infinite: NaN when the other is NaN or the larger is
// infinite (Softmax's exp(Inf - Inf)), else 0 (exp(-Inf)).
func twoInf(l0, l1 float64) float64 {
	if mx := math.Max(l0, l1); math.IsNaN(mx) || math.IsInf(mx, 0) {
		return math.NaN()
	}
	return 0
}

// expShifted is exp(v - mx) as Softmax computes it: 1 without a call when v is the maximum.
func expShifted(v, mx float64) float64 {
	if d := v - mx; d != 0 {
		return math.Exp(d)
	}
	return 1
}

// addOne folds the logits of input i under draw number k (1-based).
func addOne[F float](mo *moments, i int, logits []F, k int) {
	for j, v := range logits {
		mo.probs[j] = float64(v)
	}
	mo.fold(i, 1/float64(k))
}

// fold turns mo.probs from logits into probabilities and folds them into input i's moments:
//
//	d = f - mean,  mean += d / k,  m2 += d (f - mean).
//
// Each product is rounded before it is added (the float64 conversions: the Go spec lets the
// compiler fuse x += a*b into one multiply-add, and from GOAMD64=v3 on it does, in some places
// and not others), so that addChunk2 and this fold give the same bits in every build.
func (mo *moments) fold(i int, inv float64) {
	Softmax(mo.probs, mo.probs)
	c := mo.p.C
	mean, m2 := mo.p.Mean[i*c:(i+1)*c], mo.p.Var[i*c:(i+1)*c]
	for j, f := range mo.probs {
		d := f - mean[j]
		mean[j] += float64(d * inv)
		m2[j] += float64(d * (f - mean[j]))
	}
}

// finish turns the sums of squared deviations of inputs lo..hi-1 into unbiased variances.
func (mo *moments) finish(lo, hi int) {
	s, c := float64(mo.p.S-1), mo.p.C
	for i := lo * c; i < hi*c; i++ {
		mo.p.Var[i] /= s
	}
}

// predictive runs the S networks net(0..S-1) over the inputs z (standardised, float64) and returns
// the Monte-Carlo predictive. With workers > 1 and enough inputs, disjoint ranges of chunks run
// on that many goroutines (net must then be safe for concurrent use); each input's result is the
// same either way. Every goroutine checks ctx before every network and all have returned when
// predictive returns.
func predictive[F float](ctx context.Context, a arch, z [][]float64, samples int, prec Precision, workers int, net func(s int) wnet[F]) (*Predictive, error) {
	n, c := len(z), a.classes()
	p := &Predictive{N: n, C: c, S: samples, Precision: prec, Mean: make([]float64, n*c), Var: make([]float64, n*c)}
	in := newBatch[F](z, a.sizes[0])
	if in.rows != nil {
		return p, predictRows(ctx, a, in.rows, p, net)
	}
	workers = max(1, min(workers, len(in.chunks)/2))
	if workers == 1 {
		return p, predictChunks(ctx, a, in.chunks, 0, len(in.chunks), p, net)
	}
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		lo, hi := w*len(in.chunks)/workers, (w+1)*len(in.chunks)/workers
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[w] = predictChunks(ctx, a, in.chunks, lo, hi, p, net)
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err // every worker fails the same way: ctx ended
		}
	}
	return p, nil
}

// predictChunks folds the S networks over chunks lo..hi-1 into p, then turns their sums of
// squared deviations into variances.
func predictChunks[F float](ctx context.Context, a arch, chunks [][]F, lo, hi int, p *Predictive, net func(s int) wnet[F]) error {
	mo := &moments{p: p, probs: make([]float64, p.C)}
	bufs := make([][]F, a.layers())
	for k := range bufs {
		bufs[k] = make([]F, a.sizes[k+1]*chunkRows)
	}
	for s := 0; s < p.S; s++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		w := net(s)
		for ci := lo; ci < hi; ci++ {
			first := ci * chunkRows
			rows := min(chunkRows, p.N-first)
			addChunk(mo, first, rows, forwardChunk(a, w, chunks[ci], rows, bufs), s+1)
		}
	}
	mo.finish(lo*chunkRows, min(hi*chunkRows, p.N))
	return nil
}

// predictRows is predictChunks for inputs taken one at a time.
func predictRows[F float](ctx context.Context, a arch, rows [][]F, p *Predictive, net func(s int) wnet[F]) error {
	mo := &moments{p: p, probs: make([]float64, p.C)}
	bufs := make([][]F, a.layers())
	for k := range bufs {
		bufs[k] = make([]F, a.sizes[k+1])
	}
	for s := 0; s < p.S; s++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		w := net(s)
		for i, x := range rows {
			addOne(mo, i, forwardOne(a, w, x, bufs), s+1)
		}
	}
	mo.finish(0, p.N)
	return nil
}

// gemvT sets y = a^T x for a (m x n, row-major), x (m) and y (n) with gonum's gemv, in every
// build (a cgo call per input would cost more than it saves): y[o] = sum_i a[i, o] x[i], adding
// the products for i = 0, 1, ... in order from zero, as gemmTN does for each column of a chunk.
func gemvT[F float](m, n int, a, x, y []F) {
	if unsafe.Sizeof(a[0]) == 8 {
		gonum.Implementation{}.Dgemv(blas.Trans, m, n, 1, as[float64](a), n, as[float64](x), 1, 0, as[float64](y), 1)
		return
	}
	gonum.Implementation{}.Sgemv(blas.Trans, m, n, 1, as[float32](a), n, as[float32](x), 1, 0, as[float32](y), 1)
}

// as reinterprets a []F as a []T of the same element type; gemvT and gemmTN call it only with
// T == F, to reach the non-generic BLAS functions.
func as[T, F float](v []F) []T {
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(v))), len(v))
}
