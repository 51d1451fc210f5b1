package config

import (
	"encoding"
	"errors"
	"fmt"
	"math"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/robfig/cron/v3"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/update"
)

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

// saslWithoutMechanism begins the refusal of a SASL credential given without kafka.sasl.mechanism.
const saslWithoutMechanism = "is set but kafka.sasl.mechanism is empty, so the connection to Kafka would not authenticate: "

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
	if c.Kafka.SASL.Mechanism == "" {
		// Credentials without a mechanism are not used: the connection would not authenticate,
		// however carefully they were set. The password is never printed.
		for _, f := range []struct {
			key   string
			set   bool
			shown any
		}{{"kafka.sasl.username", c.Kafka.SASL.Username != "", c.Kafka.SASL.Username},
			{"kafka.sasl.password", c.Kafka.SASL.Password != "", redacted}} {
			if f.set {
				bad(f.key, f.shown, saslWithoutMechanism+"set kafka.sasl.mechanism (PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512), or remove the key")
			}
		}
	}
	if (c.Kafka.TLS.CertFile == "") != (c.Kafka.TLS.KeyFile == "") {
		bad("kafka.tls.cert_file", c.Kafka.TLS.CertFile, "cert_file and key_file go together")
	}
	if !c.Kafka.TLS.Enabled {
		// Files without enabled are not used: the connection would be plain Kafka, however
		// carefully the certificates were named.
		for _, f := range []struct{ key, path string }{{"kafka.tls.ca_file", c.Kafka.TLS.CAFile},
			{"kafka.tls.cert_file", c.Kafka.TLS.CertFile}, {"kafka.tls.key_file", c.Kafka.TLS.KeyFile}} {
			if f.path != "" {
				bad(f.key, f.path, "is set but kafka.tls.enabled is false, so the connection to Kafka would not use TLS: set kafka.tls.enabled: true, or remove the key")
			}
		}
		if c.Kafka.TLS.InsecureSkipVerify {
			bad("kafka.tls.insecure_skip_verify", true, "is set but kafka.tls.enabled is false (there is no TLS to verify): set kafka.tls.enabled: true, or remove the key")
		}
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
		why := "must be in [certify.epsilon, 0.25]"
		if c.Certify.EpsilonMax == certify.DefaultEpsilonMax {
			// Met by every valid certify.epsilon: it is certify.epsilon that is too large.
			why += fmt.Sprintf(": certify.epsilon_max is at its default, %v, the most it may be; lower certify.epsilon (%v)", certify.DefaultEpsilonMax, c.Certify.Epsilon)
		}
		bad("certify.epsilon_max", c.Certify.EpsilonMax, why)
	}
	if c.Certify.Samples < 2 {
		bad("certify.samples", c.Certify.Samples, "must be >= 2")
	}
	if !(c.Certify.VerdictAlpha > 0 && c.Certify.VerdictAlpha < 0.5) {
		bad("certify.verdict_alpha", c.Certify.VerdictAlpha, "must be in (0, 0.5)")
	} else if least := certify.MinRenewableSamples(c.Certify.Delta, c.Certify.VerdictAlpha); c.Certify.Samples >= 2 && c.Certify.Samples < least && c.Certify.Delta > 0 {
		bad("certify.samples", c.Certify.Samples, fmt.Sprintf("must be >= %d for certify.delta %v and certify.verdict_alpha %v: "+
			"with fewer draws the confidence margin of a measurement, at least 7 ln(2/verdict_alpha) / (3 (samples - 1)), exceeds delta, "+
			"so no counterfactual could be registered as certified or renewed", least, c.Certify.Delta, c.Certify.VerdictAlpha))
	}
	if !(c.Certify.HoeffdingAlpha >= 0 && c.Certify.HoeffdingAlpha < 1) {
		bad("certify.hoeffding_alpha", c.Certify.HoeffdingAlpha, "must be in [0, 1)")
	} else if a, s, d := c.Certify.HoeffdingAlpha, c.Certify.Samples, c.Certify.Delta; a > 0 && s >= 2 && certify.CheckDelta(d) == nil {
		// A certificate starts from Hoeffding's lower bound p1 - m (certify.HoeffdingLower); a CE
		// in its set (p1 >= 1 - delta) holds its bound at KL 0 (p1 - m >= 1/2) only if the least
		// such p1 does.
		if lo := certify.HoeffdingLower(1-d, s, a); lo < 0.5 {
			m := 1 - d - lo
			bad("certify.hoeffding_alpha", a, fmt.Sprintf("with certify.samples %d and certify.delta %v, Hoeffding's margin sqrt(ln(1/hoeffding_alpha) / (2 samples)) = %.4g "+
				"exceeds 1/2 - delta = %.4g, so a counterfactual in its set could hold no certificate even under the posterior it was measured under; "+
				"raise hoeffding_alpha (at least %.4g) or certify.samples, or lower certify.delta", s, d, m, 0.5-d, math.Exp(-2*float64(s)*(0.5-d)*(0.5-d))))
		}
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
	c.validateSkipCERequests(bad)
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrInvalid, errors.Join(errs...))
	}
	return nil
}

