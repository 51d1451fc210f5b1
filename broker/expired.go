package broker

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cfguard/cfguard/internal/atomicfile"
)

// kfake stores each partition of DataDir in <DataDir>/partitions/<topic>-<partition>/: its
// records in segment files <base offset>.dat, its offsets in snapshot.json, which it writes
// when a data directory is created and at Close only. At start it reads a snapshot only
// beside at least one segment, and otherwise replays the segments. A partition whose every
// record retention deleted has none, so kfake would restart it at offset 0 (after a clean
// Close as after a crash). A consumer that had read up to the old end then finds the partition
// ending before its offset, as if the topic had been deleted and recreated (cfguard stops
// ingesting and reports a topic reset), and new records would take offsets used before.
//
// Two things keep those offsets. At start, after every retention pass and at Close, the
// broker records every partition's high watermark in <DataDir>/offsetsFile (recordOffsets):
// the records retention deletes were all below it, so it survives a crash, and a topic deleted
// leaves the record at the next pass or Close. Before kfake loads DataDir,
// keepEmptyPartitionsOffsets gives each partition that holds no record an empty segment at its
// high watermark (the larger of its snapshot's and the recorded one), named alone in its
// snapshot, so that kfake restores the partition from the snapshot: empty, its log start and
// high watermark where they were, as Kafka keeps them.

// offsetsFile is the broker's record of every partition's high watermark, in DataDir.
const offsetsFile = "cfguard-offsets.json"

// recordedOffsets is offsetsFile's content: high watermarks by kfake's partition directory name.
type recordedOffsets struct {
	HighWatermarks map[string]int64 `json:"high_watermarks"`
}

// snapshotVersion is the format version of kfake's snapshot.json this package knows.
const snapshotVersion = 1

// parsePartitionDir splits kfake's directory name for a partition, <topic>-<partition> (a Kafka
// topic name needs no escaping, CheckTopic), into the topic and the partition.
func parsePartitionDir(name string) (topic string, p int32, ok bool) {
	i := strings.LastIndexByte(name, '-')
	if i <= 0 {
		return "", 0, false
	}
	n, err := strconv.ParseInt(name[i+1:], 10, 32)
	if err != nil || n < 0 {
		return "", 0, false
	}
	return name[:i], int32(n), true
}

// readRecordedOffsets reads offsetsFile; a missing file is no record. The file is the broker's
// own, written atomically: one it cannot read is logged and ignored (the partitions are then
// restored from their snapshots alone), never a reason to refuse the start.
func readRecordedOffsets(dataDir string, log *slog.Logger) map[string]int64 {
	path := filepath.Join(dataDir, offsetsFile)
	raw, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	var rec recordedOffsets
	if err == nil {
		err = json.Unmarshal(raw, &rec)
	}
	if err != nil {
		log.Warn("the broker's record of its partitions' offsets cannot be read; using kfake's snapshots alone", "file", path, "err", err)
		return nil
	}
	return rec.HighWatermarks
}

