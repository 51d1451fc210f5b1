//go:build linux

// Package testnet gives a test a loopback TCP port that stays its own for the whole test.
//
// A test that needs an address before anything listens there (a client configured before its
// broker starts, a broker stopped and started again on the same address, a URL that must refuse
// connections) cannot take a free port and let it go: until something binds it again, any socket
// may take it, an outgoing connection's local port included (it comes from the same range).
//
// A Port holds its port with a socket that is bound, with SO_REUSEPORT, and never listens.
// Connections to it are refused, as to a stopped server. No other socket can bind the port
// unless it too sets SO_REUSEPORT and belongs to the same user (Linux's rule), and the kernel
// picks neither it for port 0 nor it as an outgoing connection's local port. Listen opens a
// listening socket on the port (with SO_REUSEPORT); when that socket closes, the port is still
// held, and Listen may be called again.
package testnet

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// Port is a loopback TCP port a test holds without listening on it.
type Port struct {
	fd   int
	addr string
}

// Reserve binds a new port on 127.0.0.1 and holds it until the test ends.
func Reserve(t testing.TB) *Port {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("testnet: socket: %v", err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
		unix.Close(fd)
		t.Fatalf("testnet: SO_REUSEPORT: %v", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		unix.Close(fd)
		t.Fatalf("testnet: bind 127.0.0.1:0: %v", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		unix.Close(fd)
		t.Fatalf("testnet: getsockname: %v", err)
	}
	p := &Port{fd: fd, addr: fmt.Sprintf("127.0.0.1:%d", sa.(*unix.SockaddrInet4).Port)}
	t.Cleanup(func() { unix.Close(p.fd) })
	return p
}

// Addr is the port's address, 127.0.0.1:PORT.
func (p *Port) Addr() string { return p.addr }

// Listen returns a socket listening on the port. The caller closes it (or hands it to a server
// that does); the port stays held.
func (p *Port) Listen(t testing.TB) net.Listener {
	t.Helper()
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
		}); err != nil {
			return err
		}
		return serr
	}}
	ln, err := lc.Listen(t.Context(), "tcp", p.addr)
	if err != nil {
		t.Fatalf("testnet: listening on the held port %s: %v", p.addr, err)
	}
	return ln
}

// Unassigned returns the first of n consecutive loopback ports that are free and lie below the
// kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), for a test of a server that
// must bind an address it is given by itself. The kernel gives ports of that range to sockets
// bound to port 0 and to outgoing connections; a port below it is taken only by a socket that
// names it, so between this check and the server's bind no test of this repository (they all
// bind port 0 or hold a Port) and no connection can take it. Ports are tried from a random start
// so that parallel test binaries do not all try the same ones first.
func Unassigned(t testing.TB, n int) int {
	t.Helper()
	low := 32768 // Linux's default when the file cannot be read
	if raw, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(raw)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil {
				low = v
			}
		}
	}
	const first = 20000 // above the well-known and most registered services' ports
	if low-first < 100*n {
		t.Fatalf("testnet: the ephemeral range starts at %d, leaving no room below it for %d ports", low, n)
	}
	start := first + rand.IntN(low-first-n)
	for i := 0; i < low-first; i++ {
		base := first + (start-first+i)%(low-first-n)
		if free(base, n) {
			return base
		}
	}
	t.Fatalf("testnet: no %d consecutive free ports between %d and %d", n, first, low)
	return 0
}

// free reports whether ports base..base+n-1 can each be bound on 127.0.0.1 now.
func free(base, n int) bool {
	var held []net.Listener
	defer func() {
		for _, l := range held {
			l.Close()
		}
	}()
	for p := base; p < base+n; p++ {
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			return false
		}
		held = append(held, l)
	}
	return true
}
