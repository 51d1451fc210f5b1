package daemon

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// Registrations waiting together are measured together and stored in one ledger write, and each
// keeps its own outcome: a bad one, an id given twice, an id already stored, a pair that is not
// a counterfactual are refused alone, the others stored, anchored to the current posterior.
func TestRegistrationsWaitingTogetherShareOneWrite(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	if len(xs) < 12 || len(cfs) < 12 {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	pair := func(id string, k int) registration {
		return registration{id: id, x: data.X[xs[k]], xcf: data.X[cfs[k]], target: target{set: true, name: "benign"}}
	}
	if code, body := r.Do(t, "POST", "/v1/counterfactuals", "", map[string]any{"id": "stored", "x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}); code != http.StatusCreated {
		t.Fatalf("register: %d %s", code, body)
	}
	writes0, stored0 := r.RegistrationBatches(t)
	var regs []registration
	want := map[string]error{}
	for k := 0; k < 10; k++ {
		id := fmt.Sprintf("g%d", k)
		regs, want[id] = append(regs, pair(id, k)), nil
	}
	short := pair("short", 1)
	short.xcf = short.xcf[:5]
	notCF := pair("not-cf", 2)
	notCF.x = notCF.xcf
	regs = append(regs, pair("twice", 10), pair("twice", 11), pair("stored", 3), short, notCF, pair("a b", 4))
	want["short"], want["not-cf"], want["stored"], want["a b"] = errBadRequest, errNotCounterfactual, ledger.ErrExists, errBadRequest

	// A registrar of the running daemon's own storeRegistrations, started once all 16 wait.
	g := newRegistrar(1, r.D.measureRegistrations, r.D.storeRegistrations)
	out := make([][]registered, len(regs))
	errs := make([]error, len(regs))
	var wg sync.WaitGroup
	for i := range regs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i], errs[i] = g.submit(context.Background(), regs[i:i+1], false)
		}()
	}
	waitfor.Cond(t, 10*time.Second, "16 registrations queued", func() bool { return len(g.jobs) == len(regs) })
	ctx, cancel := context.WithCancel(context.Background())
	go g.run(ctx)
	wg.Wait()
	cancel()
	<-g.stopped

	twice := 0
	for i, rg := range regs {
		if errs[i] != nil {
			t.Fatalf("%s: %v", rg.id, errs[i])
		}
		got := out[i][0]
		if rg.id == "twice" {
			if got.err == nil {
				twice++
			} else if !errors.Is(got.err, ledger.ErrExists) {
				t.Errorf("twice: %v, want stored once and ErrExists once", got.err)
			}
			continue
		}
		if w := want[rg.id]; w == nil && got.err != nil || w != nil && !errors.Is(got.err, w) {
			t.Errorf("%s: %v, want %v", rg.id, got.err, w)
			continue
		}
		if got.err != nil {
			continue
		}
		ce, err := r.D.ledger.Get(rg.id)
		if err != nil {
			t.Errorf("%s is not stored: %v", rg.id, err)
			continue
		}
		if ce.Status != certify.Certified || ce.AnchorVersion != r.D.current().Version || ce.P1 != got.ce.P1 {
			t.Errorf("%s stored %v anchor %d p1 %v; want certified under version %d, p1 %v", rg.id, ce.Status, ce.AnchorVersion, ce.P1, r.D.current().Version, got.ce.P1)
		}
	}
	if twice != 1 {
		t.Errorf("id twice stored %d times, want once", twice)
	}
	if writes, stored := r.RegistrationBatches(t); writes-writes0 != 1 || stored-stored0 != 11 {
		t.Errorf("%d ledger writes storing %v CEs, want 1 storing 11", writes-writes0, stored-stored0)
	}
}

// A registration the registrar never took, because the daemon stopped, is refused with
// errStopping (503), not left waiting.
func TestRegistrationAfterStop(t *testing.T) {
	g := newRegistrar(1, func(context.Context, []registration) *regMeasure { panic("not reached") },
		func(context.Context, []registration, *regMeasure, bool) []registered { panic("not reached") })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	g.run(ctx)
	if _, err := g.submit(context.Background(), []registration{{id: "late"}}, false); !errors.Is(err, errStopping) || registerStatus(err) != http.StatusServiceUnavailable {
		t.Errorf("submit after stop: %v, want errStopping (503)", err)
	}
}

