// Package broker runs an embedded Kafka-protocol broker (franz-go's kfake) on a loopback
// address, so that cfguard can be demonstrated and tested end to end without an external
// Kafka cluster. By default it is a single node: one listener, replication factor 1. With Nodes
// above 1 the one process serves several nodes, each on its own loopback listener, as a cluster
// would: every partition is still stored once (kfake's metadata lists every node as a replica
// and in sync), led by one node, and clients bootstrap from any node and are sent to the leaders. The nodes share one log, so this spreads leadership and
// group coordination over listeners (what clients of a real cluster must cope with), not load
// or durability.
//
// It is not a production Kafka: kfake keeps every partition in one process, rejects produce
// batches larger than message.max.bytes (1048588 bytes by default), and with DataDir set it
// persists topics, records and committed group offsets to disk (fsync on segment roll and on
// Close, like Kafka's default log.flush settings), so a clean Close followed by Start with the
// same DataDir sees the same data. A crash may lose the last unsynced batches.
//
// Retention keeps it bounded: every RetentionCheckInterval the broker deletes, in every
// partition of every topic, the oldest records older than Retention (by their timestamp) and
// the oldest records past RetentionBytes of log (Kafka's retention.ms and retention.bytes,
// per partition). Logs are stored in segments of at most RetentionBytes/4 (between 64 KiB and
// 16 MiB); a segment's files are deleted once all its records are, so a partition's data on
// disk stays below about RetentionBytes plus one segment. The log of committed group offsets
// is compacted once it passes 1 MiB. A consumer that falls further behind than retention loses
// records: cfguard's consumer reports such a gap (stream.Gap). A partition whose every record
// expired keeps its offsets across a restart or a crash, as in Kafka (expired.go).
package broker

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"golang.org/x/sync/semaphore"

	"github.com/cfguard/cfguard/internal/atomicfile"
)

// SASL mechanisms understood by Config.SASL.
const (
	MechanismPlain       = "PLAIN"
	MechanismScramSHA256 = "SCRAM-SHA-256"
	MechanismScramSHA512 = "SCRAM-SHA-512"
)

// SASLConfig makes the broker require SASL authentication of every connection, with a single
// superuser. Its fields match stream.SASL, so one converts to the other.
type SASLConfig struct {
	// Mechanism is "PLAIN", "SCRAM-SHA-256" or "SCRAM-SHA-512".
	Mechanism string
	User      string
	Password  string
}

// Retention defaults. The configuration layer takes its defaults from here.
const (
	// DefaultRetention is how long records are kept: 7 days, Kafka's default.
	DefaultRetention = 7 * 24 * time.Hour
	// DefaultRetentionBytes bounds each partition's log: 256 MiB, about 850,000 records of
	// ~315 bytes (a record of 30 features as the daemon stores it).
	DefaultRetentionBytes = 256 << 20
	// DefaultRetentionCheckInterval is how often retention is applied.
	DefaultRetentionCheckInterval = time.Minute
)

// MaxNodes bounds Config.Nodes.
const MaxNodes = 64

// maxSessionTimeout is kfake's group.max.session.timeout.ms (5 minutes, Kafka's default): the
// upper bound of GroupMinSessionTimeout.
const maxSessionTimeout = 5 * time.Minute

// ErrInvalidConfig marks the errors of Start that come from its Config (a caller reports them
// as usage errors).
var ErrInvalidConfig = errors.New("invalid broker configuration")

// configError is an error of the Config: its text is the cause's, and it matches both the cause
// and ErrInvalidConfig.
type configError struct{ err error }

func (e configError) Error() string   { return e.err.Error() }
func (e configError) Unwrap() []error { return []error{e.err, ErrInvalidConfig} }

