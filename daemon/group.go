package daemon

import (
	"context"
	"fmt"
	"sync"
)

// group runs components until the first returns; then it cancels the rest and waits for them.
// A component must return when its context is cancelled.
type group struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	once   sync.Once
	err    error
}

func newGroup(ctx context.Context) *group {
	ctx, cancel := context.WithCancel(ctx)
	return &group{ctx: ctx, cancel: cancel}
}

// Go starts a named component.
func (g *group) Go(name string, fn func(ctx context.Context) error) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		err := fn(g.ctx)
		g.once.Do(func() {
			if err != nil && g.ctx.Err() == nil {
				g.err = fmt.Errorf("%s: %w", name, err)
			}
			g.cancel()
		})
	}()
}

// Wait blocks until every component returned and gives the first failure (nil on cancel).
func (g *group) Wait() error {
	g.wg.Wait()
	g.cancel()
	return g.err
}
