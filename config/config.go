// Package config loads cfguard's YAML configuration strictly: unknown keys are errors, defaults
// are applied before unmarshalling (so an absent key keeps its default), and every validation
// error names the key and the offending value.
//
// Files: config.go (the keys, as Go types, and Default), load.go (Load and LoadFile: strict
// decoding, the line of each key, suggestions for a misspelt one), validate.go (Validate: values,
// forms and limits), files.go (the checks of the files the keys name: tokens, the model, the web
// configuration), cluster.go (the scope of each key: which the replicas must share).
package config

import (
	"fmt"
	"log/slog"
	"math"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/stream"
	"github.com/cfguard/cfguard/update"
)

// Config is the whole daemon configuration. Key names are a stable contract (scripts rely on
// http.listen, state_dir, kafka.brokers, kafka.embedded_listen, kafka.topic,
// kafka.dead_letter_topic, kafka.events_topic, certify.delta, certify.epsilon).
type Config struct {
	HTTP     HTTP    `yaml:"http"`
	StateDir string  `yaml:"state_dir"` // Default: ./state. Holds cfguard.db, the model and the embedded broker's data.
	Model    Model   `yaml:"model"`
	Kafka    Kafka   `yaml:"kafka"`
	Update   Update  `yaml:"update"`
	Certify  Certify `yaml:"certify"`
	Explain  Explain `yaml:"explain"`
	Audit    Audit   `yaml:"audit"`
	Log      Log     `yaml:"log"`
	// Replication runs cfguard as one of several replicas that share one posterior through
	// Kafka (docs/DESIGN.md). Off by default: a single daemon.
	Replication Replication `yaml:"replication"`

	empty bool // the text held no keys: every value is a default
}

// Empty reports whether the configuration text held no keys, so that every value is a default.
func (c *Config) Empty() bool { return c.empty }

// HTTP configures the API server.
type HTTP struct {
	Listen string `yaml:"listen"` // Default: 127.0.0.1:8080.
	// Token, when set, is required as "Authorization: Bearer <token>" on every /v1/ endpoint
	// and, as that header or the web UI's session cookie, on /ui/ (stored CEs hold applicants'
	// features). Default: empty (no auth). The environment variable
	// CFGUARD_HTTP_TOKEN overrides it.
	Token string `yaml:"token"`
	// MetricsToken, when set, is required as a bearer token on /metrics (Prometheus:
	// authorization.credentials). Default: empty (/metrics open, like /healthz and /readyz).
	// CFGUARD_HTTP_METRICS_TOKEN overrides it.
	MetricsToken    string        `yaml:"metrics_token"`
	ShutdownTimeout time.Duration `yaml:"shutdown_timeout"` // Default: 10s.
	MaxBodyBytes    int64         `yaml:"max_body_bytes"`   // Default: 1 MiB.
	// ReadHeaderTimeout bounds reading a request's headers. Default: 10s.
	ReadHeaderTimeout time.Duration `yaml:"read_header_timeout"`
	// ReadTimeout bounds reading a whole request, headers and body: a client sending its body
	// slowly is answered 408 and cut when it runs out, so it cannot hold a connection. It must
	// leave time for max_body_bytes at the slowest client rate to serve. Default: 30s.
	ReadTimeout time.Duration `yaml:"read_timeout"`
	// WriteTimeout bounds writing a response, from the end of the request's headers. POST
	// /v1/explain extends it by explain.timeout; GET /v1/backup lifts it (it streams the whole
	// ledger). Default: 2m.
	WriteTimeout time.Duration `yaml:"write_timeout"`
	// IdleTimeout closes a keep-alive connection that waits this long for its next request.
	// Default: 2m.
	IdleTimeout time.Duration `yaml:"idle_timeout"`
	// MaxConnections bounds the connections the API holds open, so that a flood cannot exhaust
	// the process's file descriptors (the ledger and the embedded broker need theirs); further
	// connections wait in the kernel's backlog until read_timeout or idle_timeout frees a slot.
	// Default: 1024.
	MaxConnections int `yaml:"max_connections"`
	// MaxPredictInputs bounds the inputs of the POST /v1/predict requests admitted at once
	// (running or waiting for a shared engine call); a request that would pass it is answered
	// 429 with Retry-After at once, except when none is admitted (so that a request of up to
	// 10^4 inputs is always served alone). Counting inputs, not requests, lets many clients of a
	// few inputs share batched engine calls while bounding the queue's work. Default: 0, meaning
	// 10^4 per CPU the daemon may use (GOMAXPROCS): at most about what that many requests of the
	// largest size would take, each on a core.
	MaxPredictInputs int `yaml:"max_predict_inputs"`
	// IdempotencyWindow is how long the ledger keeps the outcome of a registration sent with an
	// Idempotency-Key (and, on a replica, of every request of the CE topic it applied): a retry
	// within it answers that outcome and stores nothing again; after it, the key is forgotten.
	// Default: 24h.
	IdempotencyWindow time.Duration `yaml:"idempotency_window"`
	// WebConfigFile is a Prometheus exporter-toolkit web configuration file
	// (tls_server_config, client CAs for mTLS, basic_auth_users, http_server_config): it serves
	// the API, /metrics and the probes over TLS, and is reread on every new connection, so a
	// replaced certificate is served without a restart. Default: empty (plain HTTP).
	WebConfigFile string `yaml:"web_config_file"`
}

