package daemon

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/testcert"
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
	m, err := bnn.Load(daemontest.SharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	d := config.Default()
	e := newExplainer(explainerConfig{stateDir: t.TempDir(), dataset: d.Model.Dataset, seed: d.Model.Seed, maxIterations: 10,
		concurrency: 1, delta: 0.05, epsilon: 0.01, pool: drawPool}, func() *bnn.Model { return m }, slog.New(slog.DiscardHandler))
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

// serveForStop runs d.serve on a loopback limitListener, as the daemon does, with a handler
// answering 200 "ok" (after 1.5 s for /slow, closing slow when it starts), over TLS when d's
// http.web_config_file says so. It returns a function that stops serve and gives what it
// returned, and a dialer of raw connections (TLS ones, their handshake done, when tlsCfg is not
// nil).
func serveForStop(t *testing.T, d *Daemon, tlsCfg *tls.Config) (stop func() error, dial func() net.Conn, slow <-chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	var startedOnce sync.Once
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			startedOnce.Do(func() { close(started) })
			time.Sleep(1500 * time.Millisecond)
		}
		io.WriteString(w, "ok")
	})}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() {
		served <- d.serve(ctx, srv, newLimitListener(ln, 16, prometheus.NewGauge(prometheus.GaugeOpts{Name: "conns"})))
	}()
	var once sync.Once
	var stopErr error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case stopErr = <-served:
			case <-time.After(60 * time.Second):
				stopErr = errors.New("serve did not return within 60 s of the stop")
			}
		})
		return stopErr
	}
	t.Cleanup(func() { stop() })
	dial = func() net.Conn {
		t.Helper()
		var c net.Conn
		var err error
		if tlsCfg != nil {
			c, err = tls.Dial("tcp", ln.Addr().String(), tlsCfg)
		} else {
			c, err = net.Dial("tcp", ln.Addr().String())
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	return stop, dial, started
}

// TestUnusedConnectionsDoNotHoldTheDrain: a connection a client keeps without sending a request
// on it (as Go's Transport pools one it dialed for a request another connection served) is
// closed by the drain, over plain HTTP and over TLS, so that a stop with http.shutdown_timeout
// under 5 s drains (http.Server.Shutdown alone waits 5 s for such a connection) and a request
// running at the stop, for longer than unusedGrace, is still answered.
func TestUnusedConnectionsDoNotHoldTheDrain(t *testing.T) {
	dir := t.TempDir()
	ca := testcert.NewCA(t, "cfguard test CA")
	cert, key := ca.Issue(t, 100, x509.ExtKeyUsageServerAuth)
	for name, b := range map[string][]byte{"server.pem": cert, "server.key": key,
		"web.yml": []byte("tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n")} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name string
		web  string
		tls  *tls.Config
	}{
		{"plain", "", nil},
		{"tls", filepath.Join(dir, "web.yml"), &tls.Config{RootCAs: ca.Pool()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := config.Default()
			c.HTTP.ShutdownTimeout, c.HTTP.WebConfigFile = 4*time.Second, tc.web
			stop, dial, slow := serveForStop(t, &Daemon{cfg: &c, log: slog.New(slog.DiscardHandler)}, tc.tls)
			unused, running := dial(), dial()
			if _, err := io.WriteString(running, "GET /slow HTTP/1.1\r\nHost: cfguard\r\n\r\n"); err != nil {
				t.Fatal(err)
			}
			<-slow // the request is running before the stop
			stopped := make(chan error, 1)
			go func() { stopped <- stop() }()
			running.SetReadDeadline(time.Now().Add(30 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(running), nil)
			if err != nil {
				t.Fatalf("the request running at the stop: %v, want its answer", err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || string(body) != "ok" {
				t.Fatalf("the request running at the stop: %d %q", resp.StatusCode, body)
			}
			if err := <-stopped; err != nil {
				t.Fatalf("stop with a connection that carried no request: %v, want drained", err)
			}
			unused.SetReadDeadline(time.Now().Add(10 * time.Second))
			if n, err := unused.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("the unused connection after the stop: read %d bytes, %v; want it closed", n, err)
			}
		})
	}
}
