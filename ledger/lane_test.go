package ledger

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
)

// Two lanes run at once (ConfirmLane) measure disjoint CEs, and together leave every CE exactly
// as one Confirm does: the same statuses, verdicts, bounds and renewals, bit for bit.
func TestConfirmLanesMeasureAsOne(t *testing.T) {
	const n, lanes = 3000, 2
	build := func() *Ledger {
		l, _ := openTest(t, Options{Policy: testPolicy()})
		m0 := testModel(4)
		install(t, l, m0)
		if err := l.Put(bg, cheapCEs(m0, rand.New(rand.NewPCG(5, 5)), "lane", n)...); err != nil {
			t.Fatal(err)
		}
		if _, _, err := l.Commit(bg, &Checkpoint{Model: toBias(m0, -0.5)}); err != nil {
			t.Fatal(err)
		}
		return l
	}
	one, split := build(), build()
	m1, err := one.Current()
	if err != nil {
		t.Fatal(err)
	}
	p := NewModelPredictor(m1, 256, 9)
	for {
		rep, _, err := one.Confirm(bg, p, 256)
		if err != nil {
			t.Fatal(err)
		}
		if !rep.More {
			break
		}
	}
	var wg sync.WaitGroup
	confirmed := make([]int, lanes)
	errs := make([]error, lanes)
	for lane := range lanes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				rep, _, err := split.ConfirmLane(bg, p, 256, lane, lanes)
				if err != nil {
					errs[lane] = err
					return
				}
				confirmed[lane] += rep.Confirmed
				if !rep.More {
					return
				}
			}
		}()
	}
	wg.Wait()
	for lane, err := range errs {
		if err != nil {
			t.Fatalf("lane %d: %v", lane, err)
		}
	}
	if confirmed[0] == 0 || confirmed[1] == 0 || confirmed[0]+confirmed[1] != n {
		t.Fatalf("lanes confirmed %v CEs, want both some and %d in all", confirmed, n)
	}
	a, b := listAll(t, one), listAll(t, split)
	if len(a) != n || len(b) != n {
		t.Fatalf("%d and %d CEs listed, want %d", len(a), len(b), n)
	}
	for i := range a {
		ja, _ := json.Marshal(withoutTimes(a[i]))
		jb, _ := json.Marshal(withoutTimes(b[i]))
		if string(ja) != string(jb) {
			t.Fatalf("CE %s: one Confirm left\n%s\ntwo lanes left\n%s", a[i].ID, ja, jb)
		}
	}
	if waiting, err := split.Waiting(); err != nil || waiting {
		t.Fatalf("after the lanes: waiting %v, err %v", waiting, err)
	}
	for _, c := range []struct{ lane, lanes int }{{-1, 2}, {2, 2}, {0, 0}} {
		if _, _, err := split.ConfirmLane(bg, p, 10, c.lane, c.lanes); err == nil {
			t.Errorf("ConfirmLane(lane %d of %d) accepted", c.lane, c.lanes)
		}
	}
}

// listAll lists every stored CE in id order.
func listAll(t *testing.T, l *Ledger) []*CE {
	t.Helper()
	var out []*CE
	for after := ""; ; {
		page, err := l.List(0, 1000, after)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 {
			return out
		}
		out = append(out, page...)
		after = page[len(page)-1].ID
	}
}

// withoutTimes is ce as JSON without the wall-clock times two ledgers cannot share (its own and
// those of its history's entries).
func withoutTimes(ce *CE) map[string]any {
	b, _ := json.Marshal(ce)
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		panic(fmt.Sprint(err))
	}
	for _, k := range []string{"created_at", "updated_at", "confirmed_at"} {
		delete(m, k)
	}
	if h, ok := m["history"].([]any); ok {
		for _, e := range h {
			if e, ok := e.(map[string]any); ok {
				delete(e, "at")
			}
		}
	}
	return m
}
