package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/cfguard/cfguard/internal/atomicfile"
	"github.com/cfguard/cfguard/stream"
)

// topicResetFile, in state_dir, holds the topic resets the consumer found (stream.TopicResetError)
// until an operator confirms them with --accept-topic-reset and the new offsets are
// checkpointed. It is what keeps ingest stopped across restarts: a topic recreated and written
// past the ledger's offset cannot be told from the old one by offsets once the consumer that
// saw the reset is gone.
const topicResetFile = "topic-reset.json"

func (d *Daemon) topicResetPath() string { return filepath.Join(d.cfg.StateDir, topicResetFile) }

// resetCounter is the ledger counter of the confirmed resets of partition p checkpointed (each
// checkpoint that moves p's offset to a new log adds one).
func resetCounter(p int) string { return fmt.Sprintf("topic_resets/%d", p) }

// recordedReset is one entry of topicResetFile: the reset, and how many resets of its partition
// the ledger had checkpointed when it was recorded. A ledger that counts more checkpointed this
// one (the process stopped before it removed the file): it is done. A ledger restored from an
// older backup counts no more, and the reset still waits.
type recordedReset struct {
	stream.TopicResetError
	ResetsBefore *int64 `json:"resets_before,omitempty"` // nil: recorded without it
}

// readTopicResets returns the entries of topicResetFile for kafka.topic (none when the file is
// missing).
func (d *Daemon) readTopicResets() ([]recordedReset, error) {
	path := d.topicResetPath()
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	var all []recordedReset
	if err := json.Unmarshal(b, &all); err != nil {
		return nil, fmt.Errorf("%s is damaged (%v): it records the Kafka topic resets found by the consumer; "+
			"remove it and start again (a reset is then found again only if the topic's log ends before the ledger's offsets)", path, err)
	}
	var out []recordedReset
	for _, r := range all {
		if r.Topic == d.cfg.Kafka.Topic {
			out = append(out, r)
		}
	}
	return out, nil
}

// topicResets returns the resets recorded for kafka.topic that still wait for their
// confirmation: those whose partition's resets the ledger has not checkpointed since they were
// recorded (and those recorded without the count). When none waits any more, the file is
// removed.
func (d *Daemon) topicResets() ([]stream.TopicResetError, error) {
	recorded, err := d.readTopicResets()
	if err != nil || len(recorded) == 0 {
		return nil, err
	}
	st, err := d.ledger.State()
	if err != nil {
		return nil, err
	}
	var out []stream.TopicResetError
	for _, r := range recorded {
		if r.ResetsBefore != nil && st.Counters[resetCounter(r.Partition)] > *r.ResetsBefore {
			d.log.Info("a recorded topic reset was confirmed and checkpointed before the file recording it was removed: it is done",
				"file", d.topicResetPath(), "partition", r.Partition)
			continue
		}
		out = append(out, r.TopicResetError)
	}
	if len(out) == 0 {
		return nil, d.clearTopicResets()
	}
	return out, nil
}

// recordTopicReset adds e to the file (once per partition), with the ledger's count of the
// resets of its partition checkpointed.
func (d *Daemon) recordTopicReset(e *stream.TopicResetError) error {
	all, err := d.readTopicResets()
	if err != nil {
		return err
	}
	if slices.ContainsFunc(all, func(r recordedReset) bool { return r.Partition == e.Partition }) {
		return nil
	}
	st, err := d.ledger.State()
	if err != nil {
		return err
	}
	n := st.Counters[resetCounter(e.Partition)]
	b, err := json.MarshalIndent(append(all, recordedReset{TopicResetError: *e, ResetsBefore: &n}), "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(d.topicResetPath(), b)
}

// clearTopicResets removes the file once the confirmed resets are checkpointed.
func (d *Daemon) clearTopicResets() error {
	if err := os.Remove(d.topicResetPath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return atomicfile.SyncDir(d.cfg.StateDir)
}
