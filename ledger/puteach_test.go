package ledger

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/certify"
)

// PutEach stores the acceptable CEs of one call in one transaction and refuses each of the
// others with Put's own error: a bad one, an id given twice in the call, an id already stored,
// an unknown anchor. A call that refuses every CE writes nothing; a failed write stores none.
func TestPutEach(t *testing.T) {
	l, _ := openTest(t, Options{Policy: testPolicy()})
	m := testModel(4)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(5, 5))
	good := func(id string) *CE { c := newCE(t, m, rng); c.ID = id; return c }
	stored := good("stored")
	if err := l.Put(bg, stored); err != nil {
		t.Fatal(err)
	}
	commits := 0
	l.opts.AfterCommit = func() error { commits++; return nil }
	short, anchor, outside := good("short"), good("anchor"), good("outside")
	short.XCF = short.XCF[:2]
	anchor.AnchorVersion = 99
	outside.P1 = 0.9
	ces := []*CE{good("a"), short, good("twice"), good("twice"), good("stored"), anchor, outside, good("")}
	want := []error{nil, ErrInvalid, nil, ErrExists, ErrExists, ErrUnknownAnchor, nil, nil}
	errs, err := l.PutEach(bg, ces)
	if err != nil {
		t.Fatal(err)
	}
	if commits != 1 {
		t.Errorf("%d commits, want 1 for the whole call", commits)
	}
	for i, w := range want {
		if (w == nil) != (errs[i] == nil) || (w != nil && !errors.Is(errs[i], w)) {
			t.Errorf("CE %d (%q): error %v, want %v", i, ces[i].ID, errs[i], w)
		}
		if w != nil {
			continue
		}
		got, err := l.Get(ces[i].ID)
		if err != nil {
			t.Errorf("CE %d (%q) is not stored: %v", i, ces[i].ID, err)
			continue
		}
		if got.Status != ces[i].Status || got.Bound != ces[i].Bound || !got.CreatedAt.Equal(ces[i].CreatedAt) {
			t.Errorf("CE %d: stored %v bound %v created %v, filled in %v %v %v", i, got.Status, got.Bound, got.CreatedAt,
				ces[i].Status, ces[i].Bound, ces[i].CreatedAt)
		}
	}
	if outside.Status != certify.Uncertified || ces[0].Status != certify.Certified {
		t.Errorf("statuses %v, %v; want uncertified outside the set, certified in it", outside.Status, ces[0].Status)
	}
	if n, err := l.Counts(); err != nil || sum(n) != 1+4 {
		t.Errorf("counts %v, %v; want 5 CEs", n, err)
	}
	// Nothing to store: no transaction.
	errs, err = l.PutEach(bg, []*CE{good("a"), good("stored")})
	if err != nil || !errors.Is(errs[0], ErrExists) || !errors.Is(errs[1], ErrExists) || commits != 1 {
		t.Errorf("all refused: %v, %v, %d commits; want both ErrExists and no commit", errs, err, commits)
	}
	// A failed write is the call's error, and stores none of them.
	l.opts.AfterCommit = func() error { return errors.New("injected fsync failure") }
	if _, err := l.PutEach(bg, []*CE{good("w1"), good("w2")}); !errors.Is(err, ErrWrite) {
		t.Errorf("failed write: %v, want ErrWrite", err)
	}
	l.opts.AfterCommit = nil
	for _, id := range []string{"w1", "w2"} {
		if _, err := l.Get(id); !errors.Is(err, ErrNotFound) {
			t.Errorf("%s after a failed write: %v, want not found", id, err)
		}
	}
}
