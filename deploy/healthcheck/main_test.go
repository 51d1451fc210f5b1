package main

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/internal/testnet"
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
		{"not ready", []string{srv.URL + "/readyz"}, 1, "503"},
		{"starting", []string{srv.URL + "/starting/healthz"}, 1, "still starting: opening the ledger"},
		{"nothing listening", []string{closed}, 1, "connection refused"},
		{"too slow", []string{"-timeout", "200ms", srv.URL + "/slow"}, 1, "deadline exceeded"},
		{"two URLs", []string{srv.URL, srv.URL}, 2, "at most one URL"},
		{"bad flag", []string{"-nope"}, 2, "flag provided but not defined"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var stderr bytes.Buffer
			if got := run(tc.args, &stderr); got != tc.want {
				t.Fatalf("exit %d, want %d (stderr %q)", got, tc.want, stderr.String())
			}
			if !strings.Contains(stderr.String(), tc.msg) {
				t.Fatalf("stderr %q does not say %q", stderr.String(), tc.msg)
			}
		})
	}
}
