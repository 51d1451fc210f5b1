package ledger

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
)

func TestShareOffsetsAndRelease(t *testing.T) {
	l, dir := openTest(t, Options{})
	m := testModel(3)
	install(t, l, m)
	rng := rand.New(rand.NewPCG(1, 1))
	var ces []*CE
	for i := range 40 {
		ce := newCE(t, m, rng)
		ce.ID = fmt.Sprintf("%s%d", []string{"a-", "b-"}[i%2], i)
		ces = append(ces, ce)
	}
	if err := l.Put(context.Background(), ces...); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := l.ShareOffset(3); err != nil || ok {
		t.Fatalf("ShareOffset of a partition never owned = %v, %v", ok, err)
	}
	if _, err := l.ApplyShare(3, nil, 120, nil, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := l.ApplyShare(4, nil, 7, nil, nil); err != nil {
		t.Fatal(err)
	}
	l = reopen(t, l, dir)
	if off, ok, err := l.ShareOffset(3); err != nil || !ok || off != 120 {
		t.Fatalf("ShareOffset(3) after reopening = %d, %v, %v; want 120", off, ok, err)
	}
	// A release cut short before its first deletion leaves the partition to be read again from 0.
	cut, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := l.ReleaseShare(cut, 3, func(id string) bool { return strings.HasPrefix(id, "a-") }); err == nil {
		t.Fatal("ReleaseShare with an ended context succeeded")
	}
	if off, ok, err := l.ShareOffset(3); err != nil || !ok || off != 0 {
		t.Fatalf("after a release cut short: offset %d, held %v, %v; want 0", off, ok, err)
	}
	before, _ := l.Counts()
	n, err := l.ReleaseShare(context.Background(), 3, func(id string) bool { return strings.HasPrefix(id, "a-") })
	if err != nil || n != 20 {
		t.Fatalf("ReleaseShare = %d, %v; want 20 deleted", n, err)
	}
	after, _ := l.Counts()
	total := func(c map[certify.Status]int) (s int) {
		for _, v := range c {
			s += v
		}
		return s
	}
	if total(before)-total(after) != 20 {
		t.Errorf("counts %v -> %v, want 20 fewer", before, after)
	}
	for _, ce := range ces {
		_, err := l.Get(ce.ID)
		if strings.HasPrefix(ce.ID, "a-") != (err != nil) {
			t.Errorf("%s after the release: %v", ce.ID, err)
		}
	}
	if _, ok, _ := l.ShareOffset(3); ok {
		t.Error("the released partition keeps its offset")
	}
	if off, ok, _ := l.ShareOffset(4); !ok || off != 7 {
		t.Errorf("another partition's offset: %d, %v", off, ok)
	}
	if all, err := l.ShareOffsets(); err != nil || len(all) != 1 || all[4] != 7 {
		t.Errorf("ShareOffsets = %v, %v; want partition 4 at 7 only", all, err)
	}
}

// TestPutPastAnchorsToAGivenPosterior: a CE measured under a posterior that is neither current
// nor an anchor here is refused by PutEach, and stored by PutPast given that posterior: judged
// at KL(q_now || q_past), its snapshot kept as the anchor, re-certified from it afterwards.
func TestPutPastAnchorsToAGivenPosterior(t *testing.T) {
	l, _ := openTest(t, Options{})
	m0 := testModel(3)
	install(t, l, m0)
	m1 := drift(m0, 0.02)
	if _, _, err := l.Commit(context.Background(), &Checkpoint{Model: m1}); err != nil {
		t.Fatal(err)
	}
	ce := newCE(t, m0, rand.New(rand.NewPCG(2, 2))) // measured under version 0, gone here
	ce.ID = "past"
	if errs, err := l.PutEach(context.Background(), []*CE{ce}); err != nil || !errors.Is(errs[0], ErrUnknownAnchor) {
		t.Fatalf("PutEach under a posterior not stored = %v, %v; want ErrUnknownAnchor", errs, err)
	}
	if errs, err := l.PutPast(context.Background(), []*CE{ce}, map[uint64]*bnn.Model{0: m0}); err != nil || errs[0] != nil {
		t.Fatalf("PutPast = %v, %v", errs, err)
	}
	want, _, err := certify.KL(m1, m0)
	if err != nil {
		t.Fatal(err)
	}
	got, err := l.Get("past")
	if err != nil {
		t.Fatal(err)
	}
	if got.KLFromAnchor != want || got.AnchorVersion != 0 {
		t.Errorf("stored at anchor %d with KL %v, want anchor 0 at KL(q1 || q0) = %v", got.AnchorVersion, got.KLFromAnchor, want)
	}
	// A CE read says at which version its bounds are judged: the current one.
	if listed, err := l.List(0, 10, ""); err != nil || len(listed) != 1 || listed[0].PosteriorVersion != m1.Version || got.PosteriorVersion != m1.Version {
		t.Errorf("posterior_version of Get %d, of List %v (%v); want %d", got.PosteriorVersion, listed, err, m1.Version)
	}
	// The snapshot is the anchor from now on: the next version is judged from it.
	m2 := drift(m1, 0.02)
	if _, _, err := l.Commit(context.Background(), &Checkpoint{Model: m2}); err != nil {
		t.Fatal(err)
	}
	want2, _, _ := certify.KL(m2, m0)
	if got, err = l.Get("past"); err != nil || math.Abs(got.KLFromAnchor-want2) > 1e-12*want2 {
		t.Errorf("after the next version: KL %v, %v; want KL(q2 || q0) = %v", got.KLFromAnchor, err, want2)
	}
}

// TestSkipShareCountsEachLossOnce: SkipShare moves a partition's offset past lost requests and
// counts them in the same transaction; a call from an offset the ledger does not hold, or
// backwards, writes nothing; the count survives a reopening.
func TestSkipShareCountsEachLossOnce(t *testing.T) {
	clock := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	l, dir := openTest(t, Options{Now: func() time.Time { return clock }})
	if _, err := l.ApplyShare(2, nil, 5, nil, nil); err != nil {
		t.Fatal(err)
	}
	lost := func(l *Ledger) (int64, time.Time) {
		t.Helper()
		st, err := l.State()
		if err != nil {
			t.Fatal(err)
		}
		return st.Counters[CounterRequestsLost], st.CountersAt[CounterRequestsLost]
	}
	for _, tc := range []struct {
		name     string
		p        int
		from, to int64
		ok       bool
		offset   int64 // p's offset after the call
		lost     int64 // the counter after the call
		at       int   // the hour of the clock its last increase was at
	}{
		{"past a loss", 2, 5, 12, true, 12, 7, 1},
		{"from an offset the ledger does not hold", 2, 5, 20, false, 12, 7, 1},
		{"backwards", 2, 12, 10, false, 12, 7, 1},
		{"a partition never held, from 0", 6, 0, 3, true, 3, 10, 4},
		{"nothing lost", 6, 3, 3, true, 3, 10, 4},
	} {
		clock = clock.Add(time.Hour)
		err := l.SkipShare(tc.p, tc.from, tc.to)
		if (err == nil) != tc.ok {
			t.Errorf("%s: SkipShare(%d, %d, %d) = %v, want ok %v", tc.name, tc.p, tc.from, tc.to, err, tc.ok)
		}
		if err != nil && !strings.Contains(err.Error(), fmt.Sprintf("partition %d", tc.p)) {
			t.Errorf("%s: the refusal %q does not name the partition", tc.name, err)
		}
		if off, _, _ := l.ShareOffset(tc.p); off != tc.offset {
			t.Errorf("%s: offset %d, want %d", tc.name, off, tc.offset)
		}
		if n, at := lost(l); n != tc.lost || at.Hour() != tc.at {
			t.Errorf("%s: %d requests counted lost, last at %v; want %d at %d:00", tc.name, n, at, tc.lost, tc.at)
		}
	}
	if n, at := lost(reopen(t, l, dir)); n != 10 || at.Hour() != 4 {
		t.Errorf("after reopening: %d requests counted lost, last at %v; want 10 at 4:00", n, at)
	}
}
