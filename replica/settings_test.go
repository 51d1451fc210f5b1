package replica

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
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
		{"a newer build's key, recorded empty", map[string]string{"a": "1"}, map[string]string{"a": "1", "z.new": ""},
			[]settingDiff{{"z.new", "(not a setting of this build)", ""}}},
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
// data schema (x0, x1, ... for a model without feature names, as the record schema names them;
// a model's own names when it has them). A model.path or model.dataset that cannot be read fails.
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

	// A model that names its features records those names.
	m.Features = []string{"age", "income", "debt"}
	named := t.TempDir()
	if err := bnn.Save(named, m); err != nil {
		t.Fatal(err)
	}
	cfg.Model.Path = named
	if loaded, err = ClusterSettings(&cfg); err != nil {
		t.Fatal(err)
	}
	if loaded[settingFeatures] != "age,income,debt" {
		t.Errorf("a model naming its features: %s %q, want age,income,debt", settingFeatures, loaded[settingFeatures])
	}

	cfg.Model.Path = dir + "/missing"
	if _, err := ClusterSettings(&cfg); err == nil || !strings.Contains(err.Error(), "model.path") {
		t.Errorf("a missing model.path: err %v, want one naming model.path", err)
	}
	cfg.Model.Path, cfg.Model.Dataset = "", "no-such-data-set"
	if s, err := ClusterSettings(&cfg); err == nil || !strings.Contains(err.Error(), "model.dataset") {
		t.Errorf("an unknown model.dataset: settings %v, err %v; want an error naming model.dataset", s, err)
	}
}

// TestCheckSettingsOfEveryRecordingGenesis: a genesis that records settings, however few, is
// checked key by key (a one-key genesis that differs is refused, and the gauge says by how
// many keys, whatever an earlier check set it to); only one that records none is taken
// unchecked. The refusal names every differing key, the genesis's offset and the file; a
// genesis whose settings match marks them recorded (an epoch that changes them is then one no
// replica follows), one that records none does not.
func TestCheckSettingsOfEveryRecordingGenesis(t *testing.T) {
	for _, tc := range []struct {
		name      string
		mine, log map[string]string
		differ    int // keys that differ: 0 is accepted
		recorded  bool
	}{
		{"one key, another value", map[string]string{"certify.delta": "0.05"}, map[string]string{"certify.delta": "0.2"}, 1, false},
		{"one key, the same value", map[string]string{"certify.delta": "0.05"}, map[string]string{"certify.delta": "0.05"}, 0, true},
		{"two keys, one another value", map[string]string{"certify.delta": "0.05", "certify.mode": "tight"},
			map[string]string{"certify.delta": "0.05", "certify.mode": "paper"}, 1, false},
		{"three keys, each differing", map[string]string{"certify.delta": "0.05", "certify.mode": "tight", "model.sha256": "ab"},
			map[string]string{"certify.delta": "0.1", "certify.mode": "paper", "schema.classes": "no,yes"}, 4, false},
		{"none recorded", map[string]string{"certify.delta": "0.05"}, nil, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := alerts.NewReplicaMetrics(prometheus.NewRegistry(), nil)
			m.SettingsDiffer.Set(7) // an earlier check's
			r := &Replica{lg: slog.New(slog.DiscardHandler), m: m, plog: &postlog.Log{}, settings: tc.mine, configPath: "replica.yaml"}
			err := r.checkSettings(&postlog.Entry{Settings: tc.log}, 3)
			var se *SettingsError
			if refused := tc.differ > 0; refused != errors.As(err, &se) || !refused && err != nil {
				t.Fatalf("checkSettings = %v, want refused %v", err, refused)
			}
			if se != nil {
				if !slices.Equal(se.diffs, compareSettings(tc.mine, tc.log)) || se.offset != 3 || se.config != "replica.yaml" {
					t.Errorf("refusal %+v, want every differing key %v, offset 3 and the file replica.yaml", *se, compareSettings(tc.mine, tc.log))
				}
			}
			if got := testutil.ToFloat64(m.SettingsDiffer); got != float64(tc.differ) {
				t.Errorf("%s = %v, want %v", alerts.NameSettingsDiffer, got, tc.differ)
			}
			if got := r.recorded.Load(); got != tc.recorded {
				t.Errorf("recorded %v, want %v", got, tc.recorded)
			}
		})
	}
}