// Model says where the posterior comes from on first start.
type Model struct {
	// Path is a model directory (model.safetensors + model.json). Default: empty, meaning: train
	// on the bundled Dataset at first start. Later starts resume from the state store.
	Path    string `yaml:"path"`
	Dataset string `yaml:"dataset"` // Default: breast_cancer (bundled).
	Seed    uint64 `yaml:"seed"`    // Default: 1.
	Epochs  int    `yaml:"epochs"`  // Default: 0 = the trainer's default.
	// ExportDir receives each promoted posterior in the format Path reads (model.safetensors +
	// model.json, each written atomically), for a model server on a shared volume. It is an
	// export of the ledger's posterior, never read back. Default: empty = <state_dir>/export.
	ExportDir string `yaml:"export_dir"`
}

// Kafka configures the input stream, dead letters and events.
type Kafka struct {
	// Brokers of a real cluster. Default: empty, meaning: start the embedded Kafka-protocol broker.
	Brokers         []string `yaml:"brokers"`
	EmbeddedListen  string   `yaml:"embedded_listen"`   // Default: 127.0.0.1:9092.
	Topic           string   `yaml:"topic"`             // Default: cfguard.records.
	DeadLetterTopic string   `yaml:"dead_letter_topic"` // Default: cfguard.records.dlq.
	EventsTopic     string   `yaml:"events_topic"`      // Default: cfguard.events.
	GroupID         string   `yaml:"group_id"`          // Default: cfguard.
	ClientID        string   `yaml:"client_id"`         // Default: cfguard.
	MaxRecords      int      `yaml:"max_records"`       // Records per increment. Default: stream.DefaultMaxRecords (64).
	// MaxRecordsBacklog is the most records per increment while the consumer is behind.
	// Default: stream.DefaultMaxRecordsBacklog (1024).
	MaxRecordsBacklog int           `yaml:"max_records_backlog"`
	MaxWait           time.Duration `yaml:"max_wait"`         // Longest an increment stays open. Default: stream.DefaultMaxWait (5s).
	MaxRecordBytes    int           `yaml:"max_record_bytes"` // Larger records are dead-lettered. Default: 65536.
	// EmbeddedRetention is how long the embedded broker keeps records. Default:
	// broker.DefaultRetention (168h). Negative: no age limit.
	EmbeddedRetention time.Duration `yaml:"embedded_retention"`
	// EmbeddedRetentionBytes bounds each partition of the embedded broker. Default:
	// broker.DefaultRetentionBytes (256 MiB). Negative: no size limit.
	EmbeddedRetentionBytes int64 `yaml:"embedded_retention_bytes"`
	TLS                    TLS   `yaml:"tls"`
	SASL                   SASL  `yaml:"sasl"`

	// EmbeddedMaxConnections bounds the connections the embedded broker holds open; one beyond
	// it is closed at once and /readyz says the broker is full, so that a flood of connections
	// cannot take the process's file descriptors (the API and the ledger need theirs). Default:
	// broker.DefaultMaxConnections (1024).
	EmbeddedMaxConnections int `yaml:"embedded_max_connections"`
	// EmbeddedIdleTimeout closes an embedded broker connection that sends no request for this
	// long while none of its requests is in flight (Kafka clients reconnect by themselves).
	// Default: broker.DefaultIdleTimeout (2m).
	EmbeddedIdleTimeout time.Duration `yaml:"embedded_idle_timeout"`
	// EmbeddedRequestTimeout closes an embedded broker connection whose request takes longer
	// than this from its first byte to its last, or whose response takes longer to write.
	// Default: broker.DefaultRequestTimeout (30s).
	EmbeddedRequestTimeout time.Duration `yaml:"embedded_request_timeout"`
}

