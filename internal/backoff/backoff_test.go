package backoff

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

func TestBounds(t *testing.T) {
	bo := Backoff{Min: 10 * time.Millisecond, Max: 300 * time.Millisecond}
	for round := range 2 {
		for n := range 40 {
			d := min(bo.Max, bo.Min<<min(n, 30))
			got := bo.Next()
			if got < d/2 || got > d {
				t.Fatalf("round %d wait %d = %v, want in [%v, %v]", round, n, got, d/2, d)
			}
		}
		bo.Reset() // starts over at Min
	}
}

func TestWaitHonoursContext(t *testing.T) {
	bo := Backoff{Min: time.Hour, Max: time.Hour}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	// A Wait that ignored the context would sleep for an hour, past the test binary's timeout.
	if err := bo.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("wait on a cancelled context: %v", err)
	}
}

// TestLongRunsStayAtMax pins the cap on the doubling: however many waits in a row (well past the
// 64 a shift of Min could take before it overflows), every wait after the cap is reached lies in
// [Max/2, Max]. The configurations are those of cfguard's retry loops.
func TestLongRunsStayAtMax(t *testing.T) {
	for _, bo := range []Backoff{
		{Min: 10 * time.Millisecond, Max: 300 * time.Millisecond},
		{Min: 100 * time.Millisecond, Max: 5 * time.Second},
		{Min: time.Second, Max: 30 * time.Second},
	} {
		capped := false
		for n := range 200 {
			capped = capped || bo.Min<<n >= bo.Max
			got := bo.Next()
			if capped && (got < bo.Max/2 || got > bo.Max) {
				t.Fatalf("Min %v Max %v: wait %d = %v, want in [%v, %v]", bo.Min, bo.Max, n, got, bo.Max/2, bo.Max)
			}
		}
	}
}

// TestWaitsAreJittered pins the equal jitter: a wait is drawn from all of [d/2, d], both ends
// included, not fixed at either. With d = 2ns the waits are 1ns or 2ns, each with probability
// 1/2; the test fails on correct code only if 200 draws all agree, with probability 2^-199.
func TestWaitsAreJittered(t *testing.T) {
	bo := Backoff{Min: 2, Max: 2}
	seen := map[time.Duration]bool{}
	for range 200 {
		d := bo.Next()
		if d < 1 || d > 2 {
			t.Fatalf("wait %v, want 1ns or 2ns", d)
		}
		seen[d] = true
	}
	if len(seen) != 2 {
		t.Fatalf("200 waits all %v, want both 1ns and 2ns", seen)
	}
}

// TestWaitAdvances pins that Wait takes its wait from Next: a Wait, even one cut short by its
// context, counts as a wait, so the wait after it is the second one, d_1 = 2*Min.
func TestWaitAdvances(t *testing.T) {
	bo := Backoff{Min: time.Hour, Max: 4 * time.Hour}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := bo.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("wait on a cancelled context: %v", err)
	}
	if got := bo.Next(); got < time.Hour || got > 2*time.Hour {
		t.Fatalf("the wait after a Wait is %v, want in [1h, 2h]", got)
	}
}

// TestSleep pins Sleep on the synctest clock (no real time passes): it returns nil after exactly
// d, and ctx.Err() as soon as ctx ends before d.
func TestSleep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		if err := Sleep(t.Context(), 5*time.Second); err != nil {
			t.Fatalf("Sleep: %v", err)
		}
		if took := time.Since(start); took != 5*time.Second {
			t.Fatalf("Sleep(5s) took %v", took)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
		defer cancel()
		start = time.Now()
		if err := Sleep(ctx, time.Hour); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Sleep past the context's deadline: %v", err)
		}
		if took := time.Since(start); took != 2*time.Second {
			t.Fatalf("Sleep cut short at 2s took %v", took)
		}
	})
}

// TestLargeMinDoesNotOverflow pins that Min*2^n is never computed by a shift that overflows: with
// Min = 20s (more than 2^34 ns), Min<<29 wraps to a negative duration, which a test of
// Min<<n < Max takes for "below Max"; the 30th wait in a row then panicked in rand.N. Every wait
// once capped lies in [Max/2, Max]. stream.Config.RetryMin accepts such values.
func TestLargeMinDoesNotOverflow(t *testing.T) {
	for _, lo := range []time.Duration{20 * time.Second, 30 * time.Second, time.Minute, time.Hour} {
		bo := Backoff{Min: lo, Max: 2 * time.Hour}
		capped := false
		for n := range 100 {
			capped = capped || n >= 30 || bo.Min<<n >= bo.Max
			got := bo.Next()
			if capped && (got < bo.Max/2 || got > bo.Max) {
				t.Fatalf("Min %v: wait %d = %v, want in [%v, %v]", lo, n, got, bo.Max/2, bo.Max)
			}
		}
	}
}

// TestWaitsAtTheCap pins d_n = min(Max, Min*2^n) where Min*2^n is next to Max: one below it
// (d_n is Min*2^n), equal to it, and one above it (d_n is Max). Waits are counted in nanoseconds,
// so that in 1000 runs each wait takes every value it can (at most 12: the test fails on correct
// code with probability below 10^-36): from d_n/2, rounded down to a whole nanosecond, to d_n.
func TestWaitsAtTheCap(t *testing.T) {
	for _, tc := range []struct {
		min, max time.Duration
		d        []time.Duration // d_0, d_1, ...
	}{
		{3, 4, []time.Duration{3, 4, 4}},
		{3, 5, []time.Duration{3, 5, 5}},
		{3, 6, []time.Duration{3, 6, 6}},
		{3, 7, []time.Duration{3, 6, 7}},
		{5, 19, []time.Duration{5, 10, 19}},
		{5, 20, []time.Duration{5, 10, 20, 20}},
		{5, 21, []time.Duration{5, 10, 20, 21}},
	} {
		lo := make([]time.Duration, len(tc.d))
		hi := make([]time.Duration, len(tc.d))
		for i := range lo {
			lo[i] = tc.max
		}
		for range 1000 {
			bo := Backoff{Min: tc.min, Max: tc.max}
			for n := range tc.d {
				got := bo.Next()
				lo[n], hi[n] = min(lo[n], got), max(hi[n], got)
			}
		}
		for n, d := range tc.d {
			if lo[n] != d/2 || hi[n] != d {
				t.Errorf("Min %d Max %d: wait %d from %d to %d in 1000 runs, want %d to %d", tc.min, tc.max, n, lo[n], hi[n], d/2, d)
			}
		}
	}
}
