// Package config loads cfguard's YAML configuration strictly: unknown keys are errors, defaults
// are applied before unmarshalling (so an absent key keeps its default), and every validation
// error names the key and the offending value.
package config

import (
	"bytes"
	"encoding"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/exporter-toolkit/web"
	"github.com/robfig/cron/v3"
	"go.yaml.in/yaml/v3"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/ident"
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

// MinCertifySamples is the fewest Monte-Carlo draws with which a measurement can meet the
// renewal rule (certify.Renewable) at all: the empirical Bernstein margin is at least
// 7 ln(2/alpha) / (3 (S - 1)), which must stay below delta.
func MinCertifySamples(delta, alpha float64) int {
	return int(math.Floor(1+7*math.Log(2/alpha)/(3*delta))) + 1
}

// UnknownRecords is the number of records a posterior that does not record it (a model file, or
// a ledger or posterior log written before posteriors carried it) is taken to stand for when
// update.memory_records is 0. With a memory it is taken to stand for memory_records records,
// the steady state of a posterior that has learned for long.
const UnknownRecords = 1000

// Defaults of the streaming update, chosen by measurement (docs/MATHS.md, "The streaming
// update"): DefaultKLWeight is the default update.kl_weight (each streamed record counts 1/8 of
// a record: the largest single-increment KL under correct labels stays under a quarter of the
// budget), DefaultMemoryRecords the default update.memory_records.
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
	// yet: GET its Location later). 0 answers 202 at once; a wait must end at least
	// RegisterSendMargin before http.write_timeout. Default: 10s.
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

// ErrInvalid is wrapped by every error from Load and Validate.
var ErrInvalid = errors.New("invalid configuration")

// Load parses YAML text over the defaults, rejecting unknown keys, then validates. Every error
// names its key path (certify.on_breach) and line.
func Load(text string) (*Config, error) {
	c := Default()
	var doc yaml.Node
	dec := yaml.NewDecoder(strings.NewReader(text))
	if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	// yaml.Unmarshal would read the first document alone and drop the rest, keys and mistakes.
	for {
		var more yaml.Node
		err := dec.Decode(&more)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		if !noKeys(&more) {
			return nil, fmt.Errorf("%w: line %d: another YAML document (after ---): the configuration is one document; merge its keys into the first", ErrInvalid, more.Line)
		}
	}
	c.empty = noKeys(&doc)
	if !c.empty {
		root := doc.Content[0]
		if root.Kind != yaml.MappingNode {
			return nil, fmt.Errorf("%w: line %d: the configuration must be a mapping of keys (http:, kafka:, ...), got %s", ErrInvalid, root.Line, nodeKind(root))
		}
		if errs := decodeStrict(root, reflect.ValueOf(&c).Elem(), ""); len(errs) > 0 {
			return nil, fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
		}
	}
	var lines map[string]int
	if !c.empty {
		lines = keyLines(doc.Content[0], "", map[string]int{})
	}
	if err := c.validate(lines); err != nil {
		return nil, err
	}
	return &c, nil
}

// keyLines records in lines the line of each key under n, by its path (section.key, and
// section.key[i] for the items of a list), and returns lines.
func keyLines(n *yaml.Node, path string, lines map[string]int) map[string]int {
	n = resolved(n)
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			key := n.Content[i].Value
			if path != "" {
				key = path + "." + key
			}
			lines[key] = n.Content[i].Line
			keyLines(n.Content[i+1], key, lines)
		}
	case yaml.SequenceNode:
		for i, item := range n.Content {
			lines[fmt.Sprintf("%s[%d]", path, i)] = item.Line
		}
	}
	return lines
}

// keyAt is key as an error names it: with the line the text gave it on, when lines knows it.
func keyAt(lines map[string]int, key string) string {
	if line := lines[key]; line > 0 {
		return fmt.Sprintf("%s (line %d)", key, line)
	}
	return key
}

// decodeStrict decodes node n into v (a struct field or the Config), walking mappings beside
// the struct so that each error carries its key path: unknown and repeated keys are errors, and a
// value that does not decode (a bad number, an unknown enum name) is reported under its key.
// Keys absent from the text keep their defaults.
func decodeStrict(n *yaml.Node, v reflect.Value, path string) []error {
	n = resolved(n)
	if v.Kind() != reflect.Struct {
		if err := checkScalar(n, v, path); err != nil {
			return []error{err}
		}
		if err := n.Decode(v.Addr().Interface()); err != nil {
			return []error{fmt.Errorf("%s (line %d): %s", path, n.Line, yamlMessage(err))}
		}
		return nil
	}
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return nil // "kafka:" with nothing under it: every default stays
	}
	if n.Kind != yaml.MappingNode {
		return []error{fmt.Errorf("%s (line %d): want a mapping of keys, got %s", path, n.Line, nodeKind(n))}
	}
	var errs []error
	seen := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := n.Content[i]
		key := k.Value
		if path != "" {
			key = path + "." + k.Value
		}
		if line, dup := seen[k.Value]; dup {
			errs = append(errs, fmt.Errorf("%s (line %d): given twice (first on line %d)", key, k.Line, line))
			continue
		}
		seen[k.Value] = k.Line
		f, names := fieldByKey(v, k.Value)
		if !f.IsValid() {
			hint := suggest(k.Value, names)
			if now, ok := renamedKey(key); ok {
				hint = fmt.Sprintf(" (renamed %s)", now)
			}
			errs = append(errs, fmt.Errorf("%s (line %d): unknown key%s", key, k.Line, hint))
			continue
		}
		errs = append(errs, decodeStrict(n.Content[i+1], f, key)...)
	}
	return errs
}