// TLS for the connection to kafka.brokers (the embedded broker speaks plain Kafka on loopback:
// TLS and SASL are refused without kafka.brokers).
type TLS struct {
	Enabled            bool   `yaml:"enabled"`
	CAFile             string `yaml:"ca_file"`
	CertFile           string `yaml:"cert_file"`
	KeyFile            string `yaml:"key_file"`
	InsecureSkipVerify bool   `yaml:"insecure_skip_verify"`
}

// SASL credentials for Kafka.
type SASL struct {
	Mechanism string `yaml:"mechanism"` // "", PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.
	Username  string `yaml:"username"`
	Password  string `yaml:"password"` // CFGUARD_KAFKA_SASL_PASSWORD overrides it.
}

// Update configures last-layer updates (docs/MATHS.md, "The streaming update").
type Update struct {
	// Objective is vcl (default: the negative ELBO of the increment under the previous
	// posterior, flattened by the memory) or prior (the paper's: KL to N(0, prior_sigma^2),
	// divided by the records the posterior stands for).
	Objective string `yaml:"objective"`
	// Solver is converge (default: minimise the objective until its gradient is within
	// Tolerance) or adam (the paper's protocol: Iterations Adam steps at LearningRate).
	Solver string `yaml:"solver"`
	// MemoryRecords bounds the records the posterior stands for (stabilised forgetting with
	// lambda = exp(-n / memory_records) per increment of n records); 0 keeps every record.
	// Default: DefaultMemoryRecords.
	MemoryRecords float64 `yaml:"memory_records"`
	// Tolerance is the converge solver's stopping rule, in previous-posterior standard
	// deviations. Default: update.DefaultTolerance.
	Tolerance float64 `yaml:"tolerance"`
	// MaxIterations caps the converge solver's iterations (a safety net). Default:
	// update.DefaultMaxIterations.
	MaxIterations int `yaml:"max_iterations"`
	// Draws is the converge solver's fixed body draws per increment. Default: update.DefaultDraws.
	Draws int `yaml:"draws"`
	// LearningRate is the adam solver's step size. Default: 1e-5 (the paper's).
	LearningRate float64 `yaml:"learning_rate"`
	// Iterations is the adam solver's number of iterations. Default: update.DefaultIterations.
	Iterations int `yaml:"iterations"`
	// KLWeight scales the objective's KL term. Default: DefaultKLWeight (8), whatever the
	// objective; 0 means the objective's own weight (bnn.DefaultKLWeight for prior,
	// update.DefaultVCLKLWeight for vcl).
	KLWeight float64 `yaml:"kl_weight"`
	Samples  int     `yaml:"samples"` // adam: weight draws per iteration's NLL. Default: update.DefaultSamples.
	Seed     uint64  `yaml:"seed"`    // Default: 1.
}

