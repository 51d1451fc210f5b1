//go:build linux

package testnet

import (
	"errors"
	"net"
	"syscall"
	"testing"
)

// refused dials addr and reports whether the connection was refused.
func refused(t *testing.T, addr string) bool {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err == nil {
		c.Close()
		return false
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial %s: %v, want connection refused or a connection", addr, err)
	}
	return true
}

// TestPortIsHeldAcrossListeners: a reserved port refuses connections, cannot be bound by an
// ordinary listener, accepts while Listen's socket is open, and is held again once it closes.
func TestPortIsHeldAcrossListeners(t *testing.T) {
	p := Reserve(t)
	if !refused(t, p.Addr()) {
		t.Fatalf("a connection to the reserved, not listening %s was accepted", p.Addr())
	}
	for round := range 2 {
		if ln, err := net.Listen("tcp", p.Addr()); err == nil {
			ln.Close()
			t.Fatalf("round %d: net.Listen bound the held %s", round, p.Addr())
		} else if !errors.Is(err, syscall.EADDRINUSE) {
			t.Fatalf("round %d: net.Listen on the held %s: %v, want address already in use", round, p.Addr(), err)
		}
		ln := p.Listen(t)
		if ln.Addr().String() != p.Addr() {
			t.Fatalf("Listen is on %s, want %s", ln.Addr(), p.Addr())
		}
		accepted := make(chan error, 1)
		go func() {
			c, err := ln.Accept()
			if err == nil {
				c.Close()
			}
			accepted <- err
		}()
		if refused(t, p.Addr()) {
			t.Fatalf("round %d: a connection to %s was refused while Listen's socket is open", round, p.Addr())
		}
		if err := <-accepted; err != nil {
			t.Fatalf("round %d: Accept: %v", round, err)
		}
		ln.Close()
		if !refused(t, p.Addr()) {
			t.Fatalf("round %d: a connection to %s was accepted after its listener closed", round, p.Addr())
		}
	}
}
