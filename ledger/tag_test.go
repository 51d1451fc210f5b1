package ledger

import (
	"encoding/json"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/certify"
)

// A CE's tag is a function of its registration alone (id, creation time, target, x, x_cf): the
// same after the CE is stored and read back, or sent as JSON (what a replica serves from
// another), whatever its status or certificate; another for a change of any of those five.
func TestTagNamesTheRegistration(t *testing.T) {
	at := time.Date(2026, 3, 1, 12, 0, 0, 123456789, time.UTC)
	base := CE{ID: "a", X: []float64{1, 2}, XCF: []float64{3, 4}, Target: 1, CreatedAt: at, Status: certify.Certified}
	tag := base.Tag()
	if len(tag) != 32 || strings.Trim(tag, "0123456789abcdef") != "" || !IsTag(tag) {
		t.Fatalf("tag %q (IsTag %v): want 32 hex digits", tag, IsTag(tag))
	}
	for _, s := range []string{"", tag[1:], tag + "0", strings.ToUpper(tag), tag[:31] + "g", tag[:31] + `"`} {
		if IsTag(s) {
			t.Errorf("IsTag(%q) = true; want false", s)
		}
	}
	var back CE
	raw, err := json.Marshal(&base)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	back.CreatedAt = back.CreatedAt.In(time.FixedZone("elsewhere", 3600))
	back.P1, back.AnchorVersion, back.UpdatedAt = 0.9, 7, at.Add(time.Hour)
	if back.Tag() != tag {
		t.Errorf("the CE through JSON, in another zone, with another certificate: tag %s, want %s", back.Tag(), tag)
	}
	for name, change := range map[string]func(c *CE){
		"id":         func(c *CE) { c.ID = "b" },
		"created_at": func(c *CE) { c.CreatedAt = c.CreatedAt.Add(time.Nanosecond) },
		"target":     func(c *CE) { c.Target = 0 },
		"x":          func(c *CE) { c.X = []float64{1, 2.0000000001} },
		"x_cf":       func(c *CE) { c.XCF = []float64{3} },
		"x into x_cf": func(c *CE) { // the same floats, split otherwise
			c.X, c.XCF = []float64{1, 2, 3}, []float64{4}
		},
	} {
		c := base
		c.X, c.XCF = slices.Clone(base.X), slices.Clone(base.XCF)
		change(&c)
		if c.Tag() == tag {
			t.Errorf("another %s, the same tag", name)
		}
	}
}

// A deletion that names registrations (If-Match) deletes the CE only when its tag is one of
// them (or *): a CE registered again under the id after the one the client read, with the same
// x, x_cf and target, is kept, and the outcome, stored under the request id, names what the id
// holds. Nothing stored is absent, as without a condition.
func TestDeleteIfMatchDeletesOnlyTheRegistrationItNames(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	l, _ := openTest(t, Options{Now: func() time.Time { return now }})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(17, 17))
	put := func(ce *CE) string {
		t.Helper()
		if errs, err := l.PutEach(bg, []*CE{ce}); err != nil || errs[0] != nil {
			t.Fatalf("PutEach = %v, %v", errs, err)
		}
		got, err := l.Get(ce.ID)
		if err != nil {
			t.Fatal(err)
		}
		return got.Tag()
	}
	first := newCE(t, m, rng)
	first.ID = "a"
	again := *first // the same registration sent again later, once the first was deleted
	tagFirst := put(first)

	o, err := l.DeleteRequest("a", RequestRef{RID: "m1"}, []string{"00000000000000000000000000000000", `W/"` + tagFirst + `"`})
	if err != nil || o.Result != OutcomeMismatch || !strings.Contains(o.Detail, tagFirst) {
		t.Fatalf("a deletion naming other tags = %+v, %v; want mismatch naming %s", o, err, tagFirst)
	}
	if _, err := l.Get("a"); err != nil {
		t.Fatalf("the CE after a deletion that did not name it: %v", err)
	}
	if got, ok, err := l.Outcome("m1"); err != nil || !ok || got.Result != OutcomeMismatch {
		t.Errorf("outcome stored for the mismatch = %+v, %v, %v", got, ok, err)
	}
	if o, err = l.DeleteRequest("a", RequestRef{}, []string{"1", tagFirst}); err != nil || o.Result != OutcomeDeleted {
		t.Fatalf("a deletion naming the CE's tag = %+v, %v; want deleted", o, err)
	}

	now = now.Add(time.Second)
	again.CreatedAt = time.Time{}
	tagAgain := put(&again)
	if tagAgain == tagFirst {
		t.Fatal("a registration sent again later has its first tag")
	}
	o, err = l.DeleteRequest("a", RequestRef{}, []string{tagFirst})
	if err != nil || o.Result != OutcomeMismatch || !strings.Contains(o.Detail, tagAgain) {
		t.Fatalf("the first registration's deletion sent again = %+v, %v; want mismatch naming %s", o, err, tagAgain)
	}
	if got, err := l.Get("a"); err != nil || got.Tag() != tagAgain {
		t.Fatalf("the registration made after the first was deleted: %v, %v; want it kept", got, err)
	}
	if o, err = l.DeleteRequest("none", RequestRef{}, []string{tagFirst}); err != nil || o.Result != OutcomeAbsent {
		t.Errorf("a conditional deletion of an id that holds nothing = %+v, %v; want absent", o, err)
	}
	if o, err = l.DeleteRequest("a", RequestRef{}, []string{AnyTag}); err != nil || o.Result != OutcomeDeleted {
		t.Errorf("If-Match * = %+v, %v; want deleted", o, err)
	}
	if _, err := l.Get("a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("after If-Match *: %v", err)
	}
}