// Step returns the update of prev on n records with these settings and the seed: the posterior
// to start from (prev, or a copy of it with its records stated when it does not record them)
// and the update's configuration. The daemon and verify-log both use it, so that a replay
// computes what the daemon computed.
func (u Update) Step(prev *bnn.Model, n int, seed uint64) (*bnn.Model, update.Config) {
	if prev.Records == 0 {
		stated := *prev // shallow: only Records differs, and nothing writes through the copy
		stated.Records = UnknownRecords
		if u.MemoryRecords > 0 {
			stated.Records = u.MemoryRecords
		}
		prev = &stated
	}
	c := update.Config{Objective: u.Objective, Solver: u.Solver, Memory: u.MemoryRecords, Tolerance: u.Tolerance,
		MaxIterations: u.MaxIterations, Draws: u.Draws, LR: u.LearningRate, Iterations: u.Iterations,
		KLWeight: u.KLWeight, Samples: u.Samples, Seed: seed}
	if u.Objective == update.ObjectivePrior {
		// The prior objective divides its KL by the records the new posterior stands for, as
		// training divides by its rows.
		c.Represented = update.Represented(prev.Records, n, u.MemoryRecords)
	}
	return prev, c
}

// UnknownRecords is the number of records a posterior that does not record it (a model file, or
// a ledger or posterior log written before posteriors carried it) is taken to stand for when
// update.memory_records is 0. With a memory it is taken to stand for memory_records records,
// the steady state of a posterior that has learned for long.
const UnknownRecords = 1000

// Defaults of the streaming update, chosen by measurement (docs/MATHS.md, "The streaming
// update"): DefaultKLWeight is the default update.kl_weight (each streamed record counts 1/8 of
// a record: the largest single-increment KL under correct labels, in increments of 10 to 64
// records, stays under a quarter of the budget), DefaultMemoryRecords the default
// update.memory_records.
const (
	DefaultKLWeight      = 8
	DefaultMemoryRecords = 50000
)

// Certify configures the guarantee.
type Certify struct {
	// Delta: a CE is registered as certified when the lower confidence bound of p1 (at
	// certify.verdict_alpha) is at least 1 - delta. Default: 0.05 (KL budget 0.10125).
	Delta float64 `yaml:"delta"`
	// Epsilon: and when Var1 <= epsilon. Default: 0.01.
	Epsilon float64 `yaml:"epsilon"`
	// EpsilonMax is the variance a certified CE may reach under Theorem 2. Default: 0.25 (any
	// [0,1]-valued variance), i.e. only Theorem 1 constrains; lower it to make Theorem 2 bite.
	EpsilonMax float64      `yaml:"epsilon_max"`
	Mode       certify.Mode `yaml:"mode"`    // paper or tight. Default: paper.
	Samples    int          `yaml:"samples"` // Monte-Carlo samples for p and Var. Default: certify.DefaultSamples.
	// Precision of the Monte-Carlo forward passes: float64, or float32 (about twice as fast; its
	// rounding moves p by at most 1.6e-4 on the paper's architecture in bnn's test, measured
	// 2.3e-8, far under the Monte-Carlo error; see bnn.Precision). The posterior, KL and bounds
	// stay float64. Default: float64.
	Precision bnn.Precision `yaml:"precision"`
	// HoeffdingAlpha > 0 starts certificates from the Hoeffding lower confidence bound of p1 at
	// confidence 1 - alpha. Default: 0 (off, as in the paper).
	HoeffdingAlpha float64 `yaml:"hoeffding_alpha"`
	// VerdictAlpha is the miss probability of the one-sided empirical Bernstein bounds on p that
	// renew lapsed certificates (lower(p) >= 1 - delta) and decide verdicts (invalidated when
	// upper(p) < 1/2, back to at_risk when lower(p) >= 1/2). Default: certify.DefaultVerdictAlpha.
	VerdictAlpha float64 `yaml:"verdict_alpha"`
	// OnBreach is the policy when a step's KL exceeds the budget: alert (promote and alert),
	// reject (keep the old posterior, hold the increment, alert), clip (scale the step down to the
	// budget). Default: alert.
	OnBreach certify.OnBreach `yaml:"on_breach"`
	// Uncertified: what to do with a registered CE outside the <delta, epsilon>-set: refuse or
	// store (as uncertified). Default: refuse.
	Uncertified certify.OutsideSet `yaml:"uncertified"`
}

