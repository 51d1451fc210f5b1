package daemon

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// registerChildEnv names the model directory the child daemon of
// BenchmarkRegisterConcurrentDaemonProcess serves; unset, TestRegisterBenchDaemonChild skips.
const registerChildEnv = "CFGUARD_REGISTER_BENCH_MODEL"

// registerChildAddr prefixes the line on which the child daemon prints its HTTP address.
const registerChildAddr = "cfguard-bench-http "

// BenchmarkRegisterConcurrentDaemonProcess is BenchmarkRegisterConcurrent end to end: the daemon
// runs in a process of its own (this test binary started again as TestRegisterBenchDaemonChild,
// with the same configuration: certify.samples 1000, a real fsynced ledger in a temporary
// directory) and the clients, in this process, reach it only through POST /v1/counterfactuals on
// loopback, as clients of a deployed sidecar do. With 1 client and with 16 concurrent clients in
// one run; ratio = registrations/s with 16 clients over 1 client. per-write is read from the
// child's /metrics; cpu-ms/reg adds the child's CPU time (/proc/<pid>/stat) to this process's.
//
//	go test -run '^$' -bench 'RegisterConcurrent' -benchtime 1000x ./daemon
//
// runs both, in-process first.
func BenchmarkRegisterConcurrentDaemonProcess(b *testing.B) {
	_, set, m, modelDir := benchStream(b, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	child := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestRegisterBenchDaemonChild$", "-test.count=1")
	child.Env = append(os.Environ(), registerChildEnv+"="+modelDir)
	stdin, err := child.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	var stderr bytes.Buffer
	child.Stderr = &stderr
	if err := child.Start(); err != nil {
		b.Fatal(err)
	}
	// The child stops when its stdin closes; Wait then returns once its pipes are drained.
	rest := make(chan string, 1)
	defer func() {
		stdin.Close()
		if err := child.Wait(); err != nil {
			b.Errorf("daemon process: %v\n%s%s", err, <-rest, stderr.String())
		}
	}()
	addr, err := readChildAddr(stdout, rest)
	if err != nil {
		b.Fatalf("daemon process: %v\n%s", err, stderr.String())
	}
	pairs := registrationPairs(b, set, m)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	var seq atomic.Int64
	register := func() error {
		k := int(seq.Add(1))
		pr := pairs[k%len(pairs)]
		body, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("ce-%d", k), "x": set.X[pr[0]], "x_cf": set.X[pr[1]], "target": "benign"})
		resp, err := client.Post("http://"+addr+"/v1/counterfactuals", "application/json", bytes.NewReader(body))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		msg, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusCreated {
			return fmt.Errorf("%d %s", resp.StatusCode, msg)
		}
		return nil
	}
	if err := register(); err != nil { // the version's pool is drawn by the first registration
		b.Fatal(err)
	}
	rates := map[int]float64{}
	for _, clients := range []int{1, 16} {
		b.Run(fmt.Sprintf("clients=%d", clients), func(b *testing.B) {
			writes0, stored0 := scrapeBatchSize(b, client, addr)
			cpu0 := processCPU(b) + pidCPU(b, child.Process.Pid)
			t0 := time.Now()
			if err := driveClients(clients, b.N, register); err != nil {
				b.Fatal(err)
			}
			elapsed := time.Since(t0)
			cpu := processCPU(b) + pidCPU(b, child.Process.Pid) - cpu0
			writes, stored := scrapeBatchSize(b, client, addr)
			rates[clients] = float64(b.N) / elapsed.Seconds()
			b.ReportMetric(rates[clients], "registrations/s")
			b.ReportMetric((stored-stored0)/(writes-writes0), "per-write")
			b.ReportMetric(float64(cpu)/1e6/float64(b.N), "cpu-ms/reg")
			if clients > 1 && rates[1] > 0 {
				b.ReportMetric(rates[clients]/rates[1], "ratio")
			}
		})
	}
}