// Registrations measured together get the p1 and Var1 each gets measured alone under the same
// posterior (the version's shared draws; an input's estimate depends on its own row): bit for bit
// in the default build, whose chunked and one-at-a-time paths add in the same order, and to
// rounding with -tags openblas, whose dgemm sums in its own order (bnn's engine doc). A batch
// measured under a posterior that is no longer current when it is stored is measured again under
// the current one: each CE is anchored to the posterior it was measured under, with the numbers a
// registration alone gets under it.
func TestBatchedRegistrationsMeasureAsAlone(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	const n = 12
	if len(xs) < n || len(cfs) < n {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	pairs := func(prefix string) []registration {
		rs := make([]registration, n)
		for k := range rs {
			rs[k] = registration{id: fmt.Sprintf("%s-%d", prefix, k), x: data.X[xs[k]], xcf: data.X[cfs[(k+3)%len(cfs)]], target: target{set: true, name: "benign"}}
		}
		return rs
	}
	ctx := context.Background()
	alone := func(prefix string) []*ledger.CE {
		ces := make([]*ledger.CE, n)
		for k, rg := range pairs(prefix) {
			ce, err := r.D.register(ctx, rg)
			if err != nil {
				t.Fatalf("%s alone: %v", rg.id, err)
			}
			ces[k] = ce
		}
		return ces
	}
	same := func(what string, got []registered, want []*ledger.CE) {
		t.Helper()
		for k, o := range got {
			if o.err != nil {
				t.Fatalf("%s %d: %v", what, k, o.err)
			}
			if o.ce.AnchorVersion != want[k].AnchorVersion || !sameSum(o.ce.P1, want[k].P1) || !sameSum(o.ce.Var1, want[k].Var1) {
				t.Errorf("%s %d: anchor %d p1 %v var1 %v; alone: anchor %d p1 %v var1 %v", what, k,
					o.ce.AnchorVersion, o.ce.P1, o.ce.Var1, want[k].AnchorVersion, want[k].P1, want[k].Var1)
			}
		}
	}

	// Measured and stored together (one write), against one at a time.
	v0 := r.D.current().Version
	want := alone("alone")
	writes0, _ := r.RegistrationBatches(t)
	none := time.Duration(0)
	got, err := r.D.registerMany(ctx, pairs("batch"), &none)
	if err != nil {
		t.Fatal(err)
	}
	if writes, _ := r.RegistrationBatches(t); writes-writes0 != 1 {
		t.Fatalf("%d ledger writes for %d registrations sent together, want 1", writes-writes0, n)
	}
	same("together", got, want)

	// From concurrent clients (batches of any size, measured on the registrar's lanes at once).
	got = make([]registered, n)
	var wg sync.WaitGroup
	for k, rg := range pairs("concurrent") {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[k].ce, got[k].err = r.D.register(ctx, rg)
		}()
	}
	wg.Wait()
	same("concurrent", got, want)

	// Measured under v0, stored after the posterior moved on.
	rs := pairs("moved")
	me := r.D.measureRegistrations(ctx, rs)
	var vals [][]byte
	for i := range 32 {
		vals = append(vals, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, vals...)
	waitfor.Cond(t, 30*time.Second, "32 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 32 })
	moved := r.D.storeRegistrations(ctx, rs, me, true)
	want = alone("after")
	if want[0].AnchorVersion == v0 {
		t.Fatalf("registrations after the increment anchored to version %d, the one before it", v0)
	}
	same("measured before the increment", moved, want)
}

// sameSum reports whether a and b are the same Monte-Carlo estimate: equal in the default build,
// and within rounding (a relative 1e-12, far under the estimate's own error) with OpenBLAS.
func sameSum(a, b float64) bool {
	if bnn.Backend != "openblas" {
		return a == b
	}
	return math.Abs(a-b) <= 1e-12*math.Max(math.Abs(a), math.Abs(b))
}

// sameSums is sameSum for every pair of a and b (of one length).
func sameSums(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !sameSum(a[i], b[i]) {
			return false
		}
	}
	return true
}
