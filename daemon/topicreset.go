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

// topicResets returns the resets recorded for kafka.topic (none when the file is missing).
func (d *Daemon) topicResets() ([]stream.TopicResetError, error) {
	path := d.topicResetPath()
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	var all []stream.TopicResetError
	if err := json.Unmarshal(b, &all); err != nil {
		return nil, fmt.Errorf("%s is damaged (%v): it records the Kafka topic resets found by the consumer; "+
			"remove it and start again (a reset is then found again only if the topic's log ends before the ledger's offsets)", path, err)
	}
	var out []stream.TopicResetError
	for _, r := range all {
		if r.Topic == d.cfg.Kafka.Topic {
			out = append(out, r)
		}
	}
	return out, nil
}

// recordTopicReset adds e to the file (once per partition).
func (d *Daemon) recordTopicReset(e *stream.TopicResetError) error {
	all, err := d.topicResets()
	if err != nil {
		return err
	}
	if slices.ContainsFunc(all, func(r stream.TopicResetError) bool { return r.Partition == e.Partition }) {
		return nil
	}
	b, err := json.MarshalIndent(append(all, *e), "", "  ")
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
