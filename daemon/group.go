package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// group runs components until the first returns; then it cancels the rest and waits for them.
// A component must return when its context is cancelled. An error a component returns once the
// group is stopping (an HTTP server that could not drain in time, say) is not Wait's: it is
// logged at WARN, context.Canceled excepted.
type group struct {
	ctx    context.Context
	cancel context.CancelFunc
	log    *slog.Logger
	wg     sync.WaitGroup
	once   sync.Once
	err    error
}

func newGroup(ctx context.Context, log *slog.Logger) *group {
	ctx, cancel := context.WithCancel(ctx)
	return &group{ctx: ctx, cancel: cancel, log: log}
}

// Go starts a named component.
func (g *group) Go(name string, fn func(ctx context.Context) error) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		err := fn(g.ctx)
		if err != nil && g.ctx.Err() != nil && !errors.Is(err, context.Canceled) {
			g.log.Warn("component stopped with an error while the daemon stopped", "component", name, "err", err)
		}
		g.once.Do(func() {
			if err != nil && g.ctx.Err() == nil {
				g.err = fmt.Errorf("%s: %w", name, err)
			}
			g.cancel()
		})
	}()
}

// Wait blocks until every component returned and gives the first failure (nil on cancel).
// Once the group is stopping (cancelled, or a component returned), the components get at most
// deadline to return; after that Wait gives up on them with an error, so that a stuck component
// cannot keep the process from exiting.
func (g *group) Wait(deadline time.Duration) error {
	done := make(chan struct{})
	go func() {
		g.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-g.ctx.Done():
		select {
		case <-done:
		case <-time.After(deadline):
			return fmt.Errorf("components still running %v after shutdown began", deadline)
		}
	}
	g.cancel()
	return g.err
}