// Explain configures counterfactual generation.
type Explain struct {
	Timeout       time.Duration `yaml:"timeout"`        // Per request. Default: 60s.
	MaxIterations int           `yaml:"max_iterations"` // Default: 2000 (the paper's).
	Concurrency   int           `yaml:"concurrency"`    // Generations at once. Default: 0, one per core (GOMAXPROCS).
	// Reissue, when set (invalidated or at_risk), makes the daemon generate a new robust CE for
	// the x of every CE that reaches that status (or, for at_risk, a worse one), in the
	// background, and publish counterfactual_reissued (old id -> new id) or
	// counterfactual_reissue_failed. Default: "" (off).
	Reissue string `yaml:"reissue"`
}

// Audit configures the scheduled full re-certification.
type Audit struct {
	Schedule string `yaml:"schedule"` // robfig/cron spec. Default: "@every 1h". Empty string disables.
	// Workers is how many cores an audit's Monte-Carlo runs on, and how many lanes the confirmer
	// runs in (one core each, each measuring its own CEs). Default: 0, every core but one (at
	// least one), so that ingestion keeps a core while they run.
	Workers int `yaml:"workers"`
}

// Replication configures replicas sharing one posterior log (docs/DESIGN.md).
type Replication struct {
	// Enabled makes this daemon a replica: it follows the posterior log on PosteriorTopic and
	// computes updates only while the consumer group <kafka.group_id>.updater assigns it the
	// log's partition. It needs kafka.brokers (a cluster the replicas share). Default: false.
	Enabled bool `yaml:"enabled"`
	// ReplicaID names this replica in the log's claims, in logs and metrics. Default: "" (the
	// host name).
	ReplicaID string `yaml:"replica_id"`
	// PosteriorTopic is the posterior log: one partition, never compacted, kept for ever.
	// Default: cfguard.posterior.
	PosteriorTopic string `yaml:"posterior_topic"`
	// CETopic holds registration and deletion requests, keyed by CE id. Its partitions are
	// shared out to the replicas by the consumer group <kafka.group_id>.ce; each replica keeps,
	// re-certifies, confirms and audits the CEs of the partitions it owns. Default: cfguard.ce.
	CETopic string `yaml:"ce_topic"`
	// CEPartitions is the CE topic's partition count when cfguard creates it: the most replicas
	// that can share the CEs. Default: 12.
	CEPartitions int `yaml:"ce_partitions"`
	// AdvertiseURL is how the other replicas reach this one's API, to answer for the CEs it
	// owns. Default: "" (the API's bound address, <host name>:<port> when http.listen is every
	// interface; https:// when http.web_config_file serves TLS, else http://). The environment variable
	// CFGUARD_REPLICATION_ADVERTISE_URL overrides it (Kubernetes: the pod's IP from the downward
	// API).
	AdvertiseURL string `yaml:"advertise_url"`
	// SessionTimeout is the updater group's session timeout: how long a replica that stopped
	// heartbeating keeps the updater role before another takes it over. Default: 10s.
	SessionTimeout time.Duration `yaml:"session_timeout"`
	// HeartbeatInterval is how often a replica heartbeats to the updater group. It must be
	// below session_timeout (a third of it or less is usual). Default: 1s.
	HeartbeatInterval time.Duration `yaml:"heartbeat_interval"`
	// KeyFile is the cluster key file that every replica shares: lines "<id>:<hex key>" (at
	// least 32 bytes each); the first key signs what this replica writes to the posterior and
	// CE topics, every key verifies what it reads (package internal/clusterkey). Required with
	// enabled; `cfguard gen-key` makes one. The environment variable
	// CFGUARD_REPLICATION_KEY_FILE overrides it (Kubernetes: a mounted Secret). Default: "".
	KeyFile string `yaml:"key_file"`
	// RegisterWait is how long a registration or deletion accepted by this replica waits for the
	// owner of its CE's partition to apply it before it is answered 202 (accepted, not applied
	// yet: GET its Location later), and how long a prediction with min_version waits for the
	// daemon to apply that version (on a single daemon too). 0 answers 202 at once; a wait must
	// end at least RegisterSendMargin before http.write_timeout. Default: 10s.
	RegisterWait time.Duration `yaml:"register_wait"`
	// SkipCERequests are requests of the CE topic that no build of the cluster reads (a newer
	// build's, after the upgrade was rolled back; or one written wrongly), each named by its
	// partition and offset (and id) as GET /v1/model's replication.ce_partitions_blocked names
	// it, or by a range of offsets: an owner whose partition is blocked at one skips it instead,
	// and the registration or deletion it holds is lost (send it again). Read at start; every
	// replica needs them, as a partition that moves replays its requests. Default: none.
	SkipCERequests CERequests `yaml:"skip_ce_requests"`
	// PeerTLS is how this replica speaks TLS to the other replicas' APIs (their https://
	// advertise URLs): the CAs that sign their server certificates, and the client certificate
	// it presents where their http.web_config_file requires one (client_auth_type). Read at
	// start. Default: none (the system's roots, no client certificate).
	PeerTLS PeerTLS `yaml:"peer_tls"`
}

