package config

import (
	"encoding"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Scope says whether replicas of one cluster must agree on a key.
type Scope int

const (
	// Local keys belong to one process: its addresses, credentials, files, timeouts, logging,
	// how much work it does at once. Replicas may differ in them.
	Local Scope = iota + 1
	// Cluster keys decide what the posterior log holds or what status a CE gets: the updates,
	// the guarantee, the increments' boundaries, the starting model and the data schema, the
	// shared topics and groups. They are recorded in the log's genesis, and a replica whose
	// file differs refuses to join (docs/REPLICAS.md, "One configuration").
	Cluster
)

// scopes classifies every key of Config. TestEveryKeyHasAScope reflects over Config: a key
// added without a scope here fails it.
var scopes = map[string]Scope{
	"http.listen": Local, "http.token": Local, "http.metrics_token": Local, "http.shutdown_timeout": Local,
	"http.max_body_bytes": Local, "http.read_header_timeout": Local, "http.read_timeout": Local,
	"http.write_timeout": Local, "http.idle_timeout": Local, "http.max_connections": Local,
	"http.max_predict_inputs": Local, "http.web_config_file": Local,
	// The CE owner applies it to every registration sent to its partition, whichever replica
	// took it: owners must remember request ids equally long for an answer not to depend on
	// which replica owns the CE.
	"http.idempotency_window": Cluster,

	"state_dir": Local,

	// The starting posterior: a model file (checked by its hash, model.sha256, since its path
	// is a local matter) or the training that produced it.
	"model.path": Local, "model.dataset": Cluster, "model.seed": Cluster, "model.epochs": Cluster,
	"model.export_dir": Local,

	"kafka.brokers": Local, "kafka.embedded_listen": Local, "kafka.client_id": Local,
	"kafka.embedded_retention": Local, "kafka.embedded_retention_bytes": Local,
	"kafka.embedded_max_connections": Local, "kafka.embedded_idle_timeout": Local,
	"kafka.embedded_request_timeout": Local,
	"kafka.tls.enabled":              Local, "kafka.tls.ca_file": Local, "kafka.tls.cert_file": Local,
	"kafka.tls.key_file": Local, "kafka.tls.insecure_skip_verify": Local,
	"kafka.sasl.mechanism": Local, "kafka.sasl.username": Local, "kafka.sasl.password": Local,
	// The topics and groups the cluster shares, and what makes an increment (its boundaries
	// and which records are dead letters decide the update).
	"kafka.topic": Cluster, "kafka.dead_letter_topic": Cluster, "kafka.events_topic": Cluster,
	"kafka.group_id": Cluster, "kafka.max_records": Cluster, "kafka.max_records_backlog": Cluster,
	"kafka.max_wait": Cluster, "kafka.max_record_bytes": Cluster,

	"update.objective": Cluster, "update.solver": Cluster, "update.memory_records": Cluster,
	"update.tolerance": Cluster, "update.max_iterations": Cluster, "update.draws": Cluster,
	"update.learning_rate": Cluster, "update.iterations": Cluster, "update.kl_weight": Cluster,
	"update.samples": Cluster, "update.seed": Cluster,

	"certify.delta": Cluster, "certify.epsilon": Cluster, "certify.epsilon_max": Cluster,
	"certify.mode": Cluster, "certify.samples": Cluster, "certify.precision": Cluster,
	"certify.hoeffding_alpha": Cluster, "certify.verdict_alpha": Cluster, "certify.on_breach": Cluster,
	"certify.uncertified": Cluster,

	// Generation runs where it is asked and its CE is then measured and certified like any
	// other; reissue is done by the CE's owner when a status changes, so owners must agree.
	"explain.timeout": Local, "explain.max_iterations": Local, "explain.concurrency": Local,
	"explain.reissue": Cluster,

	// Audits cover the replica's own share and change no status by their timing alone.
	"audit.schedule": Local, "audit.workers": Local,

	"log.level": Local, "log.format": Local,

	"replication.enabled": Cluster, "replication.posterior_topic": Cluster,
	"replication.ce_topic": Cluster, "replication.ce_partitions": Cluster,
	"replication.replica_id": Local, "replication.advertise_url": Local,
	"replication.session_timeout": Local, "replication.heartbeat_interval": Local,
	"replication.key_file": Local, "replication.register_wait": Local, "replication.skip_ce_requests": Local, "replication.peer_tls.ca_file": Local,
	"replication.peer_tls.cert_file": Local, "replication.peer_tls.key_file": Local,
}

// ScopeOf is the scope of a key (its YAML path, e.g. "certify.delta"); ok is false for a key
// Config does not have.
func ScopeOf(key string) (s Scope, ok bool) {
	s, ok = scopes[key]
	return s, ok
}

// ClusterKeys are the keys replicas must agree on, sorted.
func ClusterKeys() []string {
	var out []string
	for k, s := range scopes {
		if s == Cluster {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

// ClusterSettings are c's values of the keys replicas must agree on (ClusterKeys), each as
// text that compares equal exactly when the values are equal: numbers in their shortest exact
// form, durations as time.Duration writes them, lists joined by commas.
func (c *Config) ClusterSettings() map[string]string {
	out := map[string]string{}
	walkKeys(reflect.ValueOf(c).Elem(), "", func(key string, v reflect.Value) {
		if scopes[key] == Cluster {
			out[key] = settingText(v)
		}
	})
	return out
}

// walkKeys calls leaf for every key of a Config value: its YAML path and value. Structs of this
// package are sections; any other type is a key's value.
func walkKeys(v reflect.Value, prefix string, leaf func(key string, v reflect.Value)) {
	t := v.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if !f.IsExported() || name == "" || name == "-" {
			continue
		}
		key := prefix + name
		if f.Type.Kind() == reflect.Struct && f.Type.PkgPath() == t.PkgPath() {
			walkKeys(v.Field(i), key+".", leaf)
			continue
		}
		leaf(key, v.Field(i))
	}
}

// settingText renders a key's value for ClusterSettings.
func settingText(v reflect.Value) string {
	switch x := v.Interface().(type) {
	case time.Duration:
		return x.String()
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64)
	case []string:
		return strings.Join(x, ",")
	case fmt.Stringer:
		return x.String()
	}
	return fmt.Sprint(v.Interface())
}

// WithSettings is a copy of c with the cluster-wide keys of settings (another replica's
// ClusterSettings, as a posterior log's genesis records them) set to their values; keys that are
// not cluster-wide keys of Config (derived ones such as model.sha256) are left out. It returns
// the keys whose value changed, sorted. The copy is validated.
func (c *Config) WithSettings(settings map[string]string) (*Config, []string, error) {
	out := *c
	var changed []string
	var errs []error
	mine := c.ClusterSettings()
	walkKeys(reflect.ValueOf(&out).Elem(), "", func(key string, v reflect.Value) {
		text, ok := settings[key]
		if !ok || scopes[key] != Cluster || text == mine[key] {
			return
		}
		if err := setText(v, text); err != nil {
			errs = append(errs, fmt.Errorf("%s: %q: %w", key, text, err))
			return
		}
		changed = append(changed, key)
	})
	if len(errs) > 0 {
		return nil, nil, fmt.Errorf("the recorded settings do not fit this build's configuration: %w", errors.Join(errs...))
	}
	if err := out.Validate(); err != nil {
		return nil, nil, fmt.Errorf("with the recorded settings: %w", err)
	}
	slices.Sort(changed)
	return &out, changed, nil
}

// setText is settingText's inverse.
func setText(v reflect.Value, text string) error {
	if u, ok := v.Addr().Interface().(encoding.TextUnmarshaler); ok {
		return u.UnmarshalText([]byte(text))
	}
	if _, ok := v.Interface().(time.Duration); ok {
		d, err := time.ParseDuration(text)
		v.SetInt(int64(d))
		return err
	}
	switch v.Kind() {
	case reflect.String:
		v.SetString(text)
	case reflect.Bool:
		b, err := strconv.ParseBool(text)
		v.SetBool(b)
		return err
	case reflect.Int, reflect.Int64, reflect.Int32:
		n, err := strconv.ParseInt(text, 10, 64)
		v.SetInt(n)
		return err
	case reflect.Uint, reflect.Uint64, reflect.Uint32:
		n, err := strconv.ParseUint(text, 10, 64)
		v.SetUint(n)
		return err
	case reflect.Float64:
		f, err := strconv.ParseFloat(text, 64)
		v.SetFloat(f)
		return err
	default:
		return fmt.Errorf("a %s cannot be set from text", v.Type())
	}
	return nil
}