// checkScalar refuses what yaml would decode into v without a word: a key with no value (yaml
// leaves the default in place) and a fraction for an integer key (yaml truncates 10.5 to 10).
func checkScalar(n *yaml.Node, v reflect.Value, path string) error {
	if n.Kind == yaml.ScalarNode && n.Tag == "!!null" {
		return fmt.Errorf("%s (line %d): the key has no value; give one, or remove the key to keep the default (%s)", path, n.Line, defaultText(v))
	}
	if _, ok := v.Interface().(time.Duration); ok {
		return nil // a duration is text (5s); its decode names what a number is not
	}
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		if n.Kind != yaml.ScalarNode || n.Tag != "!!float" {
			return nil
		}
		var f float64
		if err := n.Decode(&f); err != nil {
			return nil // the decode that follows names the key
		}
		if f != math.Trunc(f) || math.IsInf(f, 0) {
			return fmt.Errorf("%s (line %d): %s is not a whole number", path, n.Line, n.Value)
		}
		// yaml turns a float beyond the integer's range into its nearest bound, silently.
		if v.CanInt() && (f < math.MinInt64 || f >= math.MaxInt64) || v.CanUint() && (f < 0 || f >= math.MaxUint64) {
			return fmt.Errorf("%s (line %d): %s is out of range", path, n.Line, n.Value)
		}
	}
	return nil
}

// defaultText renders the value a key keeps when it is absent, as the key would be written.
func defaultText(v reflect.Value) string {
	switch x := v.Interface().(type) {
	case time.Duration:
		return x.String()
	case string:
		return strconv.Quote(x)
	case []string:
		return fmt.Sprintf("%q", x)
	case fmt.Stringer:
		return x.String()
	}
	return fmt.Sprint(v.Interface())
}

// renamedKey gives the name now of a key an earlier release used.
func renamedKey(key string) (string, bool) {
	switch key {
	case "update.steps":
		return "update.iterations", true
	case "http.max_concurrent_predict":
		return "http.max_predict_inputs, which counts inputs, not requests", true
	}
	return "", false
}

// fieldByKey returns the field of struct v whose yaml tag is key (invalid if none), and every
// key v accepts.
func fieldByKey(v reflect.Value, key string) (reflect.Value, []string) {
	var names []string
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("yaml"), ",")
		if name == "" || name == "-" {
			continue
		}
		if name == key {
			return v.Field(i), nil
		}
		names = append(names, name)
	}
	return reflect.Value{}, names
}

