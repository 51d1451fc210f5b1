package ledger

import (
	"fmt"

	bolt "go.etcd.io/bbolt"
)

// OutboxNewest returns up to max (default 1000) of the unacknowledged events (StreamEvents) of
// commits that succeeded (as Outbox), newest first: the events a person looking at the outbox
// wants to see first. It reads backwards from the last such entry, so its cost is the entries
// newer than the last one returned (a replica's CE states, StreamStates, are passed over),
// whatever the outbox's length.
func (l *Ledger) OutboxNewest(max int) ([]OutboxEntry, error) {
	if max <= 0 {
		max = 1000
	}
	var out []OutboxEntry
	err := l.view(func(tx *bolt.Tx) error {
		c := tx.Bucket(bOutbox).Cursor()
		for k, v := c.Last(); k != nil && len(out) < max; k, v = c.Prev() {
			e, err := readOutboxEntry(k, v)
			if err != nil {
				return err
			}
			if e.Stream == StreamEvents {
				out = append(out, e)
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: outbox, newest first: %w", err)
	}
	return out, nil
}
