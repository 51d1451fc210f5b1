package ledger

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

// damageValue flips one byte of the value stored under key in bucket b, through bbolt, so that
// the file's structure stays intact and only the record's checksum fails.
func damageValue(t *testing.T, l *Ledger, b []byte, key string) {
	t.Helper()
	err := l.update(func(tx *bolt.Tx) error {
		v := bytes.Clone(tx.Bucket(b).Get([]byte(key)))
		if v == nil {
			return fmt.Errorf("%s has no %q", b, key) // not t.Fatalf: Close would wait for this transaction
		}
		v[len(v)/2] ^= 0x20
		return tx.Bucket(b).Put([]byte(key), v)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Damaged CE records (a header, a body, an index entry) are found at Open, before anything
// reads them: the CEs are quarantined, counted and named in the log, lists, audits and
// re-certification go on without them, every invariant holds, Get answers ErrQuarantined, and a
// DELETE or a new registration of the id takes it off the count.
func TestDamagedRecordsQuarantinedAtOpen(t *testing.T) {
	dir := t.TempDir()
	m := richLedger(t, dir)
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), Now: fixedClock()})
	if err != nil {
		t.Fatal(err)
	}
	before, err := l.List(0, 1000, "")
	if err != nil {
		t.Fatal(err)
	}
	damageValue(t, l, bHeaders, "rich-a-05")
	damageValue(t, l, bBodies, "rich-b-03")
	var idx []byte
	l.view(func(tx *bolt.Tx) error {
		k, _ := tx.Bucket(bIdxP1).Cursor().First()
		idx = bytes.Clone(k)
		return nil
	})
	damageValue(t, l, bIdxP1, string(idx))
	l.Close()

	var log strings.Builder
	l, err = Open(dir, Options{Policy: testPolicy(), Logger: slog.New(slog.NewTextHandler(&log, nil)), Now: fixedClock(),
		EncodeChange: encodeChangeJSON})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if n := l.Damaged(); n != 2 {
		t.Fatalf("Damaged() = %d, want 2", n)
	}
	for _, want := range []string{`id=rich-a-05 reason="header checksum mismatch"`, `id=rich-b-03 reason="body checksum mismatch"`,
		"damaged index entries", "records checked"} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("the log does not say %q:\n%s", want, log.String())
		}
	}
	checkInvariants(t, l)
	for _, id := range []string{"rich-a-05", "rich-b-03"} {
		_, err := l.Get(id)
		if !errors.Is(err, ErrQuarantined) || errors.Is(err, ErrNotFound) || strings.Contains(err.Error(), dir) {
			t.Fatalf("Get(%q) = %v, want ErrQuarantined without the path", id, err)
		}
	}
	after, err := l.List(0, 1000, "")
	if err != nil || len(after) != len(before)-2 {
		t.Fatalf("List after quarantine: %d CEs (%v), want %d", len(after), err, len(before)-2)
	}
	for _, st := range certify.Statuses() {
		if _, err := l.List(st, 1000, ""); err != nil {
			t.Fatalf("List(%v): %v", st, err)
		}
	}
	if rep, _, err := l.Audit(bg, NewModelPredictor(m, 50, 1), AuditOptions{}); err != nil || rep.Evaluated != len(after) {
		t.Fatalf("audit after quarantine: %+v, %v", rep, err)
	}
	if _, _, err := l.Commit(bg, &Checkpoint{Model: drift(m, 0.001)}); err != nil {
		t.Fatalf("commit after quarantine: %v", err)
	}
	checkInvariants(t, l)

	// Deleting a quarantined CE drops its record; registering the id again does too.
	if err := l.Delete("rich-a-05"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Get("rich-a-05"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get after deleting a quarantined CE: %v, want ErrNotFound", err)
	}
	cur, _ := l.Current()
	ce := newCE(t, cur, rand.New(rand.NewPCG(7, 7)))
	ce.ID = "rich-b-03"
	if err := l.Put(bg, ce); err != nil {
		t.Fatal(err)
	}
	if n := l.Damaged(); n != 0 {
		t.Fatalf("Damaged() = %d after the delete and the new registration, want 0", n)
	}
	checkInvariants(t, l)
	l.Close()
	if _, err := Verify(l.Path()); err != nil {
		t.Fatalf("Verify after quarantine: %v", err)
	}
}

