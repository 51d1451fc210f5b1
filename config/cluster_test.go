package config

import (
	"errors"
	"maps"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// Every key of Config is classified, and every classified key exists: a field added to Config
// without a scope in scopes fails here, so it cannot be left out of the cluster's settings by
// omission.
func TestEveryKeyHasAScope(t *testing.T) {
	seen := map[string]bool{}
	walkKeys(reflect.ValueOf(&Config{}).Elem(), "", func(key string, _ reflect.Value) {
		seen[key] = true
		if _, ok := ScopeOf(key); !ok {
			t.Errorf("config key %s has no scope: add it to scopes in config/cluster.go as Local or Cluster "+
				"(and to docs/CONFIGURATION.md's list when Cluster)", key)
		}
	})
	for key := range scopes {
		if !seen[key] {
			t.Errorf("scopes classifies %s, which Config does not have", key)
		}
	}
	if len(seen) < 60 {
		t.Fatalf("walked %d keys: the walk missed sections", len(seen))
	}
}

func TestClusterSettings(t *testing.T) {
	a, err := Load("certify:\n  delta: 0.1\n")
	if err != nil {
		t.Fatal(err)
	}
	b, err := Load("certify:\n  delta: 0.2\n  mode: tight\nhttp:\n  listen: 127.0.0.1:9999\nstate_dir: elsewhere\n")
	if err != nil {
		t.Fatal(err)
	}
	sa, sb := a.ClusterSettings(), b.ClusterSettings()
	if !slices.Equal(slices.Sorted(maps.Keys(sa)), ClusterKeys()) {
		t.Fatalf("settings keys %v, want %v", slices.Sorted(maps.Keys(sa)), ClusterKeys())
	}
	var differ []string
	for k := range sa {
		if sa[k] != sb[k] {
			differ = append(differ, k)
		}
	}
	slices.Sort(differ)
	if want := []string{"certify.delta", "certify.mode"}; !slices.Equal(differ, want) {
		t.Fatalf("differing cluster keys %v, want %v (local keys must not count)", differ, want)
	}
	if sa["certify.delta"] != "0.1" || sb["certify.mode"] != "tight" || sa["kafka.max_wait"] != a.Kafka.MaxWait.String() {
		t.Fatalf("values rendered as %q, %q, %q", sa["certify.delta"], sb["certify.mode"], sa["kafka.max_wait"])
	}
}

// WithSettings sets every cluster key from another configuration's text, and nothing else.
func TestWithSettingsRoundTrips(t *testing.T) {
	other, err := Load("certify:\n  delta: 0.2\n  mode: tight\n  precision: float32\n  on_breach: clip\n" +
		"update:\n  solver: adam\n  learning_rate: 0.001\n  seed: 7\nkafka:\n  max_wait: 750ms\n  topic: in\n" +
		"model:\n  dataset: german_credit\nexplain:\n  reissue: invalidated\nhttp:\n  listen: 127.0.0.1:9\n")
	if err != nil {
		t.Fatal(err)
	}
	mine := Default()
	got, changed, err := mine.WithSettings(other.ClusterSettings())
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(got.ClusterSettings(), other.ClusterSettings()) {
		t.Fatalf("after WithSettings:\n%v\nwant\n%v", got.ClusterSettings(), other.ClusterSettings())
	}
	want := []string{"certify.delta", "certify.mode", "certify.on_breach", "certify.precision", "explain.reissue", "kafka.max_wait",
		"kafka.topic", "model.dataset", "update.learning_rate", "update.seed", "update.solver"}
	if !slices.Equal(changed, want) {
		t.Fatalf("changed %v, want %v", changed, want)
	}
	if got.HTTP.Listen != mine.HTTP.Listen || mine.Certify.Delta == got.Certify.Delta {
		t.Fatalf("a local key moved (%s) or the receiver changed (delta %v)", got.HTTP.Listen, mine.Certify.Delta)
	}
	if _, _, err := mine.WithSettings(map[string]string{"certify.delta": "a lot"}); err == nil || !strings.Contains(err.Error(), "certify.delta") {
		t.Fatalf("a bad value: %v", err)
	}
}

// TestClusterKeysAreTheDocumentedOnes: the cluster-wide keys are those docs/CONFIGURATION.md
// lists ("Keys the replicas must share"), written out here from that list: a key moved between
// Local and Cluster changes which replicas may join a cluster, and must change the docs too.
func TestClusterKeysAreTheDocumentedOnes(t *testing.T) {
	want := []string{
		"certify.delta", "certify.epsilon", "certify.epsilon_max", "certify.hoeffding_alpha", "certify.mode",
		"certify.on_breach", "certify.precision", "certify.samples", "certify.uncertified", "certify.verdict_alpha",
		"explain.reissue", "http.idempotency_window",
		"kafka.dead_letter_topic", "kafka.events_topic", "kafka.group_id", "kafka.max_record_bytes", "kafka.max_records",
		"kafka.max_records_backlog", "kafka.max_wait", "kafka.topic",
		"model.dataset", "model.epochs", "model.seed",
		"replication.ce_partitions", "replication.ce_topic", "replication.enabled", "replication.posterior_topic",
		"update.draws", "update.iterations", "update.kl_weight", "update.learning_rate", "update.max_iterations",
		"update.memory_records", "update.objective", "update.samples", "update.seed", "update.solver", "update.tolerance",
	}
	if got := ClusterKeys(); !slices.Equal(got, want) {
		t.Fatalf("ClusterKeys:\n %v\nwant (docs/CONFIGURATION.md):\n %v", got, want)
	}
}

// TestClusterSettingsKeepEveryDigit: a setting's text compares equal exactly when the values do,
// so two deltas that differ in the seventh digit differ, and WithSettings sets the exact value.
func TestClusterSettingsKeepEveryDigit(t *testing.T) {
	a, err := Load("certify:\n  delta: 0.1000001\n")
	if err != nil {
		t.Fatal(err)
	}
	if got := a.ClusterSettings()["certify.delta"]; got != "0.1000001" {
		t.Fatalf("certify.delta rendered %q, want 0.1000001", got)
	}
	b := Default()
	got, changed, err := b.WithSettings(a.ClusterSettings())
	if err != nil || got.Certify.Delta != 0.1000001 || !slices.Equal(changed, []string{"certify.delta"}) {
		t.Fatalf("WithSettings: %v, delta %v, changed %v; want 0.1000001, [certify.delta]", err, got.Certify.Delta, changed)
	}
}

// TestWithSettingsLeavesLocalKeysAndValidates: settings that name a local key (a genesis is not
// expected to, but one written by another build might) do not change it, and settings that make
// an invalid configuration are refused, naming the key.
func TestWithSettingsLeavesLocalKeysAndValidates(t *testing.T) {
	mine := Default()
	got, changed, err := mine.WithSettings(map[string]string{"http.listen": "127.0.0.1:9", "state_dir": "/elsewhere"})
	if err != nil || len(changed) != 0 || got.HTTP.Listen != mine.HTTP.Listen || got.StateDir != mine.StateDir {
		t.Fatalf("WithSettings of local keys: %v, changed %v, http.listen %s, state_dir %s; want nothing changed", err, changed, got.HTTP.Listen, got.StateDir)
	}
	if _, _, err := mine.WithSettings(map[string]string{"update.solver": "sgd"}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "update.solver") {
		t.Fatalf("WithSettings of an invalid value: %v, want ErrInvalid naming update.solver", err)
	}
}
