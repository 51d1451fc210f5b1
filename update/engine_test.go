package update

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/gradcheck"
	"github.com/cfguard/cfguard/internal/vec"
)

var engines = []string{EngineGo, EngineGorgonia}

// engineProblem is a breast-cancer model (30 -> 64 -> 32 -> 2) whose last layer was moved off
// prev's, so that the vcl KL and its gradient are not zero, with standardised rows.
func engineProblem(t *testing.T, rows int) (q, prev *bnn.Model, z [][]float64, y []int) {
	t.Helper()
	m0, test := trained(t)
	zd, err := m0.Standardize(test.X[:rows])
	if err != nil {
		t.Fatal(err)
	}
	z = make([][]float64, rows)
	for i := range z {
		z[i] = zd.RawRowView(i)
	}
	prev, q = m0.Clone(), m0.Clone()
	rng := rand.New(rand.NewPCG(1, 1))
	for _, v := range [][]float64{q.Last().WeightMu, q.Last().WeightLogSigma, q.Last().BiasMu, q.Last().BiasLogSigma} {
		for i := range v {
			v[i] += 0.05 * rng.NormFloat64()
		}
	}
	return q, prev, z, test.Y[:rows]
}

// randomProblem is a torchbnn-initialised network 6 -> hidden -> classes, a copy whose last
// layer was moved off it, and rows of standard-normal features with random labels.
func randomProblem(hidden []int, classes, rows int) (q, prev *bnn.Model, z [][]float64, y []int) {
	rng := rand.New(rand.NewPCG(11, uint64(len(hidden))))
	names := make([]string, classes)
	for i := range names {
		names[i] = fmt.Sprint("class", i)
	}
	prev = bnn.New(6, hidden, names, 0.1, rng)
	q = prev.Clone()
	for _, v := range [][]float64{q.Last().WeightMu, q.Last().WeightLogSigma, q.Last().BiasMu, q.Last().BiasLogSigma} {
		for i := range v {
			v[i] += 0.1 * rng.NormFloat64()
		}
	}
	z, y = make([][]float64, rows), make([]int, rows)
	for i := range z {
		z[i] = make([]float64, 6)
		for j := range z[i] {
			z[i][j] = rng.NormFloat64()
		}
		y[i] = rng.IntN(classes)
	}
	return q, prev, z, y
}

// relErr is the largest |a_j - b_j| / max(|b_j|, floor * max_j |b_j|) over a block: elementwise
// relative error, with a floor so that components that cancel to nearly 0 are judged against
// the block's scale rather than their own.
func relErr(a, b []float64, floor float64) float64 {
	scale := 0.0
	for _, v := range b {
		scale = math.Max(scale, math.Abs(v))
	}
	worst := 0.0
	for j := range a {
		den := math.Max(math.Abs(b[j]), floor*scale)
		if den == 0 {
			if a[j] != 0 {
				return math.Inf(1)
			}
			continue
		}
		worst = math.Max(worst, math.Abs(a[j]-b[j])/den)
	}
	return worst
}

func rel(a, b float64) float64 {
	if a == b {
		return 0
	}
	return math.Abs(a-b) / math.Max(math.Abs(a), math.Abs(b))
}