// validateReplication checks the replication keys; they are checked only when replication is
// enabled, so that a single daemon's configuration is never refused for them, but for
// register_wait, which a single daemon's predictions with min_version wait for too; the items
// of skip_ce_requests are checked apart (validateSkipCERequests).
func (c *Config) validateReplication(bad func(key string, v any, why string)) {
	r := c.Replication
	if !r.Enabled {
		if r.RegisterWait < 0 { // a prediction's wait moves the write deadline past itself
			bad("replication.register_wait", r.RegisterWait, "must be 0 or more")
		}
		return
	}
	if r.RegisterWait < 0 || r.RegisterWait > 0 && r.RegisterWait >= c.HTTP.WriteTimeout-RegisterSendMargin { // no sum to overflow
		bad("replication.register_wait", r.RegisterWait, fmt.Sprintf("must be 0 or more, and more than %v below http.write_timeout (%v): "+
			"a request is measured and sent to the CE topic before it waits, and the write deadline would cut its answer", RegisterSendMargin, c.HTTP.WriteTimeout))
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
	if (r.PeerTLS.CertFile == "") != (r.PeerTLS.KeyFile == "") {
		bad("replication.peer_tls.cert_file", fmt.Sprintf("%q", r.PeerTLS.CertFile), "cert_file and key_file go together")
	}
}

// validateSkipCERequests checks the items of replication.skip_ce_requests whatever
// replication.enabled says: a partition not negative, a range's through at least its offset, an
// id in the format of CE ids and naming one request. The partition's upper bound,
// replication.ce_partitions, is checked only with replication enabled, as that key is checked
// (and the CE topic read) only then.
func (c *Config) validateSkipCERequests(bad func(key string, v any, why string)) {
	r := c.Replication
	for i, q := range r.SkipCERequests {
		key := fmt.Sprintf("replication.skip_ce_requests[%d]", i)
		switch {
		case q.Partition < 0 || r.Enabled && q.Partition >= r.CEPartitions:
			if r.Enabled {
				bad(key, fmt.Sprintf("partition %d", q.Partition), fmt.Sprintf("needs a partition in [0, %d) (replication.ce_partitions)", r.CEPartitions))
			} else {
				bad(key, fmt.Sprintf("partition %d", q.Partition), "needs a partition of 0 or more")
			}
		case q.Through != 0 && q.Through < q.Offset:
			bad(key, fmt.Sprintf("offset %d, through %d", q.Offset, q.Through), "through is the last offset of the range: at least offset")
		case q.ID != "" && q.Through != 0 && q.Through != q.Offset:
			bad(key, fmt.Sprintf("id %q, through %d", q.ID, q.Through), "an id names one request: give offset alone")
		case q.ID != "" && ident.Check(q.ID) != nil:
			bad(key, "id", strings.TrimPrefix(ident.Check(q.ID).Error(), "id "))
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

// CheckListenAddr checks an address to listen on as the listen keys (http.listen,
// kafka.embedded_listen) are checked: host:port with a port number in 0..65535 (0: any free
// port), the host empty for every interface. The commands' flags that take such an address use
// it too, so that a flag and a key refuse the same addresses, with the same words.
func CheckListenAddr(addr string) error { return checkHostPort(addr, true) }

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
