package replica

import (
	"errors"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/postlog"
)

// TestCompareSettings: every key whose value differs is reported once, sorted, with both values;
// a key only the log records is not a setting of this build, a key only this build has was not
// recorded.
func TestCompareSettings(t *testing.T) {
	for _, tc := range []struct {
		name      string
		mine, log map[string]string
		want      []settingDiff
	}{
		{"equal", map[string]string{"a": "1", "b": "2"}, map[string]string{"b": "2", "a": "1"}, nil},
		{"values differ", map[string]string{"b": "2", "a": "1", "c": "3"}, map[string]string{"a": "9", "b": "2", "c": "0"},
			[]settingDiff{{"a", "1", "9"}, {"c", "3", "0"}}},
		{"a newer build's key", map[string]string{"a": "1"}, map[string]string{"a": "1", "z.new": "x"},
			[]settingDiff{{"z.new", "(not a setting of this build)", "x"}}},
		{"a key the log did not record", map[string]string{"a": "1", "m.added": "y"}, map[string]string{"a": "1"},
			[]settingDiff{{"m.added", "y", "(not recorded)"}}},
		{"all three, sorted", map[string]string{"c": "1", "b": "y"}, map[string]string{"c": "2", "a": "x"},
			[]settingDiff{{"a", "(not a setting of this build)", "x"}, {"b", "y", "(not recorded)"}, {"c", "1", "2"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := compareSettings(tc.mine, tc.log); !slices.Equal(got, tc.want) {
				t.Errorf("compareSettings = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestSettingsErrorNamesEveryKey: the refusal names each differing key with both values (an
// empty one quoted), the genesis's offset and topic, and the file to align.
func TestSettingsErrorNamesEveryKey(t *testing.T) {
	e := &SettingsError{diffs: compareSettings(map[string]string{"certify.delta": "0.1", "model.dataset": ""},
		map[string]string{"certify.delta": "0.05", "model.dataset": "adult"}), topic: "cfguard.posterior", offset: 7, config: "replica.yaml"}
	msg := e.Error()
	for _, want := range []string{"certify.delta: this replica 0.1, the cluster's log 0.05", `model.dataset: this replica "", the cluster's log adult`,
		"genesis at offset 7 of cfguard.posterior", "align the file replica.yaml"} {
		if !strings.Contains(msg, want) {
			t.Errorf("the refusal %q does not say %q", msg, want)
		}
	}
}

// A follower stopped at a new epoch says how it recovers: restarted with the epoch's settings
// when the log still holds its head and its genesis recorded none; rebuilt from the log when
// the log was recreated (the epoch begins it); a new cluster when the epoch changes settings
// the log recorded.
func TestSettingsErrorAtAnEpochSaysHowToRecover(t *testing.T) {
	diffs := compareSettings(map[string]string{"certify.delta": "0.2"}, map[string]string{"certify.delta": "0.05"})
	for _, tc := range []struct {
		recorded, reset bool
		want, not       string
	}{
		{false, false, "set these keys to the log's values in the file replica.yaml and restart this replica: it applies the epoch then", "state_dir"},
		{false, true, "the log was recreated: set these keys to the log's values in the file replica.yaml, move this replica's state_dir aside and restart it", "applies the epoch"},
		{true, true, "move this replica's state_dir aside", "new cluster"},
		{true, false, "the epoch changes settings that the log recorded before it, which no replica can follow", "restart"},
	} {
		e := &SettingsError{diffs: diffs, topic: "cfguard.posterior", offset: 9, config: "replica.yaml", following: stoppedAtEpoch(tc.recorded, tc.reset)}
		msg := e.Error()
		if !strings.HasPrefix(msg, "a new epoch of the posterior log records other cluster-wide settings than this replica's file: certify.delta: this replica 0.2, the cluster's log 0.05 (genesis at offset 9 of cfguard.posterior); ") ||
			!strings.Contains(msg, tc.want) || strings.Contains(msg, tc.not) {
			t.Errorf("recorded %v, reset %v: %q\nwant it to say %q and not %q", tc.recorded, tc.reset, msg, tc.want, tc.not)
		}
	}
}

// TestClusterSettings: besides the file's cluster-wide keys, a replica records its starting
// model (the SHA-256 of model.path's posterior, or that it trains on model.dataset) and its
// data schema (x0, x1, ... for a model without feature names, as the record schema names them).
func TestClusterSettings(t *testing.T) {
	cfg := config.Default()
	trained, err := ClusterSettings(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	set, ds, err := assets.Load(cfg.Model.Dataset)
	if err != nil {
		t.Fatal(err)
	}
	want := cfg.ClusterSettings()
	want[settingModel], want[settingFeatures], want[settingClasses] = settingTrained, strings.Join(set.Features, ","), strings.Join(ds.Classes, ",")
	if !maps.Equal(trained, want) {
		t.Errorf("trained on %s: ClusterSettings = %v, want %v", cfg.Model.Dataset, trained, want)
	}

	m := bnn.New(3, []int{4}, []string{"no", "yes"}, 1, rand.New(rand.NewPCG(1, 2)))
	dir := t.TempDir()
	if err := bnn.Save(dir, m); err != nil {
		t.Fatal(err)
	}
	cfg.Model.Path = dir
	loaded, err := ClusterSettings(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	sha, err := postlog.PosteriorHash(m)
	if err != nil {
		t.Fatal(err)
	}
	if loaded[settingModel] != sha || loaded[settingFeatures] != "x0,x1,x2" || loaded[settingClasses] != "no,yes" {
		t.Errorf("model.path: model %q features %q classes %q, want %q, x0,x1,x2, no,yes",
			loaded[settingModel], loaded[settingFeatures], loaded[settingClasses], sha)
	}

	cfg.Model.Path = dir + "/missing"
	if _, err := ClusterSettings(&cfg); err == nil || !strings.Contains(err.Error(), "model.path") {
		t.Errorf("a missing model.path: err %v, want one naming model.path", err)
	}
}

// TestCheckSettingsOfEveryRecordingGenesis: a genesis that records settings, however few, is
// checked key by key (a one-key genesis that differs is refused, and the gauge says by how
// many keys); only one that records none is taken unchecked.
func TestCheckSettingsOfEveryRecordingGenesis(t *testing.T) {
	for _, tc := range []struct {
		name      string
		mine, log map[string]string
		refused   bool
	}{
		{"one key, another value", map[string]string{"certify.delta": "0.05"}, map[string]string{"certify.delta": "0.2"}, true},
		{"one key, the same value", map[string]string{"certify.delta": "0.05"}, map[string]string{"certify.delta": "0.05"}, false},
		{"two keys, one another value", map[string]string{"certify.delta": "0.05", "certify.mode": "tight"},
			map[string]string{"certify.delta": "0.05", "certify.mode": "paper"}, true},
		{"none recorded", map[string]string{"certify.delta": "0.05"}, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := alerts.NewReplicaMetrics(prometheus.NewRegistry(), nil)
			r := &Replica{lg: slog.New(slog.DiscardHandler), m: m, plog: &postlog.Log{}, settings: tc.mine}
			err := r.checkSettings(&postlog.Entry{Settings: tc.log}, 3)
			var se *SettingsError
			if tc.refused != errors.As(err, &se) || !tc.refused && err != nil {
				t.Errorf("checkSettings = %v, want refused %v", err, tc.refused)
			}
			want := 0.0
			if tc.refused {
				want = 1
			}
			if got := testutil.ToFloat64(m.SettingsDiffer); got != want {
				t.Errorf("%s = %v, want %v", alerts.NameSettingsDiffer, got, want)
			}
		})
	}
}
