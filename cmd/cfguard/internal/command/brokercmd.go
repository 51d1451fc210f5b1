package command

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/internal/cli"
)

// cmdBroker runs the embedded Kafka-protocol broker alone, with one or more nodes on loopback,
// until SIGINT/SIGTERM. Once it serves it prints "brokers: ADDR,ADDR,..." on stdout (node i's
// address at position i) for scripts, and logs the same on stderr. With --metrics-listen it
// serves the broker's connection and write metrics on /metrics there, and prints
// "metrics: http://ADDR/metrics" before the brokers line.
func cmdBroker(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("broker", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:9092", "host:port of node 0; node i listens on port+i (port 0: every node on a free port). Loopback hosts only")
	nodes := fs.Int("nodes", 1, fmt.Sprintf("number of broker nodes, 1..%d", broker.MaxNodes))
	dataDir := fs.String("data-dir", "", "persist topics, records and committed group offsets here, and reload them at start (default: memory only)")
	syncWrites := fs.Bool("sync-writes", false, "with --data-dir, fsync every produced batch before acknowledging it")
	topics := fs.String("topics", "", "comma-separated topics to create at start unless they exist")
	partitions := fs.Int("partitions", 1, "partition count of the topics --topics creates; partition p is led by node p mod --nodes")
	minSession := fs.Duration("group-min-session-timeout", 6*time.Second, "shortest consumer-group session timeout a member may ask for (Kafka's group.min.session.timeout.ms)")
	retention := fs.Duration("retention", broker.DefaultRetention, "delete records older than this (negative: keep)")
	retentionBytes := fs.Int64("retention-bytes", broker.DefaultRetentionBytes, "delete a partition's oldest records past this many bytes (negative: no limit)")
	maxConns := fs.Int("max-connections", broker.DefaultMaxConnections, "connections open at once, across the nodes and every client; the broker closes those beyond it")
	idle := fs.Duration("idle-timeout", broker.DefaultIdleTimeout, "close a connection with no request in progress for this long")
	request := fs.Duration("request-timeout", broker.DefaultRequestTimeout, "close a connection whose request takes longer than this from its first byte to its last, or whose response takes longer to write")
	metricsListen := fs.String("metrics-listen", "", "host:port to serve the broker's connection and write metrics on, at /metrics (default: none; port 0: a free port)")
	if err := cli.ParseFlags(fs, args, stderr); err != nil {
		return err
	}
	if *syncWrites && *dataDir == "" {
		return fmt.Errorf("%w: --sync-writes needs --data-dir", cli.ErrUsage)
	}
	if *nodes < 1 || *nodes > broker.MaxNodes {
		return fmt.Errorf("%w: --nodes %d: want 1..%d", cli.ErrUsage, *nodes, broker.MaxNodes)
	}
	if *partitions < 1 {
		return fmt.Errorf("%w: --partitions %d: want at least 1", cli.ErrUsage, *partitions)
	}
	partitionsGiven := false
	fs.Visit(func(f *flag.Flag) { partitionsGiven = partitionsGiven || f.Name == "partitions" })
	if partitionsGiven && *topics == "" {
		return fmt.Errorf("%w: --partitions %d applies to the topics --topics creates: give --topics too", cli.ErrUsage, *partitions)
	}
	if *retention == 0 {
		return fmt.Errorf("%w: --retention 0: want a positive duration, or a negative one to keep records for ever", cli.ErrUsage)
	}
	if *retentionBytes == 0 {
		return fmt.Errorf("%w: --retention-bytes 0: want a positive size, or a negative one for no limit", cli.ErrUsage)
	}
	if *maxConns < 1 {
		return fmt.Errorf("%w: --max-connections %d: want at least 1", cli.ErrUsage, *maxConns)
	}
	if *idle <= 0 {
		return fmt.Errorf("%w: --idle-timeout %v: want a positive duration", cli.ErrUsage, *idle)
	}
	if *request <= 0 {
		return fmt.Errorf("%w: --request-timeout %v: want a positive duration", cli.ErrUsage, *request)
	}
	if *minSession <= 0 {
		return fmt.Errorf("%w: --group-min-session-timeout %v: want a positive duration", cli.ErrUsage, *minSession)
	}
	if err := config.CheckListenAddr(*listen); err != nil {
		return fmt.Errorf("%w: --listen %q: %v, such as 127.0.0.1:9092 (port 0: every node on a free port)", cli.ErrUsage, *listen, err)
	}
	if *metricsListen != "" {
		if err := config.CheckListenAddr(*metricsListen); err != nil {
			return fmt.Errorf("%w: --metrics-listen %q: %v, such as 127.0.0.1:9644 (port 0: a free port)", cli.ErrUsage, *metricsListen, err)
		}
	}
	cfg := broker.Config{Listen: *listen, Nodes: *nodes, DataDir: *dataDir, SyncWrites: *syncWrites,
		Partitions: *partitions, GroupMinSessionTimeout: *minSession,
		Retention: *retention, RetentionBytes: *retentionBytes, MaxConnections: *maxConns, IdleTimeout: *idle, RequestTimeout: *request,
		LimitNames: broker.LimitNames{MaxConnections: "--max-connections", IdleTimeout: "--idle-timeout"}}
	if *topics != "" {
		cfg.Topics = strings.Split(*topics, ",")
	}
	var metricsLn net.Listener
	if *metricsListen != "" {
		var err error
		if metricsLn, err = net.Listen("tcp", *metricsListen); err != nil {
			return fmt.Errorf("--metrics-listen %s: %w", *metricsListen, err)
		}
		defer metricsLn.Close()
	}
	log := cli.Logger(stderr)
	b, err := broker.Start(ctx, cfg, log)
	if errors.Is(err, broker.ErrInvalidConfig) {
		return fmt.Errorf("%w: %v", cli.ErrUsage, err)
	}
	if err != nil {
		return err
	}
	defer b.Close()
	if metricsLn != nil {
		stop := serveBrokerMetrics(b, metricsLn)
		defer stop()
		url := "http://" + metricsLn.Addr().String() + "/metrics"
		log.Info("serving the broker's metrics", "url", url)
		if _, err := fmt.Fprintf(stdout, "metrics: %s\n", url); err != nil {
			return err
		}
	}
	brokers := strings.Join(b.Addrs(), ",")
	log.Info("SIGINT or SIGTERM stops the broker", "brokers", brokers)
	if _, err := fmt.Fprintf(stdout, "brokers: %s\n", brokers); err != nil {
		return err
	}
	<-ctx.Done()
	b.Close() // persists the state with --data-dir
	log.Info("Kafka-protocol broker stopped", "brokers", brokers)
	return nil
}

// serveBrokerMetrics serves b's connection and write metrics (the series the daemon exports for
// its embedded broker) on /metrics at ln, from a registry of their own, until the returned stop
// is called.
func serveBrokerMetrics(b *broker.Broker, ln net.Listener) (stop func()) {
	reg := prometheus.NewRegistry()
	daemon.RegisterBrokerMetrics(reg, b)
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln) // ErrServerClosed once stopped
	}()
	return func() {
		srv.Close()
		<-done
	}
}
