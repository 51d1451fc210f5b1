package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestGroupFirstFailureStopsTheRest(t *testing.T) {
	g := newGroup(context.Background(), slog.New(slog.DiscardHandler))
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
	g := newGroup(ctx, slog.New(slog.DiscardHandler))
	g.Go("a", func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() })
	cancel()
	if err := g.Wait(time.Second); err != nil {
		t.Fatalf("Wait after cancel = %v", err)
	}
}

func TestGroupShutdownDeadline(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	g := newGroup(ctx, slog.New(slog.DiscardHandler))
	release := make(chan struct{})
	defer close(release)
	g.Go("stuck", func(ctx context.Context) error { <-release; return nil })
	cancel()
	// "stuck" returns only when the test ends: Wait returns at all only because of its deadline.
	if err := g.Wait(100 * time.Millisecond); err == nil {
		t.Fatal("Wait = nil with a goroutine still running, want a deadline error")
	}
}

// An error a component returns while the group stops (an HTTP server that could not drain) is
// logged, not returned; a cancellation is neither.
func TestGroupLogsErrorsWhileStopping(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var logs bytes.Buffer
	g := newGroup(ctx, slog.New(slog.NewTextHandler(&logs, nil)))
	g.Go("http", func(ctx context.Context) error {
		<-ctx.Done()
		return fmt.Errorf("draining within http.shutdown_timeout 1s: %w", context.DeadlineExceeded)
	})
	g.Go("quiet", func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() })
	cancel()
	if err := g.Wait(time.Second); err != nil {
		t.Fatalf("Wait after cancel = %v", err)
	}
	if got := logs.String(); strings.Count(got, "level=WARN") != 1 || !strings.Contains(got, "component=http") || !strings.Contains(got, "draining within") {
		t.Errorf("logged %q, want one WARN line naming the http component and its error", got)
	}
}