// keepEmptyPartitionsOffsets runs before kfake loads dataDir (see the comment above). Only
// partitions that hold no record are touched (no segment file, or only empty ones), and only
// when their snapshot is missing or of a format version it knows (snapshotVersion), and their
// high watermark is above 0. nodes is the broker's node count: a snapshot it writes names
// partition p's leader as node p mod nodes, as ensureTopics does. It returns the partitions it
// repaired (kfake's directory names). A partition it cannot repair (a full or read-only disk)
// stops the start, naming the partition: kfake would begin it again at offset 0 and write that
// down at its Close, losing the offsets for good, while a start after the disk is freed keeps
// them (writeFile writes each file, atomicfile.WriteFile but in tests).
func keepEmptyPartitionsOffsets(dataDir string, nodes int, writeFile func(string, []byte) error, log *slog.Logger) ([]string, error) {
	dirs, err := os.ReadDir(filepath.Join(dataDir, "partitions"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("broker: DataDir: %w", err)
	}
	recorded := readRecordedOffsets(dataDir, log)
	var kept []string
	for _, d := range dirs {
		_, p, ok := parsePartitionDir(d.Name())
		if !d.IsDir() || !ok {
			continue
		}
		repaired, err := keepPartitionOffsets(filepath.Join(dataDir, "partitions", d.Name()), recorded[d.Name()], p, nodes, writeFile)
		if err != nil {
			return kept, fmt.Errorf("broker: cannot keep the offsets of partition %s, whose every record expired: %w; "+
				"without them it would begin again at offset 0, which its consumers take for a recreated topic. "+
				"Nothing was changed: make %s writable (free space) and start again", d.Name(), err, dataDir)
		}
		if repaired > 0 {
			log.Info("kept the offsets of a partition whose every record retention had deleted", "partition", d.Name(), "high_watermark", repaired)
			kept = append(kept, d.Name())
		}
	}
	return kept, nil
}

// keepPartitionOffsets repairs the partition stored in pdir when it holds no record and its high
// watermark (the larger of its snapshot's and recorded) is above 0, returning that high
// watermark; it returns 0 when there is nothing to repair.
func keepPartitionOffsets(pdir string, recorded int64, p int32, nodes int, writeFile func(string, []byte) error) (int64, error) {
	empty, holdsRecords, err := emptySegments(pdir)
	if err != nil || holdsRecords {
		return 0, err
	}
	snap, known, err := readSnapshot(pdir)
	if err != nil || !known {
		return 0, err
	}
	hw := max(recorded, snapHighWatermark(snap))
	if hw <= 0 {
		return 0, nil
	}
	if snap == nil {
		snap = map[string]json.RawMessage{"version": json.RawMessage(strconv.Itoa(snapshotVersion)),
			"epoch": json.RawMessage("0"), "max_timestamp": json.RawMessage("0")}
		snap["created_at"], _ = json.Marshal(time.Now().UTC())
		if leader := int(p) % max(nodes, 1); leader > 0 {
			snap["leader_node"] = json.RawMessage(strconv.Itoa(leader))
		}
	}
	if err := keepOffsets(pdir, snap, hw, empty, writeFile); err != nil {
		return 0, err
	}
	return hw, nil
}

// emptySegments lists the base offsets of pdir's empty segment files, and reports whether any
// segment file holds a record.
func emptySegments(pdir string) (empty []int64, holdsRecords bool, err error) {
	entries, err := os.ReadDir(pdir)
	if err != nil {
		return nil, false, fmt.Errorf("broker: DataDir: %w", err)
	}
	for _, e := range entries {
		name, found := strings.CutSuffix(e.Name(), ".dat")
		base, perr := strconv.ParseInt(name, 10, 64)
		if !found || perr != nil {
			continue
		}
		info, err := e.Info()
		if err != nil {
			return nil, false, fmt.Errorf("broker: DataDir: %w", err)
		}
		if info.Size() > 0 {
			return nil, true, nil
		}
		empty = append(empty, base)
	}
	return empty, false, nil
}

// readSnapshot returns pdir's snapshot.json as fields (nil when there is none), and whether
// this package may rewrite it: none, or one of format version snapshotVersion.
func readSnapshot(pdir string) (snap map[string]json.RawMessage, known bool, err error) {
	raw, err := os.ReadFile(filepath.Join(pdir, "snapshot.json"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, true, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("broker: DataDir: %w", err)
	}
	var version int
	if json.Unmarshal(raw, &snap) != nil || json.Unmarshal(snap["version"], &version) != nil || version != snapshotVersion {
		return nil, false, nil
	}
	return snap, true, nil
}

// snapHighWatermark is a snapshot's high watermark, 0 when it has none.
func snapHighWatermark(snap map[string]json.RawMessage) int64 {
	var hw int64
	if v, ok := snap["high_watermark"]; ok && json.Unmarshal(v, &hw) == nil {
		return hw
	}
	return 0
}

// keepOffsets writes an empty segment at hw in pdir and, in the partition's snapshot, names it
// alone with the high watermark, log start and last stable offset at hw; every other field of
// the snapshot is kept as written. The other empty segments (at bases in empty) are removed:
// kfake reads a snapshot only when it names every segment file.
func keepOffsets(pdir string, snap map[string]json.RawMessage, hw int64, empty []int64, writeFile func(string, []byte) error) error {
	for _, base := range empty {
		if base == hw {
			continue
		}
		for _, ext := range []string{".dat", ".idx"} {
			if err := os.Remove(filepath.Join(pdir, strconv.FormatInt(base, 10)+ext)); err != nil && !errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("broker: DataDir: %w", err)
			}
		}
	}
	end := json.RawMessage(strconv.FormatInt(hw, 10))
	snap["high_watermark"], snap["log_start_offset"], snap["last_stable_offset"] = end, end, end
	snap["segments"] = json.RawMessage(fmt.Sprintf(`[{"base_offset":%d,"size":0}]`, hw))
	b, err := json.Marshal(snap)
	if err != nil {
		return err
	}
	// The segment first: a crash between the two writes leaves an empty segment that the old
	// snapshot does not name, which kfake replays as it replays none (offsets from 0), the
	// state before this repair; the next start repairs it.
	if err := writeFile(filepath.Join(pdir, strconv.FormatInt(hw, 10)+".dat"), nil); err != nil {
		return fmt.Errorf("broker: DataDir: %w", err)
	}
	if err := writeFile(filepath.Join(pdir, "snapshot.json"), b); err != nil {
		return fmt.Errorf("broker: DataDir: %w", err)
	}
	return nil
}

// recordOffsets writes every partition's high watermark to offsetsFile (the caller holds b.mu
// for reading, with the broker running). The partitions are those with a directory under
// DataDir/partitions: every partition kfake stores.
func (b *Broker) recordOffsets() error {
	dirs, err := os.ReadDir(filepath.Join(b.dataDir, "partitions"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	rec := recordedOffsets{HighWatermarks: map[string]int64{}}
	infos := map[string]map[int32]int64{}
	for _, d := range dirs {
		topic, p, ok := parsePartitionDir(d.Name())
		if !d.IsDir() || !ok {
			continue
		}
		if infos[topic] == nil {
			infos[topic] = map[int32]int64{}
			for _, pi := range b.c.PartitionInfos(topic) {
				infos[topic][pi.Partition] = pi.HighWatermark
			}
		}
		if hw, ok := infos[topic][p]; ok && hw > 0 {
			rec.HighWatermarks[d.Name()] = hw
		}
	}
	raw, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(filepath.Join(b.dataDir, offsetsFile), raw)
}
