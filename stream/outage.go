package stream

import (
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"
)

// outage keeps the log of a broker outage short. Several sources (one per partition reader,
// the metadata refresh, dead-letter writes, offset commits) report every attempt to it:
//
//   - the first failure while nothing was failing logs one WARN line (source and error): the
//     outage starts;
//   - further failures, of any source, are counted and not logged;
//   - when every source that failed has succeeded again, one INFO line reports how long the
//     outage lasted, how many attempts failed and how many log lines were suppressed.
//
// Lines from kafka-go's own ErrorLogger (see kafkaLogger) are suppressed during an outage and
// rate-limited outside one. Retries themselves back off exponentially with jitter (internal/backoff);
// outage only decides what is written.
type outage struct {
	log  *slog.Logger
	what string // names the operations in the log lines, e.g. "kafka broker operations"

	mu         sync.Mutex
	failing    map[string]bool
	start      time.Time
	attempts   int // failed attempts during the current outage
	suppressed int // log lines not written during the current outage
	// kafka-go lines outside an outage: at most one per lineEvery; the rest are counted and
	// reported with the next line written.
	lastLine    time.Time
	linesDenied int
	// Outages counts outages that ended; Failures counts every failed attempt.
	outages, failures int64
}

// lineEvery is the shortest interval between two kafka-go log lines outside an outage.
const lineEvery = 30 * time.Second

func newOutage(log *slog.Logger, what string) *outage {
	return &outage{log: log, what: what, failing: make(map[string]bool)}
}

// fail records a failed attempt by source.
func (o *outage) fail(source string, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.failures++
	o.attempts++
	if len(o.failing) == 0 {
		o.failing[source] = true
		o.start, o.attempts, o.suppressed = time.Now(), 1, 0
		o.log.Warn(o.what+" failing; retrying with backoff (further failures are counted, not logged, until they all succeed again)",
			"source", source, "err", err)
		return
	}
	o.failing[source] = true
	o.suppressed++
}

// ok records a successful attempt by source; it ends the outage when no source is failing.
func (o *outage) ok(source string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.failing[source] {
		return
	}
	delete(o.failing, source)
	if len(o.failing) > 0 {
		return
	}
	o.outages++
	o.log.Info(o.what+" succeed again", "outage", time.Since(o.start).Round(time.Millisecond),
		"failed_attempts", o.attempts, "suppressed_log_lines", o.suppressed)
}

// kafkaLogger is a kafka-go ErrorLogger that writes through the outage: suppressed (and
// counted) while an outage is going on, otherwise WARN at most once per lineEvery.
func (o *outage) kafkaLogger(prefix string) kafka.Logger {
	return kafka.LoggerFunc(func(format string, args ...any) {
		o.mu.Lock()
		defer o.mu.Unlock()
		if len(o.failing) > 0 {
			o.suppressed++
			return
		}
		if now := time.Now(); now.Sub(o.lastLine) >= lineEvery {
			o.log.Warn(prefix+": "+fmt.Sprintf(format, args...), "suppressed_since_last", o.linesDenied)
			o.lastLine, o.linesDenied = now, 0
			return
		}
		o.linesDenied++
	})
}