// Config configures Start.
type Config struct {
	// Listen is the host:port of node 0. The host must be a loopback address or "localhost";
	// port 0 picks a free port (see Broker.Addrs). Node i listens on the same host, on port+i
	// (or on a free port of its own when port is 0).
	// Default: "127.0.0.1:0".
	Listen string
	// Listener, when set, is node 0's socket, already bound (to Listen); the broker takes it
	// over and closes it. A caller binds it first to learn that the port is busy before it
	// writes any state.
	Listener net.Listener
	// Nodes is the number of broker nodes (1..MaxNodes), node ids 0..Nodes-1. The topics of
	// Topics have partition p led by node p mod Nodes, created or reloaded; topics created by
	// clients get leaders at random, which a reload keeps for partitions holding records (a
	// leader beyond Nodes is replaced at random).
	// Default: 1.
	Nodes int
	// GroupMinSessionTimeout is the shortest session timeout a consumer group member may ask
	// for (Kafka's group.min.session.timeout.ms); a join asking for less is refused.
	// Default: 6s, Kafka's default.
	GroupMinSessionTimeout time.Duration
	// DataDir, when set, makes the broker persist its state there and reload it on Start.
	// Default: "" (memory only; everything is lost on Close).
	DataDir string
	// SyncWrites fsyncs every produced batch before acknowledging it (slower, crash-safe).
	// Default: false.
	SyncWrites bool
	// Topics are created on Start if they do not exist yet (they may exist in DataDir).
	Topics []string
	// Partitions is the partition count of each topic created on Start.
	// Default: 1.
	Partitions int
	// TLS, when set, makes the listener speak TLS only. It must carry a certificate.
	TLS *tls.Config
	// SASL, when set, makes the broker require SASL authentication.
	SASL *SASLConfig
	// Retention is the age (by record timestamp) after which records are deleted.
	// Default: DefaultRetention. Negative: no age limit.
	Retention time.Duration
	// RetentionBytes bounds each partition's log; the oldest records beyond it are deleted.
	// Default: DefaultRetentionBytes. Negative: no size limit.
	RetentionBytes int64
	// RetentionCheckInterval is how often retention is applied.
	// Default: DefaultRetentionCheckInterval.
	RetentionCheckInterval time.Duration
	// MaxConnections bounds the connections open at once, across the nodes; a connection
	// beyond it is accepted and closed at once, and Healthy says so while the broker is full.
	// Default: DefaultMaxConnections.
	MaxConnections int
	// IdleTimeout closes a connection that sends no request for this long while none of its
	// requests is in flight (TLS included: the broker reads requests below it).
	// Default: DefaultIdleTimeout.
	IdleTimeout time.Duration
	// RequestTimeout closes a connection whose request takes longer than this from its first
	// byte to its last, or a response longer to write. Default: DefaultRequestTimeout.
	RequestTimeout time.Duration
	// LimitNames name the settings of MaxConnections and IdleTimeout in the broker's lines and
	// in Healthy, so that they say what to change. Default: the daemon's configuration keys,
	// kafka.embedded_max_connections and kafka.embedded_idle_timeout.
	LimitNames LimitNames

	// bufferedBytes, when not 0, replaces MaxBufferedBytes (tests fill a smaller budget).
	bufferedBytes int64
	// writeFile, when not nil, replaces atomicfile.WriteFile where the start keeps the offsets of
	// empty partitions (tests make it fail, as a full disk would).
	writeFile func(path string, data []byte) error
	// hold, when not 0, replaces maxHold (tests wait less for a request the broker holds).
	hold time.Duration
	// writeFailureHold, when not 0, replaces writeFailureHold (tests wait less for a failed
	// write to stop counting).
	writeFailureHold time.Duration
}

// stateLogCompactBytes bounds the broker's log of group offset commits (see
// retentionConfigs).
const stateLogCompactBytes = 1 << 20

// segmentBytes is the segment size for a retention size: a quarter of it, between 64 KiB and
// 16 MiB, so that deleting whole segments tracks the limit closely.
func (cfg *Config) segmentBytes() int64 {
	if cfg.RetentionBytes < 0 {
		return 16 << 20
	}
	return min(max(cfg.RetentionBytes/4, 64<<10), 16<<20)
}

// retentionConfigs are the kfake broker configs that implement retention (they apply to every
// topic, including topics reloaded from DataDir that were created without them).
func (cfg *Config) retentionConfigs() map[string]string {
	ms := int64(-1)
	if cfg.Retention >= 0 {
		ms = cfg.Retention.Milliseconds()
	}
	return map[string]string{
		"log.retention.ms":    strconv.FormatInt(ms, 10),
		"log.retention.bytes": strconv.FormatInt(max(cfg.RetentionBytes, -1), 10),
		"log.segment.bytes":   strconv.FormatInt(cfg.segmentBytes(), 10),
		// The log of group offset commits is rewritten with the latest commit per partition
		// once it passes this size (kfake's default is 10 MiB).
		"state.log.compact.bytes": strconv.Itoa(stateLogCompactBytes),
	}
}

