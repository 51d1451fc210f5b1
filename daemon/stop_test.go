package daemon

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
)

// A request still running when the drain (http.shutdown_timeout) ends has its context cancelled
// and its connection closed, and serve returns only once its handler has: no handler outlives
// the daemon's stop. The handler here waits for its request's context alone, as a generation
// does.
func TestRequestsRunningAtTheStopEndBeforeServeReturns(t *testing.T) {
	c := config.Default()
	c.HTTP.ShutdownTimeout = 50 * time.Millisecond
	d := &Daemon{cfg: &c, log: slog.New(slog.DiscardHandler)}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var ended atomic.Bool
	entered := make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-r.Context().Done()
		time.Sleep(20 * time.Millisecond) // a handler takes a moment to wind up
		ended.Store(true)
	})}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- d.serve(ctx, srv, ln) }()
	answered := make(chan error, 1)
	go func() {
		resp, err := http.Get("http://" + ln.Addr().String() + "/slow")
		if err == nil {
			resp.Body.Close()
		}
		answered <- err
	}()
	<-entered
	cancel()
	select {
	case err := <-served:
		if !ended.Load() {
			t.Fatal("serve returned while a handler was still running")
		}
		if err == nil || !strings.Contains(err.Error(), "draining within http.shutdown_timeout") {
			t.Fatalf("serve: %v, want the drain's timeout", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("serve did not return")
	}
	if err := <-answered; err == nil {
		t.Fatal("the request cut off by the stop got an answer")
	}
}

// An explanation waiting for the VAE's first training when the daemon stops is answered
// errStopping (503) at once, instead of holding the HTTP drain, and then the request, until
// explain.timeout.
func TestExplanationWaitingForTheVAEEndsAtTheStop(t *testing.T) {
	m, err := bnn.Load(sharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	d := config.Default()
	e := newExplainer(explainerConfig{stateDir: t.TempDir(), dataset: d.Model.Dataset, seed: d.Model.Seed, maxIterations: 10,
		concurrency: 1, delta: 0.05, epsilon: 0.01}, func() *bnn.Model { return m }, slog.New(slog.DiscardHandler))
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { e.run(ctx); close(ran) }()
	x := make([]float64, m.Inputs())
	reqCtx, reqCancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer reqCancel()
	got := make(chan error, 1)
	go func() {
		_, err := e.generate(reqCtx, m, x, -1, "psce")
		got <- err
	}()
	<-e.want // the request has asked for the VAE: its training begins
	cancel()
	<-ran
	if err := <-got; !errors.Is(err, errStopping) {
		t.Fatalf("generate during the stop: %v, want errStopping", err)
	}
}
