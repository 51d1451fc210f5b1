// Package config loads cfguard's YAML configuration strictly: unknown keys are errors, defaults
// are applied before unmarshalling (so an absent key keeps its default), and every validation
// error names the key and the offending value.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
	"gopkg.in/yaml.v3"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/stream"
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
}

// HTTP configures the API server.
type HTTP struct {
	Listen string `yaml:"listen"` // Default: 127.0.0.1:8080.
	// Token, when set, is required as "Authorization: Bearer <token>" on mutating endpoints.
	// Default: empty (no auth). The environment variable CFGUARD_HTTP_TOKEN overrides it.
	Token           string        `yaml:"token"`
	ShutdownTimeout time.Duration `yaml:"shutdown_timeout"` // Default: 10s.
	MaxBodyBytes    int64         `yaml:"max_body_bytes"`   // Default: 1 MiB.
}

// Model says where the posterior comes from on first start.
type Model struct {
	// Path is a model directory (model.safetensors + model.json). Default: empty, meaning: train
	// on the bundled Dataset at first start. Later starts resume from the state store.
	Path    string `yaml:"path"`
	Dataset string `yaml:"dataset"` // Default: breast_cancer (bundled).
	Seed    uint64 `yaml:"seed"`    // Default: 1.
	Epochs  int    `yaml:"epochs"`  // Default: 0 = the trainer's default.
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
}

// TLS for the Kafka connection (and, for the embedded broker, its listener).
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

// Update configures last-layer updates.
type Update struct {
	Objective    string  `yaml:"objective"`     // prior (paper) or vcl. Default: prior.
	LearningRate float64 `yaml:"learning_rate"` // Adam step size. Default: 1e-5 (the paper's).
	Steps        int     `yaml:"steps"`         // Optimiser steps per increment. Default: 0 = updater's default.
	KLWeight     float64 `yaml:"kl_weight"`     // Default: 0 = updater's default.
	Samples      int     `yaml:"samples"`       // Weight samples per step. Default: 0 = updater's default.
	Seed         uint64  `yaml:"seed"`          // Default: 1.
}

// Certify configures the guarantee.
type Certify struct {
	Delta float64 `yaml:"delta"` // CEs need p1 >= 1 - delta. Default: 0.05 (KL budget 0.10125).
	// Epsilon: CEs need Var1 <= epsilon to be registered as certified. Default: 0.01.
	Epsilon float64 `yaml:"epsilon"`
	// EpsilonMax is the variance a certified CE may reach under Theorem 2. Default: 0.25 (any
	// [0,1]-valued variance), i.e. only Theorem 1 constrains; lower it to make Theorem 2 bite.
	EpsilonMax float64 `yaml:"epsilon_max"`
	Mode       string  `yaml:"mode"`    // paper or tight. Default: paper.
	Samples    int     `yaml:"samples"` // Monte-Carlo samples for p and Var. Default: 1000.
	// HoeffdingAlpha > 0 starts certificates from the Hoeffding lower confidence bound of p1 at
	// confidence 1 - alpha. Default: 0 (off, as in the paper).
	HoeffdingAlpha float64 `yaml:"hoeffding_alpha"`
	// OnBreach is the policy when a step's KL exceeds the budget: alert (promote and alert),
	// reject (keep the old posterior, hold the increment, alert), clip (scale the step down to the
	// budget). Default: alert.
	OnBreach string `yaml:"on_breach"`
	// Uncertified: what to do with a registered CE outside the <delta, epsilon>-set: refuse or
	// store (as uncertified). Default: refuse.
	Uncertified string `yaml:"uncertified"`
}

// Explain configures counterfactual generation.
type Explain struct {
	Timeout       time.Duration `yaml:"timeout"`        // Per request. Default: 60s.
	MaxIterations int           `yaml:"max_iterations"` // Default: 2000 (the paper's).
	Concurrency   int           `yaml:"concurrency"`    // Generations at once. Default: 1.
}

// Audit configures the scheduled full re-certification.
type Audit struct {
	Schedule string `yaml:"schedule"` // robfig/cron spec. Default: "@every 1h". Empty string disables.
}

// Log configures log/slog.
type Log struct {
	Level  string `yaml:"level"`  // debug, info, warn, error. Default: info.
	Format string `yaml:"format"` // text or json. Default: text.
}

// Default returns the configuration with every default applied.
func Default() Config {
	return Config{
		HTTP:     HTTP{Listen: "127.0.0.1:8080", ShutdownTimeout: 10 * time.Second, MaxBodyBytes: 1 << 20},
		StateDir: "./state",
		Model:    Model{Dataset: "breast_cancer", Seed: 1},
		Kafka: Kafka{EmbeddedListen: "127.0.0.1:9092", Topic: "cfguard.records", DeadLetterTopic: "cfguard.records.dlq",
			EventsTopic: "cfguard.events", GroupID: "cfguard", ClientID: "cfguard", MaxRecords: stream.DefaultMaxRecords,
			MaxRecordsBacklog: stream.DefaultMaxRecordsBacklog, MaxWait: stream.DefaultMaxWait, MaxRecordBytes: 65536,
			EmbeddedRetention: broker.DefaultRetention, EmbeddedRetentionBytes: broker.DefaultRetentionBytes},
		Update:  Update{Objective: "prior", LearningRate: 1e-5, Seed: 1},
		Certify: Certify{Delta: 0.05, Epsilon: 0.01, EpsilonMax: 0.25, Mode: "paper", Samples: 1000, OnBreach: "alert", Uncertified: "refuse"},
		Explain: Explain{Timeout: 60 * time.Second, MaxIterations: 2000, Concurrency: 1},
		Audit:   Audit{Schedule: "@every 1h"},
		Log:     Log{Level: "info", Format: "text"},
	}
}