// Broker is a running embedded broker. Close stops it; so does cancelling the context given
// to Start.
type Broker struct {
	c     *kfake.Cluster
	lns   []*listener // node i's listener at index i
	conns *connLimits // shared by the listeners
	addrs []string
	log   *slog.Logger

	once sync.Once
	stop chan struct{} // closed by Close
	done chan struct{} // closed when the cluster is shut down and the watcher has exited

	// mu guards the cluster against admin calls after shutdown: kfake's admin functions block
	// forever once the cluster has stopped.
	mu     sync.RWMutex
	closed bool

	dataDir         string      // Config.DataDir: "" keeps no files
	recordingFailed atomic.Bool // recordOffsets is failing (logged once per episode)
	writes          *writeHealth
}

// Start validates cfg, starts the broker and creates cfg.Topics. The broker runs until Close
// or until ctx is cancelled.
func Start(ctx context.Context, cfg Config, log *slog.Logger) (*Broker, error) {
	return start(ctx, cfg, log, net.Listen)
}

// start is Start with the function that opens the listening socket (tests inject faults).
func start(ctx context.Context, cfg Config, log *slog.Logger, listen func(network, address string) (net.Listener, error)) (*Broker, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := cfg.applyDefaults(); err != nil {
		return nil, configError{err}
	}
	var lns []*listener // appended to by kfake's calls of ListenFn (node 0, 1, ...), within NewCluster
	writes := &writeHealth{hold: cmp.Or(cfg.writeFailureHold, writeFailureHold)}
	conns := &connLimits{max: cfg.MaxConnections, idle: cfg.IdleTimeout, request: cfg.RequestTimeout, hold: cmp.Or(cfg.hold, maxHold), names: cfg.LimitNames,
		log: log, budget: semaphore.NewWeighted(cmp.Or(cfg.bufferedBytes, MaxBufferedBytes))}
	opts := []kfake.Opt{
		kfake.NumBrokers(cfg.Nodes),
		kfake.ListenFn(func(network, _ string) (net.Listener, error) {
			// kfake asks for 127.0.0.1:<port>; we listen where the config says, through a
			// listener that survives temporary accept errors (kfake's loop would end on them).
			node := len(lns)
			inner := cfg.Listener
			if node > 0 || inner == nil {
				var err error
				if inner, err = listen(network, cfg.nodeAddr(node)); err != nil {
					if cfg.Nodes > 1 {
						err = fmt.Errorf("node %d: %w", node, err)
					}
					return nil, err
				}
			}
			ln := newListener(inner, conns, cfg.TLS, log)
			lns = append(lns, ln)
			return ln, nil
		}),
		kfake.WithLogger(kfakeLogger{log, writes}),
		kfake.ClusterID("cfguard"),
		kfake.BrokerConfigs(cfg.retentionConfigs()),
	}
	if cfg.GroupMinSessionTimeout > 0 {
		opts = append(opts, kfake.GroupMinSessionTimeout(cfg.GroupMinSessionTimeout))
	}
	if cfg.DataDir != "" {
		writeFile := cfg.writeFile
		if writeFile == nil {
			writeFile = atomicfile.WriteFile
		}
		if _, err := keepEmptyPartitionsOffsets(cfg.DataDir, cfg.Nodes, writeFile, log); err != nil {
			return nil, err
		}
		opts = append(opts, kfake.DataDir(cfg.DataDir))
		if cfg.SyncWrites {
			opts = append(opts, kfake.SyncWrites())
		}
	}
	if cfg.SASL != nil {
		opts = append(opts, kfake.EnableSASL(), kfake.Superuser(cfg.SASL.Mechanism, cfg.SASL.User, cfg.SASL.Password))
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		return nil, fmt.Errorf("broker: starting on %s: %w", cfg.Listen, err)
	}
	b := &Broker{c: c, lns: lns, conns: conns, addrs: c.ListenAddrs(), log: log, dataDir: cfg.DataDir, writes: writes,
		stop: make(chan struct{}), done: make(chan struct{})}
	if err := b.ensureTopics(cfg.Topics, int32(cfg.Partitions), int32(cfg.Nodes)); err != nil {
		c.Close()
		return nil, err
	}
	b.record() // the record mirrors the partitions loaded, not those of before (a topic deleted)
	go b.watch(ctx, cfg.RetentionCheckInterval)
	log.Info("Kafka-protocol broker started", "addrs", b.addrs, "nodes", cfg.Nodes, "data_dir", cfg.DataDir,
		"tls", cfg.TLS != nil, "sasl", cfg.SASL != nil, "topics", cfg.Topics,
		"retention", cfg.Retention, "retention_bytes", cfg.RetentionBytes,
		"max_connections", cfg.MaxConnections, "idle_timeout", cfg.IdleTimeout, "request_timeout", cfg.RequestTimeout)
	return b, nil
}

