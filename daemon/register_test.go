package daemon

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// Registrations waiting together are measured together and stored in one ledger write, and each
// keeps its own outcome: a bad one, an id given twice, an id already stored, a pair that is not
// a counterfactual are refused alone, the others stored, anchored to the current posterior.
func TestRegistrationsWaitingTogetherShareOneWrite(t *testing.T) {
	r := startDaemon(t, nil)
	p := pairsUnder(t, r, 12)
	pair := p.reg
	p.register(t, r, "stored", 0)
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
			out[i], errs[i] = g.submit(context.Background(), regs[i:i+1])
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
		func(context.Context, []registration, *regMeasure) []registered { panic("not reached") })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	g.run(ctx)
	if _, err := g.submit(context.Background(), []registration{{id: "late"}}); !errors.Is(err, errStopping) || registerStatus(err) != http.StatusServiceUnavailable {
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
	const n = 12
	p := pairsUnder(t, r, n)
	data, xs, cfs := p.data, p.xs, p.cfs
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
	moved := r.D.storeRegistrations(ctx, rs, me)
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

// A single daemon answers a registration that stored its CE with the CE the ledger holds under
// its id when it reads it back, only when that is the same x and x_cf: a CE deleted or replaced
// (another x_cf under the id) meanwhile is errDeletedSince (409), whose message says to send the
// registration again, with a new Idempotency-Key when it was sent with one.
func TestStoredNowAnswersOnlyTheCEItStored(t *testing.T) {
	r := startDaemon(t, nil)
	p := pairsUnder(t, r, 2)
	data, xs, cfs := p.data, p.xs, p.cfs
	p.register(t, r, "held", 0)
	const (
		again      = "to register it again, send it again"
		againKeyed = "to register it again, send it with a new Idempotency-Key"
	)
	for _, c := range []struct {
		name   string
		want   *ledger.CE
		keyed  bool
		stored bool   // answered with the CE as stored
		says   string // what the errDeletedSince message ends with
	}{
		{"the same CE", &ledger.CE{ID: "held", X: data.X[xs[0]], XCF: data.X[cfs[0]]}, false, true, ""},
		{"another x_cf under the id", &ledger.CE{ID: "held", X: data.X[xs[0]], XCF: data.X[cfs[1]]}, false, false, again},
		{"another x_cf under the id, keyed", &ledger.CE{ID: "held", X: data.X[xs[0]], XCF: data.X[cfs[1]]}, true, false, againKeyed},
		{"nothing under the id", &ledger.CE{ID: "gone", X: data.X[xs[0]], XCF: data.X[cfs[0]]}, false, false, again},
		{"nothing under the id, keyed", &ledger.CE{ID: "gone", X: data.X[xs[0]], XCF: data.X[cfs[0]]}, true, false, againKeyed},
	} {
		t.Run(c.name, func(t *testing.T) {
			ce, err := storedNow(r.D.ledger, c.want, c.keyed)
			if c.stored {
				if err != nil || ce == nil || ce.ID != "held" || ce.Status != certify.Certified {
					t.Fatalf("answered CE %v, %v; want the certified CE held", ce != nil, err)
				}
				return
			}
			if ce != nil || !errors.Is(err, errDeletedSince) || !strings.HasSuffix(err.Error(), c.says) {
				t.Fatalf("answered CE %v, %v; want errDeletedSince ending %q", ce != nil, err, c.says)
			}
		})
	}
}

// Two attempts of one keyed registration stored in one write (the same key, the same request)
// store the CE once, and the attempt the ledger refuses as applied before is answered from that
// outcome: both with the CE as stored, as a retry after the write would be.
func TestKeyedAttemptsInOneWriteAnswerAlike(t *testing.T) {
	r := startDaemon(t, nil)
	p := pairsUnder(t, r, 1)
	data, xs, cfs := p.data, p.xs, p.cfs
	body := `{"x":` + mustJSON(t, data.X[xs[0]]) + `,"x_cf":` + mustJSON(t, data.X[cfs[0]]) + `,"target":"benign"}`
	attempt := registration{x: data.X[xs[0]], xcf: data.X[cfs[0]], target: target{set: true, name: "benign"}}
	keyed(&attempt, "twice-key", "", requestFingerprint("POST", "/v1/counterfactuals", []byte(body)))
	writes0, stored0 := r.RegistrationBatches(t)
	none := time.Duration(0)
	got, err := r.D.registerMany(context.Background(), []registration{attempt, attempt}, &none)
	if err != nil {
		t.Fatal(err)
	}
	for k, o := range got {
		if o.err != nil || o.ce == nil || o.ce.ID != attempt.id || o.ce.Status != certify.Certified {
			t.Errorf("attempt %d: answered CE %v, %v; want the certified CE %s", k+1, o.ce != nil, o.err, attempt.id)
		}
	}
	if writes, stored := r.RegistrationBatches(t); writes-writes0 != 1 || stored-stored0 != 1 {
		t.Errorf("%d ledger writes storing %v CEs, want 1 storing 1", writes-writes0, stored-stored0)
	}
	if got := r.Metric(t, "cfguard_requests_replayed_total", "result", "stored"); got != 1 {
		t.Errorf("cfguard_requests_replayed_total{result=\"stored\"} %v, want 1: the second attempt answered from the first's outcome", got)
	}
}

// A registration whose client went away while it waited for the registrar is answered with its
// context's error and not stored; the registrations batched with it are stored as usual.
func TestRegistrationOfAClientGoneIsNotStored(t *testing.T) {
	r := startDaemon(t, nil)
	p := pairsUnder(t, r, 2)
	pair := p.reg
	writes0, stored0 := r.RegistrationBatches(t)
	// A registrar of the running daemon's own storeRegistrations, started once both wait.
	g := newRegistrar(1, r.D.measureRegistrations, r.D.storeRegistrations)
	gone, leave := context.WithCancel(context.Background())
	goneErr := make(chan error, 1)
	go func() {
		_, err := g.submit(gone, []registration{pair("gone", 0)})
		goneErr <- err
	}()
	waitfor.Cond(t, 10*time.Second, "the first registration queued", func() bool { return len(g.jobs) == 1 })
	stayed := make(chan []registered, 1)
	go func() {
		out, err := g.submit(context.Background(), []registration{pair("stayed", 1)})
		if err != nil {
			t.Errorf("stayed: %v", err)
		}
		stayed <- out
	}()
	waitfor.Cond(t, 10*time.Second, "both registrations queued", func() bool { return len(g.jobs) == 2 })
	leave()
	if err := <-goneErr; !errors.Is(err, context.Canceled) {
		t.Errorf("the registration of the client gone: %v, want context.Canceled", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go g.run(ctx)
	out := <-stayed
	cancel()
	<-g.stopped

	if len(out) != 1 || out[0].err != nil || out[0].ce == nil {
		t.Fatalf("stayed: %+v, want stored", out)
	}
	if _, err := r.D.ledger.Get("stayed"); err != nil {
		t.Errorf("stayed is not stored: %v", err)
	}
	if ce, err := r.D.ledger.Get("gone"); !errors.Is(err, ledger.ErrNotFound) {
		t.Errorf("the registration of the client gone: stored %v, %v; want nothing stored", ce != nil, err)
	}
	if writes, stored := r.RegistrationBatches(t); writes-writes0 != 1 || stored-stored0 != 1 {
		t.Errorf("%d ledger writes storing %v CEs, want 1 storing 1", writes-writes0, stored-stored0)
	}
}

// A keyed registration stored in one write with registrations sent without a key, before or
// after it in the batch, records its request's outcome, from which a retry is answered.
func TestKeyedRegistrationAmongUnkeyedRecordsItsOutcome(t *testing.T) {
	r := startDaemon(t, nil)
	p := pairsUnder(t, r, 4)
	pair := p.reg
	for _, c := range []struct {
		name  string
		keyAt int // index of the keyed registration in the batch
	}{
		{"keyed first", 0},
		{"keyed last", 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			rs := []registration{pair(fmt.Sprintf("plain-%d", c.keyAt), 2*c.keyAt), pair(fmt.Sprintf("plain-%d-b", c.keyAt), 2*c.keyAt+1)}
			keyed(&rs[c.keyAt], fmt.Sprintf("mixed-key-%d", c.keyAt), "", "fingerprint")
			out := r.D.storeRegistrations(context.Background(), rs, nil)
			for k, o := range out {
				if o.err != nil || o.ce == nil {
					t.Fatalf("%s: %v, want stored", rs[k].id, o.err)
				}
			}
			o, ok, err := r.D.ledger.Outcome(rs[c.keyAt].req.RID)
			if err != nil || !ok || o.Result != ledger.OutcomeStored || o.ID != rs[c.keyAt].id {
				t.Errorf("the keyed registration's outcome: %+v %v %v, want stored under %s", o, ok, err, rs[c.keyAt].id)
			}
		})
	}
}

// cfguard_counterfactuals_registration_batch_size observes the ledger writes that stored
// counterfactuals: a registration refused before the write (not a counterfactual) or by it (its
// id taken) adds no observation.
func TestRefusedRegistrationsObserveNoBatch(t *testing.T) {
	r := startDaemon(t, nil)
	p := pairsUnder(t, r, 2)
	data, xs, cfs := p.data, p.xs, p.cfs
	p.register(t, r, "taken", 0)
	for _, c := range []struct {
		name string
		reg  registration
		want error
	}{
		{"not a counterfactual", registration{id: "same", x: data.X[cfs[1]], xcf: data.X[cfs[1]], target: target{set: true, name: "benign"}}, errNotCounterfactual},
		{"id taken", registration{id: "taken", x: data.X[xs[1]], xcf: data.X[cfs[1]], target: target{set: true, name: "benign"}}, ledger.ErrExists},
	} {
		t.Run(c.name, func(t *testing.T) {
			writes0, stored0 := r.RegistrationBatches(t)
			if _, err := r.D.register(context.Background(), c.reg); !errors.Is(err, c.want) {
				t.Fatalf("register: %v, want %v", err, c.want)
			}
			if writes, stored := r.RegistrationBatches(t); writes != writes0 || stored != stored0 {
				t.Errorf("%d batches observed storing %v CEs, want none", writes-writes0, stored-stored0)
			}
		})
	}
}

// Registrations that wait for the registrar together, all of them counterfactuals, are measured
// and stored as one batch: one ledger write storing every one of them.
func TestRegistrationsQueuedTogetherAreOneWrite(t *testing.T) {
	r := startDaemon(t, nil)
	const n = 8
	p := pairsUnder(t, r, n)
	data, xs, cfs := p.data, p.xs, p.cfs
	writes0, stored0 := r.RegistrationBatches(t)
	// A registrar of the running daemon's own storeRegistrations, started once all n wait.
	g := newRegistrar(1, r.D.measureRegistrations, r.D.storeRegistrations)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for k := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reg := registration{id: fmt.Sprintf("q%d", k), x: data.X[xs[k]], xcf: data.X[cfs[k]], target: target{set: true, name: "benign"}}
			out, err := g.submit(context.Background(), []registration{reg})
			if err == nil {
				err = out[0].err
			}
			errs[k] = err
		}()
	}
	waitfor.Cond(t, 10*time.Second, fmt.Sprintf("%d registrations queued", n), func() bool { return len(g.jobs) == n })
	ctx, cancel := context.WithCancel(context.Background())
	go g.run(ctx)
	wg.Wait()
	cancel()
	<-g.stopped
	for k, err := range errs {
		if err != nil {
			t.Errorf("q%d: %v, want stored", k, err)
		}
	}
	if writes, stored := r.RegistrationBatches(t); writes-writes0 != 1 || stored-stored0 != n {
		t.Errorf("%d ledger writes storing %v CEs, want 1 storing %d", writes-writes0, stored-stored0, n)
	}
}