// On the CE topic (ApplyShare) a deletion's condition is the ShareOp's IfMatch, decided at its
// place in the partition's order; a CE whose record is damaged on disk has no tag to compare,
// so a deletion naming tags keeps it (mismatch, saying how to delete it), and one with * drops it.
func TestShareDeletionIfMatch(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(5, 5))
	registerShare(t, l, m, rng, "x", "y", "z")
	z, err := l.Get("z")
	if err != nil {
		t.Fatal(err)
	}
	damageValue(t, l, bBodies, "y")
	outs, err := l.ApplyShare(0, []ShareOp{
		{RID: "d-x", Offset: 10, ID: "x", IfMatch: []string{z.Tag()}},
		{RID: "d-y", Offset: 11, ID: "y", IfMatch: []string{z.Tag()}},
		{RID: "d-z", Offset: 12, ID: "z", IfMatch: []string{z.Tag()}},
	}, 13, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if outs[0].Result != OutcomeMismatch || outs[1].Result != OutcomeMismatch || !strings.Contains(outs[1].Detail, "without If-Match") ||
		outs[2].Result != OutcomeDeleted {
		t.Fatalf("outcomes %+v; want x and y kept (mismatch; y's detail saying how to delete it), z deleted", outs)
	}
	if _, err := l.Get("x"); err != nil {
		t.Errorf("x after a deletion naming another tag: %v", err)
	}
	outs, err = l.ApplyShare(0, []ShareOp{{RID: "d-y2", Offset: 13, ID: "y", IfMatch: []string{AnyTag}}}, 14, nil, nil)
	if err != nil || outs[0].Result != OutcomeDeleted {
		t.Fatalf("the damaged CE with If-Match *: %+v, %v; want deleted", outs, err)
	}
	checkInvariants(t, l)
}

// A registration's outcome names the registration it stored, or found stored (its tag), so
// that a retry of it tells that CE from the same CE deleted and registered again since: on a
// single daemon (PutRequests) and at a share's owner (ApplyShare), with a creation time given
// (a replica's request) or none (the ledger's clock).
func TestRegistrationOutcomeNamesItsRegistration(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	l, _ := openTest(t, Options{Policy: testPolicy(), Now: func() time.Time { return now }})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(23, 23))
	tagOf := func(id string) string {
		t.Helper()
		ce, err := l.Get(id)
		if err != nil {
			t.Fatal(err)
		}
		return ce.Tag()
	}
	single := newCE(t, m, rng)
	single.ID = "single"
	if errs, err := l.PutRequests(bg, []*CE{single}, []RequestRef{{RID: "r-single"}}); err != nil || errs[0] != nil {
		t.Fatalf("PutRequests = %v, %v", errs, err)
	}
	if o, ok, err := l.Outcome("r-single"); err != nil || !ok || o.Tag != tagOf("single") {
		t.Errorf("PutRequests' outcome %+v, %v, %v; want the tag %s of the CE it stored", o, ok, err, tagOf("single"))
	}
	shared, unstamped := newCE(t, m, rng), newCE(t, m, rng)
	shared.ID, shared.CreatedAt = "shared", now.Add(-time.Minute)
	unstamped.ID = "unstamped"
	again := *shared
	again.CreatedAt = now // the same CE sent again later: found stored
	outs, err := l.ApplyShare(0, []ShareOp{
		{RID: "r-shared", Offset: 0, ID: "shared", CE: shared},
		{RID: "r-unstamped", Offset: 1, ID: "unstamped", CE: unstamped},
		{RID: "r-again", Offset: 2, ID: "shared", CE: &again},
	}, 3, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []struct{ result, id string }{{OutcomeStored, "shared"}, {OutcomeStored, "unstamped"}, {OutcomeSame, "shared"}} {
		if o := outs[i]; o.Result != want.result || o.Tag != tagOf(want.id) {
			t.Errorf("ApplyShare's outcome %d = %+v; want %s with the tag %s of %s as stored", i, o, want.result, tagOf(want.id), want.id)
		}
	}
}
