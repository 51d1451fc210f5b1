package config

import (
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
