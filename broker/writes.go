package broker

import (
	"fmt"
	"strings"
	"sync"
	"time"
)

// writeFailureHold is how long Healthy reports a failure to write the data directory: kfake
// reports failures, never a write that works again, so a failure stands for this long after the
// last one (records produced meanwhile are refused each time, renewing it).
const writeFailureHold = time.Minute

// writeFailures start kfake's log lines of a write to its data directory that failed: a record
// batch (its producer is refused), a group's committed offsets or a producer id (kfake logs the
// failure and acknowledges all the same), its topics' metadata, a transaction's control batch, the
// logs it compacts or rebuilds, and the state it saves at Close (by then Healthy says the broker
// stopped). kfake does not look at fsync's errors, so a failed fsync is not among them.
var writeFailures = []string{"persist ", "save session state", "rebuildSegments ", "endTx: failed to persist",
	"compact groups.log: create", "compact groups.log: write", "compact groups.log: sync", "compact groups.log: rename",
	"compact pids.log"}

// writeHealth keeps the embedded broker's latest failure to write its data directory (a full or
// read-only disk), which kfake reports only in its log.
type writeHealth struct {
	hold time.Duration
	mu   sync.Mutex
	at   time.Time // the latest failure; zero: none
	msg  string    // its log line
}

// logged records msg, a line kfake logged at now, when it reports a failed write.
func (h *writeHealth) logged(msg string, now time.Time) {
	for _, prefix := range writeFailures {
		if strings.HasPrefix(msg, prefix) {
			h.mu.Lock()
			h.at, h.msg = now, msg
			h.mu.Unlock()
			return
		}
	}
}

// failing says whether a write failed within hold before now.
func (h *writeHealth) failing(now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.failingLocked(now)
}

func (h *writeHealth) failingLocked(now time.Time) bool {
	return !h.at.IsZero() && now.Sub(h.at) < h.hold
}

// err is the failure to report at now (within hold of the latest), naming dir; nil if none.
func (h *writeHealth) err(dir string, now time.Time) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.failingLocked(now) {
		return nil
	}
	return fmt.Errorf("embedded broker cannot write its data directory %s (at %s, the latest failure: %s): it refuses the records "+
		"produced until it can; the error says why (no space left: free some on its file system; a read-only file system; "+
		"too many open files: raise the process's limit)", dir, h.at.UTC().Format(time.RFC3339), h.msg)
}