func (cfg *Config) applyDefaults() error {
	cfg.Listen = cmp.Or(cfg.Listen, "127.0.0.1:0")
	host, port, err := net.SplitHostPort(cfg.Listen)
	if err != nil {
		return fmt.Errorf("broker: Listen %q: %w", cfg.Listen, err)
	}
	// A port number only: net.Listen would also take a service name ("http" is port 80).
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("broker: Listen %q: the port must be a number 0..65535 (0: any free port)", cfg.Listen)
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return fmt.Errorf("broker: Listen %q: host must be a loopback address or localhost", cfg.Listen)
	}
	cfg.Nodes = cmp.Or(cfg.Nodes, 1)
	if cfg.Nodes < 1 || cfg.Nodes > MaxNodes {
		return fmt.Errorf("broker: Nodes %d: want 1..%d", cfg.Nodes, MaxNodes)
	}
	if port, _ := strconv.Atoi(cfg.listenPort()); port > 0 && port+cfg.Nodes-1 > 65535 {
		return fmt.Errorf("broker: Listen %q: %d nodes need ports %d..%d, past 65535", cfg.Listen, cfg.Nodes, port, port+cfg.Nodes-1)
	}
	if d := cfg.GroupMinSessionTimeout; d < 0 || d > maxSessionTimeout || (d > 0 && d < time.Millisecond) {
		return fmt.Errorf("broker: GroupMinSessionTimeout %v: want 1ms..%v", d, maxSessionTimeout)
	}
	cfg.Partitions = cmp.Or(cfg.Partitions, 1)
	cfg.Retention = cmp.Or(cfg.Retention, DefaultRetention)
	cfg.RetentionBytes = cmp.Or(cfg.RetentionBytes, DefaultRetentionBytes)
	cfg.RetentionCheckInterval = cmp.Or(cfg.RetentionCheckInterval, DefaultRetentionCheckInterval)
	if cfg.RetentionCheckInterval < 0 {
		return fmt.Errorf("broker: RetentionCheckInterval %v: must be positive", cfg.RetentionCheckInterval)
	}
	cfg.MaxConnections = cmp.Or(cfg.MaxConnections, DefaultMaxConnections)
	cfg.IdleTimeout = cmp.Or(cfg.IdleTimeout, DefaultIdleTimeout)
	cfg.RequestTimeout = cmp.Or(cfg.RequestTimeout, DefaultRequestTimeout)
	if cfg.LimitNames == (LimitNames{}) {
		cfg.LimitNames = LimitNames{MaxConnections: "kafka.embedded_max_connections", IdleTimeout: "kafka.embedded_idle_timeout"}
	}
	if cfg.MaxConnections < 1 {
		return fmt.Errorf("broker: MaxConnections %d: want at least 1", cfg.MaxConnections)
	}
	if cfg.IdleTimeout < 0 || cfg.RequestTimeout < 0 {
		return fmt.Errorf("broker: IdleTimeout %v and RequestTimeout %v must be positive", cfg.IdleTimeout, cfg.RequestTimeout)
	}
	if cfg.Partitions < 0 || cfg.Partitions > 1<<16 {
		return fmt.Errorf("broker: Partitions %d: want 1..65536", cfg.Partitions)
	}
	seen := make(map[string]bool, len(cfg.Topics))
	for _, t := range cfg.Topics {
		if err := CheckTopic(t); err != nil {
			return fmt.Errorf("broker: Topics: %q %w", t, err)
		}
		if seen[t] {
			return fmt.Errorf("broker: Topics: %q is named twice", t)
		}
		seen[t] = true
	}
	if cfg.TLS != nil && len(cfg.TLS.Certificates) == 0 && cfg.TLS.GetCertificate == nil {
		return errors.New("broker: TLS: config has no certificate")
	}
	if s := cfg.SASL; s != nil {
		switch s.Mechanism {
		case MechanismPlain, MechanismScramSHA256, MechanismScramSHA512:
		default:
			return fmt.Errorf("broker: SASL.Mechanism %q: want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", s.Mechanism)
		}
		if s.User == "" || s.Password == "" {
			return errors.New("broker: SASL: User and Password must be set")
		}
	}
	return nil
}

