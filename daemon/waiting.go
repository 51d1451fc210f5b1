package daemon

import (
	"context"
	"maps"
	"sync"
	"time"

	"github.com/cfguard/cfguard/stream"
)

// watermarksEvery is how often the input topic's watermarks are read for the gauge of records
// waiting (cfguard_consumer_lag_records): one Metadata and one ListOffsets request.
const watermarksEvery = 5 * time.Second

// topicEnds holds the input topic's watermarks as last read, and the partitions found reset
// (deleted and created again) whose reset is not checkpointed yet: the ledger's offsets of those
// count records of the old log, so every record of the new one waits.
type topicEnds struct {
	mu    sync.Mutex
	w     map[int]stream.Watermarks
	at    time.Time // when w was read
	reset map[int]bool
	// failing is true while reads fail (one WARN line per episode); only readEnds uses it.
	failing bool
}

func (t *topicEnds) set(w map[int]stream.Watermarks, at time.Time) {
	t.mu.Lock()
	t.w, t.at = w, at
	t.mu.Unlock()
}

// setReset marks partition p reset (a reset found, or confirmed and not yet checkpointed), or
// not.
func (t *topicEnds) setReset(p int, reset bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !reset {
		delete(t.reset, p)
		return
	}
	if t.reset == nil {
		t.reset = map[int]bool{}
	}
	t.reset[p] = true
}

// clearResets unmarks every partition marked reset.
func (t *topicEnds) clearResets() {
	t.mu.Lock()
	defer t.mu.Unlock()
	clear(t.reset)
}

// get returns the last watermarks read, when, and a copy of the reset partitions; ok is false
// before the first read.
func (t *topicEnds) get() (w map[int]stream.Watermarks, at time.Time, reset map[int]bool, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.w, t.at, maps.Clone(t.reset), t.w != nil
}

// watchTopic reads the input topic's watermarks with r every watermarksEvery until ctx ends
// (Run has read them once before the components start, so the gauge has a sample from the first
// scrape). The gauge of records waiting is computed at each scrape from them and the ledger's
// checkpointed offsets (Daemon.state), so it counts records not yet applied, whatever holds
// them: a consumer that waits for a checkpoint the disk refuses, a reset topic, a replica's
// updater that stopped appending, or a broker that answers offsets but not fetches. It is read
// apart from the consumer, which a single daemon stops on a reset topic and a replica runs only
// as the updater. While the broker does not answer, the last watermarks read stay (the records
// they counted still wait); a failed read is logged once per episode.
func (d *Daemon) watchTopic(ctx context.Context, r *stream.OffsetsReader) error {
	t := time.NewTicker(watermarksEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		d.readEnds(ctx, r)
	}
}

// readEnds reads the input topic's watermarks once, within watermarksEvery.
func (d *Daemon) readEnds(ctx context.Context, r *stream.OffsetsReader) {
	rctx, cancel := context.WithTimeout(ctx, watermarksEvery)
	w, err := r.Read(rctx)
	cancel()
	switch {
	case err == nil:
		d.ends.set(w, time.Now())
		if d.ends.failing {
			d.log.Info("input topic offsets read again", "topic", d.cfg.Kafka.Topic)
			d.ends.failing = false
		}
	case ctx.Err() != nil:
	case !d.ends.failing:
		d.log.Warn("cannot read the input topic's offsets; cfguard_consumer_lag_records keeps the last ones read", "topic", d.cfg.Kafka.Topic, "err", err)
		d.ends.failing = true
	}
}