// TestGoObjectiveMatchesGraph is the strongest check of the Go engine: for the same parameters,
// minibatch and noise, its loss, NLL, KL and every gradient component equal bnn.Graph's (gorgonia
// autodiff) within 1e-10 relative (per gradient block, components below 1e-3 of the block's
// largest are judged against 1e-3 of it; measured: at most ~5e-12). The noise is fed both ways: by
// SetEps with a fixed function, and by DrawEps from two copies of one seeded rng, which also
// checks that both engines consume the rng in the same order. The comparison is repeated over
// 10 Adam iterations taken in lockstep, so it covers parameters away from the starting point, and
// runs on the paper's architecture and on networks with no body, three body layers, 3 and 4
// classes.
func TestGoObjectiveMatchesGraph(t *testing.T) {
	bq, bprev, bz, by := engineProblem(t, 12)
	for _, tc := range []struct {
		hidden        []int // nil: the trained breast-cancer network 30 -> 64 -> 32 -> 2
		classes       int
		objective     string
		samples, rows int
		batch         int
		klWeight      float64
		draw          bool
		act           bnn.Activation // ReLU unless set
	}{
		{nil, 2, ObjectivePrior, 1, 12, 12, 0, true, bnn.ReLU},
		{nil, 2, ObjectiveVCL, 1, 12, 12, 0, true, bnn.ReLU},
		{nil, 2, ObjectivePrior, 3, 12, 12, 0.7, false, bnn.ReLU},
		{nil, 2, ObjectiveVCL, 2, 12, 12, 0.7, true, bnn.ReLU},
		{nil, 2, ObjectiveVCL, 2, 7, 12, 5, false, bnn.ReLU}, // a short batch: the graph pads with weight-0 rows
		{nil, 2, ObjectivePrior, 1, 5, 5, 1e-9, true, bnn.ReLU},
		{[]int{}, 3, ObjectiveVCL, 2, 12, 12, 1, true, bnn.ReLU},           // no body: softmax regression
		{[]int{9, 7, 5}, 4, ObjectivePrior, 1, 12, 12, 1, false, bnn.ReLU}, // three body layers, four classes
		{[]int{9, 7, 5}, 4, ObjectiveVCL, 2, 10, 12, 1, true, bnn.ReLU},
		{nil, 2, ObjectiveVCL, 2, 12, 12, 0.7, true, bnn.Tanh},
		{nil, 2, ObjectivePrior, 1, 12, 12, 0.7, false, bnn.Sigmoid},
		{[]int{9, 7, 5}, 4, ObjectiveVCL, 2, 10, 12, 1, true, bnn.Tanh},
		{[]int{9, 7, 5}, 4, ObjectivePrior, 1, 12, 12, 1, false, bnn.Sigmoid},
	} {
		arch := "breast_cancer"
		if tc.hidden != nil {
			arch = fmt.Sprintf("6-%v-%d", tc.hidden, tc.classes)
		}
		name := fmt.Sprintf("%s/%s/%s/S=%d/rows=%d/batch=%d/klw=%g/draw=%v", arch, tc.act, tc.objective, tc.samples, tc.rows, tc.batch, tc.klWeight, tc.draw)
		t.Run(name, func(t *testing.T) {
			q, prev, z, y := bq, bprev, bz, by
			if tc.hidden != nil {
				q, prev, z, y = randomProblem(tc.hidden, tc.classes, 12)
			}
			q, prev = withActivation(q, tc.act), withActivation(prev, tc.act)
			cfg := Config{Objective: tc.objective, Samples: tc.samples, KLWeight: tc.klWeight, BatchSize: tc.batch}.withDefaults()
			var objs [2]objective
			for i, e := range engines {
				cfg.Engine = e
				// N = 40 rows in the "update": KLScale = klw/40; vcl pulls towards prev.
				o, err := newObjectiveWithPrev(q, prev, 40, cfg)
				if err != nil {
					t.Fatal(err)
				}
				defer o.Close()
				objs[i] = o
				if err := o.SetBatch(z[:tc.rows], y[:tc.rows]); err != nil {
					t.Fatal(err)
				}
			}
			goOpt := bnn.NewAdam(objs[0].Params(), 1e-2)
			grOpt := bnn.NewAdam(objs[1].Params(), 1e-2)
			worst := 0.0
			for it := 0; it < 10; it++ {
				if tc.draw {
					objs[0].DrawEps(rand.New(rand.NewPCG(uint64(it), 77)))
					objs[1].DrawEps(rand.New(rand.NewPCG(uint64(it), 77)))
				} else {
					f := func(s, k int, bias bool, i int) float64 {
						b := uint64(0)
						if bias {
							b = 1
						}
						return rand.New(rand.NewPCG(uint64(it)<<50|uint64(s)<<40|uint64(k)<<32|b<<31|uint64(i), 5)).NormFloat64()
					}
					objs[0].SetEps(f)
					objs[1].SetEps(f)
				}
				evGo, err := objs[0].Run()
				if err != nil {
					t.Fatal(err)
				}
				evGr, err := objs[1].Run()
				if err != nil {
					t.Fatal(err)
				}
				if evGo.Rows != evGr.Rows || evGo.Correct != evGr.Correct {
					t.Errorf("iteration %d: rows/correct %d/%d, graph %d/%d", it, evGo.Rows, evGo.Correct, evGr.Rows, evGr.Correct)
				}
				for _, v := range []struct {
					name   string
					go_, g float64
				}{{"loss", evGo.Loss, evGr.Loss}, {"NLL", evGo.NLL, evGr.NLL}, {"KL", evGo.KL, evGr.KL}} {
					e := rel(v.go_, v.g)
					worst = math.Max(worst, e)
					if e > 1e-10 {
						t.Errorf("iteration %d: %s %.17g, graph %.17g (relative error %.2g)", it, v.name, v.go_, v.g, e)
					}
				}
				pg, pr := objs[0].Params(), objs[1].Params()
				for b := range pr {
					if pg[b].Name != pr[b].Name {
						t.Fatalf("block %d is %s, graph's %s", b, pg[b].Name, pr[b].Name)
					}
					e := relErr(pg[b].Grad, pr[b].Grad, 1e-3)
					worst = math.Max(worst, e)
					if e > 1e-10 {
						t.Errorf("iteration %d: gradient of %s: relative error %.3g\n go    %.6g\n graph %.6g", it, pr[b].Name, e, pg[b].Grad, pr[b].Grad)
					}
				}
				goOpt.Step(pg)
				grOpt.Step(pr)
			}
			t.Logf("largest relative difference over 10 iterations: %.3g", worst)
		})
	}
}