// listenPort is the port of cfg.Listen (validated by applyDefaults).
func (cfg *Config) listenPort() string {
	_, port, _ := net.SplitHostPort(cfg.Listen)
	return port
}

// nodeAddr is the address node i listens on: Listen for node 0; the same host with port+i, or
// with port 0 when Listen's port is 0, for the others.
func (cfg *Config) nodeAddr(i int) string {
	host, _, _ := net.SplitHostPort(cfg.Listen)
	port, _ := strconv.Atoi(cfg.listenPort())
	if port > 0 {
		port += i
	}
	return net.JoinHostPort(host, strconv.Itoa(port))
}

// ensureTopics creates the topics that do not exist yet, and gives partition p of each topic
// named node p mod nodes as its leader, created or reloaded (kfake keeps a leader only for a
// partition that holds records, and picks one at random for the others on a reload). A reloaded
// topic keeps its partition count; a mismatch is logged, not fixed (partitions cannot be
// removed).
func (b *Broker) ensureTopics(topics []string, partitions, nodes int32) error {
	for _, t := range topics {
		if b.c.TopicInfo(t) != nil {
			if n := int32(len(b.c.PartitionInfos(t))); n != partitions {
				b.log.Warn("existing topic has a different partition count", "topic", t, "partitions", n, "configured", partitions)
			}
		} else if err := b.c.CreateTopic(t, partitions, nil); err != nil {
			return fmt.Errorf("broker: creating topic %q: %w", t, err)
		}
		if nodes == 1 {
			continue // node 0 leads everything
		}
		for p := range int32(len(b.c.PartitionInfos(t))) {
			if err := b.c.MoveTopicPartition(t, p, p%nodes); err != nil {
				return fmt.Errorf("broker: topic %q: partition %d to node %d: %w", t, p, p%nodes, err)
			}
		}
	}
	return nil
}

// watch applies retention every interval and shuts the cluster down when ctx is cancelled
// or Close is called.
func (b *Broker) watch(ctx context.Context, interval time.Duration) {
	defer close(b.done)
	t := time.NewTicker(interval)
	defer t.Stop()
wait:
	for {
		select {
		case <-ctx.Done():
			break wait
		case <-b.stop:
			break wait
		case <-t.C:
			b.ApplyRetention()
		}
	}
	b.mu.Lock()
	b.record()
	b.closed = true
	b.c.Close() // persists state when DataDir is set
	b.mu.Unlock()
	b.log.Info("embedded kafka broker stopped", "addrs", b.addrs)
}

// Addrs returns the host:port each node listens on, node i at index i. Any of them bootstraps
// a client.
func (b *Broker) Addrs() []string { return append([]string(nil), b.addrs...) }

// Healthy is nil while the broker runs and accepts connections (also while it retries a
// temporary accept error such as EMFILE); otherwise it says why Kafka clients cannot connect:
// the broker stopped, its listener failed for good, or it is at its connection limit.
func (b *Broker) Healthy() error {
	b.mu.RLock()
	closed := b.closed
	b.mu.RUnlock()
	if closed {
		return fmt.Errorf("embedded broker on %s stopped", strings.Join(b.addrs, ","))
	}
	errs := []error{b.conns.full(), b.writes.err(b.dataDir, time.Now())}
	for _, ln := range b.lns {
		errs = append(errs, ln.healthy())
	}
	return errors.Join(errs...)
}

// WriteFailing says whether the broker failed to write its data directory within the last
// minute (what Healthy reports): a full or read-only disk, on which it refuses every record
// produced.
func (b *Broker) WriteFailing() bool { return b.writes.failing(time.Now()) }

// Connections returns the connection counters.
func (b *Broker) Connections() ConnStats { return b.conns.stats() }

// Done is closed once the broker has stopped (after Close, or after Start's context ends).
func (b *Broker) Done() <-chan struct{} { return b.done }