// A CE damaged while the ledger is open (after Open's check) does not take a list down: List
// skips it, logs it and counts it.
func TestListSkipsRecordDamagedAfterOpen(t *testing.T) {
	dir := t.TempDir()
	richLedger(t, dir)
	var log strings.Builder
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: slog.New(slog.NewTextHandler(&log, nil)), Now: fixedClock()})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	all, _ := l.List(0, 1000, "")
	damageValue(t, l, bHeaders, "rich-b-07")
	damageValue(t, l, bBodies, "rich-b-08")
	for range 2 {
		got, err := l.List(0, 1000, "")
		if err != nil || len(got) != len(all)-2 {
			t.Fatalf("List: %d CEs (%v), want %d", len(got), err, len(all)-2)
		}
	}
	if n := l.Damaged(); n != 2 {
		t.Fatalf("Damaged() = %d, want 2", n)
	}
	if c := strings.Count(log.String(), "a counterfactual record is damaged"); c != 2 {
		t.Fatalf("%d log lines about damaged records, want one per record:\n%s", c, log.String())
	}
	// Deleted, the CE whose body is damaged leaves the count.
	if err := l.Delete("rich-b-08"); err != nil {
		t.Fatal(err)
	}
	if n := l.Damaged(); n != 1 {
		t.Fatalf("Damaged() = %d after deleting the CE whose body is damaged, want 1", n)
	}
}

// A damaged CE is quarantined at Open also when the policy changed since the ledger was last
// open: the indexes are rebuilt for the new policy from the CEs left, instead of the rebuild
// refusing the whole ledger on the damaged header.
func TestDamagedRecordQuarantinedOnPolicyChange(t *testing.T) {
	dir := t.TempDir()
	richLedger(t, dir)
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), Now: fixedClock()})
	if err != nil {
		t.Fatal(err)
	}
	damageValue(t, l, bHeaders, "rich-a-05")
	l.Close()

	changed := testPolicy()
	changed.EpsilonMax = 0.06
	l, err = Open(dir, Options{Policy: changed, Logger: quietLogger(), Now: fixedClock(), EncodeChange: encodeChangeJSON})
	if err != nil {
		t.Fatalf("Open with a changed policy and a damaged header: %v", err)
	}
	defer l.Close()
	if n := l.Damaged(); n != 1 {
		t.Fatalf("Damaged() = %d, want 1", n)
	}
	if _, err := l.Get("rich-a-05"); !errors.Is(err, ErrQuarantined) {
		t.Fatalf("Get of the damaged CE = %v, want ErrQuarantined", err)
	}
	var fp []byte
	l.view(func(tx *bolt.Tx) (err error) {
		fp, err = getSealed(tx.Bucket(bMeta), kPolicy, "meta policy")
		return err
	})
	if string(fp) != policyFingerprint(changed) {
		t.Fatalf("policy fingerprint %q after Open, want %q", fp, policyFingerprint(changed))
	}
	checkInvariants(t, l)
}

// Deleting a quarantined CE is a deletion like any other on a replica (Options.EncodeState): its
// state's tombstone goes to the outbox, whether the deletion comes from the CE topic
// (ApplyShare) or from Delete, so that no later owner restores the CE from its old state.
func TestDeletingAQuarantinedCEWritesItsTombstone(t *testing.T) {
	dir := t.TempDir()
	opts := Options{Policy: testPolicy(), Logger: quietLogger(), EncodeChange: encodeChangeJSON, EncodeState: encodeStateJSON}
	l, err := Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(3, 3))
	x, y := newCE(t, m, rng), newCE(t, m, rng)
	x.ID, y.ID = "x", "y"
	if _, err := l.ApplyShare(0, []ShareOp{{RID: "r-x", Offset: 0, ID: "x", CE: x}, {RID: "r-y", Offset: 1, ID: "y", CE: y}}, 2, nil, nil); err != nil {
		t.Fatal(err)
	}
	if s := latestStates(t, l); s["x"] == nil || s["y"] == nil {
		t.Fatalf("states after the registrations: %v, want x and y", s)
	}
	damageValue(t, l, bHeaders, "x")
	damageValue(t, l, bHeaders, "y")
	l.Close()
	if l, err = Open(dir, opts); err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if n := l.Damaged(); n != 2 {
		t.Fatalf("Damaged() = %d, want 2", n)
	}
	outs, err := l.ApplyShare(0, []ShareOp{{RID: "d-x", Offset: 2, ID: "x"}}, 3, nil, nil)
	if err != nil || outs[0].Result != OutcomeDeleted {
		t.Fatalf("ApplyShare of the deletion of quarantined x = %+v, %v; want deleted", outs, err)
	}
	if err := l.Delete("y"); err != nil {
		t.Fatal(err)
	}
	if s := latestStates(t, l); s["x"] != nil || s["y"] != nil {
		t.Fatalf("x and y deleted from the quarantine, and their states are still the last ones in the outbox: x %+v, y %+v", s["x"], s["y"])
	}
	if n := l.Damaged(); n != 0 {
		t.Fatalf("Damaged() = %d after the deletions, want 0", n)
	}
	checkInvariants(t, l)
}