// CERequest names requests of the CE topic to skip (replication.skip_ce_requests): the one at
// Offset of Partition, or, with Through, every one from Offset to Through; with ID, only those
// whose CE id it is.
type CERequest struct {
	Partition int    `yaml:"partition"`
	Offset    int64  `yaml:"offset"`
	Through   int64  `yaml:"through,omitempty"` // the last offset of a range; 0: Offset alone
	ID        string `yaml:"id,omitempty"`
}

// CERequests are replication.skip_ce_requests.
type CERequests []CERequest

// UnmarshalYAML refuses an item that is not a mapping (null included), then reads each item.
func (rs *CERequests) UnmarshalYAML(n *yaml.Node) error {
	n = resolved(n)
	if n.Kind != yaml.SequenceNode {
		return fmt.Errorf("want a list of {partition: P, offset: O}, got %s", nodeKind(n))
	}
	out := make(CERequests, len(n.Content))
	for i, item := range n.Content {
		if err := out[i].UnmarshalYAML(item); err != nil {
			return err
		}
	}
	*rs = out
	return nil
}

// resolved is n, or the node an alias n refers to.
func resolved(n *yaml.Node) *yaml.Node {
	if n.Kind == yaml.AliasNode {
		return n.Alias
	}
	return n
}

// decimal is a whole number as people write one: digits, no sign, no leading zero (yaml would
// read 012 as 10, 0x12 as 18 and 1_200 as 1200).
var decimal = regexp.MustCompile(`^(0|[1-9][0-9]*)$`)

