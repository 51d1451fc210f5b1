package cluster

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/ceshare"
)

// A peer that gives no answer (a connection closed before any answer, or an answer cut before
// its end) is an UnreachableError: an ErrPeer that says when to retry (the CE group's session
// timeout, after which a stopped replica's partitions have another owner) and names the peer. A
// peer that answers, whatever it answers, is not: its answer is decodePeer's to judge.
func TestAPeerThatGivesNoAnswerIsUnreachable(t *testing.T) {
	closing := func(t *testing.T) string { // accepts connections and closes them at once
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		t.Cleanup(func() { ln.Close(); <-done })
		return "http://" + ln.Addr().String()
	}
	serving := func(h http.HandlerFunc) func(t *testing.T) string {
		return func(t *testing.T) string {
			srv := httptest.NewServer(h)
			t.Cleanup(srv.Close)
			return srv.URL
		}
	}
	cut := serving(func(w http.ResponseWriter, r *http.Request) { // promises 100 bytes, sends 10, hangs up
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(http.StatusOK)
		w.Write([]byte(`{"counter`))
		w.(http.Flusher).Flush()
		c, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			c.Close()
		}
	})
	for _, c := range []struct {
		name        string
		peer        func(t *testing.T) string
		unreachable bool
	}{
		{"a connection closed before any answer", closing, true},
		{"an answer cut before its end", cut, true},
		{"an answer of 500", serving(func(w http.ResponseWriter, r *http.Request) { http.Error(w, "broken", 500) }), false},
		{"an answer of 200", serving(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte(`{}`)) }), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			url := c.peer(t)
			s := &Share{id: "r1", client: &http.Client{Timeout: 5 * time.Second}, sessionTimeout: 7 * time.Second}
			_, err := s.ask(context.Background(), ceshare.Owner{Replica: "r2", URL: url}, http.MethodGet, "/v1/counterfactuals/a", nil, "")
			var u *UnreachableError
			switch {
			case !c.unreachable && err != nil:
				t.Fatalf("a peer that answered: %v, want its answer", err)
			case !c.unreachable:
				return
			case !errors.As(err, &u) || !errors.Is(err, ErrPeer):
				t.Fatalf("%v (%T), want an UnreachableError matching ErrPeer", err, err)
			case u.RetryAfter != 7*time.Second:
				t.Fatalf("RetryAfter %v, want the session timeout, 7s", u.RetryAfter)
			}
			for _, want := range []string{"r2", url, "replication.session_timeout (7s)"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("%q does not name %s", err, want)
				}
			}
		})
	}
}
