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
	"net"
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