// UnmarshalYAML reads {partition: P, offset: O} with, optionally, through: and id: — partition
// and offset required, whole decimal numbers, a through not below offset, an id not empty, and
// nothing else — as a request skipped by mistake is lost (a misspelt key must not leave an
// offset of 0).
func (r *CERequest) UnmarshalYAML(n *yaml.Node) error {
	n = resolved(n)
	line := n.Line
	if n.Kind != yaml.MappingNode {
		return fmt.Errorf("item on line %d: want {partition: P, offset: O}, got %s", line, nodeKind(n))
	}
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], resolved(n.Content[i+1])
		if seen[k.Value] {
			return fmt.Errorf("item on line %d: %s given twice (again on line %d)", line, k.Value, k.Line)
		}
		seen[k.Value] = true
		if v.Kind != yaml.ScalarNode || v.Tag == "!!null" {
			return fmt.Errorf("item on line %d: %s: want a value, got %s", line, k.Value, nodeKind(v))
		}
		if k.Value == "id" {
			if v.Value == "" {
				return fmt.Errorf("item on line %d: an empty id names no request; remove the key to name every id", line)
			}
			r.ID = v.Value // an id of digits (123) is an id as any: yaml's type for it does not matter
			continue
		}
		var dst *int64
		var p int64
		switch k.Value {
		case "partition":
			dst = &p
		case "offset":
			dst = &r.Offset
		case "through":
			dst = &r.Through
		default:
			return fmt.Errorf("item on line %d: unknown key %q (want partition, offset, and optionally through and id)", line, k.Value)
		}
		if !decimal.MatchString(v.Value) {
			return fmt.Errorf("item on line %d: %s %q: want a whole number of decimal digits", line, k.Value, v.Value)
		}
		x, err := strconv.ParseInt(v.Value, 10, 64)
		if k.Value == "partition" && (err != nil || x > math.MaxInt32) {
			return fmt.Errorf("item on line %d: partition %s is out of range (at most replication.ce_partitions - 1)", line, v.Value)
		}
		if err != nil {
			return fmt.Errorf("item on line %d: %s %s is out of range (at most %d)", line, k.Value, v.Value, int64(math.MaxInt64))
		}
		*dst = x
		if k.Value == "partition" {
			r.Partition = int(x)
		}
	}
	if !seen["partition"] || !seen["offset"] {
		return fmt.Errorf("item on line %d: want both partition and offset", line)
	}
	if seen["through"] && r.Through < r.Offset {
		return fmt.Errorf("item on line %d: through %d is below offset %d: through is the last offset of the range", line, r.Through, r.Offset)
	}
	return nil
}

// RegisterSendMargin is how much of http.write_timeout a replicated registration or deletion may
// spend before it waits for its owner (replication.register_wait): its measurement, and its
// send to the CE topic, which is retried for up to 10 s.
const RegisterSendMargin = 15 * time.Second

// PeerTLS is a replica's TLS client configuration toward its peers, as files (PEM).
type PeerTLS struct {
	// CAFile holds the certificates of the CAs that may sign the peers' server certificates.
	// Default: "" (the system's roots).
	CAFile string `yaml:"ca_file"`
	// CertFile and KeyFile are the client certificate and key presented to a peer that asks for
	// one. Both or neither. Default: "" (none).
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
}

// Files is p as stream.LoadTLSAt reads it: TLS settings of their own when any file is named.
func (p PeerTLS) Files() stream.TLSFiles {
	return stream.TLSFiles{Enabled: p != PeerTLS{}, CAFile: p.CAFile, CertFile: p.CertFile, KeyFile: p.KeyFile}
}

// Log configures log/slog.
type Log struct {
	Level  slog.Level `yaml:"level"`  // debug, info, warn, error. Default: info.
	Format LogFormat  `yaml:"format"` // text or json. Default: text.
}

// LogFormat is log.format: the log/slog handler.
type LogFormat string

// Log formats.
const (
	LogText LogFormat = "text" // slog.TextHandler: key=value lines
	LogJSON LogFormat = "json" // slog.JSONHandler: one JSON object per line
)

// UnmarshalText accepts text or json.
func (f *LogFormat) UnmarshalText(b []byte) error {
	switch v := LogFormat(b); v {
	case LogText, LogJSON:
		*f = v
		return nil
	}
	return fmt.Errorf("unknown log format %q (want text or json)", b)
}

