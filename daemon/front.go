package daemon

import (
	"context"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/cfguard/cfguard/ui"
)

// startingRetryAfter is the Retry-After of the answers a starting daemon gives.
const startingRetryAfter = 10 * time.Second

// front is the HTTP server's handler. The server serves as soon as http.listen is bound, so that
// a daemon that is still starting (opening a large ledger, training its first model, waiting for
// its brokers) answers probes and says what it waits for instead of holding connections
// unanswered: GET /healthz is 200 {"status": "starting", "phase": ...}, every other request 503
// with Retry-After and the phase (an HTML page under /ui/). Run puts the API in its place once
// every component the API calls exists (or a replica's refusal, see refuse).
type front struct {
	h     atomic.Pointer[http.Handler]
	phase atomic.Pointer[string]
	ui    http.Handler // /ui/ while starting: a page that says the same
}

func newFront() *front {
	f := &front{}
	var starting http.Handler = http.HandlerFunc(f.starting)
	f.h.Store(&starting)
	f.setPhase("starting")
	f.ui = ui.Starting(func() string { return *f.phase.Load() }, int(startingRetryAfter/time.Second))
	return f
}

func (f *front) ServeHTTP(w http.ResponseWriter, r *http.Request) { (*f.h.Load()).ServeHTTP(w, r) }

// serve makes h answer every request from now on.
func (f *front) serve(h http.Handler) { f.h.Store(&h) }

// setPhase names what the start is doing, as the answers while starting say (without absolute
// paths: publicMessage, as every 5xx answer's error).
func (f *front) setPhase(phase string) {
	phase = publicMessage(phase)
	f.phase.Store(&phase)
}

func (f *front) starting(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/ui" || strings.HasPrefix(r.URL.Path, "/ui/") {
		f.ui.ServeHTTP(w, r)
		return
	}
	phase := *f.phase.Load()
	if r.URL.Path == "/healthz" && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "starting", "phase": phase})
		return
	}
	retryLater(w, http.StatusServiceUnavailable, startingRetryAfter, "starting: "+phase)
}

// server is the HTTP server from the moment http.listen is bound: it serves front (serve) in a
// goroutine of its own until stopped, then drains for http.shutdown_timeout.
type server struct {
	stop     context.CancelFunc
	done     chan struct{}
	err      error       // serve's, once done is closed
	reported atomic.Bool // run returned err: close does not report it again
}

// serveOn starts serving srv on ln.
func (d *Daemon) serveOn(srv *http.Server, ln net.Listener) *server {
	ctx, stop := context.WithCancel(context.Background())
	s := &server{stop: stop, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		s.err = d.serve(ctx, srv, ln)
	}()
	return s
}

// run is the server as one of Run's components: it returns when ctx ends, once the server has
// drained, or when the server fails.
func (s *server) run(ctx context.Context) error {
	select {
	case <-ctx.Done():
		s.stop()
		<-s.done
	case <-s.done:
	}
	s.reported.Store(true)
	return s.err
}

// close stops the server and waits for it: teardown's step, which a start that failed (or was
// stopped) before the components ran needs, and a no-op after run.
func (s *server) close() error {
	s.stop()
	<-s.done
	if s.reported.Load() {
		return nil
	}
	return s.err
}