// benignPairs is the bundled data set and the rows of it that pair as (x, x_cf) for target benign
// under a daemon's posterior (daemontest.CandidatePairs).
type benignPairs struct {
	data    *dataset.Set
	xs, cfs []int
}

// pairsUnder finds the pairs under r's posterior, at least n of each kind.
func pairsUnder(t *testing.T, r *running, n int) benignPairs {
	t.Helper()
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	if len(xs) < n || len(cfs) < n {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf, want %d of each", len(xs), len(cfs), n)
	}
	return benignPairs{data, xs, cfs}
}

// reg is the registration under id of the k-th x with the k-th x_cf.
func (p benignPairs) reg(id string, k int) registration {
	return registration{id: id, x: p.data.X[p.xs[k]], xcf: p.data.X[p.cfs[k]], target: target{set: true, name: "benign"}}
}

// register stores the k-th pair under id through the API.
func (p benignPairs) register(t *testing.T, r *running, id string, k int) {
	t.Helper()
	body := map[string]any{"id": id, "x": p.data.X[p.xs[k]], "x_cf": p.data.X[p.cfs[k]], "target": "benign"}
	if code, b := r.Do(t, "POST", "/v1/counterfactuals", "", body); code != http.StatusCreated {
		t.Fatalf("register %s: %d %s", id, code, b)
	}
}