// Close stops the broker, persists its state when DataDir is set, and waits until it has
// stopped. It is safe to call more than once and after the context was cancelled.
func (b *Broker) Close() {
	b.once.Do(func() { close(b.stop) })
	<-b.done
}

// ApplyRetention deletes the records past retention now, instead of at the next check, and,
// with DataDir, records every partition's high watermark there (record), so that a partition it
// empties keeps its offsets after a crash. It does nothing once the broker has stopped.
func (b *Broker) ApplyRetention() {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.closed {
		return
	}
	b.c.ApplyRetention()
	b.record()
}

// record writes every partition's high watermark with DataDir (recordOffsets), logging a
// failure once per episode; the broker is running, and the caller holds b.mu or is Start.
func (b *Broker) record() {
	if b.dataDir == "" {
		return
	}
	if err := b.recordOffsets(); err != nil {
		if !b.recordingFailed.Swap(true) {
			b.log.Error("cannot record the partitions' offsets; a partition whose every record expired may restart at offset 0 after a crash",
				"file", filepath.Join(b.dataDir, offsetsFile), "err", err)
		}
	} else if b.recordingFailed.Swap(false) {
		b.log.Info("the partitions' offsets are recorded again", "file", filepath.Join(b.dataDir, offsetsFile))
	}
}

// LogStartOffsets returns, per partition, the first offset still stored (records before it
// were deleted by retention), or nil when the topic does not exist or the broker has stopped.
func (b *Broker) LogStartOffsets(topic string) []int64 {
	return b.perPartition(topic, func(p *kfake.PartitionInfo) int64 { return p.LogStartOffset })
}

// Leaders returns, per partition, the id of the node that leads it (the index of its address in
// Addrs), or nil when the topic does not exist or the broker has stopped.
func (b *Broker) Leaders(topic string) []int32 {
	out := b.perPartition(topic, func(p *kfake.PartitionInfo) int64 { return int64(p.Leader) })
	if out == nil {
		return nil
	}
	nodes := make([]int32, len(out))
	for i, n := range out {
		nodes[i] = int32(n)
	}
	return nodes
}

// HighWatermarks returns, per partition, the offset the next produced record will get, or
// nil when the topic does not exist or the broker has stopped. Tests use it to wait for
// records to land.
func (b *Broker) HighWatermarks(topic string) []int64 {
	return b.perPartition(topic, func(p *kfake.PartitionInfo) int64 { return p.HighWatermark })
}

func (b *Broker) perPartition(topic string, get func(*kfake.PartitionInfo) int64) []int64 {
	b.mu.RLock()
	defer b.mu.RUnlock()
	if b.closed {
		return nil
	}
	infos := b.c.PartitionInfos(topic)
	if infos == nil {
		return nil
	}
	out := make([]int64, len(infos))
	for _, p := range infos {
		if int(p.Partition) < len(out) {
			out[p.Partition] = get(p)
		}
	}
	return out
}

// kfakeLogger forwards kfake's warnings and errors to slog; its info and debug lines (one per
// request) are dropped.
// kfakeLogger passes kfake's warnings and errors to log, and its failed writes to writes.
type kfakeLogger struct {
	log    *slog.Logger
	writes *writeHealth
}

func (l kfakeLogger) Logf(level kfake.LogLevel, format string, args ...any) {
	if level != kfake.LogLevelError && level != kfake.LogLevelWarn {
		return
	}
	msg := fmt.Sprintf(format, args...)
	l.writes.logged(msg, time.Now())
	if level == kfake.LogLevelError {
		l.log.Error("kfake: " + msg)
	} else {
		l.log.Warn("kfake: " + msg)
	}
}

// CheckTopic applies Kafka's rules for topic names: 1 to 249 of [a-zA-Z0-9._-], and neither "."
// nor "..".
func CheckTopic(name string) error {
	if name == "" {
		return errors.New("must name a topic")
	}
	if len(name) > 249 {
		return fmt.Errorf("is %d characters long; Kafka allows at most 249", len(name))
	}
	if name == "." || name == ".." {
		return errors.New(`is "." or "..", which Kafka refuses as a topic name`)
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("holds %q; Kafka topic names may hold only a-z, A-Z, 0-9, '.', '_' and '-'", r)
		}
	}
	return nil
}
