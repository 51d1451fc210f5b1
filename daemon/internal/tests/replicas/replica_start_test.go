package replicas

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// A replica started before its broker waits for it, as ingestion waits out an outage: one WARN
// line while the broker refuses connections, then it joins the posterior log, serves and becomes
// ready once the broker listens. Meanwhile its port answers: /healthz 200 "starting", every other
// route 503 with Retry-After, naming the wait and the brokers.
func TestReplicaStartedBeforeItsBrokerWaits(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica whose broker starts late: not with -short")
	}
	t.Parallel()
	port := testnet.Reserve(t) // refuses connections, as a broker not started yet
	c := daemontest.Config(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, []string{port.Addr()}, "r1", daemontest.WriteKeyFile(t, daemontest.ClusterKey))
	})
	stopBroker := func() {}
	t.Cleanup(func() { stopBroker() }) // after the replica's (cleanups run last first), as the other tests' clusters
	logs := &tooltest.Output{}
	log := slog.New(slog.NewTextHandler(io.MultiWriter(tooltest.LogWriter(t), logs), &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan *daemon.Daemon, 1), make(chan error, 1)
	httpLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	base := "http://" + httpLn.Addr().String()
	go func() {
		done <- daemon.Run(ctx, daemon.Options{Config: &c, Logger: log, Registry: prometheus.NewRegistry(), Ready: ready, HTTPListener: httpLn,
			BundledModel: daemontest.BundledModelOf(t, &c)})
	}()
	daemontest.StopAtCleanup(t, cancel, done)

	const warn = "cannot join the posterior log yet"
	waitfor.Cond(t, 60*time.Second, "the replica waiting for its broker", func() bool {
		select {
		case err := <-done:
			done <- nil // Run has returned: the cleanup has nothing to wait for
			t.Fatalf("the replica stopped while its broker was not up yet: %v", err)
		default:
		}
		return strings.Contains(logs.String(), warn)
	})
	asked := &http.Client{Timeout: 10 * time.Second} // a port that holds connections unanswered fails the test
	waiting := &launch.Running{Client: asked, Base: base}
	if code, body := waiting.Get(t, "/healthz"); code != 200 || !strings.Contains(string(body), `"status":"starting"`) {
		t.Errorf("/healthz while waiting for the broker: %d %s, want 200 starting", code, body)
	}
	for _, path := range []string{"/readyz", "/v1/model", "/metrics", "/ui/"} {
		resp, err := asked.Get(base + path)
		if err != nil {
			t.Fatalf("GET %s while waiting for the broker: %v", path, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "10" ||
			!strings.Contains(string(body), "joining the posterior log: its brokers ("+port.Addr()+") did not answer") {
			t.Errorf("GET %s while waiting for the broker: %d (Retry-After %q) %s, want 503 naming the wait",
				path, resp.StatusCode, resp.Header.Get("Retry-After"), body)
		}
	}
	bctx, bcancel := context.WithCancel(context.Background())
	b, err := broker.Start(bctx, broker.Config{Listener: port.Listen(t), Partitions: 1,
		Topics: []string{"cfguard.records", "cfguard.records.dlq", "cfguard.events"}}, nil)
	if err != nil {
		bcancel()
		t.Fatal(err)
	}
	stopBroker = func() { b.Close(); bcancel() }

	var r *launch.Running
	select {
	case d := <-ready:
		r = &launch.Running{D: d, Config: &c, Logs: logs, Client: http.DefaultClient, Base: "http://" + d.HTTPAddr()}
	case err := <-done:
		done <- nil
		t.Fatalf("the replica stopped once its broker was up: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("the replica did not start within 60 s of its broker")
	}
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	if n := strings.Count(logs.String(), warn); n != 1 {
		t.Errorf("%d lines %q, want one for the whole wait:\n%s", n, warn, logs.String())
	}
}

// A replica whose brokers drop its first requests to create the CE topic (a broker at its
// connection limit closes them) waits as for the posterior log: one WARN line, then it joins the
// CE group and becomes ready.
func TestReplicaWaitsForTheCETopic(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica: not with -short")
	}
	t.Parallel()
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "cfguard.records", "cfguard.records.dlq", "cfguard.events"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the replica's cleanup
	var dropped atomic.Int64
	kc.ControlKey(int16(kmsg.CreateTopics), func(req kmsg.Request) (kmsg.Response, error, bool) {
		kc.KeepControl()
		for _, tp := range req.(*kmsg.CreateTopicsRequest).Topics {
			if tp.Topic == "cfguard.ce" && dropped.Load() < 3 {
				dropped.Add(1)
				return nil, errors.New("connection closed by the test"), true
			}
		}
		return nil, nil, false
	})
	r := launch.ReplicaAt(t, kc.ListenAddrs(), "r1", daemontest.WriteKeyFile(t, daemontest.ClusterKey))
	if n := dropped.Load(); n != 3 {
		t.Fatalf("%d questions about the CE topic dropped, want 3", n)
	}
	const warn = "cannot join the CE topic yet"
	if n := strings.Count(r.Logs.String(), warn); n != 1 {
		t.Errorf("%d lines %q, want one for the whole wait:\n%s", n, warn, r.Logs.String())
	}
}

// A replica that waits for its brokers at start stops when asked to, whichever join it waits
// in, whether the broker refuses or holds its requests, and cleanly (Run returns nil: cfguard run
// exits 0).
func TestReplicaWaitingForItsBrokersStops(t *testing.T) {
	if testing.Short() {
		t.Skip("replicas that wait: not with -short")
	}
	t.Parallel()
	// ceTopic is a broker that drops (hold false) or holds (hold true) every request to create
	// the CE topic; waiting is closed at the first.
	ceTopic := func(t *testing.T, hold bool, waiting chan struct{}) []string {
		kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "cfguard.records", "cfguard.records.dlq", "cfguard.events"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(kc.Close)
		release := make(chan struct{})
		t.Cleanup(func() { close(release) }) // before kc.Close
		var once sync.Once
		kc.ControlKey(int16(kmsg.CreateTopics), func(req kmsg.Request) (kmsg.Response, error, bool) {
			kc.KeepControl()
			for _, tp := range req.(*kmsg.CreateTopicsRequest).Topics {
				if tp.Topic != "cfguard.ce" {
					continue
				}
				once.Do(func() { close(waiting) })
				if hold {
					kc.SleepControl(func() { <-release })
				}
				return nil, errors.New("connection closed by the test"), true
			}
			return nil, nil, false
		})
		return kc.ListenAddrs()
	}
	for _, tc := range []struct {
		what    string
		brokers func(t *testing.T, waiting chan struct{}) []string
	}{
		{"the posterior log, refused", func(t *testing.T, _ chan struct{}) []string { return []string{testnet.Reserve(t).Addr()} }},
		{"the CE topic, refused", func(t *testing.T, waiting chan struct{}) []string { return ceTopic(t, false, waiting) }},
		{"the CE topic, held", func(t *testing.T, waiting chan struct{}) []string { return ceTopic(t, true, waiting) }},
	} {
		t.Run(tc.what, func(t *testing.T) {
			waiting := make(chan struct{})
			c := daemontest.Config(t, func(c *config.Config) {
				daemontest.ReplicaConfig(c, tc.brokers(t, waiting), "r1", daemontest.WriteKeyFile(t, daemontest.ClusterKey))
			})
			logs := &tooltest.Output{}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() {
				done <- daemon.Run(ctx, daemon.Options{Config: &c, Registry: prometheus.NewRegistry(),
					Logger: slog.New(slog.NewTextHandler(io.MultiWriter(tooltest.LogWriter(t), logs), &slog.HandlerOptions{Level: slog.LevelWarn}))})
			}()
			waitfor.Cond(t, 60*time.Second, "the replica waiting for its brokers", func() bool {
				select {
				case <-waiting:
					return true
				default:
				}
				return strings.Contains(logs.String(), "cannot join the posterior log yet")
			})
			daemontest.Stop(t, cancel, done)
		})
	}
}