// Default returns the configuration with every default applied.
func Default() Config {
	return Config{
		HTTP: HTTP{Listen: "127.0.0.1:8080", ShutdownTimeout: 10 * time.Second, MaxBodyBytes: 1 << 20,
			ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second, WriteTimeout: 2 * time.Minute,
			IdleTimeout: 2 * time.Minute, MaxConnections: 1024, IdempotencyWindow: 24 * time.Hour},
		StateDir: "./state",
		Model:    Model{Dataset: "breast_cancer", Seed: 1},
		Kafka: Kafka{EmbeddedListen: "127.0.0.1:9092", Topic: "cfguard.records", DeadLetterTopic: "cfguard.records.dlq",
			EventsTopic: "cfguard.events", GroupID: "cfguard", ClientID: "cfguard", MaxRecords: stream.DefaultMaxRecords,
			MaxRecordsBacklog: stream.DefaultMaxRecordsBacklog, MaxWait: stream.DefaultMaxWait, MaxRecordBytes: 65536,
			EmbeddedRetention: broker.DefaultRetention, EmbeddedRetentionBytes: broker.DefaultRetentionBytes,
			EmbeddedMaxConnections: broker.DefaultMaxConnections, EmbeddedIdleTimeout: broker.DefaultIdleTimeout,
			EmbeddedRequestTimeout: broker.DefaultRequestTimeout},
		Update: Update{Objective: update.ObjectiveVCL, Solver: update.SolverConverge, MemoryRecords: DefaultMemoryRecords, KLWeight: DefaultKLWeight,
			Tolerance: update.DefaultTolerance, MaxIterations: update.DefaultMaxIterations, Draws: update.DefaultDraws,
			LearningRate: update.DefaultLR, Iterations: update.DefaultIterations, Samples: update.DefaultSamples, Seed: 1},
		Certify: Certify{Delta: 0.05, Epsilon: 0.01, EpsilonMax: certify.DefaultEpsilonMax, Mode: certify.Paper, Samples: certify.DefaultSamples, VerdictAlpha: certify.DefaultVerdictAlpha, OnBreach: certify.Alert, Uncertified: certify.Refuse},
		Explain: Explain{Timeout: 60 * time.Second, MaxIterations: 2000, Concurrency: 0},
		Audit:   Audit{Schedule: "@every 1h"},
		Log:     Log{Level: slog.LevelInfo, Format: LogText},
		Replication: Replication{PosteriorTopic: "cfguard.posterior", CETopic: "cfguard.ce", CEPartitions: 12, SessionTimeout: 10 * time.Second,
			HeartbeatInterval: time.Second, RegisterWait: 10 * time.Second, SkipCERequests: CERequests{}},
	}
}

// ExportDir is model.export_dir, or <state_dir>/export when it is empty.
func (c *Config) ExportDir() string {
	if c.Model.ExportDir != "" {
		return c.Model.ExportDir
	}
	return filepath.Join(c.StateDir, "export")
}

// Embedded reports whether the daemon should start its own broker.
func (c *Config) Embedded() bool { return len(c.Kafka.Brokers) == 0 }

// redacted replaces a secret's value when a configuration is printed.
const redacted = "<redacted>"

// YAML renders the effective configuration: every key with its value (defaults included),
// durations as Go duration strings ("10s"), secrets that are set replaced by "<redacted>".
// Load of the output (with the secrets put back) gives the same configuration.
func (c *Config) YAML() ([]byte, error) {
	r := *c
	if r.HTTP.Token != "" {
		r.HTTP.Token = redacted
	}
	if r.HTTP.MetricsToken != "" {
		r.HTTP.MetricsToken = redacted
	}
	if r.Kafka.SASL.Password != "" {
		r.Kafka.SASL.Password = redacted
	}
	var n yaml.Node
	if err := n.Encode(&r); err != nil {
		return nil, err
	}
	durationsAsText(&n, reflect.ValueOf(r))
	return yaml.Marshal(&n)
}

// durationsAsText rewrites the nodes of time.Duration fields (which yaml encodes as integer
// nanoseconds) as duration strings, walking the node tree beside the struct it was encoded from.
func durationsAsText(n *yaml.Node, v reflect.Value) {
	if v.Type() == reflect.TypeFor[time.Duration]() {
		n.Tag, n.Value = "", time.Duration(v.Int()).String()
		return
	}
	if v.Kind() != reflect.Struct || n.Kind != yaml.MappingNode {
		return
	}
	t := v.Type()
	for i := 0; i+1 < len(n.Content); i += 2 {
		for j := 0; j < t.NumField(); j++ {
			if name, _, _ := strings.Cut(t.Field(j).Tag.Get("yaml"), ","); name == n.Content[i].Value {
				durationsAsText(n.Content[i+1], v.Field(j))
			}
		}
	}
}
