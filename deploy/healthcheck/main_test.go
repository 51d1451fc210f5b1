package main

import (
	"bytes"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/tooltest"
)

func TestHealthcheckExitCodes(t *testing.T) {
	slow := make(chan struct{})
	// /slow answers only when the test ends: "too slow" returns at all only because -timeout
	// ended the request (and says so).
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/healthz":
			w.Write([]byte(`{"status":"ok"}`))
		case "/starting/healthz":
			w.Write([]byte(`{"status":"starting","phase":"opening the ledger"}`))
		case "/nophase/healthz":
			w.Write([]byte(`{"status":"starting"}`))
		case "/accepted":
			w.WriteHeader(http.StatusAccepted)
		case "/readyz":
			http.Error(w, `{"error":"broker unreachable"}`, http.StatusServiceUnavailable)
		case "/slow":
			<-slow
		}
	}))
	defer srv.Close()
	defer close(slow) // before Close, which waits for the handler
	// A port this test holds and nothing listens on: connections to it are refused.
	closed := "http://" + testnet.Reserve(t).Addr() + "/healthz"

	cases := []struct {
		name string
		args []string
		want int
		msg  string // in stderr
	}{
		{"healthy", []string{srv.URL + "/healthz"}, 0, ""},
		// The reason is the answer's status and body (http.Error's, with its newline).
		{"not ready", []string{srv.URL + "/readyz"}, 1, `503 Service Unavailable: {"error":"broker unreachable"}`},
		{"starting", []string{srv.URL + "/starting/healthz"}, 1, "still starting: opening the ledger"},
		{"starting without a phase", []string{srv.URL + "/nophase/healthz"}, 1, "still starting"},
		// Only 200 is healthy: another 2xx is not what /healthz answers.
		{"202", []string{srv.URL + "/accepted"}, 1, "202 Accepted"},
		{"nothing listening", []string{closed}, 1, "connection refused"},
		{"too slow", []string{"-timeout", "200ms", srv.URL + "/slow"}, 1, "deadline exceeded"},
		{"two URLs", []string{srv.URL, srv.URL}, 2, "at most one URL"},
		{"bad flag", []string{"-nope"}, 2, "flag provided but not defined"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			if got := run(tc.args, DefaultURL, &stderr); got != tc.want {
				t.Fatalf("exit %d, want %d (stderr %q)", got, tc.want, stderr.String())
			}
			if !strings.Contains(stderr.String(), tc.msg) {
				t.Fatalf("stderr %q does not say %q", stderr.String(), tc.msg)
			}
		})
	}
}

// The image's HEALTHCHECK runs the program without arguments, so DefaultURL must be /healthz on
// loopback at the port of the image's http.listen (deploy/docker/config.yaml), and a run without
// a URL must check DefaultURL.
func TestDefaultURLIsTheImagesHealthz(t *testing.T) {
	cfg, err := config.LoadFile(filepath.Join(tooltest.RepoRoot(t), "deploy", "docker", "config.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	host, port, err := net.SplitHostPort(cfg.HTTP.Listen)
	if err != nil {
		t.Fatal(err)
	}
	if ip := net.ParseIP(host); host != "" && (ip == nil || !ip.IsUnspecified() && !ip.IsLoopback()) {
		t.Fatalf("http.listen %s: 127.0.0.1 reaches only a wildcard or loopback address", cfg.HTTP.Listen)
	}
	u, err := url.Parse(DefaultURL)
	if err != nil {
		t.Fatal(err)
	}
	if u.Scheme != "http" || u.Hostname() != "127.0.0.1" || u.Port() != port || u.Path != "/healthz" {
		t.Errorf("DefaultURL %s, want http://127.0.0.1:%s/healthz (http.listen %s)", DefaultURL, port, cfg.HTTP.Listen)
	}

}

// A run without a URL checks the default it is given (main gives DefaultURL): here a server
// that answers healthy at one path and 503 at another, so that the exit code says which was asked.
func TestNoURLChecksTheDefault(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/healthz" {
			http.Error(w, "not here", http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte(`{"status":"ok"}`))
	}))
	defer srv.Close()
	for _, tc := range []struct {
		def  string
		want int
	}{{srv.URL + "/healthz", 0}, {srv.URL + "/elsewhere", 1}} {
		var stderr bytes.Buffer
		if code := run(nil, tc.def, &stderr); code != tc.want || (code != 0) != strings.Contains(stderr.String(), tc.def) {
			t.Errorf("no URL, default %s: exit %d (want %d), stderr %q", tc.def, code, tc.want, stderr.String())
		}
	}
}

// The timeout defaults to 3s, as the usage says: under the image's HEALTHCHECK --timeout=5s, so
// that the check gives up and says why before Docker kills it.
func TestDefaultTimeout(t *testing.T) {
	var stderr bytes.Buffer
	run([]string{"-h"}, DefaultURL, &stderr)
	if !strings.Contains(stderr.String(), "give up after this long (default 3s)") {
		t.Errorf("-h: usage %q, want a -timeout default of 3s", stderr.String())
	}
}