// withActivation returns a copy of m evaluated with act between layers.
func withActivation(m *bnn.Model, act bnn.Activation) *bnn.Model {
	c := m.Clone()
	c.Activation = act
	return c
}

// newObjectiveWithPrev is newObjective for the parameters q with prev as the update's previous
// posterior (vcl's KL target; ignored by the prior objective).
func newObjectiveWithPrev(q, prev *bnn.Model, n int, cfg Config) (objective, error) {
	gc := graphConfig(prev, n, cfg)
	if cfg.Engine == EngineGorgonia {
		return bnn.NewGraph(q, gc)
	}
	return newGoObjective(q, gc)
}

// TestGoObjectiveFiniteDifferences checks the Go engine's hand-written gradient against central
// finite differences of its own loss at fixed noise (h = 1e-5; truncation ~1e-10, rounding
// ~1e-11; tolerance 1e-7 * max(1, |g|)), for both objectives, two draws and every activation, on
// every parameter of the last layer. (That the loss itself evaluates the activation is checked
// against gorgonia's graph in TestGoObjectiveMatchesGraph.)
func TestGoObjectiveFiniteDifferences(t *testing.T) {
	q0, prev0, z, y := engineProblem(t, 9)
	for _, tc := range []struct {
		objective string
		act       bnn.Activation
	}{{ObjectivePrior, bnn.ReLU}, {ObjectiveVCL, bnn.ReLU}, {ObjectivePrior, bnn.Tanh}, {ObjectiveVCL, bnn.Tanh},
		{ObjectivePrior, bnn.Sigmoid}, {ObjectiveVCL, bnn.Sigmoid}} {
		objective := tc.objective
		q, prev := withActivation(q0, tc.act), withActivation(prev0, tc.act)
		t.Run(objective+"/"+tc.act.String(), func(t *testing.T) {
			cfg := Config{Objective: objective, Samples: 2, KLWeight: 3, Engine: EngineGo}.withDefaults()
			o, err := newObjectiveWithPrev(q, prev, 9, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if err := o.SetBatch(z, y); err != nil {
				t.Fatal(err)
			}
			o.DrawEps(rand.New(rand.NewPCG(4, 4)))
			if _, err := o.Run(); err != nil {
				t.Fatal(err)
			}
			ps := o.Params()
			grads := make([][]float64, len(ps))
			for b, p := range ps {
				grads[b] = vec.Clone(p.Grad)
			}
			loss := func() float64 {
				ev, err := o.Run()
				if err != nil {
					t.Fatal(err)
				}
				return ev.Loss
			}
			checked := 0
			values := make([][]float64, len(ps))
			for b, p := range ps {
				values[b] = p.Value
			}
			gradcheck.Central(values, 1e-5, loss, func(b, j int, fd float64) {
				if g := grads[b][j]; math.Abs(g-fd) > 1e-7*math.Max(1, math.Abs(g)) {
					t.Errorf("%s[%d]: gradient %.10g, finite difference %.10g", ps[b].Name, j, g, fd)
				}
				checked++
			})
			if checked != 2*(q.Last().In*q.Last().Out+q.Last().Out) {
				t.Errorf("checked %d components", checked)
			}
		})
	}
}

// TestEnginesAgreeEndToEnd runs LastLayer with both engines from the same prev, data and seed.
// Both draw the same minibatches and the same noise (one rng per iteration, consumed in the same
// order), so they differ only by rounding; KL(q_new || q_prev) agrees within 1e-6 relative
// (measured: at most ~1e-14) and every last-layer parameter within 1e-9 absolute.
func TestEnginesAgreeEndToEnd(t *testing.T) {
	m, test := trained(t)
	for _, tc := range []struct {
		rows int
		cfg  Config
	}{
		{64, Config{}}, // the daemon's default: prior, lr 1e-5, 50 iterations, batch 64
		{64, Config{Objective: ObjectiveVCL, Seed: 5}},
		{40, Config{Objective: ObjectiveVCL, LR: 1e-3, BatchSize: 16, Samples: 2, Iterations: 30, Seed: 7}},
		{25, Config{LR: 1e-2, BatchSize: 10, Iterations: 40, KLWeight: 2, Seed: 8}},
	} {
		t.Run(fmt.Sprintf("%s/rows=%d/lr=%g", tc.cfg.withDefaults().Objective, tc.rows, tc.cfg.withDefaults().LR), func(t *testing.T) {
			var outs [2]*bnn.Model
			var sts [2]Stats
			for i, e := range engines {
				cfg := tc.cfg
				cfg.Engine = e
				next, st, err := LastLayer(context.Background(), m, test.X[:tc.rows], test.Y[:tc.rows], cfg)
				if err != nil {
					t.Fatal(err)
				}
				outs[i], sts[i] = next, st
			}
			g, r := sts[0], sts[1]
			t.Logf("KL go %.12g, gorgonia %.12g (relative %.2g); loss %.6g -> %.6g", g.KL, r.KL, rel(g.KL, r.KL), g.LossStart, g.LossEnd)
			if e := rel(g.KL, r.KL); !(e <= 1e-6) || !(g.KL > 0) {
				t.Errorf("KL go %.15g, gorgonia %.15g: relative difference %.3g", g.KL, r.KL, e)
			}
			for _, v := range [][2]float64{{g.LossStart, r.LossStart}, {g.LossEnd, r.LossEnd}, {g.NLLStart, r.NLLStart}, {g.NLLEnd, r.NLLEnd}} {
				if rel(v[0], v[1]) > 1e-9 {
					t.Errorf("stats differ: go %+v, gorgonia %+v", g, r)
					break
				}
			}
			a, b := outs[0].Last(), outs[1].Last()
			for k, pair := range [][2][]float64{{a.WeightMu, b.WeightMu}, {a.WeightLogSigma, b.WeightLogSigma}, {a.BiasMu, b.BiasMu}, {a.BiasLogSigma, b.BiasLogSigma}} {
				for j := range pair[0] {
					if d := math.Abs(pair[0][j] - pair[1][j]); d > 1e-9 {
						t.Fatalf("block %d [%d]: go %.15g, gorgonia %.15g", k, j, pair[0][j], pair[1][j])
					}
				}
			}
			if !bnn.SameBody(outs[0], m) || outs[0].Version != m.Version+1 {
				t.Error("go engine: body changed or version wrong")
			}
			if kl, _, err := certify.KL(outs[0], outs[1]); err != nil || kl > 1e-12 {
				t.Errorf("KL between the two engines' results %v (%v)", kl, err)
			}
		})
	}
}

// engineObjectives is every (engine, objective) pair.
func engineObjectives() []struct{ engine, objective string } {
	var out []struct{ engine, objective string }
	for _, e := range engines {
		for _, o := range []string{ObjectivePrior, ObjectiveVCL} {
			out = append(out, struct{ engine, objective string }{e, o})
		}
	}
	return out
}

// countdown is a context whose Err turns to context.Canceled after n calls.
type countdown struct {
	context.Context
	n int
}

func (c *countdown) Err() error {
	if c.n--; c.n < 0 {
		return context.Canceled
	}
	return nil
}

// TestLastLayerCancelledMidway cancels after 7 iterations: both engines stop with ctx's error and
// return no model.
func TestLastLayerCancelledMidway(t *testing.T) {
	m, test := trained(t)
	for _, engine := range engines {
		ctx := &countdown{Context: context.Background(), n: 7}
		next, st, err := LastLayer(ctx, m, test.X[:20], test.Y[:20], Config{Engine: engine})
		if !errors.Is(err, context.Canceled) || next != nil || st.Iterations != 7 || !strings.Contains(err.Error(), "iteration 8") {
			t.Errorf("%s: err %v, model %v, %d iterations", engine, err, next != nil, st.Iterations)
		}
	}
}

// The vcl objective's KL term is KL(q || q~), q~ the previous posterior flattened by the memory
// (lambda = exp(-n / M) per parameter, towards N(0, prior_sigma^2)), in both engines and so in the
// Adam solver as in the converged one: computed here from the formula on prev's parameters and
// certify.KLDiag. With M = 0, q~ is prev.
func TestVCLTargetIsTheFlattenedPosterior(t *testing.T) {
	q, prev, z, y := randomProblem([]int{5, 4}, 2, 7)
	qm, qls := lastVector(q)
	pm, pls := lastVector(prev)
	tau0 := 1 / (prev.PriorSigma * prev.PriorSigma)
	for _, engine := range []string{EngineGo, EngineGorgonia} {
		for _, memory := range []float64{0, 30} {
			lambda := 1.0
			if memory > 0 {
				lambda = math.Exp(-7 / memory)
			}
			tm, tls := make([]float64, len(pm)), make([]float64, len(pm))
			for j := range pm {
				tau := math.Exp(-2 * pls[j])
				prec := lambda*tau + (1-lambda)*tau0
				tm[j], tls[j] = lambda*tau*pm[j]/prec, -0.5*math.Log(prec)
			}
			want := certify.KLDiag(qm, qls, tm, tls)
			cfg := Config{Objective: ObjectiveVCL, Solver: SolverAdam, Memory: memory, Engine: engine, Seed: 5}.withDefaults()
			o, err := newObjectiveWithPrev(q, prev, len(z), cfg)
			if err != nil {
				t.Fatal(err)
			}
			if err := o.SetBatch(z, y); err != nil {
				t.Fatal(err)
			}
			o.DrawEps(rand.New(rand.NewPCG(1, 2)))
			ev, err := o.Run()
			o.Close()
			if err != nil {
				t.Fatal(err)
			}
			if math.Abs(ev.KL-want) > 1e-9*want {
				t.Errorf("%s engine, memory %v: KL term %.12g, KL(q || flattened prev) %.12g", engine, memory, ev.KL, want)
			}
		}
	}
}
