package backoff

import (
	"context"
	"errors"
	"testing"
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
