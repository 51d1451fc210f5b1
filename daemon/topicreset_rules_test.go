package daemon

import (
	"encoding/json"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/stream"
)

// resetDaemon is a daemon of kafka.topic cfguard.records with only what topic-reset.json needs:
// its configuration and a ledger in state_dir whose partition 0 has had resets0 confirmed resets
// checkpointed.
func resetDaemon(t *testing.T, resets0 int64) *Daemon {
	t.Helper()
	c := config.Default()
	c.StateDir, c.Kafka.Topic = t.TempDir(), "cfguard.records"
	l, err := ledger.Open(c.StateDir, ledger.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if resets0 > 0 {
		if err := l.Checkpoint(&ledger.Checkpoint{Counters: map[string]int64{resetCounter(0): resets0}}); err != nil {
			t.Fatal(err)
		}
	}
	return &Daemon{cfg: &c, ledger: l, log: slog.New(slog.DiscardHandler)}
}

// A recorded topic reset waits for its confirmation until the ledger has checkpointed a reset of
// its partition since it was recorded; an entry recorded without that count (by an older
// release) always waits, and entries of another kafka.topic are not this daemon's. When none
// waits, topic-reset.json is removed; while one does, it is kept as it is.
func TestRecordedTopicResetsWaitForTheirCheckpoint(t *testing.T) {
	for _, c := range []struct {
		name    string
		resets0 int64  // confirmed resets of partition 0 the ledger checkpointed
		file    string // topic-reset.json
		waiting []int  // partitions of the resets still waiting
	}{
		{"none checkpointed since", 1, `[{"topic":"cfguard.records","partition":0,"offset":64,"resets_before":1}]`, []int{0}},
		{"one checkpointed since", 1, `[{"topic":"cfguard.records","partition":0,"offset":64,"resets_before":0}]`, nil},
		{"recorded without the count", 3, `[{"topic":"cfguard.records","partition":0,"offset":64}]`, []int{0}},
		{"another partition's reset checkpointed", 1, `[{"topic":"cfguard.records","partition":1,"offset":64,"resets_before":0}]`, []int{1}},
		{"another topic's", 0, `[{"topic":"other.records","partition":0,"offset":64,"resets_before":0}]`, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := resetDaemon(t, c.resets0)
			if err := os.WriteFile(d.topicResetPath(), []byte(c.file), 0o600); err != nil {
				t.Fatal(err)
			}
			resets, err := d.topicResets()
			if err != nil {
				t.Fatal(err)
			}
			var parts []int
			for _, r := range resets {
				if r.Topic != "cfguard.records" || r.Offset != 64 {
					t.Errorf("waiting reset %+v, want the recorded one of cfguard.records at offset 64", r)
				}
				parts = append(parts, r.Partition)
			}
			if !slices.Equal(parts, c.waiting) {
				t.Fatalf("waiting resets of partitions %v, want %v", parts, c.waiting)
			}
			now, err := os.ReadFile(d.topicResetPath())
			switch {
			case len(c.waiting) == 0 && c.name != "another topic's":
				if !errors.Is(err, fs.ErrNotExist) {
					t.Fatalf("%s with no reset waiting: %v %s, want it removed", topicResetFile, err, now)
				}
			case err != nil || string(now) != c.file:
				t.Fatalf("%s: %v %s, want it kept as it was", topicResetFile, err, now)
			}
		})
	}
}

// Removing topic-reset.json once the confirmed resets are checkpointed finds it gone without
// error when the operator already removed it by hand.
func TestClearingTopicResetsFindsTheFileGone(t *testing.T) {
	d := resetDaemon(t, 0)
	for i := range 2 {
		if err := d.clearTopicResets(); err != nil {
			t.Fatalf("removal %d of an absent %s: %v", i+1, topicResetFile, err)
		}
	}
}

// A reset is recorded once per partition, with the number of its partition's resets the ledger
// had checkpointed then: a second reset of a partition whose first one was confirmed waits for a
// checkpoint of its own.
func TestTopicResetIsRecordedOncePerPartitionWithTheLedgersCount(t *testing.T) {
	d := resetDaemon(t, 2)
	for _, e := range []stream.TopicResetError{
		{Topic: "cfguard.records", Partition: 0, Offset: 64, End: 10},
		{Topic: "cfguard.records", Partition: 0, Offset: 70, End: 12},
		{Topic: "cfguard.records", Partition: 1, Offset: 5, End: 1},
	} {
		if err := d.recordTopicReset(&e); err != nil {
			t.Fatal(err)
		}
	}
	b, err := os.ReadFile(filepath.Join(d.cfg.StateDir, topicResetFile))
	if err != nil {
		t.Fatal(err)
	}
	var got []struct {
		Partition    int    `json:"partition"`
		Offset       int64  `json:"offset"`
		ResetsBefore *int64 `json:"resets_before"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Partition != 0 || got[0].Offset != 64 || got[1].Partition != 1 || got[1].Offset != 5 ||
		got[0].ResetsBefore == nil || *got[0].ResetsBefore != 2 || got[1].ResetsBefore == nil || *got[1].ResetsBefore != 0 {
		t.Fatalf("%s:\n%s\nwant the first reset of partitions 0 and 1, with 2 and 0 resets checkpointed before", topicResetFile, b)
	}
	resets, err := d.topicResets()
	if err != nil || len(resets) != 2 {
		t.Fatalf("resets waiting after they were recorded: %v %+v, want both", err, resets)
	}
}
