package daemon

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

func TestGroupFirstFailureStopsTheRest(t *testing.T) {
	g := newGroup(context.Background())
	boom := errors.New("boom")
	stopped := make(chan struct{})
	g.Go("waits", func(ctx context.Context) error { <-ctx.Done(); close(stopped); return nil })
	g.Go("fails", func(ctx context.Context) error { return boom })
	if err := g.Wait(time.Second); !errors.Is(err, boom) || !strings.HasPrefix(err.Error(), "fails:") {
		t.Fatalf("Wait = %v, want the failing component's error", err)
	}
	<-stopped
}

func TestGroupCancelIsNotAnError(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	g := newGroup(ctx)
	g.Go("a", func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() })
	cancel()
	if err := g.Wait(time.Second); err != nil {
		t.Fatalf("Wait after cancel = %v", err)
	}
}

func TestGroupShutdownDeadline(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	g := newGroup(ctx)
	release := make(chan struct{})
	defer close(release)
	g.Go("stuck", func(ctx context.Context) error { <-release; return nil })
	cancel()
	// "stuck" returns only when the test ends: Wait returns at all only because of its deadline.
	if err := g.Wait(100 * time.Millisecond); err == nil {
		t.Fatal("Wait = nil with a goroutine still running, want a deadline error")
	}
}
