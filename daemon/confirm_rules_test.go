package daemon

import (
	"context"
	"log/slog"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
)

// TestConfirmerMovedPastThePoolSlack: a confirmer draws a new pool before a batch when the newest
// posterior has moved from the pool's by more than confirmPoolSlack, measured as the mean slack
// (certify.Policy.Slack) of KL(q_newest || q_pool); at or below it the pool is kept. A posterior
// whose KL from the pool's cannot be computed (another architecture) counts as moved.
func TestConfirmerMovedPastThePoolSlack(t *testing.T) {
	l, err := ledger.Open(t.TempDir(), ledger.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	pool := bnn.New(3, []int{4}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	c := newConfirmer(l, nil, nil, nil, nil, slog.New(slog.DiscardHandler))
	c.model = pool
	// shifted moves every output bias of the pool's posterior by k of its standard deviations.
	shifted := func(k float64) *bnn.Model {
		m := pool.Clone()
		last := &m.Layers[len(m.Layers)-1]
		for i := range last.BiasMu {
			last.BiasMu[i] += k * math.Exp(last.BiasLogSigma[i])
		}
		return m
	}
	cases := []struct {
		name  string
		m     *bnn.Model
		moved bool
	}{
		{"the pool's own posterior", pool, false},
		{"a posterior a thousandth of a deviation away", shifted(1e-3), false},
		{"a posterior one deviation away", shifted(1), true},
		{"a posterior of another architecture", bnn.New(3, []int{5}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 2))), true},
	}
	for _, tc := range cases {
		// The fixture is on the side of the slack it is named for.
		if kl, _, err := certify.KL(tc.m, pool); err == nil {
			if over := l.Policy().Slack(kl).Mean > confirmPoolSlack; over != tc.moved {
				t.Fatalf("%s: mean slack %v against %v: fixture on the wrong side", tc.name, l.Policy().Slack(kl).Mean, confirmPoolSlack)
			}
		} else if !tc.moved {
			t.Fatalf("%s: KL: %v", tc.name, err)
		}
		if got := c.moved(tc.m); got != tc.moved {
			t.Errorf("%s: moved = %v, want %v", tc.name, got, tc.moved)
		}
	}
}

// TestConfirmersNotifyWakesEveryLane: a commit wakes every lane of the confirmer (each measures
// only its own CEs, so a lane left asleep leaves its CEs waiting until the poll), and waking never
// blocks: wake-ups that come while one is pending coalesce into it.
func TestConfirmersNotifyWakesEveryLane(t *testing.T) {
	l, err := ledger.Open(t.TempDir(), ledger.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cs := newConfirmers(3, l, nil, nil, nil, nil, slog.New(slog.DiscardHandler))
	for i, c := range cs {
		if c.lane != i || c.lanes != 3 {
			t.Fatalf("confirmer %d measures lane %d of %d, want lane %d of 3", i, c.lane, c.lanes, i)
		}
	}
	for range 3 {
		cs.notify() // would block here if a pending wake-up were not coalesced
	}
	for i, c := range cs {
		if len(c.wake) != 1 {
			t.Fatalf("lane %d has %d wake-ups pending after three commits, want 1", i, len(c.wake))
		}
	}
}

// TestConfirmerRunsARoundWhenWoken: the confirmer runs a round when it starts and again as soon
// as it is woken (notify, after every commit), not only at its poll; it stops when its context
// ends. The poll is set to an hour here, so a second round can only come from the wake-up.
func TestConfirmerRunsARoundWhenWoken(t *testing.T) {
	l, err := ledger.Open(t.TempDir(), ledger.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	m := bnn.New(3, []int{4}, []string{"a", "b"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	ps := &pools{samples: 8}
	c := newConfirmer(l, func() *bnn.Model { return m }, ps, nil, nil, slog.New(slog.DiscardHandler))
	c.poll = time.Hour
	rounds := make(chan struct{})
	c.beforeRound = func(ctx context.Context) {
		select {
		case rounds <- struct{}{}:
		case <-ctx.Done():
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- c.run(ctx) }()
	defer func() {
		cancel()
		if err := <-stopped; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	round := func(what string) {
		t.Helper()
		select {
		case <-rounds:
		case <-time.After(time.Minute): // the poll is an hour away: only a wake-up brings a round
			t.Fatalf("no round %s", what)
		}
	}
	round("at the start")
	c.notify()
	round("after a wake-up")
	c.notify()
	round("after a second wake-up")
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.drawn != 0 {
		t.Fatalf("%d pools drawn for an empty ledger", ps.drawn)
	}
}