// A deletion of a CE whose record is found damaged while the ledger is open (after Open's
// check) is applied, not an error that stops the batch: from the CE topic (ApplyShare), the
// rest of the batch is applied with it and the partition's offset moves on; from a single
// daemon (DeleteRequest) too. The CE is quarantined and dropped in the deletion's transaction
// (the outcome is OutcomeDeleted, its Detail saying the record was damaged), its tombstone goes
// to the outbox, it is no longer counted as damaged, and every invariant holds.
func TestDeletingACEDamagedAfterOpen(t *testing.T) {
	dir := t.TempDir()
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: quietLogger(), EncodeChange: encodeChangeJSON, EncodeState: encodeStateJSON})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(4, 4))
	registerShare(t, l, m, rng, "x", "y", "z")
	damageValue(t, l, bHeaders, "x")
	damageValue(t, l, bHeaders, "y")
	if all, err := l.List(0, 100, ""); err != nil || len(all) != 1 || l.Damaged() != 2 {
		t.Fatalf("List with two damaged headers: %d CEs, %v, Damaged() = %d; want z, and 2", len(all), err, l.Damaged())
	}
	z := newCE(t, m, rng)
	z.ID = "w"
	outs, err := l.ApplyShare(0, []ShareOp{{RID: "d-x", Offset: 3, ID: "x"}, {RID: "r-w", Offset: 4, ID: "w", CE: z}}, 5, nil, nil)
	if err != nil {
		t.Fatalf("ApplyShare of the deletion of a CE damaged since Open: %v", err)
	}
	if outs[0].Result != OutcomeDeleted || !strings.Contains(outs[0].Detail, "damaged") || outs[1].Result != OutcomeStored {
		t.Fatalf("outcomes %+v; want x deleted (its detail saying it was damaged) and w stored", outs)
	}
	if off, _, _ := l.ShareOffset(0); off != 5 {
		t.Fatalf("share offset %d after the batch, want 5", off)
	}
	o, err := l.DeleteRequest("y", RequestRef{RID: "d-y"}, nil)
	if err != nil || o.Result != OutcomeDeleted {
		t.Fatalf("DeleteRequest of a CE damaged since Open = %+v, %v; want deleted", o, err)
	}
	for _, id := range []string{"x", "y"} {
		if _, err := l.Get(id); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Get(%q) after its deletion: %v, want ErrNotFound", id, err)
		}
	}
	if n := l.Damaged(); n != 0 {
		t.Fatalf("Damaged() = %d after the deletions, want 0", n)
	}
	if s := latestStates(t, l); s["x"] != nil || s["y"] != nil || s["z"] == nil || s["w"] == nil {
		t.Fatalf("latest states %v; want z and w only", s)
	}
	checkInvariants(t, l)
}