// TestRefusalIsTheRefusal: after Refuse, Refusal answers the refusal (what /readyz says);
// before, nothing.
func TestRefusalIsTheRefusal(t *testing.T) {
	r := &Replica{lg: slog.New(slog.DiscardHandler)}
	if err := r.Refusal(); err != nil {
		t.Fatalf("Refusal before any = %v", err)
	}
	refusal := &SettingsError{diffs: compareSettings(map[string]string{"a": "1"}, map[string]string{"a": "2"}), topic: "t", config: "replica.yaml"}
	r.Refuse(refusal)
	if err := r.Refusal(); err != refusal {
		t.Errorf("Refusal = %v, want %v", err, refusal)
	}
}

// TestGenesisOfAHead: the genesis whose settings a restarted replica checks is, for a head that
// records it, the record at its offset with its hash and an authenticator under the cluster's
// keys (a record there that hashes otherwise, one forged under another key, one that is not an
// entry are each an error); for a head stored before heads recorded it, the first genesis the
// acceptance rule accepts from the log's start, at its own offset (records the rule does not
// accept are passed over), and an error when none is accepted by the head's offset.
func TestGenesisOfAHead(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Partitions: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	conn := stream.ConnConfig{Brokers: b.Addrs()}
	keys, err := clusterkey.Parse([]byte("k1:"+strings.Repeat("5a", 32)), "test")
	if err != nil {
		t.Fatal(err)
	}
	otherKeys, err := clusterkey.Parse([]byte("k1:"+strings.Repeat("a5", 32)), "another cluster's")
	if err != nil {
		t.Fatal(err)
	}
	lg := slog.New(slog.DiscardHandler)
	plog, err := postlog.Open(ctx, conn, "posterior", keys, lg)
	if err != nil {
		t.Fatal(err)
	}
	defer plog.Close()
	forger, err := postlog.Open(ctx, conn, "posterior", otherKeys, lg)
	if err != nil {
		t.Fatal(err)
	}
	defer forger.Close()
	m := bnn.New(3, []int{4}, []string{"no", "yes"}, 1, rand.New(rand.NewPCG(1, 2)))
	genesis := func(settings map[string]string) []byte {
		e, err := postlog.NewGenesis(m, "r1", settings)
		if err != nil {
			t.Fatal(err)
		}
		v, err := e.Encode()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	forged, genuine, notAnEntry := genesis(map[string]string{"certify.delta": "0.2"}), genesis(map[string]string{"certify.delta": "0.05"}), []byte(`{"format":1}`)
	for _, a := range []struct {
		log   *postlog.Log
		value []byte
	}{{forger, forged}, {plog, genuine}, {plog, notAnEntry}} { // offsets 0, 1, 2
		if err := a.log.Append(ctx, "genesis", a.value); err != nil {
			t.Fatal(err)
		}
	}
	r := &Replica{plog: plog, keys: keys, lg: lg}
	for _, tc := range []struct {
		name string
		head postlog.Head
		err  string // "": the genesis at offset 1
	}{
		{"the head's genesis", postlog.Head{Offset: 2, GenesisOffset: 1, GenesisHash: hashHex(genuine)}, ""},
		{"a head without its genesis: the first accepted", postlog.Head{Offset: 2}, ""},
		{"another record at the genesis's offset", postlog.Head{Offset: 2, GenesisOffset: 1, GenesisHash: hashHex(forged)}, "no longer holds the genesis"},
		{"a genesis forged under another key", postlog.Head{Offset: 2, GenesisHash: hashHex(forged)}, "the genesis of the posterior log"},
		{"an authentic record that is not an entry", postlog.Head{Offset: 2, GenesisOffset: 2, GenesisHash: hashHex(notAnEntry)}, "malformed"},
		{"a head without its genesis, before any accepted", postlog.Head{Offset: 0}, "no genesis accepted before the head"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, at, err := r.genesisOf(ctx, &tc.head)
			switch {
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Errorf("genesisOf = offset %d, %v; want an error saying %q", at, err, tc.err)
			case tc.err == "" && (err != nil || at != 1 || e == nil || !maps.Equal(e.Settings, map[string]string{"certify.delta": "0.05"})):
				t.Errorf("genesisOf = %v at offset %d, %v; want the genesis at offset 1", e, at, err)
			}
		})
	}
}
