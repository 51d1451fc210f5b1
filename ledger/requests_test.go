package ledger

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
)

// partitionLog is the requests of one CE-topic partition, in offset order, and what applying
// them in order must leave: each id's CE (nil when none) and each request id's result.
type partitionLog struct {
	ops     []ShareOp
	stored  map[string]*CE
	results map[string]string
}

// attackLog builds a partition's requests: registrations, deletions, registrations of another
// CE under a deleted id, a registration delivered twice on either side of its deletion (a
// producer's retry), and a registration of an id that holds another CE.
func attackLog(t *testing.T, m *bnn.Model) partitionLog {
	rng := rand.New(rand.NewPCG(7, 7))
	lg := partitionLog{stored: map[string]*CE{}, results: map[string]string{}}
	add := func(op ShareOp) {
		op.Offset = int64(len(lg.ops))
		lg.ops = append(lg.ops, op)
	}
	clone := func(ce *CE) *CE { c := *ce; return &c }
	for i := range 4 {
		id := fmt.Sprintf("ce-%d", i)
		a, b := newCE(t, m, rng), newCE(t, m, rng)
		a.ID, b.ID = id, id
		add(ShareOp{RID: id + "/a", ID: id, CE: clone(a)})
		add(ShareOp{RID: id + "/del", ID: id})
		add(ShareOp{RID: id + "/b", ID: id, CE: clone(b)})
		add(ShareOp{RID: id + "/a", ID: id, CE: clone(a)}) // the first registration, delivered again
		add(ShareOp{RID: id + "/a2", ID: id, CE: clone(a)})
		lg.stored[id] = b
		lg.results[id+"/a"], lg.results[id+"/del"], lg.results[id+"/b"], lg.results[id+"/a2"] =
			OutcomeStored, OutcomeDeleted, OutcomeStored, OutcomeExists
	}
	add(ShareOp{RID: "gone/del", ID: "gone"})
	lg.results["gone/del"] = OutcomeAbsent
	return lg
}