// Releasing a partition that holds CEs damaged since Open (a header, a body a read found) and
// one quarantined at Open releases it whole: the damaged records are dropped with the rest (the
// partition's next owner stores them again from the CE topic), each quarantined one named in the
// log as dropped, none left on the count of damaged CEs, and the partition's offset is gone.
func TestReleasingAShareWithACEDamagedAfterOpen(t *testing.T) {
	dir := t.TempDir()
	var log strings.Builder
	l, err := Open(dir, Options{Policy: testPolicy(), Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { l.Close() }()
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(5, 5))
	registerShare(t, l, m, rng, "a-1", "a-2", "a-3", "a-4", "b-1")
	damageValue(t, l, bHeaders, "a-3") // quarantined at the next Open
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if l, err = Open(dir, Options{Policy: testPolicy(), Logger: slog.New(slog.NewTextHandler(&log, nil))}); err != nil {
		t.Fatal(err)
	}
	if n := l.Damaged(); n != 1 {
		t.Fatalf("Damaged() = %d after reopening, want 1 (a-3)", n)
	}
	damageValue(t, l, bHeaders, "a-2")
	damageValue(t, l, bBodies, "a-4")  // a read finds it damaged; its header is whole
	damageValue(t, l, bHeaders, "b-1") // outside the released partition: quarantined, not dropped
	if _, err := l.List(0, 100, ""); err != nil || l.Damaged() != 4 {
		t.Fatalf("List: %v, Damaged() = %d; want 4 (a-3 in quarantine, a-2, a-4 and b-1 found by the list)", err, l.Damaged())
	}
	n, err := l.ReleaseShare(context.Background(), 0, func(id string) bool { return strings.HasPrefix(id, "a-") })
	if err != nil || n != 4 {
		t.Fatalf("ReleaseShare of a partition holding a CE damaged since Open = %d, %v; want 4 released", n, err)
	}
	if _, ok, _ := l.ShareOffset(0); ok {
		t.Error("the released partition keeps its offset")
	}
	for _, id := range []string{"a-1", "a-2", "a-3", "a-4"} {
		if _, err := l.Get(id); !errors.Is(err, ErrNotFound) {
			t.Errorf("Get(%q) after the release: %v, want ErrNotFound", id, err)
		}
	}
	if _, err := l.Get("b-1"); !errors.Is(err, ErrQuarantined) {
		t.Errorf("Get(b-1), damaged outside the released partition: %v, want ErrQuarantined", err)
	}
	if n := l.Damaged(); n != 1 {
		t.Errorf("Damaged() = %d after the release, want 1 (b-1)", n)
	}
	for _, id := range []string{"a-2", "a-3"} {
		if c := strings.Count(log.String(), `it was dropped with its partition, whose next owner stores it again from the CE topic" path=`+
			dir+"/cfguard.db id="+id); c != 1 {
			t.Errorf("%d log lines naming %s dropped with its partition, want 1:\n%s", c, id, log.String())
		}
	}
	checkInvariants(t, l)
}

// A deletion that meets a damaged header sweeps every damaged header into the quarantine; one
// of them registered again later in the same batch is stored, and the log says the registration
// replaced it, not that it is quarantined.
func TestDamagedCERegisteredAgainInTheDeletingBatch(t *testing.T) {
	var log strings.Builder
	l, err := Open(t.TempDir(), Options{Policy: testPolicy(), Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(6, 6))
	registerShare(t, l, m, rng, "x", "y")
	damageValue(t, l, bHeaders, "x")
	damageValue(t, l, bHeaders, "y")
	y := newCE(t, m, rng)
	y.ID = "y"
	outs, err := l.ApplyShare(0, []ShareOp{{RID: "d-x", Offset: 2, ID: "x"}, {RID: "r-y2", Offset: 3, ID: "y", CE: y}}, 4, nil, nil)
	if err != nil || outs[0].Result != OutcomeDeleted || outs[1].Result != OutcomeStored {
		t.Fatalf("ApplyShare = %+v, %v; want x deleted and y stored", outs, err)
	}
	if _, err := l.Get("y"); err != nil {
		t.Fatalf("Get(y) after its registration: %v", err)
	}
	if n := l.Damaged(); n != 0 {
		t.Errorf("Damaged() = %d, want 0", n)
	}
	if got := log.String(); strings.Count(got, "a registration of its id replaced it") != 1 || strings.Contains(got, "it was quarantined") {
		t.Errorf("log, want y named once as replaced and nothing as quarantined:\n%s", got)
	}
	checkInvariants(t, l)
}

// registerShare registers a new CE under each id in partition 0 of a replica's share, one
// request per id from offset 0 (request id "r-" + id).
func registerShare(t *testing.T, l *Ledger, m *bnn.Model, rng *rand.Rand, ids ...string) {
	t.Helper()
	var ops []ShareOp
	for i, id := range ids {
		ce := newCE(t, m, rng)
		ce.ID = id
		ops = append(ops, ShareOp{RID: "r-" + id, Offset: int64(i), ID: id, CE: ce})
	}
	if _, err := l.ApplyShare(0, ops, int64(len(ids)), nil, nil); err != nil {
		t.Fatal(err)
	}
}