// ErrInvalid is wrapped by every error from Load and Validate.
var ErrInvalid = errors.New("invalid configuration")

// Load parses YAML text over the defaults, rejecting unknown keys, then validates.
func Load(text string) (*Config, error) {
	c := Default()
	dec := yaml.NewDecoder(strings.NewReader(text))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil && !errors.Is(err, io.EOF) { // empty text: all defaults
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// LoadFile reads and parses a configuration file, then applies environment overrides for
// secrets (CFGUARD_HTTP_TOKEN, CFGUARD_KAFKA_SASL_PASSWORD).
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
	if v := os.Getenv("CFGUARD_HTTP_TOKEN"); v != "" {
		c.HTTP.Token = v
	}
	if v := os.Getenv("CFGUARD_KAFKA_SASL_PASSWORD"); v != "" {
		c.Kafka.SASL.Password = v
	}
	return c, nil
}

// Embedded reports whether the daemon should start its own broker.
func (c *Config) Embedded() bool { return len(c.Kafka.Brokers) == 0 }

// Validate checks every value; errors name the key.
func (c *Config) Validate() error {
	var errs []error
	bad := func(key string, v any, why string) { errs = append(errs, fmt.Errorf("%s: %v: %s", key, v, why)) }
	if c.HTTP.Listen == "" {
		bad("http.listen", `""`, "must be host:port")
	}
	if c.HTTP.ShutdownTimeout <= 0 {
		bad("http.shutdown_timeout", c.HTTP.ShutdownTimeout, "must be positive")
	}
	if c.HTTP.MaxBodyBytes <= 0 {
		bad("http.max_body_bytes", c.HTTP.MaxBodyBytes, "must be positive")
	}
	if c.StateDir == "" {
		bad("state_dir", `""`, "must name a directory")
	}
	if c.Model.Path == "" && c.Model.Dataset == "" {
		bad("model.dataset", `""`, "needed when model.path is empty")
	}
	if c.Model.Epochs < 0 {
		bad("model.epochs", c.Model.Epochs, "must be >= 0")
	}
	for i, b := range c.Kafka.Brokers {
		if !strings.Contains(b, ":") {
			bad(fmt.Sprintf("kafka.brokers[%d]", i), b, "must be host:port")
		}
	}
	if c.Embedded() && !strings.Contains(c.Kafka.EmbeddedListen, ":") {
		bad("kafka.embedded_listen", c.Kafka.EmbeddedListen, "must be host:port")
	}
	topics := map[string]string{}
	for key, v := range map[string]string{"kafka.topic": c.Kafka.Topic, "kafka.dead_letter_topic": c.Kafka.DeadLetterTopic, "kafka.events_topic": c.Kafka.EventsTopic} {
		if v == "" {
			bad(key, `""`, "must name a topic")
		} else if other, dup := topics[v]; dup {
			bad(key, v, "is the same topic as "+other)
		}
		topics[v] = key
	}
	if c.Kafka.GroupID == "" {
		bad("kafka.group_id", `""`, "must be set")
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
	if c.Update.Steps < 0 || c.Update.Samples < 0 || c.Update.KLWeight < 0 {
		bad("update", fmt.Sprintf("steps=%d samples=%d kl_weight=%v", c.Update.Steps, c.Update.Samples, c.Update.KLWeight), "must be >= 0")
	}
	if !(c.Certify.Delta > 0 && c.Certify.Delta < 0.5) {
		bad("certify.delta", c.Certify.Delta, "must be in (0, 0.5)")
	}
	if !(c.Certify.Epsilon > 0 && c.Certify.Epsilon <= 0.25) {
		bad("certify.epsilon", c.Certify.Epsilon, "must be in (0, 0.25]")
	}
	if !(c.Certify.EpsilonMax >= c.Certify.Epsilon && c.Certify.EpsilonMax <= 0.25) {
		bad("certify.epsilon_max", c.Certify.EpsilonMax, "must be in [certify.epsilon, 0.25]")
	}
	if c.Certify.Mode != "paper" && c.Certify.Mode != "tight" {
		bad("certify.mode", c.Certify.Mode, "must be paper or tight")
	}
	if c.Certify.Samples < 2 {
		bad("certify.samples", c.Certify.Samples, "must be >= 2")
	}
	if c.Certify.HoeffdingAlpha < 0 || c.Certify.HoeffdingAlpha >= 1 {
		bad("certify.hoeffding_alpha", c.Certify.HoeffdingAlpha, "must be in [0, 1)")
	}
	switch c.Certify.OnBreach {
	case "alert", "reject", "clip":
	default:
		bad("certify.on_breach", c.Certify.OnBreach, "must be alert, reject or clip")
	}
	if c.Certify.Uncertified != "refuse" && c.Certify.Uncertified != "store" {
		bad("certify.uncertified", c.Certify.Uncertified, "must be refuse or store")
	}
	if c.Explain.Timeout <= 0 || c.Explain.MaxIterations <= 0 || c.Explain.Concurrency <= 0 {
		bad("explain", fmt.Sprintf("timeout=%v max_iterations=%d concurrency=%d", c.Explain.Timeout, c.Explain.MaxIterations, c.Explain.Concurrency), "must all be positive")
	}
	if c.Audit.Schedule != "" {
		if _, err := cron.ParseStandard(c.Audit.Schedule); err != nil {
			bad("audit.schedule", c.Audit.Schedule, err.Error())
		}
	}
	switch c.Log.Level {
	case "debug", "info", "warn", "error":
	default:
		bad("log.level", c.Log.Level, "must be debug, info, warn or error")
	}
	if c.Log.Format != "text" && c.Log.Format != "json" {
		bad("log.format", c.Log.Format, "must be text or json")
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
	}
	return nil
}