// TestRegisterBenchDaemonChild is the daemon process of BenchmarkRegisterConcurrentDaemonProcess:
// it serves the model in $CFGUARD_REGISTER_BENCH_MODEL with the benchmark's configuration,
// prints its HTTP address and runs until its stdin closes.
func TestRegisterBenchDaemonChild(t *testing.T) {
	modelDir := os.Getenv(registerChildEnv)
	if modelDir == "" {
		t.Skip("child process of BenchmarkRegisterConcurrentDaemonProcess")
	}
	c := config.Default()
	c.StateDir, c.HTTP.Listen, c.Model.Path = t.TempDir(), "127.0.0.1:0", modelDir
	c.Kafka.EmbeddedListen = "127.0.0.1:0"
	c.Audit.Schedule = ""
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := make(chan *Daemon, 1)
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Options{Config: &c, Logger: slog.New(slog.DiscardHandler), Registry: prometheus.NewRegistry(), Ready: ready})
	}()
	select {
	case d := <-ready:
		fmt.Printf("%s%s\n", registerChildAddr, d.HTTPAddr())
	case err := <-done:
		t.Fatalf("daemon exited before it was ready: %v", err)
	}
	io.Copy(io.Discard, os.Stdin) // returns when the benchmark closes the pipe
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// readChildAddr reads the child's stdout up to the line with its HTTP address; the rest of its
// output is copied in the background and sent on rest when the child closes stdout.
func readChildAddr(stdout io.Reader, rest chan<- string) (string, error) {
	r := bufio.NewReader(stdout)
	var seen strings.Builder
	for {
		line, err := r.ReadString('\n')
		seen.WriteString(line)
		if addr, ok := strings.CutPrefix(strings.TrimSpace(line), strings.TrimSpace(registerChildAddr)); ok && strings.HasPrefix(line, registerChildAddr) {
			go func() {
				b, _ := io.ReadAll(r)
				rest <- string(b)
			}()
			return strings.TrimSpace(addr), nil
		}
		if err != nil {
			rest <- seen.String()
			return "", fmt.Errorf("no address line (%q) before %v; it printed:\n%s", registerChildAddr, err, seen.String())
		}
	}
}

// registrationPairs are (x, x_cf) rows of set that the model admits as a certified
// registration: x of class 0 with p > 0.9, x_cf of class 1 with p > 0.985 and a small variance
// (as BenchmarkRegisterConcurrent picks them).
func registrationPairs(b *testing.B, set *dataset.Set, m *bnn.Model) [][2]int {
	p, err := m.Predict(set.X, 1000, 1)
	if err != nil {
		b.Fatal(err)
	}
	var xs, cfs []int
	for i := range set.X {
		switch {
		case p.Argmax(i) == 0 && p.P(i, 0) > 0.9:
			xs = append(xs, i)
		case p.P(i, 1) > 0.985 && p.V(i, 1) < 0.002:
			cfs = append(cfs, i)
		}
	}
	if len(xs) == 0 || len(cfs) == 0 {
		b.Fatalf("no candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	pairs := make([][2]int, max(len(xs), len(cfs)))
	for k := range pairs {
		pairs[k] = [2]int{xs[k%len(xs)], cfs[k%len(cfs)]}
	}
	return pairs
}

// driveClients runs n calls of register from clients concurrent goroutines, each making its
// next call when its last is answered, and returns the first error.
func driveClients(clients, n int, register func() error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				if err := register(); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs // nil when the channel is empty
}

// scrapeBatchSize reads cfguard_counterfactuals_registration_batch_size from a daemon's
// /metrics: the ledger writes and the CEs they stored.
func scrapeBatchSize(b *testing.B, client *http.Client, addr string) (writes, stored float64) {
	resp, err := client.Get("http://" + addr + "/metrics")
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	found := 0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			continue
		}
		var dst *float64
		switch name {
		case "cfguard_counterfactuals_registration_batch_size_count":
			dst = &writes
		case "cfguard_counterfactuals_registration_batch_size_sum":
			dst = &stored
		default:
			continue
		}
		if *dst, err = strconv.ParseFloat(value, 64); err != nil {
			b.Fatalf("/metrics: %s: %v", name, err)
		}
		found++
	}
	if err := sc.Err(); err != nil || found != 2 {
		b.Fatalf("/metrics of %s: cfguard_counterfactuals_registration_batch_size not found (%d of 2 series, %v)", addr, found, err)
	}
	return writes, stored
}

// pidCPU is the CPU time (user and system) process pid has used (tooltest.CPU).
func pidCPU(b *testing.B, pid int) time.Duration {
	d, err := tooltest.CPU(pid)
	if err != nil {
		b.Fatal(err)
	}
	return d
}
