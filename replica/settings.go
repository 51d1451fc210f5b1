package replica

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/postlog"
)

// Settings a genesis records besides config.ClusterSettings: the starting model and the data
// schema, which the file decides only indirectly (model.path is a local path).
const (
	// settingModel is the SHA-256 of the posterior at model.path (postlog.PosteriorHash), or
	// settingTrained when the first posterior is trained on model.dataset (then model.dataset,
	// model.seed and model.epochs decide it).
	settingModel    = "model.sha256"
	settingTrained  = "trained on model.dataset"
	settingFeatures = "schema.features"
	settingClasses  = "schema.classes"
)

// ClusterSettings are the cluster-wide settings of a replica with configuration cfg, as a
// posterior log's genesis records them: the file's (config.ClusterSettings) and the starting
// model and data schema it names. A model file is read and hashed; a bundled data set is read,
// not trained on.
func ClusterSettings(cfg *config.Config) (map[string]string, error) {
	s := cfg.ClusterSettings()
	var features, classes []string
	if cfg.Model.Path != "" {
		m, err := bnn.Load(cfg.Model.Path)
		if err != nil {
			return nil, fmt.Errorf("model.path: %w", err)
		}
		if s[settingModel], err = postlog.PosteriorHash(m); err != nil {
			return nil, err
		}
		features, classes = m.Features, m.Classes
		if len(features) == 0 { // the names the record schema gives them (the daemon's record schema)
			for j := range m.Inputs() {
				features = append(features, fmt.Sprintf("x%d", j))
			}
		}
	} else {
		set, ds, err := assets.Load(cfg.Model.Dataset)
		if err != nil {
			return nil, fmt.Errorf("model.dataset: %w", err)
		}
		s[settingModel], features, classes = settingTrained, set.Features, ds.Classes
	}
	s[settingFeatures], s[settingClasses] = strings.Join(features, ","), strings.Join(classes, ",")
	return s, nil
}

// settingDiff is one key whose value differs between this replica and the log's genesis.
type settingDiff struct{ key, mine, log string }

// SettingsError is a replica's refusal to join a cluster whose genesis records other
// cluster-wide settings (Join returns it), or to follow a new epoch that records settings its
// file does not have (the follower stops there): every differing key, both values and where the
// genesis is.
type SettingsError struct {
	diffs     []settingDiff
	topic     string
	offset    int64
	config    string
	following epochStop // met by a running follower at a new epoch (not atJoin): how it recovers
}

// epochStop is how a follower stopped by a new epoch's settings recovers.
type epochStop uint8

const (
	atJoin        epochStop = iota // not at an epoch: the replica refused to join
	restartAtHead                  // the log holds the head: restarted with the epoch's settings, it applies the epoch
	rebuild                        // the log was recreated (new-epoch --head-from): its state_dir moved aside, it rebuilds from the new log
	changed                        // the epoch changes settings the log recorded: no replica follows both
)

// stoppedAtEpoch is how a follower stopped by an epoch's settings recovers: reset says that the
// log lost its head since this replica started (the epoch begins a recreated log: a replica
// rebuilt from it follows it, whatever came before), recorded that the genesis or epoch it
// follows recorded settings (which the epoch then changes).
func stoppedAtEpoch(recorded, reset bool) epochStop {
	switch {
	case reset:
		return rebuild
	case recorded:
		return changed
	}
	return restartAtHead
}

func (e *SettingsError) Error() string {
	var b strings.Builder
	if e.following != atJoin {
		fmt.Fprintf(&b, "a new epoch of the posterior log records other cluster-wide settings than this replica's file: ")
	} else {
		fmt.Fprintf(&b, "not joining the cluster, whose posterior log records other cluster-wide settings: ")
	}
	for i, d := range e.diffs {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s: this replica %s, the cluster's log %s", d.key, quoteEmpty(d.mine), quoteEmpty(d.log))
	}
	fmt.Fprintf(&b, " (genesis at offset %d of %s); ", e.offset, e.topic)
	switch e.following {
	case restartAtHead:
		fmt.Fprintf(&b, "set these keys to the log's values in the file %s and restart this replica: it applies the epoch then", e.config)
	case rebuild:
		fmt.Fprintf(&b, "the log was recreated: set these keys to the log's values in the file %s, move this replica's state_dir aside and restart it: "+
			"it rebuilds from the new log", e.config)
	case changed:
		b.WriteString("the epoch changes settings that the log recorded before it, which no replica can follow (cfguard new-epoch keeps them): " +
			"start a new cluster with the settings wanted")
	default:
		fmt.Fprintf(&b, "align the file %s or start a new cluster", e.config)
	}
	return b.String()
}

