package broker

import (
	"context"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/internal/waitfor"
)

// faultyListener is a real TCP listener whose first Accepts fail with EMFILE, as accept(2)
// does when the process is at its file descriptor limit.
type faultyListener struct {
	net.Listener
	faults  atomic.Int32 // injected errors left
	accepts atomic.Int32 // Accept calls
}

func (l *faultyListener) Accept() (net.Conn, error) {
	l.accepts.Add(1)
	if l.faults.Add(-1) >= 0 {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Addr: l.Addr(), Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	return l.Listener.Accept()
}

// startFaulty starts a broker whose socket is a faultyListener with the given faults.
func startFaulty(t *testing.T, faults int32) (*Broker, *faultyListener) {
	t.Helper()
	var fl *faultyListener
	listen := func(network, addr string) (net.Listener, error) {
		ln, err := net.Listen(network, addr)
		if err != nil {
			return nil, err
		}
		fl = &faultyListener{Listener: ln}
		fl.faults.Store(faults)
		return fl, nil
	}
	b, err := start(context.Background(), Config{Topics: []string{"t"}}, nil, listen)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b, fl
}

// TestListenerSurvivesEMFILE: kfake's accept loop returns on the first Accept error; through
// the broker's listener, EMFILE is retried with backoff and the broker accepts (and serves)
// a real Kafka client afterwards.
func TestListenerSurvivesEMFILE(t *testing.T) {
	const faults = 6
	b, fl := startFaulty(t, faults)
	// Every injected error was returned, and Accept was called again after the last.
	waitfor.Cond(t, 10*time.Second, "the injected EMFILEs to be consumed", func() bool { return fl.accepts.Load() > faults })
	if err := b.Healthy(); err != nil {
		t.Fatalf("Healthy after temporary accept errors: %v", err)
	}
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()...), Topic: "t", RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, kafka.Message{Value: []byte("after EMFILE")}); err != nil {
		t.Fatalf("producing after the accept errors: %v", err)
	}
	if hw := b.HighWatermarks("t"); len(hw) != 1 || hw[0] != 1 {
		t.Fatalf("high watermarks %v, want [1]", hw)
	}
}

// TestHealthyReportsADeadListener: a listener that fails for good (its socket closed under
// it) is reported by Healthy; a stopped broker too.
func TestHealthyReportsADeadListener(t *testing.T) {
	b, fl := startFaulty(t, 0)
	if err := b.Healthy(); err != nil {
		t.Fatalf("Healthy at start: %v", err)
	}
	fl.Listener.Close() // the socket, not the broker
	waitfor.Cond(t, 10*time.Second, "Healthy to report the closed listener", func() bool { return b.Healthy() != nil })
	if err := b.Healthy(); !strings.Contains(err.Error(), "stopped accepting") || !strings.Contains(err.Error(), b.Addrs()[0]) {
		t.Fatalf("Healthy = %v, want it to name the address and say it stopped accepting", err)
	}

	b2, _ := startFaulty(t, 0)
	b2.Close()
	if err := b2.Healthy(); err == nil || !strings.Contains(err.Error(), "stopped") {
		t.Fatalf("Healthy of a closed broker = %v, want stopped", err)
	}
}
