package daemon

import (
	"errors"
	"fmt"
	"log/slog"
)

// teardown is a stack of named cleanups, registered right after the resource each releases was
// acquired and run in reverse order. Every cleanup runs even when an earlier one fails; failures
// are logged by name and returned joined.
type teardown struct {
	log   *slog.Logger
	steps []teardownStep
}

type teardownStep struct {
	name string
	fn   func() error
}

func (t *teardown) add(name string, fn func() error) {
	t.steps = append(t.steps, teardownStep{name, fn})
}

// run runs every cleanup, last registered first, and returns their errors joined.
func (t *teardown) run() error {
	var errs []error
	for i := len(t.steps) - 1; i >= 0; i-- {
		s := t.steps[i]
		if err := s.fn(); err != nil {
			t.log.Error("shutdown step failed", "step", s.name, "err", err)
			errs = append(errs, fmt.Errorf("closing %s: %w", s.name, err))
		}
	}
	t.steps = nil
	return errors.Join(errs...)
}