func quoteEmpty(s string) string {
	if s == "" {
		return `""`
	}
	return s
}

// compareSettings returns the keys of log (a genesis's settings) whose value differs in mine,
// sorted. A key this build does not have (a newer build's) differs too: this build could not
// follow what it decides.
func compareSettings(mine, log map[string]string) []settingDiff {
	var out []settingDiff
	for _, k := range slices.Sorted(maps.Keys(log)) {
		if v, ok := mine[k]; !ok || v != log[k] {
			if !ok {
				v = "(not a setting of this build)"
			}
			out = append(out, settingDiff{key: k, mine: v, log: log[k]})
		}
	}
	for _, k := range slices.Sorted(maps.Keys(mine)) {
		if _, ok := log[k]; !ok {
			out = append(out, settingDiff{key: k, mine: mine[k], log: "(not recorded)"})
		}
	}
	slices.SortFunc(out, func(a, b settingDiff) int { return strings.Compare(a.key, b.key) })
	return out
}

// checkSettings compares this replica's settings with those of the genesis e at offset. A
// genesis that records none (a log begun by a build that did not record them) is accepted with
// a warning: refusing it would stop every replica of such a cluster at its upgrade, and its
// replicas agreed on nothing checkable before either; a new epoch (cfguard new-epoch) or a new
// cluster records them.
func (r *Replica) checkSettings(e *postlog.Entry, offset int64) error {
	if len(e.Settings) == 0 {
		r.lg.Warn("the posterior log's genesis records no settings: this replica's cluster-wide settings cannot be checked against the cluster's",
			"topic", r.plog.Topic(), "genesis_offset", offset)
		r.m.SettingsDiffer.Set(0)
		return nil
	}
	diffs := compareSettings(r.settings, e.Settings)
	r.m.SettingsDiffer.Set(float64(len(diffs)))
	if len(diffs) == 0 {
		r.recorded.Store(true)
		r.lg.Info("cluster-wide settings match the posterior log's genesis", "genesis_offset", offset, "keys", len(e.Settings))
		return nil
	}
	return &SettingsError{diffs: diffs, topic: r.plog.Topic(), offset: offset, config: r.configPath}
}

// genesisOf reads the genesis the head h descends from: at the offset h records (checked by its
// hash and authenticator), or, for a head stored before it recorded one, the first entry the
// acceptance rule accepts from the log's start.
func (r *Replica) genesisOf(ctx context.Context, h *postlog.Head) (*postlog.Entry, int64, error) {
	from := h.GenesisOffset
	if h.GenesisHash == "" {
		from = 0
	}
	rd, err := r.plog.Read(from)
	if err != nil {
		return nil, 0, err
	}
	defer rd.Close()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	chain := postlog.NewChain(r.keys)
	for {
		rec, err := rd.Next(cctx)
		if err != nil {
			return nil, 0, fmt.Errorf("reading the genesis of the posterior log %s (from offset %d): %w", r.plog.Topic(), from, err)
		}
		if h.GenesisHash != "" {
			// The genesis of the head's epoch, which a chain from the start would reach only by
			// playing the whole log: checked by its hash and authenticator.
			if rec.Offset != from || hashHex(rec.Value) != h.GenesisHash {
				return nil, 0, fmt.Errorf("the posterior log %s no longer holds the genesis this replica followed at offset %d (sha256 %s): "+
					"move state_dir aside and restart, the replica rebuilds from the log", r.plog.Topic(), from, h.GenesisHash)
			}
			if err := postlog.Authenticate(r.keys, rec); err != nil {
				return nil, 0, fmt.Errorf("the genesis of the posterior log %s at offset %d: %w", r.plog.Topic(), from, err)
			}
			e, err := postlog.Decode(rec.Value)
			return e, from, err
		}
		e, reason, err := chain.Offer(rec)
		if err != nil {
			return nil, 0, err
		}
		if reason == postlog.Accepted {
			return e, rec.Offset, nil
		}
		if rec.Offset >= h.Offset {
			return nil, 0, errors.New("no genesis accepted before the head this replica followed")
		}
	}
}

// Refusal is the reason this replica did not join (nil when it did): /readyz answers it.
func (r *Replica) Refusal() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.refused
}

// Refuse records that this replica does not join, for Refusal, and logs why. A replica that
// refuses joins no group, applies nothing and owns no CE.
func (r *Replica) Refuse(refusal *SettingsError) {
	r.mu.Lock()
	r.refused = refusal
	r.mu.Unlock()
	r.lg.Error("not joining the cluster: fix the configuration and restart", "err", refusal.Error(), "differing_keys", len(refusal.diffs))
}