// applyLog applies lg's requests to the ledger in dir as a member of the CE group does: from
// the offset the ledger stored, batch requests at a time, each batch with the offset after it.
// Each commit calls fail with its number (from 1); a commit it fails is a crash: the ledger is
// closed and opened again, and the member starts again from the offset stored.
func applyLog(t *testing.T, dir string, lg partitionLog, batch int, fail func(commit int) bool) *Ledger {
	t.Helper()
	const p = 3
	commits := 0
	open := func() *Ledger {
		l, err := Open(dir, Options{Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		l.opts.AfterCommit = func() error {
			commits++
			if fail(commits) {
				return errors.New("injected crash at the commit's final fsync")
			}
			return nil
		}
		return l
	}
	l := open()
	for crashes := 0; ; {
		from, _, err := l.ShareOffset(p)
		if err != nil {
			t.Fatal(err)
		}
		if from >= int64(len(lg.ops)) {
			break
		}
		next := min(from+int64(batch), int64(len(lg.ops)))
		ops := make([]ShareOp, 0, next-from)
		for _, op := range lg.ops[from:next] {
			if op.CE != nil {
				c := *op.CE
				op.CE = &c
			}
			ops = append(ops, op)
		}
		if _, err := l.ApplyShare(p, ops, next, nil, nil); err != nil {
			if !errors.Is(err, ErrWrite) || crashes > 10 {
				t.Fatalf("ApplyShare of offsets [%d, %d): %v", from, next, err)
			}
			crashes++
			l.Close()
			l = open()
		}
	}
	l.opts.AfterCommit = nil
	return l
}

// checkLog checks that l holds what applying lg's requests once each, in order, leaves.
func checkLog(t *testing.T, l *Ledger, lg partitionLog, what string) {
	t.Helper()
	for id, want := range lg.stored {
		got, err := l.Get(id)
		if err != nil {
			t.Errorf("%s: %s: %v; want it stored", what, id, err)
			continue
		}
		if !slices.Equal(got.XCF, want.XCF) {
			t.Errorf("%s: %s holds x_cf %v, want %v", what, id, got.XCF, want.XCF)
		}
	}
	for rid, want := range lg.results {
		o, ok, err := l.Outcome(rid)
		if err != nil || !ok || o.Result != want {
			t.Errorf("%s: outcome of %s = %+v, %v, %v; want %s", what, rid, o, ok, err, want)
		}
	}
}

// TestApplyShareCrashLosesNoRequest crashes the owner of a partition at each commit of its
// batches in turn: the requests and the offset after them are one transaction, so whatever the
// commit the crash hits, the member reads the batch again from the stored offset and the ledger
// ends as applying every request once, in order, leaves. A ledger that stored the offset in a
// transaction of its own before the requests' would lose the batch at a crash between the two.
func TestApplyShareCrashLosesNoRequest(t *testing.T) {
	m := testModel(4)
	lg := attackLog(t, m)
	const batch = 4
	// Without a crash: how many commits the log takes.
	dir := t.TempDir()
	l0, err := Open(dir, Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	install(t, l0, m)
	l0.Close()
	total := 0
	l := applyLog(t, dir, lg, batch, func(n int) bool { total = n; return false })
	checkLog(t, l, lg, "no crash")
	l.Close()
	if total < 2 {
		t.Fatalf("the log took %d commits", total)
	}
	for at := 1; at <= total; at++ {
		dir := t.TempDir()
		l0, err := Open(dir, Options{Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		install(t, l0, m)
		l0.Close()
		l := applyLog(t, dir, lg, batch, func(n int) bool { return n == at })
		checkLog(t, l, lg, fmt.Sprintf("crash at commit %d of %d", at, total))
		l.Close()
	}
}

// An owner applies a request of a given request id once: delivered again after its CE was
// deleted, it registers nothing. A batch with a registration under a posterior the ledger does
// not have writes nothing, not even the offset. A released or reset partition forgets its
// outcomes, so that reading it again from its start applies its requests again. Outcomes expire
// after the window.
func TestApplyShareOutcomes(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, _ := openTest(t, Options{RequestWindow: time.Hour, Now: func() time.Time { return now }})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(8, 8))
	a := newCE(t, m, rng)
	a.ID = "x"
	outs, err := l.ApplyShare(1, []ShareOp{{RID: "r1", ID: "x", CE: a}, {RID: "d1", ID: "x"}, {RID: "r1", ID: "x", CE: a}}, 3, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if outs[0].Result != OutcomeStored || outs[1].Result != OutcomeDeleted || !outs[2].Duplicate || outs[2].Result != OutcomeStored {
		t.Errorf("outcomes %+v", outs)
	}
	if _, err := l.Get("x"); !errors.Is(err, ErrNotFound) {
		t.Errorf("a registration delivered again after its deletion: Get = %v, want not found", err)
	}
	// A registration under a posterior neither current nor given: nothing written.
	b := newCE(t, m, rng)
	b.ID, b.AnchorVersion = "y", 42
	var need *AnchorsNeededError
	if _, err := l.ApplyShare(1, []ShareOp{{RID: "d2", ID: "gone"}, {RID: "r2", ID: "y", CE: b}}, 5, nil, nil); !errors.As(err, &need) ||
		!slices.Equal(need.Ops, []int{1}) || !slices.Equal(need.Versions, []uint64{42}) {
		t.Fatalf("ApplyShare with an unknown anchor = %v", err)
	}
	if off, _, _ := l.ShareOffset(1); off != 3 {
		t.Errorf("offset %d after a batch that needed anchors, want 3", off)
	}
	if _, ok, _ := l.Outcome("d2"); ok {
		t.Error("a batch that needed anchors stored an outcome")
	}
	// Released: read again from the start, the requests apply again.
	if _, err := l.ReleaseShare(bg, 1, func(string) bool { return true }); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := l.Outcome("r1"); ok {
		t.Error("a released partition kept its outcomes")
	}
	if outs, err = l.ApplyShare(1, []ShareOp{{RID: "r1", ID: "x", CE: a}}, 1, nil, nil); err != nil || outs[0].Duplicate {
		t.Fatalf("after the release: %+v, %v", outs, err)
	}
	// Reset (the topic recreated), the new log read from offset 1 on: the offset back to 0, the
	// CEs kept, the outcomes of requests read from offset 1 on forgotten (they apply again, in
	// order), those before kept (a client's retry of an old request is answered as before).
	// Another partition's outcomes stay.
	c := newCE(t, m, rng)
	c.ID = "y"
	if _, err := l.ApplyShare(1, []ShareOp{{RID: "k0", ID: "old", Offset: 1}, {RID: "n1", ID: "y", CE: c, Offset: 2}}, 3, nil, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := l.ApplyShare(2, []ShareOp{{RID: "d3", ID: "elsewhere"}}, 1, nil, nil); err != nil {
		t.Fatal(err)
	}
	if err := l.ResetShare(1, 2); err != nil {
		t.Fatal(err)
	}
	if off, held, _ := l.ShareOffset(1); off != 0 || !held {
		t.Errorf("after ResetShare: offset %d (held %v), want 0, held", off, held)
	}
	if _, err := l.Get("x"); err != nil {
		t.Errorf("ResetShare deleted a CE: %v", err)
	}
	if _, ok, _ := l.Outcome("n1"); ok {
		t.Error("a reset partition kept the outcome of a request read at or after the reset's offset")
	}
	if _, ok, _ := l.Outcome("k0"); !ok {
		t.Error("a reset partition forgot the outcome of a request read before the reset's offset")
	}
	if _, ok, _ := l.Outcome("d3"); !ok {
		t.Error("a reset of partition 1 forgot partition 2's outcome")
	}
	if outs, err = l.ApplyShare(1, []ShareOp{{RID: "k0", ID: "old", Offset: 1}, {RID: "n1", ID: "y", CE: c, Offset: 2}}, 3, nil, nil); err != nil ||
		!outs[0].Duplicate || outs[1].Duplicate || outs[1].Result != OutcomeSame {
		t.Fatalf("requests read again after the reset: %+v, %v; want the one before offset 2 answered from its outcome, the other applied again (same CE)", outs, err)
	}
	// Expired: an hour and a bit later, r1's outcome is gone.
	now = now.Add(61 * time.Minute)
	if _, err := l.ApplyShare(2, nil, 0, nil, nil); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := l.Outcome("r1"); ok {
		t.Error("an outcome outlived the request window")
	}
}

// PutRequests stores each CE's outcome under its request id in the registration's own
// transaction, and refuses a request applied before with its outcome, also after the CE was
// deleted; a failed write stores neither the CE nor the outcome.
func TestPutRequests(t *testing.T) {
	l, _ := openTest(t, Options{})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(9, 9))
	a, b := newCE(t, m, rng), newCE(t, m, rng)
	a.ID, b.ID = "a", "b"
	errs, err := l.PutRequests(bg, []*CE{a, b}, []RequestRef{{RID: "k1", Fingerprint: "f1"}, {}})
	if err != nil || errs[0] != nil || errs[1] != nil {
		t.Fatalf("PutRequests = %v, %v", errs, err)
	}
	if o, ok, err := l.Outcome("k1"); err != nil || !ok || o.Result != OutcomeStored || o.Fingerprint != "f1" || o.Partition != -1 {
		t.Errorf("outcome of k1 = %+v, %v, %v", o, ok, err)
	}
	if err := l.Delete("a"); err != nil {
		t.Fatal(err)
	}
	again := *a
	errs, err = l.PutRequests(bg, []*CE{&again}, []RequestRef{{RID: "k1", Fingerprint: "f1"}})
	var dup *DuplicateError
	if err != nil || !errors.As(errs[0], &dup) || dup.Outcome.Result != OutcomeStored {
		t.Errorf("PutRequests of a request applied before = %v, %v; want a DuplicateError", errs, err)
	}
	if _, err := l.Get("a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("a request applied before registered its CE again after its deletion: %v", err)
	}
	c := newCE(t, m, rng)
	c.ID = "c"
	l.opts.AfterCommit = func() error { return errors.New("injected fsync failure") }
	if _, err := l.PutRequests(bg, []*CE{c}, []RequestRef{{RID: "k3"}}); !errors.Is(err, ErrWrite) {
		t.Errorf("failed write: %v, want ErrWrite", err)
	}
	l.opts.AfterCommit = nil
	if _, ok, _ := l.Outcome("k3"); ok {
		t.Error("a failed write stored an outcome")
	}
}

const shareCrashDirEnv = "CFGUARD_LEDGER_SHARE_CRASH_DIR"

// longLog is a partition's requests over a few ids, drawn with a fixed seed (the same in the
// parent and the child of TestShareKilledMidApply): registrations of two CEs per id, deletions,
// and registrations delivered again.
func longLog(t *testing.T, m *bnn.Model, n int) []ShareOp {
	rng := rand.New(rand.NewPCG(11, 11))
	type pair struct{ a, b *CE }
	ids := make([]pair, 6)
	for i := range ids {
		a, b := newCE(t, m, rng), newCE(t, m, rng)
		a.ID, b.ID = fmt.Sprintf("ce-%d", i), fmt.Sprintf("ce-%d", i)
		ids[i] = pair{a, b}
	}
	var ops []ShareOp
	for len(ops) < n {
		k := rng.IntN(len(ids))
		id := ids[k].a.ID
		op := ShareOp{RID: fmt.Sprintf("r%d", len(ops)), ID: id, Offset: int64(len(ops))}
		switch r := rng.IntN(10); {
		case r < 3:
			c := *ids[k].a
			op.CE = &c
		case r < 6:
			c := *ids[k].b
			op.CE = &c
		case r < 8:
		default: // an earlier request delivered again
			if len(ops) > 0 {
				prev := ops[rng.IntN(len(ops))]
				prev.Offset = op.Offset
				op = prev
			}
		}
		ops = append(ops, op)
	}
	return ops
}

// expected applies ops in order, each request id once, to a model of the ledger: each id's x_cf
// (absent when none) and each request id's result.
func expected(ops []ShareOp) (map[string][]float64, map[string]string) {
	stored, results := map[string][]float64{}, map[string]string{}
	for _, op := range ops {
		if _, ok := results[op.RID]; ok {
			continue
		}
		have, ok := stored[op.ID]
		switch {
		case op.CE == nil && ok:
			delete(stored, op.ID)
			results[op.RID] = OutcomeDeleted
		case op.CE == nil:
			results[op.RID] = OutcomeAbsent
		case ok && slices.Equal(have, op.CE.XCF):
			results[op.RID] = OutcomeSame
		case ok:
			results[op.RID] = OutcomeExists
		default:
			stored[op.ID], results[op.RID] = op.CE.XCF, OutcomeStored
		}
	}
	return stored, results
}

// TestShareApplyChild is the child of TestShareKilledMidApply: it applies longLog to the ledger
// in $CFGUARD_LEDGER_SHARE_CRASH_DIR from the offset stored there, a few requests per batch,
// printing each offset stored, until the log ends or it is killed.
func TestShareApplyChild(t *testing.T) {
	dir := os.Getenv(shareCrashDirEnv)
	if dir == "" {
		t.Skip("child process of TestShareKilledMidApply")
	}
	l, err := Open(dir, Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	m := testModel(4)
	if _, err := l.Current(); err != nil {
		install(t, l, m)
	}
	ops := longLog(t, m, shareCrashOps)
	for {
		from, _, err := l.ShareOffset(shareCrashPartition)
		if err != nil {
			t.Fatal(err)
		}
		if from >= int64(len(ops)) {
			return
		}
		next := min(from+5, int64(len(ops)))
		batch := make([]ShareOp, 0, next-from)
		for _, op := range ops[from:next] {
			if op.CE != nil {
				c := *op.CE
				op.CE = &c
			}
			batch = append(batch, op)
		}
		if _, err := l.ApplyShare(shareCrashPartition, batch, next, nil, nil); err != nil {
			t.Fatal(err)
		}
		fmt.Printf("applied %d\n", next)
	}
}

const (
	shareCrashOps       = 400
	shareCrashPartition = 2
)

// TestShareKilledMidApply kills an owner applying its partition with SIGKILL at arbitrary
// points: whatever the moment, the ledger holds exactly what applying the requests before its
// stored offset leaves, each request once, and the next run goes on from there.
func TestShareKilledMidApply(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills child processes")
	}
	dir := t.TempDir()
	ops := longLog(t, testModel(4), shareCrashOps)
	rng := rand.New(rand.NewPCG(43, 43))
	for round := 0; ; round++ {
		ctx, cancel := context.WithCancel(context.Background())
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestShareApplyChild$", "-test.count=1")
		cmd.Env = append(os.Environ(), shareCrashDirEnv+"="+dir)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(out)
		seen, want := 0, 1+rng.IntN(12)
		for seen < want && sc.Scan() {
			if strings.HasPrefix(sc.Text(), "applied ") {
				seen++
			}
		}
		cmd.Process.Kill()
		cmd.Wait()
		cancel()
		l, err := Open(dir, Options{Logger: quietLogger()})
		if err != nil {
			t.Fatal(err)
		}
		off, _, err := l.ShareOffset(shareCrashPartition)
		if err != nil {
			t.Fatal(err)
		}
		stored, results := expected(ops[:off])
		for i := range 6 {
			id := fmt.Sprintf("ce-%d", i)
			ce, err := l.Get(id)
			want, ok := stored[id]
			if ok != (err == nil) || (ok && !slices.Equal(ce.XCF, want)) {
				t.Fatalf("round %d, offset %d: %s holds %v (%v), want %v", round, off, id, ce, err, want)
			}
		}
		for _, op := range ops {
			o, ok, err := l.Outcome(op.RID)
			if want, applied := results[op.RID]; err != nil || ok != applied || (ok && o.Result != want) {
				t.Fatalf("round %d, offset %d: outcome of %s = %+v, %v, %v; want %q", round, off, op.RID, o, ok, err, want)
			}
		}
		l.Close()
		if _, err := Verify(filepath.Join(dir, FileName)); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		t.Logf("round %d: killed after %d batches seen; the ledger holds offset %d", round, seen, off)
		if off == int64(len(ops)) {
			if round < 3 {
				t.Fatalf("the log was applied in %d rounds: too few kills to test", round+1)
			}
			return
		}
	}
}

// Verify checks the request outcomes: an outcome without its entry in requests_at is damage.
func TestVerifyChecksOutcomes(t *testing.T) {
	dir := t.TempDir()
	l, err := Open(dir, Options{Logger: quietLogger()})
	if err != nil {
		t.Fatal(err)
	}
	m := testModel(4)
	install(t, l, m)
	a := newCE(t, m, rand.New(rand.NewPCG(3, 3)))
	a.ID = "a"
	outs, err := l.ApplyShare(0, []ShareOp{{RID: "r1", ID: "a", CE: a}, {RID: "r2", ID: "b"}}, 2, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	path := filepath.Join(dir, FileName)
	if _, err := Verify(path); err != nil {
		t.Fatalf("Verify of a ledger with outcomes: %v", err)
	}
	if l, err = Open(dir, Options{Logger: quietLogger()}); err != nil {
		t.Fatal(err)
	}
	l.wmu.Lock()
	err = l.update(func(tx *bolt.Tx) error { return tx.Bucket(bRequestsAt).Delete(outcomeAtKey(outs[1].At, "r2")) })
	l.wmu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	if _, err := Verify(path); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Verify of an outcome missing from requests_at: %v, want ErrCorrupt", err)
	}
}

// A deletion with a request id is applied once: its outcome (deleted, or absent when nothing is
// stored) is stored under the id, and the request again, after the id was registered anew,
// returns that outcome and deletes nothing. A deletion without a request id stores no outcome.
func TestDeleteRequest(t *testing.T) {
	l, _ := openTest(t, Options{})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(13, 13))
	a, b := newCE(t, m, rng), newCE(t, m, rng)
	a.ID, b.ID = "a", "a"
	if errs, err := l.PutEach(bg, []*CE{a}); err != nil || errs[0] != nil {
		t.Fatalf("PutEach = %v, %v", errs, err)
	}
	ref := RequestRef{RID: "d1", Fingerprint: "f-d1"}
	o, err := l.DeleteRequest("a", ref, nil)
	if err != nil || o.Result != OutcomeDeleted || o.Duplicate || o.ID != "a" || o.Partition != -1 {
		t.Fatalf("DeleteRequest = %+v, %v; want deleted, not a duplicate", o, err)
	}
	if got, ok, err := l.Outcome("d1"); err != nil || !ok || got.Result != OutcomeDeleted || got.Fingerprint != "f-d1" {
		t.Errorf("outcome of d1 = %+v, %v, %v", got, ok, err)
	}
	if _, err := l.Get("a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("a after its deletion: %v", err)
	}
	// The id registered anew; the deletion again deletes nothing and says what it decided first.
	if errs, err := l.PutEach(bg, []*CE{b}); err != nil || errs[0] != nil {
		t.Fatalf("PutEach = %v, %v", errs, err)
	}
	o, err = l.DeleteRequest("a", ref, nil)
	if err != nil || o.Result != OutcomeDeleted || !o.Duplicate || o.Fingerprint != "f-d1" {
		t.Errorf("DeleteRequest again = %+v, %v; want the first outcome, a duplicate", o, err)
	}
	if got, err := l.Get("a"); err != nil || !slices.Equal(got.XCF, b.XCF) {
		t.Errorf("the deletion again deleted the CE registered after it: %v, %v", got, err)
	}
	// Nothing stored under the id: absent.
	o, err = l.DeleteRequest("none", RequestRef{RID: "d2"}, nil)
	if err != nil || o.Result != OutcomeAbsent || o.Duplicate {
		t.Errorf("DeleteRequest of a missing id = %+v, %v; want absent", o, err)
	}
	// Without a request id: applied, no outcome stored.
	o, err = l.DeleteRequest("a", RequestRef{}, nil)
	if err != nil || o.Result != OutcomeDeleted {
		t.Errorf("DeleteRequest without a request id = %+v, %v; want deleted", o, err)
	}
	if o, err = l.DeleteRequest("a", RequestRef{}, nil); err != nil || o.Result != OutcomeAbsent {
		t.Errorf("DeleteRequest without a request id, again = %+v, %v; want absent", o, err)
	}
	l.opts.AfterCommit = func() error { return errors.New("injected fsync failure") }
	if _, err := l.DeleteRequest("x", RequestRef{RID: "d3"}, nil); !errors.Is(err, ErrWrite) {
		t.Errorf("failed write: %v, want ErrWrite", err)
	}
	l.opts.AfterCommit = nil
	if _, ok, _ := l.Outcome("d3"); ok {
		t.Error("a failed write stored an outcome")
	}
}

// Two CEs of one PutRequests call with the same request id are one request applied once, as
// across calls: the first is stored with its outcome, the second is refused with a
// *DuplicateError holding the first's outcome, whether its fingerprint is the first's (a retry
// racing the first) or another (a key reused), so the outcome names the CE stored.
func TestPutRequestsOneRequestIDTwiceInABatch(t *testing.T) {
	l, _ := openTest(t, Options{})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(17, 17))
	stored := 0
	for _, tc := range []struct {
		name, rid, fp2 string
		ids            [2]string
	}{
		{"another fingerprint", "k", "f2", [2]string{"a", "b"}},
		{"the same fingerprint, ids given by the ledger", "k2", "f1", [2]string{"", ""}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			first, second := newCE(t, m, rng), newCE(t, m, rng)
			first.ID, second.ID = tc.ids[0], tc.ids[1]
			errs, err := l.PutRequests(bg, []*CE{first, second}, []RequestRef{{RID: tc.rid, Fingerprint: "f1"}, {RID: tc.rid, Fingerprint: tc.fp2}})
			if err != nil || errs[0] != nil {
				t.Fatalf("PutRequests = %v, %v", errs, err)
			}
			var dup *DuplicateError
			if !errors.As(errs[1], &dup) || dup.Outcome.ID != first.ID || dup.Outcome.Result != OutcomeStored || dup.Outcome.Fingerprint != "f1" {
				t.Fatalf("the second CE with request id %q: %v (%+v); want a DuplicateError with the first's outcome", tc.rid, errs[1], dup)
			}
			if second.ID != "" {
				if _, err := l.Get(second.ID); !errors.Is(err, ErrNotFound) {
					t.Fatalf("the second CE with request id %q was stored: %v", tc.rid, err)
				}
			}
			if all, err := l.List(0, 1000, ""); err != nil || len(all) != stored+1 {
				t.Fatalf("%d CEs stored (%v), want %d: one per request", len(all), err, stored+1)
			}
			stored++
			if o, ok, err := l.Outcome(tc.rid); err != nil || !ok || o.ID != first.ID || o.Fingerprint != "f1" || !o.At.Equal(dup.Outcome.At) {
				t.Fatalf("outcome of %q = %+v, %v, %v; want the first CE's, as the DuplicateError said (%+v)", tc.rid, o, ok, err, dup.Outcome)
			}
		})
	}
	checkInvariants(t, l)
}

// A keyed registration refused because its id holds a CE (stored, or kept earlier in the same
// call) has its outcome stored: sent again once the id is free, it is refused as before. One
// refused for an id given only to an earlier CE of the call that was refused too stores none:
// the id held nothing.
func TestPutRequestsRemembersAnIDThatHeldACE(t *testing.T) {
	l, _ := openTest(t, Options{})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(23, 23))
	ce := func(id string) *CE { c := newCE(t, m, rng); c.ID = id; return c }
	stored := ce("s")
	if err := l.Put(bg, stored); err != nil {
		t.Fatal(err)
	}
	same := *stored
	errs, err := l.PutRequests(bg,
		[]*CE{ce("s"), &same, ce("x"), ce("x"), ce("y"), ce("y"), ce("y")},
		[]RequestRef{{RID: "other"}, {RID: "same"}, {RID: "first"}, {RID: "in-call"}, {RID: "first"}, {RID: "y2"}, {RID: "y3"}})
	if err != nil {
		t.Fatal(err)
	}
	// 0 another CE under "s", 1 the stored CE itself, 2 stored, 3 "x" kept by 2, 4 a retry of
	// request "first" (refused, so "y" holds nothing), 5 and 6 "y" given to 4 only (refused for
	// the id all the same, which judgePut takes before it knows 4 is a retry: not checked here).
	for i, want := range []string{"keyed", "keyed", "", "keyed", "duplicate"} {
		var ke *KeyedExistsError
		var dup *DuplicateError
		got := map[bool]string{true: "exists"}[errors.Is(errs[i], ErrExists)]
		switch {
		case errs[i] == nil:
			got = ""
		case errors.As(errs[i], &ke):
			got = "keyed"
		case errors.As(errs[i], &dup):
			got = "duplicate"
		}
		if got != want {
			t.Errorf("CE %d: %v (%s), want %s", i, errs[i], got, want)
		}
	}
	for _, c := range []struct {
		rid  string
		want bool
	}{{"other", true}, {"same", true}, {"in-call", true}, {"y2", false}, {"y3", false}} {
		o, ok, err := l.Outcome(c.rid)
		if err != nil || ok != c.want || ok && o.Result != OutcomeExists {
			t.Errorf("outcome of %s = %+v, %v, %v; want stored: %v (exists)", c.rid, o, ok, err, c.want)
		}
	}
}

// A partition's share witness is stored with its offset, kept while the offset moves on without
// one and across a restart, and dropped when the offset goes back to it or below (a reset) or
// the share is released.
func TestShareWitnessFollowsItsOffset(t *testing.T) {
	l, dir := openTest(t, Options{Policy: testPolicy()})
	const p = 2
	apply := func(next int64, w *ShareWitness) {
		t.Helper()
		if _, err := l.ApplyShare(p, nil, next, w, nil); err != nil {
			t.Fatal(err)
		}
	}
	check := func(what string, wantOff int64, want *ShareWitness) {
		t.Helper()
		off, _, got, err := l.ShareStart(p)
		if err != nil || off != wantOff || (got == nil) != (want == nil) || got != nil && *got != *want {
			t.Errorf("%s: ShareStart = %d, %+v, %v; want %d, %+v", what, off, got, err, wantOff, want)
		}
	}
	check("nothing stored", 0, nil)
	w := &ShareWitness{Offset: 4, Hash: [32]byte{1, 2, 3}}
	apply(5, w)
	check("stored with its offset", 5, w)
	apply(9, nil)
	check("the offset moved on without a witness", 9, w)
	apply(12, &ShareWitness{Offset: 12, Hash: [32]byte{9}})
	check("a witness not before its offset is not stored", 12, w)
	l = reopen(t, l, dir)
	check("after a restart", 12, w)
	apply(0, nil)
	check("the offset back to 0 (a reset)", 0, nil)
	apply(6, nil) // past the old witness's offset: the old log's record must not come back
	check("read on past the dropped witness's offset", 6, nil)
	w2 := &ShareWitness{Offset: 1, Hash: [32]byte{7}}
	apply(3, w2)
	check("stored again", 3, w2)
	if _, err := l.ReleaseShare(bg, p, func(string) bool { return false }); err != nil {
		t.Fatal(err)
	}
	check("released", 0, nil)
	apply(4, nil)
	check("read again after the release", 4, nil)
}

// A registration of an id that holds a CE stores nothing: OutcomeSame when it is the same CE
// (x, x' and target), OutcomeExists (a 409 "holds another counterfactual") when any of them
// differs. A refused registration (its CE did not decode, or its state did not) changes nothing,
// not even the CE its id holds, and a request without a request id (a CE restored from its
// state) is applied with no outcome stored. A negative offset is refused.
func TestApplyShareJudgesEachRegistration(t *testing.T) {
	l, _ := openTest(t, Options{})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(9, 9))
	a := newCE(t, m, rng)
	a.ID = "x"
	if outs, err := l.ApplyShare(1, []ShareOp{{RID: "r0", ID: "x", CE: a}}, 1, nil, nil); err != nil || outs[0].Result != OutcomeStored {
		t.Fatalf("storing x: %+v, %v", outs, err)
	}
	edited := func(edit func(c *CE)) *CE {
		c := *a
		c.X, c.XCF = slices.Clone(a.X), slices.Clone(a.XCF)
		edit(&c)
		return &c
	}
	for i, tc := range []struct {
		name string
		op   ShareOp
		want string
	}{
		{"the same CE", ShareOp{CE: edited(func(*CE) {})}, OutcomeSame},
		{"another x'", ShareOp{CE: edited(func(c *CE) { c.XCF[0] += 0.25 })}, OutcomeExists},
		{"another x", ShareOp{CE: edited(func(c *CE) { c.X[2] -= 0.25 })}, OutcomeExists},
		{"another target", ShareOp{CE: edited(func(c *CE) { c.Target = 1 - c.Target })}, OutcomeExists},
		{"refused", ShareOp{Refuse: "the registration's CE does not decode"}, OutcomeRefused},
	} {
		op := tc.op
		op.RID, op.ID, op.Offset = fmt.Sprintf("q%d", i), "x", int64(1+i)
		outs, err := l.ApplyShare(1, []ShareOp{op}, int64(2+i), nil, nil)
		if err != nil || outs[0].Result != tc.want {
			t.Errorf("%s: %+v, %v; want %s", tc.name, outs, err, tc.want)
		}
		if got, err := l.Get("x"); err != nil || !slices.Equal(got.XCF, a.XCF) || got.Target != a.Target {
			t.Fatalf("%s: x is %+v (%v) after it, want the CE stored first", tc.name, got, err)
		}
	}
	b := newCE(t, m, rng)
	b.ID = "restored"
	if outs, err := l.ApplyShare(1, []ShareOp{{ID: "restored", CE: b, Offset: 9}}, 10, nil, nil); err != nil || outs[0].Result != OutcomeStored {
		t.Fatalf("a request without a request id: %+v, %v", outs, err)
	}
	if off, _, _ := l.ShareOffset(1); off != 10 {
		t.Errorf("offset %d after the request without a request id, want 10", off)
	}
	if _, err := l.ApplyShare(1, nil, -1, nil, nil); err == nil {
		t.Error("a negative offset was stored")
	}
}