// suggest names the accepted key closest to a misspelt one (edit distance <= 2).
func suggest(key string, names []string) string {
	best, bestD := "", 3
	for _, n := range names {
		if d := editDistance(key, n); d < bestD {
			best, bestD = n, d
		}
	}
	if best == "" {
		return fmt.Sprintf(" (accepted here: %s)", strings.Join(names, ", "))
	}
	return fmt.Sprintf(" (did you mean %q?)", best)
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

// yamlMessage strips yaml's "yaml: unmarshal errors: line N:" wrapping (decodeStrict gives the
// line itself).
func yamlMessage(err error) string {
	var te *yaml.TypeError
	if errors.As(err, &te) {
		msgs := make([]string, len(te.Errors))
		for i, e := range te.Errors {
			if _, rest, ok := strings.Cut(e, ": "); ok && strings.HasPrefix(e, "line ") {
				e = rest
			}
			msgs[i] = e
		}
		return strings.Join(msgs, "; ")
	}
	return err.Error()
}

func nodeKind(n *yaml.Node) string {
	switch n.Kind {
	case yaml.SequenceNode:
		return "a list"
	case yaml.MappingNode:
		return "a mapping"
	}
	return fmt.Sprintf("the value %q", n.Value)
}

// noKeys reports whether a parsed YAML document has no keys ("", comments only, "{}", "~").
func noKeys(n *yaml.Node) bool {
	if n.Kind == 0 {
		return true
	}
	if n.Kind == yaml.DocumentNode && len(n.Content) == 1 {
		c := n.Content[0]
		return c.Kind == yaml.MappingNode && len(c.Content) == 0 || c.Kind == yaml.ScalarNode && c.Tag == "!!null"
	}
	return false
}

// LoadFile reads and parses a configuration file, then applies environment overrides: for
// secrets (CFGUARD_HTTP_TOKEN, CFGUARD_HTTP_METRICS_TOKEN, CFGUARD_KAFKA_SASL_PASSWORD,
// CFGUARD_REPLICATION_KEY_FILE) and for replication.advertise_url
// (CFGUARD_REPLICATION_ADVERTISE_URL).
func LoadFile(path string) (*Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if bytes.Contains(b, []byte("\t")) {
		// yaml.v3's own message for tabs is obscure; say it plainly.
		for i, line := range bytes.Split(b, []byte("\n")) {
			if bytes.HasPrefix(bytes.TrimLeft(line, " "), []byte("\t")) {
				return nil, fmt.Errorf("%w: %s:%d: indentation uses a tab; YAML needs spaces", ErrInvalid, path, i+1)
			}
		}
	}
	c, err := Load(string(b))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	for _, tk := range []struct {
		env string
		dst *string
	}{{"CFGUARD_HTTP_TOKEN", &c.HTTP.Token}, {"CFGUARD_HTTP_METRICS_TOKEN", &c.HTTP.MetricsToken}} {
		if v := os.Getenv(tk.env); v != "" {
			if why := tokenProblem(v); why != "" {
				return nil, fmt.Errorf("%w: %s: %s", ErrInvalid, tk.env, why)
			}
			*tk.dst = v
		}
	}
	if v := os.Getenv("CFGUARD_KAFKA_SASL_PASSWORD"); v != "" {
		c.Kafka.SASL.Password = v
	}
	if v := os.Getenv("CFGUARD_REPLICATION_KEY_FILE"); v != "" {
		c.Replication.KeyFile = v
	}
	if v := os.Getenv("CFGUARD_REPLICATION_ADVERTISE_URL"); v != "" {
		// A replica's own address is known only where it runs (Kubernetes: the pod's IP, from
		// the downward API), so it comes from the environment; it is checked as the key is.
		c.Replication.AdvertiseURL = v
		if err := c.Validate(); err != nil {
			return nil, fmt.Errorf("%s, with CFGUARD_REPLICATION_ADVERTISE_URL=%q: %w", path, v, err)
		}
	}
	if err := c.CheckFiles(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// CheckFiles checks that the files the configuration names exist and are what they should be:
// model.path a directory with the model's two files (CheckModel loads them), another directory
// than model.export_dir, the TLS files readable, with replication
// enabled a readable key file (replication.key_file). Validate does not
// touch the file system; LoadFile calls both.
func (c *Config) CheckFiles() error {
	var errs []error
	if c.Model.Path != "" {
		for _, name := range []string{"model.json", "model.safetensors"} {
			p := filepath.Join(c.Model.Path, name)
			if st, err := os.Stat(p); err != nil {
				errs = append(errs, fmt.Errorf("model.path: %s: %w (a model directory holds model.json and model.safetensors; see cfguard train and cfguard import)", c.Model.Path, err))
				break
			} else if !st.Mode().IsRegular() {
				errs = append(errs, fmt.Errorf("model.path: %s is not a regular file", p))
			}
		}
		if sameDir(c.Model.Path, c.ExportDir()) {
			errs = append(errs, fmt.Errorf("model.export_dir: %s is model.path's directory: each promoted posterior would overwrite "+
				"the model this state directory began from; name another directory", c.ExportDir()))
		}
	}
	opened := len(errs)
	for _, tf := range []struct{ key, path string }{{"kafka.tls.ca_file", c.Kafka.TLS.CAFile}, {"kafka.tls.cert_file", c.Kafka.TLS.CertFile}, {"kafka.tls.key_file", c.Kafka.TLS.KeyFile}} {
		if tf.path == "" {
			continue
		}
		if f, err := os.Open(tf.path); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", tf.key, err))
		} else {
			f.Close()
		}
	}
	if c.Kafka.TLS.Enabled && len(errs) == opened { // every file opens: parsed as run parses them
		if _, err := stream.LoadTLS(stream.TLSFiles(c.Kafka.TLS)); err != nil {
			errs = append(errs, err)
		}
	}
	if err := c.checkWebConfig(); err != nil {
		errs = append(errs, err)
	}
	if c.Replication.Enabled {
		// Checked here, after the environment's override, not in Validate: in Kubernetes the
		// file's path comes from CFGUARD_REPLICATION_KEY_FILE.
		if _, err := clusterkey.Load(c.Replication.KeyFile); err != nil {
			errs = append(errs, err)
		}
		if _, err := stream.LoadTLSAt("replication.peer_tls", c.Replication.PeerTLS.Files()); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
	}
	return nil
}

// tokenProblem says why no client could present v as "Authorization: Bearer <v>", or "" when one
// can: an HTTP header value holds no control character but the tab (a token read from a file
// often keeps its file's last newline), and loses the spaces and tabs at its end.
func tokenProblem(v string) string {
	for i, r := range v {
		if (r < 0x20 && r != '\t') || r == 0x7f {
			what := fmt.Sprintf("a control character (%U) at byte %d", r, i)
			if r == '\n' && i == len(v)-1 {
				what = "a newline at its end (the last line of the file it was read from?)"
			}
			return "holds " + what + ", which no HTTP header can carry, so no client could send it; remove it " +
				"(a Kubernetes Secret: kubectl create secret generic --from-literal, or a file written with printf '%s')"
		}
	}
	if strings.TrimRight(v, " \t") != v {
		return "ends with a space or a tab, which HTTP drops from a header's value, so no client could send it; remove it"
	}
	return ""
}

// CheckModel loads model.path's model as run loads it, so that a model run would refuse (cut
// short, corrupt, invalid) is refused with the key that names it. LoadFile does not: every
// command loads the configuration, and only check-config and run need the model (a large one
// takes a fraction of a second to decode).
func (c *Config) CheckModel() error {
	if c.Model.Path == "" {
		return nil
	}
	if _, err := bnn.Load(c.Model.Path); err != nil {
		return fmt.Errorf("%w: model.path: %w", ErrInvalid, err)
	}
	return nil
}

// sameDir reports whether a and b name one directory: the same path once cleaned and made
// absolute, or, when both exist, the same file (a symbolic link or a bind mount to it).
func sameDir(a, b string) bool {
	if aa, err := filepath.Abs(a); err == nil {
		if bb, err := filepath.Abs(b); err == nil && aa == bb {
			return true
		}
	}
	sa, errA := os.Stat(a)
	sb, errB := os.Stat(b)
	return errA == nil && errB == nil && os.SameFile(sa, sb)
}

// CheckWebConfig checks http.web_config_file as the exporter-toolkit reads it, the certificates
// and keys it names included, so that a mistake stops the start rather than the first
// handshake; and that it does not ask for basic auth beside http.token or http.metrics_token,
// which would need the same Authorization header. CheckFiles calls it.
func (c *Config) CheckWebConfig() error {
	if err := c.checkWebConfig(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

func (c *Config) checkWebConfig() error {
	p := c.HTTP.WebConfigFile
	if p == "" {
		return nil
	}
	if err := web.Validate(p); err != nil {
		return fmt.Errorf("http.web_config_file: %s: %w (the format: https://prometheus.io/docs/prometheus/latest/configuration/https/)", p, err)
	}
	wc, err := readWebConfig(p)
	if err != nil {
		return fmt.Errorf("http.web_config_file: %w", err)
	}
	if len(wc.Users) > 0 && (c.HTTP.Token != "" || c.HTTP.MetricsToken != "") {
		return fmt.Errorf("http.web_config_file: %s sets basic_auth_users while http.token or http.metrics_token is set: "+
			"both need the Authorization header, so keep one of them (basic auth guards every route, /healthz and /readyz too)", p)
	}
	if len(wc.Users) > 0 && c.Replication.Enabled {
		return fmt.Errorf("http.web_config_file: %s sets basic_auth_users on a replica (replication.enabled): the replicas ask "+
			"each other with the client's bearer token, which basic auth refuses; guard the API with http.token, and with TLS "+
			"client certificates (replication.peer_tls)", p)
	}
	return nil
}

// ServesTLS says whether http.web_config_file serves the API over TLS (a tls_server_config
// with a certificate): the default replication.advertise_url is then https://. False without
// the file, or when it cannot be read (CheckWebConfig reports that).
func (c *Config) ServesTLS() bool {
	if c.HTTP.WebConfigFile == "" {
		return false
	}
	wc, err := readWebConfig(c.HTTP.WebConfigFile)
	return err == nil && (wc.TLS.CertFile != "" || wc.TLS.Cert != "")
}

// webConfig is what cfguard reads itself of an exporter-toolkit web configuration file
// (web.Validate checks the whole of it).
type webConfig struct {
	Users map[string]any `yaml:"basic_auth_users"`
	TLS   struct {
		CertFile string `yaml:"cert_file"`
		Cert     string `yaml:"cert"`
	} `yaml:"tls_server_config"`
}

// readWebConfig reads the web configuration file at path.
func readWebConfig(path string) (webConfig, error) {
	var wc webConfig
	b, err := os.ReadFile(path)
	if err != nil {
		return wc, err
	}
	return wc, yaml.Unmarshal(b, &wc)
}

// checkSchedule parses a robfig/cron spec (five fields or a descriptor, after an optional
// TZ= or CRON_TZ= zone). "@every D" needs a positive D of at least one second: cron would
// silently run "@every -1s" every second.
func checkSchedule(spec string) error {
	body := strings.TrimSpace(spec)
	if strings.HasPrefix(body, "TZ=") || strings.HasPrefix(body, "CRON_TZ=") {
		_, rest, _ := strings.Cut(body, " ")
		if body = strings.TrimSpace(rest); body == "" {
			return errors.New("a time zone and no schedule after it")
		}
	}
	if rest, ok := strings.CutPrefix(body, "@every "); ok {
		d, err := time.ParseDuration(strings.TrimSpace(rest))
		if err != nil {
			return err
		}
		if d < time.Second {
			return fmt.Errorf("the interval must be at least 1s, got %v", d)
		}
	}
	_, err := cron.ParseStandard(spec)
	return err
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

// Validate checks every value; errors name the key.
func (c *Config) Validate() error { return c.validate(nil) }

// validate is Validate, its errors naming the line of each key that lines knows (Load's).
func (c *Config) validate(lines map[string]int) error {
	var errs []error
	bad := func(key string, v any, why string) {
		errs = append(errs, fmt.Errorf("%s: %v: %s", keyAt(lines, key), v, why))
	}
	if c.HTTP.Listen == "" {
		bad("http.listen", `""`, "must be host:port")
	}
	if c.HTTP.ShutdownTimeout <= 0 {
		bad("http.shutdown_timeout", c.HTTP.ShutdownTimeout, "must be positive")
	}
	if c.HTTP.MaxBodyBytes <= 0 {
		bad("http.max_body_bytes", c.HTTP.MaxBodyBytes, "must be positive")
	}
	// Groups of keys are slices, not maps, so that the errors come in the same order on every run.
	for _, d := range []struct {
		key string
		v   time.Duration
	}{{"http.read_header_timeout", c.HTTP.ReadHeaderTimeout}, {"http.read_timeout", c.HTTP.ReadTimeout},
		{"http.write_timeout", c.HTTP.WriteTimeout}, {"http.idle_timeout", c.HTTP.IdleTimeout}} {
		if d.v <= 0 {
			bad(d.key, d.v, "must be positive")
		}
	}
	if c.HTTP.MaxConnections <= 0 {
		bad("http.max_connections", c.HTTP.MaxConnections, "must be positive")
	}
	for _, tk := range []struct{ key, v string }{{"http.token", c.HTTP.Token}, {"http.metrics_token", c.HTTP.MetricsToken}} {
		if why := tokenProblem(tk.v); why != "" {
			errs = append(errs, fmt.Errorf("%s: %s", keyAt(lines, tk.key), why)) // the value is a secret: never printed
		}
	}
	if c.HTTP.MaxPredictInputs < 0 {
		bad("http.max_predict_inputs", c.HTTP.MaxPredictInputs, "must be >= 0 (0: 10000 per CPU)")
	}
	if c.HTTP.IdempotencyWindow < time.Minute {
		bad("http.idempotency_window", c.HTTP.IdempotencyWindow, "must be at least 1m (a client's retries come within it)")
	}
	if c.StateDir == "" {
		bad("state_dir", `""`, "must name a directory")
	}
	if c.Model.Path == "" && c.Model.Dataset == "" {
		bad("model.dataset", `""`, "needed when model.path is empty")
	}
	if c.Model.Dataset != "" {
		if _, ok := assets.Lookup(c.Model.Dataset); !ok {
			bad("model.dataset", c.Model.Dataset, fmt.Sprintf("not a bundled data set (have %s)", strings.Join(assets.Names(), ", ")))
		}
	}
	if c.Model.Epochs < 0 {
		bad("model.epochs", c.Model.Epochs, "must be >= 0")
	}
	c.validateSyntaxAndLimits(bad)
	topics := map[string]string{} // name -> the first key that gave it
	for _, t := range c.topicKeys() {
		if t.name == "" {
			bad(t.key, `""`, "must name a topic")
		} else if other, dup := topics[t.name]; dup {
			bad(t.key, t.name, "is the same topic as "+other)
		} else {
			topics[t.name] = t.key
		}
	}
	if c.Kafka.GroupID == "" {
		bad("kafka.group_id", `""`, "must be set")
	}
	if c.Embedded() && c.Kafka.TLS.Enabled {
		bad("kafka.tls.enabled", true, "the embedded broker (kafka.brokers empty) speaks plain Kafka on loopback: set kafka.brokers for TLS, or remove the key")
	}
	if c.Embedded() && c.Kafka.SASL.Mechanism != "" {
		bad("kafka.sasl.mechanism", c.Kafka.SASL.Mechanism, "the embedded broker (kafka.brokers empty) has no authentication: set kafka.brokers for SASL, or remove the key")
	}
	if c.Kafka.ClientID == "" {
		bad("kafka.client_id", `""`, "must be set (default cfguard)")
	}
	if c.Kafka.MaxRecords <= 0 {
		bad("kafka.max_records", c.Kafka.MaxRecords, "must be positive")
	}
	if c.Kafka.MaxRecordsBacklog < c.Kafka.MaxRecords {
		bad("kafka.max_records_backlog", c.Kafka.MaxRecordsBacklog, fmt.Sprintf("must be >= kafka.max_records (%d)", c.Kafka.MaxRecords))
	}
	if c.Kafka.MaxWait <= 0 {
		bad("kafka.max_wait", c.Kafka.MaxWait, "must be positive")
	}
	if c.Kafka.EmbeddedRetention == 0 {
		bad("kafka.embedded_retention", c.Kafka.EmbeddedRetention, "must be positive, or negative for no age limit")
	}
	if c.Kafka.EmbeddedRetentionBytes == 0 {
		bad("kafka.embedded_retention_bytes", c.Kafka.EmbeddedRetentionBytes, "must be positive, or negative for no size limit")
	}
	if n := c.Kafka.EmbeddedMaxConnections; n < 16 || n > 1_000_000 {
		bad("kafka.embedded_max_connections", n, "must be in [16, 1000000] (the daemon's own Kafka clients hold several)")
	}
	if c.Kafka.EmbeddedIdleTimeout < time.Second {
		bad("kafka.embedded_idle_timeout", c.Kafka.EmbeddedIdleTimeout, "must be at least 1s")
	}
	if c.Kafka.EmbeddedRequestTimeout < time.Second {
		bad("kafka.embedded_request_timeout", c.Kafka.EmbeddedRequestTimeout, "must be at least 1s")
	}
	if c.Kafka.MaxRecordBytes <= 0 || c.Kafka.MaxRecordBytes > 900_000 {
		bad("kafka.max_record_bytes", c.Kafka.MaxRecordBytes, "must be in (0, 900000] (brokers reject ~1 MB batches)")
	}
	switch c.Kafka.SASL.Mechanism {
	case "", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512":
	default:
		bad("kafka.sasl.mechanism", c.Kafka.SASL.Mechanism, "must be PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")
	}
	if c.Kafka.SASL.Mechanism != "" && c.Kafka.SASL.Username == "" {
		bad("kafka.sasl.username", `""`, "needed with a SASL mechanism")
	}
	if (c.Kafka.TLS.CertFile == "") != (c.Kafka.TLS.KeyFile == "") {
		bad("kafka.tls.cert_file", c.Kafka.TLS.CertFile, "cert_file and key_file go together")
	}
	if c.Update.Objective != "prior" && c.Update.Objective != "vcl" {
		bad("update.objective", c.Update.Objective, "must be prior or vcl")
	}
	if !(c.Update.LearningRate > 0) || c.Update.LearningRate > 1 {
		bad("update.learning_rate", c.Update.LearningRate, "must be in (0, 1]")
	}
	if c.Update.Iterations < 1 {
		bad("update.iterations", c.Update.Iterations, "must be >= 1")
	}
	if c.Update.Solver != update.SolverConverge && c.Update.Solver != update.SolverAdam {
		bad("update.solver", c.Update.Solver, "must be converge or adam")
	}
	if !(c.Update.MemoryRecords >= 0) || math.IsInf(c.Update.MemoryRecords, 0) {
		bad("update.memory_records", c.Update.MemoryRecords, "must be >= 0 (0: keep every record)")
	}
	if !(c.Update.Tolerance > 0) || c.Update.Tolerance > 1 {
		bad("update.tolerance", c.Update.Tolerance, "must be in (0, 1]")
	}
	if c.Update.MaxIterations < 1 {
		bad("update.max_iterations", c.Update.MaxIterations, "must be >= 1")
	}
	if c.Update.Draws < 1 {
		bad("update.draws", c.Update.Draws, "must be >= 1")
	}
	if c.Update.Samples < 1 {
		bad("update.samples", c.Update.Samples, "must be >= 1")
	}
	if !(c.Update.KLWeight >= 0) || math.IsInf(c.Update.KLWeight, 0) {
		bad("update.kl_weight", c.Update.KLWeight, "must be finite and >= 0 (0: the objective's own weight)")
	}
	var rangeErr *certify.RangeError
	if errors.As(certify.CheckDelta(c.Certify.Delta), &rangeErr) {
		bad("certify.delta", c.Certify.Delta, "must be within "+rangeErr.Want)
	}
	if errors.As(certify.CheckEpsilon(c.Certify.Epsilon), &rangeErr) {
		bad("certify.epsilon", c.Certify.Epsilon, "must be within "+rangeErr.Want)
	}
	if !(c.Certify.EpsilonMax >= c.Certify.Epsilon && c.Certify.EpsilonMax <= 0.25) {
		bad("certify.epsilon_max", c.Certify.EpsilonMax, "must be in [certify.epsilon, 0.25]")
	}
	if c.Certify.Samples < 2 {
		bad("certify.samples", c.Certify.Samples, "must be >= 2")
	}
	if !(c.Certify.VerdictAlpha > 0 && c.Certify.VerdictAlpha < 0.5) {
		bad("certify.verdict_alpha", c.Certify.VerdictAlpha, "must be in (0, 0.5)")
	} else if least := MinCertifySamples(c.Certify.Delta, c.Certify.VerdictAlpha); c.Certify.Samples >= 2 && c.Certify.Samples < least && c.Certify.Delta > 0 {
		bad("certify.samples", c.Certify.Samples, fmt.Sprintf("must be >= %d for certify.delta %v and certify.verdict_alpha %v: "+
			"with fewer draws the confidence margin of a measurement, at least 7 ln(2/verdict_alpha) / (3 (samples - 1)), exceeds delta, "+
			"so no counterfactual could be registered as certified or renewed", least, c.Certify.Delta, c.Certify.VerdictAlpha))
	}
	if !(c.Certify.HoeffdingAlpha >= 0 && c.Certify.HoeffdingAlpha < 1) {
		bad("certify.hoeffding_alpha", c.Certify.HoeffdingAlpha, "must be in [0, 1)")
	}
	// Enums are checked when decoded (UnmarshalText); a Config built in code is checked here.
	for _, e := range []struct {
		key, text string
		into      encoding.TextUnmarshaler
	}{
		{"certify.mode", string(c.Certify.Mode), new(certify.Mode)},
		{"certify.on_breach", string(c.Certify.OnBreach), new(certify.OnBreach)},
		{"certify.uncertified", string(c.Certify.Uncertified), new(certify.OutsideSet)},
		{"certify.precision", c.Certify.Precision.String(), new(bnn.Precision)},
		{"log.format", string(c.Log.Format), new(LogFormat)},
	} {
		if err := e.into.UnmarshalText([]byte(e.text)); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", e.key, err))
		}
	}
	if c.Audit.Workers < 0 || c.Audit.Workers > MaxAuditWorkers {
		bad("audit.workers", c.Audit.Workers, fmt.Sprintf("must be 0 (every core but one) or 1..%d", MaxAuditWorkers))
	}
	if r := c.Explain.Reissue; r != "" && r != "invalidated" && r != "at_risk" {
		bad("explain.reissue", r, `must be "", "invalidated" or "at_risk"`)
	}
	if c.Explain.Timeout <= 0 {
		bad("explain.timeout", c.Explain.Timeout, "must be positive")
	}
	if c.Explain.MaxIterations <= 0 {
		bad("explain.max_iterations", c.Explain.MaxIterations, "must be positive")
	}
	if c.Explain.Concurrency < 0 {
		bad("explain.concurrency", c.Explain.Concurrency, "must be 0 (one per core) or positive")
	}
	if c.Audit.Schedule != "" {
		if err := checkSchedule(c.Audit.Schedule); err != nil {
			bad("audit.schedule", c.Audit.Schedule, err.Error())
		}
	}
	c.validateReplication(bad)
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
	}
	return nil
}

// validateReplication checks the replication keys; they are checked only when replication is
// enabled, so that a single daemon's configuration is never refused for them.
func (c *Config) validateReplication(bad func(key string, v any, why string)) {
	r := c.Replication
	if !r.Enabled {
		return
	}
	if c.Embedded() {
		bad("replication.enabled", true, "replicas share a Kafka cluster: set kafka.brokers "+
			"(on one machine, `cfguard broker --nodes 3` runs one on loopback)")
	}
	if err := broker.CheckTopic(r.PosteriorTopic); err != nil {
		bad("replication.posterior_topic", fmt.Sprintf("%q", r.PosteriorTopic), err.Error())
	}
	if err := broker.CheckTopic(r.CETopic); err != nil {
		bad("replication.ce_topic", fmt.Sprintf("%q", r.CETopic), err.Error())
	}
	for _, t := range []struct{ key, name string }{{"kafka.topic", c.Kafka.Topic}, {"kafka.dead_letter_topic", c.Kafka.DeadLetterTopic}, {"kafka.events_topic", c.Kafka.EventsTopic}} {
		if t.name == r.PosteriorTopic {
			bad("replication.posterior_topic", r.PosteriorTopic, "must differ from "+t.key)
		}
		if t.name == r.CETopic {
			bad("replication.ce_topic", r.CETopic, "must differ from "+t.key)
		}
	}
	if r.CETopic == r.PosteriorTopic {
		bad("replication.ce_topic", r.CETopic, "must differ from replication.posterior_topic")
	}
	// The CE state topic is the CE topic's name with ".state" appended (ceshare.StateTopic).
	state := r.CETopic + ".state"
	if err := broker.CheckTopic(state); err != nil {
		bad("replication.ce_topic", fmt.Sprintf("%q", r.CETopic), "its state topic "+state+": "+err.Error())
	}
	for _, t := range []struct{ key, name string }{{"kafka.topic", c.Kafka.Topic}, {"kafka.dead_letter_topic", c.Kafka.DeadLetterTopic},
		{"kafka.events_topic", c.Kafka.EventsTopic}, {"replication.posterior_topic", r.PosteriorTopic}} {
		if t.name == state {
			bad(t.key, t.name, "must differ from the CE state topic (replication.ce_topic with \".state\" appended)")
		}
	}
	if r.CEPartitions < 1 || r.CEPartitions > 1024 {
		bad("replication.ce_partitions", r.CEPartitions, "must be in [1, 1024]")
	}
	if r.AdvertiseURL != "" {
		if u, err := url.Parse(r.AdvertiseURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("replication.advertise_url", r.AdvertiseURL, "must be an http:// or https:// URL with a host (how the other replicas reach this one's API)")
		}
	}
	if strings.ContainsAny(r.ReplicaID, " \t\n/") || len(r.ReplicaID) > 128 {
		bad("replication.replica_id", fmt.Sprintf("%q", r.ReplicaID), "must be at most 128 characters without spaces or '/'")
	}
	if r.SessionTimeout < time.Second || r.SessionTimeout > 5*time.Minute {
		bad("replication.session_timeout", r.SessionTimeout, "must be in [1s, 5m]")
	}
	if r.HeartbeatInterval <= 0 || r.HeartbeatInterval >= r.SessionTimeout {
		bad("replication.heartbeat_interval", r.HeartbeatInterval, "must be positive and below replication.session_timeout")
	}
	if r.RegisterWait < 0 || r.RegisterWait > 0 && r.RegisterWait+RegisterSendMargin >= c.HTTP.WriteTimeout {
		bad("replication.register_wait", r.RegisterWait, fmt.Sprintf("must be 0 or more, and more than %v below http.write_timeout (%v): "+
			"a request is measured and sent to the CE topic before it waits, and the write deadline would cut its answer", RegisterSendMargin, c.HTTP.WriteTimeout))
	}
	if (r.PeerTLS.CertFile == "") != (r.PeerTLS.KeyFile == "") {
		bad("replication.peer_tls.cert_file", fmt.Sprintf("%q", r.PeerTLS.CertFile), "cert_file and key_file go together")
	}
	for i, q := range r.SkipCERequests {
		switch {
		case q.Partition < 0 || q.Partition >= r.CEPartitions:
			bad(fmt.Sprintf("replication.skip_ce_requests[%d]", i), fmt.Sprintf("partition %d", q.Partition),
				fmt.Sprintf("needs a partition in [0, %d) (replication.ce_partitions)", r.CEPartitions))
		case q.Through != 0 && q.Through < q.Offset:
			bad(fmt.Sprintf("replication.skip_ce_requests[%d]", i), fmt.Sprintf("offset %d, through %d", q.Offset, q.Through),
				"through is the last offset of the range: at least offset")
		case q.ID != "" && q.Through != 0 && q.Through != q.Offset:
			bad(fmt.Sprintf("replication.skip_ce_requests[%d]", i), fmt.Sprintf("id %q, through %d", q.ID, q.Through),
				"an id names one request: give offset alone")
		case q.ID != "" && ident.Check(q.ID) != nil:
			bad(fmt.Sprintf("replication.skip_ce_requests[%d]", i), "id", strings.TrimPrefix(ident.Check(q.ID).Error(), "id "))
		}
	}
}

// Upper limits of numeric keys: far above any useful value, low enough that a typo (an extra
// zero, 1e9) is refused at load rather than found as a daemon that takes hours per update or
// exhausts memory.
const (
	MaxCertifySamples      = 100_000   // certify.samples: Monte-Carlo draws per posterior version
	MaxUpdateIterations    = 100_000   // update.iterations: Adam iterations per increment
	MaxUpdateSamples       = 1_000     // update.samples: weight draws per iteration
	MaxExplainConcurrency  = 256       // explain.concurrency: generations at once
	MaxExplainIterations   = 1_000_000 // explain.max_iterations
	MaxKafkaRecordsBacklog = 100_000   // kafka.max_records_backlog (and so kafka.max_records)
)

// validateSyntaxAndLimits checks the forms of addresses and topic names and the upper limits of
// numeric keys, reporting each through bad.
func (c *Config) validateSyntaxAndLimits(bad func(key string, v any, why string)) {
	if c.HTTP.Listen != "" {
		if err := checkHostPort(c.HTTP.Listen, true); err != nil {
			bad("http.listen", c.HTTP.Listen, err.Error())
		}
	}
	for i, b := range c.Kafka.Brokers {
		if err := checkHostPort(b, false); err != nil {
			bad(fmt.Sprintf("kafka.brokers[%d]", i), b, err.Error())
		}
	}
	if c.Embedded() {
		if err := checkHostPort(c.Kafka.EmbeddedListen, true); err != nil {
			bad("kafka.embedded_listen", c.Kafka.EmbeddedListen, err.Error())
		} else if host, _, _ := net.SplitHostPort(c.Kafka.EmbeddedListen); host != "localhost" && !net.ParseIP(host).IsLoopback() {
			bad("kafka.embedded_listen", c.Kafka.EmbeddedListen, "must be a loopback address or localhost: the embedded broker "+
				"has no authentication and serves this daemon only (list kafka.brokers to use a broker others reach)")
		} else if why := sharedListen(c.HTTP.Listen, c.Kafka.EmbeddedListen); why != "" {
			bad("http.listen", c.HTTP.Listen, fmt.Sprintf("%s kafka.embedded_listen (%s): the API and the embedded broker "+
				"each need a port of their own; change one of the two", why, c.Kafka.EmbeddedListen))
		}
	}
	for _, t := range c.topicKeys() {
		if t.name != "" {
			if err := broker.CheckTopic(t.name); err != nil {
				bad(t.key, strconv.Quote(t.name), err.Error())
			}
		}
	}
	for _, l := range []struct {
		key      string
		v, limit int
	}{
		{"certify.samples", c.Certify.Samples, MaxCertifySamples},
		{"update.iterations", c.Update.Iterations, MaxUpdateIterations},
		{"update.max_iterations", c.Update.MaxIterations, MaxUpdateIterations},
		{"update.draws", c.Update.Draws, MaxUpdateSamples},
		{"update.samples", c.Update.Samples, MaxUpdateSamples},
		{"explain.concurrency", c.Explain.Concurrency, MaxExplainConcurrency},
		{"explain.max_iterations", c.Explain.MaxIterations, MaxExplainIterations},
		{"kafka.max_records_backlog", c.Kafka.MaxRecordsBacklog, MaxKafkaRecordsBacklog},
	} {
		if l.v > l.limit {
			bad(l.key, l.v, fmt.Sprintf("must be at most %d", l.limit))
		}
	}
}

// topicKeys lists the topic keys with their values, in a fixed order.
func (c *Config) topicKeys() []struct{ key, name string } {
	return []struct{ key, name string }{{"kafka.topic", c.Kafka.Topic}, {"kafka.dead_letter_topic", c.Kafka.DeadLetterTopic}, {"kafka.events_topic", c.Kafka.EventsTopic}}
}

// checkHostPort checks host:port as net.Listen and net.Dial read it: a port number (0, "any
// free port", only where the address is listened on); the host may be empty to listen on every
// interface.
func checkHostPort(addr string, listen bool) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("must be host:port (%v)", err)
	}
	n, err := strconv.ParseUint(port, 10, 16)
	switch {
	case err != nil:
		return fmt.Errorf("must be host:port with a port number, got port %q", port)
	case n == 0 && !listen:
		return errors.New("must be host:port with a port in 1..65535")
	case host == "" && !listen:
		return errors.New("must be host:port with a host")
	case strings.ContainsAny(host, " /"):
		return fmt.Errorf("must be host:port, got host %q", host)
	}
	return nil
}

// sharedListen says how the listen addresses a and b would take the same port, or "": the same
// port number (not 0, which is any free port) on the same host (localhost being 127.0.0.1 or
// ::1, whichever it binds), or on every interface ("", 0.0.0.0 or ::) for either. Addresses that are not host:port are left to checkHostPort.
func sharedListen(a, b string) string {
	ha, pa, errA := net.SplitHostPort(a)
	hb, pb, errB := net.SplitHostPort(b)
	na, errPA := strconv.ParseUint(pa, 10, 16)
	nb, errPB := strconv.ParseUint(pb, 10, 16)
	if errA != nil || errB != nil || errPA != nil || errPB != nil || na == 0 || na != nb {
		return ""
	}
	every := func(h string) bool { return h == "" || h == "0.0.0.0" || h == "::" }
	// localhost binds 127.0.0.1 (or ::1 on a host without IPv4 loopback).
	host := func(h string) string {
		if strings.EqualFold(h, "localhost") {
			return "127.0.0.1"
		}
		if ip := net.ParseIP(h); ip != nil { // one spelling per address: ::ffff:127.0.0.1 is 127.0.0.1
			return ip.String()
		}
		return h
	}
	localhostV6 := func(a, b string) bool { return strings.EqualFold(a, "localhost") && b == "::1" }
	switch {
	case host(ha) == host(hb), localhostV6(ha, hb), localhostV6(hb, ha):
		return "is the address of"
	case every(host(ha)) || every(host(hb)):
		return fmt.Sprintf("takes port %d, which is also the port of", na)
	}
	return ""
}

// MaxAuditWorkers bounds audit.workers.
const MaxAuditWorkers = 256

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
