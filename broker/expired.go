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

	"github.com/cfguard/cfguard/internal/atomicfile"
)

// kfake stores each partition of DataDir in <DataDir>/partitions/<topic>-<partition>/: its
// records in segment files <base offset>.dat, its offsets in snapshot.json. It reads a
// snapshot only beside at least one segment; a partition whose every record retention deleted
// has none, so kfake would replay nothing and restart it at offset 0. A consumer that had read
// up to the old end then finds the partition ending before its offset, as if the topic had been
// deleted and recreated (cfguard stops ingesting and reports a topic reset), and new records
// would take offsets that were used before.
//
// keepEmptyPartitionsOffsets runs before kfake loads DataDir. It gives each such partition an
// empty segment at its high watermark, named in its snapshot, so that kfake restores the
// partition from the snapshot: empty, its log start and high watermark where they were, as
// Kafka keeps them. Only partitions in that state are touched: no record in any segment file,
// a snapshot of a format version it knows (snapshotVersion) with a high watermark above 0. It
// returns the partitions it repaired ("topic-partition").
func keepEmptyPartitionsOffsets(dataDir string, log *slog.Logger) ([]string, error) {
	dirs, err := os.ReadDir(filepath.Join(dataDir, "partitions"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("broker: DataDir: %w", err)
	}
	var kept []string
	for _, d := range dirs {
		if !d.IsDir() {
			continue
		}
		pdir := filepath.Join(dataDir, "partitions", d.Name())
		hw, empty, ok, err := emptyPartitionEnd(pdir)
		if err != nil {
			return kept, err
		}
		if !ok {
			continue
		}
		if err := keepOffsets(pdir, hw, empty); err != nil {
			return kept, err
		}
		log.Info("kept the offsets of a partition whose every record retention had deleted", "partition", d.Name(), "high_watermark", hw)
		kept = append(kept, d.Name())
	}
	return kept, nil
}

// snapshotVersion is the format version of kfake's snapshot.json this package knows.
const snapshotVersion = 1

// emptyPartitionEnd reports the high watermark of the partition stored in pdir when it holds
// no record (no segment file, or only empty ones: this repair's, kept by kfake after it loaded)
// and a snapshot with a high watermark above 0 (ok), with the empty segments' base offsets; a
// partition it cannot read is left to kfake (ok false, no error).
func emptyPartitionEnd(pdir string) (hw int64, empty []int64, ok bool, err error) {
	entries, err := os.ReadDir(pdir)
	if err != nil {
		return 0, nil, false, fmt.Errorf("broker: DataDir: %w", err)
	}
	for _, e := range entries {
		name, found := strings.CutSuffix(e.Name(), ".dat")
		base, perr := strconv.ParseInt(name, 10, 64)
		if !found || perr != nil {
			continue
		}
		info, err := e.Info()
		if err != nil {
			return 0, nil, false, fmt.Errorf("broker: DataDir: %w", err)
		}
		if info.Size() > 0 {
			return 0, nil, false, nil
		}
		empty = append(empty, base)
	}
	raw, err := os.ReadFile(filepath.Join(pdir, "snapshot.json"))
	if err != nil {
		return 0, nil, false, nil
	}
	var snap struct {
		Version       int   `json:"version"`
		HighWatermark int64 `json:"high_watermark"`
	}
	if json.Unmarshal(raw, &snap) != nil || snap.Version != snapshotVersion || snap.HighWatermark <= 0 {
		return 0, nil, false, nil
	}
	return snap.HighWatermark, empty, true, nil
}

// keepOffsets writes an empty segment at hw in pdir and names it, alone, in the partition's
// snapshot, with the log start and last stable offset at hw; every other field of the snapshot
// is kept as written. The other empty segments (at bases in empty) are removed: kfake reads a
// snapshot only when it names every segment file.
func keepOffsets(pdir string, hw int64, empty []int64) error {
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
	path := filepath.Join(pdir, "snapshot.json")
	raw, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("broker: DataDir: %w", err)
	}
	var snap map[string]json.RawMessage
	if err := json.Unmarshal(raw, &snap); err != nil {
		return fmt.Errorf("broker: DataDir: %s: %w", path, err)
	}
	end := json.RawMessage(strconv.FormatInt(hw, 10))
	snap["log_start_offset"], snap["last_stable_offset"] = end, end
	snap["segments"] = json.RawMessage(fmt.Sprintf(`[{"base_offset":%d,"size":0}]`, hw))
	b, err := json.Marshal(snap)
	if err != nil {
		return err
	}
	// The segment first: a crash between the two writes leaves an empty segment that the old
	// snapshot does not name, which kfake replays as it replays none (offsets from 0), the
	// state before this repair; the next start repairs it.
	if err := atomicfile.WriteFile(filepath.Join(pdir, strconv.FormatInt(hw, 10)+".dat"), nil); err != nil {
		return fmt.Errorf("broker: DataDir: %w", err)
	}
	if err := atomicfile.WriteFile(path, b); err != nil {
		return fmt.Errorf("broker: DataDir: %w", err)
	}
	return nil
}
